"""dbo-runtime policy-sweep: the auto policy against every static threshold, replayed from the same steps.

The summary's arithmetic is checked on per-rank step times built here (what the rank task returns); one small run
goes through two real gloo ranks with the reference model and the real policy.
"""

from __future__ import annotations

import json

import pytest
from dbo_runtime.cli import main
from dbo_runtime.reference.policy_sweep import (
    PolicySweepPlan,
    format_sweep_markdown,
    run_policy_sweep,
    summarize_sweep,
)


def _ranks(plan: PolicySweepPlan, off: dict[int, float], on: dict[int, float], auto_splits: dict[int, bool],
           slow_rank1: float = 1.0) -> list[dict]:
    load = plan.load()
    out = []
    for rank, scale in ((0, 1.0), (1, slow_rank1)):
        split = [auto_splits[t] for t in load]
        out.append({
            "rank": rank, "link": "modelled", "auto_split": split, "auto_reason": ["verdict"] * len(load),
            "policy_s": [0.0] * len(load),
            "times": {"off": [off[t] * scale for t in load], "on": [on[t] * scale for t in load],
                      "auto": [(on[t] if split[i] else off[t]) * scale for i, t in enumerate(load)]},
            "policy_table": {"classes": []},
        })
    return out


def test_the_best_threshold_is_replayed_and_auto_charged_the_arms_it_chose():
    plan = PolicySweepPlan(token_counts=(16, 256, 512), steps_per_size=4)
    off = {16: 0.030, 256: 0.180, 512: 0.360}
    on = {16: 0.050, 256: 0.140, 512: 0.260}
    perfect = summarize_sweep(plan, _ranks(plan, off, on, {16: False, 256: True, 512: True}))
    assert perfect["best_threshold"] == 256
    total_off = 4 * sum(off.values())
    assert perfect["best_speedup"] == pytest.approx(total_off / (4 * (0.030 + 0.140 + 0.260)))
    assert perfect["auto_ratio"] == pytest.approx(1.0) and perfect["auto_meets_target"]
    never = next(t for t in perfect["thresholds"] if t["threshold"] is None)
    assert never["speedup"] == 1.0
    # auto that splits the 16-token batches too pays for it, from the same steps
    wrong = summarize_sweep(plan, _ranks(plan, off, on, {16: True, 256: True, 512: True}))
    assert wrong["auto_ratio"] == pytest.approx((4 * 0.430) / (4 * 0.450)) and not wrong["auto_meets_target"]
    # the slowest rank's time is the step's
    slow = summarize_sweep(plan, _ranks(plan, off, on, {16: False, 256: True, 512: True}, slow_rank1=2.0))
    assert slow["total_off_s"] == pytest.approx(2 * total_off)
    text = format_sweep_markdown(perfect)
    assert "static, split at >= 256 tokens (best)" in text and "target 97%: met" in text


@pytest.mark.slow
def test_a_small_sweep_on_two_gloo_ranks(tmp_path):
    plan = PolicySweepPlan(token_counts=(8, 64), steps_per_size=10, num_layers=1, hidden_size=64,
                           expert_intermediate=128, shared_intermediate=128, warmup=1)
    summary = run_policy_sweep(tmp_path, plan, timeout_s=300)
    assert summary["steps"] == 20 and {s["tokens"] for s in summary["sizes"]} == {8, 64}
    assert summary["policy_table"]["steps"] == 20 and summary["policy_overhead_s"] > 0
    # every class alternates from its first step until the first agreement (16 calls in): at least one side-by-side
    # pair each. Not 8 each: a class whose first pair is a clear loss is decided at that agreement, and a class may
    # then start from its decided neighbour's arm (SplitPolicy._prior_of), so the count depends on the machine.
    assert all(s["auto_explore_steps"] >= 2 for s in summary["sizes"]), summary["sizes"]
    written = json.loads((tmp_path / "dbo_policy_sweep.json").read_text())
    assert written["auto_ratio"] == pytest.approx(summary["auto_ratio"])
    assert (tmp_path / "dbo_policy_sweep.md").read_text().startswith("### The auto policy")


@pytest.mark.parametrize("argv, needle", [
    (["--tokens", "1"], "--tokens"), (["--steps-per-size", "0"], "--steps-per-size"), (["--layers", "x"], "--layers"),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, needle):
    assert main(["policy-sweep", "--out", str(tmp_path / "o"), *argv]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0]
    assert not (tmp_path / "o").exists()


def _noisy_ranks(plan: PolicySweepPlan, off: dict[int, float], on: dict[int, float], seed: int = 0) -> list[dict]:
    """Per-rank step times with +-10% noise per step and rank (the two ranks of one step move together)."""
    import random

    rng = random.Random(seed)
    load = plan.load()
    common = [rng.uniform(0.9, 1.1) for _ in load]
    out = []
    for rank in (0, 1):
        times = {m: [base[t] * common[i] * rng.uniform(0.98, 1.02) for i, t in enumerate(load)]
                 for m, base in (("off", off), ("on", on))}
        times["auto"] = list(times["off"])
        out.append({"rank": rank, "link": "modelled", "auto_split": [False] * len(load),
                    "auto_reason": ["verdict"] * len(load), "policy_s": [0.0] * len(load), "times": times,
                    "policy_table": {"classes": []}})
    return out


REPLAY_OFF = {16: 0.030, 64: 0.060, 256: 0.180, 512: 0.330}
REPLAY_ON = {16: 0.050, 64: 0.075, 256: 0.160, 512: 0.260}


def test_a_replay_runs_the_real_policy_on_every_rank_over_the_recorded_steps():
    from dbo_runtime.reference.policy_sweep import replay_orders, replay_sweep

    plan = PolicySweepPlan()
    summary = summarize_sweep(plan, _noisy_ranks(plan, REPLAY_OFF, REPLAY_ON))
    assert len(summary["rank_times"]) == 2 and len(summary["rank_times"][0]["on"]) == len(plan.load())
    result = replay_sweep(summary)
    assert result["verdicts"] == {"mixed:9-16": "unsplit", "mixed:33-64": "unsplit", "mixed:129-256": "split",
                                  "mixed:257-512": "split"}
    assert result["best_speedup"] == pytest.approx(summary["best_speedup"])
    # what it costs is its exploration: a few steps per class on the losing arm, not more
    assert 0.95 <= result["auto_ratio"] < 1.0
    assert 180 <= result["split_steps"] <= 215
    # settings change what it does: exploring every other step runs the losing arm on half the steps
    slower = replay_sweep(summary, {"explore_every": 2, "explore_max_every": 2})
    assert slower["auto_ratio"] < result["auto_ratio"] - 0.03 and slower["verdicts"] == result["verdicts"]
    orders = replay_orders(summary, {}, orders=3)
    assert len(orders["ratios"]) == 3 and orders["recorded"] == result


def test_policy_sweep_replay_command(tmp_path, capsys):
    plan = PolicySweepPlan()
    path = tmp_path / "dbo_policy_sweep.json"
    path.write_text(json.dumps(summarize_sweep(plan, _noisy_ranks(plan, REPLAY_OFF, REPLAY_ON))))
    assert main(["policy-sweep", "--replay", str(path), "--set", "explore_cost=0.02", "--set", "window=5",
                 "--orders", "2"]) == 0
    out = capsys.readouterr().out
    assert "explore_cost=0.02, window=5" in out and "the recorded order" in out and "2 other orders" in out


@pytest.mark.parametrize("argv, needle", [
    (["--set", "nosuch=1"], "'nosuch' is unknown"),
    (["--set", "explore_cost=abc"], "KEY=NUMBER"),
    (["--set", "window=0"], "window=0"),
    (["--tokens", "16"], "--replay replays a recorded sweep"),
])
def test_replay_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, needle):
    plan = PolicySweepPlan(token_counts=(16, 256), steps_per_size=20)
    path = tmp_path / "dbo_policy_sweep.json"
    path.write_text(json.dumps(summarize_sweep(plan, _noisy_ranks(plan, REPLAY_OFF, REPLAY_ON))))
    assert main(["policy-sweep", "--replay", str(path), *argv]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("content, needle", [
    ("{not json", "cannot be read as JSON"),
    ('{"plan": {}}', "cannot be replayed"),  # a sweep written before rank_times were recorded
    ("[1, 2]", "is not a policy sweep"),
])
def test_replay_of_what_is_not_a_recorded_sweep_is_one_line_exit_2(tmp_path, capsys, content, needle):
    path = tmp_path / "sweep.json"
    path.write_text(content)
    assert main(["policy-sweep", "--replay", str(path)]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], lines
    assert main(["policy-sweep", "--set", "window=5"]) == 2
    assert "--set applies to --replay only" in capsys.readouterr().err
