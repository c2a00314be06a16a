"""The benchmark: its formula, the handoff measurement, and a quick end-to-end run that writes the JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from dbo_runtime import estimate_check
from dbo_runtime.reference.bench import (
    TARGET_EFFICIENCY,
    BenchPlan,
    _handoff_lines,
    efficiency,
    format_markdown,
    format_table,
    handoff_by_cpu,
    main,
    measure_handoff,
    summarize,
)


def test_efficiency_formula():
    # T_off = compute + comm; perfect overlap leaves max(compute, comm).
    assert efficiency(100.0, 60.0, 60.0, 40.0) == 1.0
    assert efficiency(100.0, 100.0, 60.0, 40.0) == 0.0
    assert efficiency(100.0, 80.0, 60.0, 40.0) == 0.5
    assert math.isnan(efficiency(50.0, 40.0, 60.0, 40.0))


@pytest.mark.parametrize("mode", ["thread", "greenlet"])
def test_handoff_cost_is_measured(mode):
    h = measure_handoff(200, mode=mode)
    assert h["samples"] == 200 and h["scheduler"] == mode
    assert 0 < h["median_us"] <= h["p99_us"]
    assert h["median_us"] < 50_000  # a handoff is a thread wake-up, not a sleep


def test_greenlet_handoff_is_cheaper_than_a_thread_wake_up():
    """The point of the greenlet scheduler: a switch inside one thread, no futex round trip through the kernel."""
    thread = measure_handoff(500, mode="thread")
    greenlet = measure_handoff(500, mode="greenlet")
    assert greenlet["median_us"] < thread["median_us"], (greenlet, thread)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning to each CPU needs two CPUs or more")
@pytest.mark.parametrize("mode", ["thread", "greenlet"])
def test_handoff_pinned_to_each_cpu_in_turn(mode):
    """The handoff per CPU (the vCPUs of this machine have differed by 1.7x): every CPU the process may use is
    measured, and the process may use them all again afterwards."""
    before = os.sched_getaffinity(0)
    by_cpu = handoff_by_cpu(mode, 200)
    assert sorted(by_cpu) == sorted(before) and all(0 < v < 50_000 for v in by_cpu.values())
    assert os.sched_getaffinity(0) == before
    summary = {"handoff_by_scheduler": {mode: {"median_us": 1.0, "p99_us": 2.0, "samples": 200,
                                               "median_us_by_cpu": {0: 2.5, 1: 1.5}}},
               "handoff_target_us": {"greenlet": 2.0}}
    (line,) = _handoff_lines(summary, "us")
    assert line.endswith("pinned to one CPU: cpu0 2.50 us, cpu1 1.50 us" + (" (met on 1 of 2)" if mode == "greenlet"
                                                                          else ""))


def test_bad_out_is_one_line_exit_2(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0]


@pytest.mark.parametrize("argv, needle", [(["--tokens", "4"], "--tokens"), (["--tokens", "x"], "--tokens"),
                                          (["--pattern", "a4"], "--pattern"), (["--steps", "1"], "--steps"),
                                          (["--steps", "x"], "--steps")])
def test_bad_sweep_options_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    assert main(["--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not list(tmp_path.iterdir())  # nothing written


def test_links_default_sweeps_the_calibrated_link_only():
    # make bench's default run: `--tokens 1024 --links default` is the two rows the 80% target is judged on (one per
    # pattern); `--links all` (the default, and the opt-in dbo-reference-sweep step) adds three link settings each
    from dbo_runtime.commands.bench import bench_plan
    from dbo_runtime.reference.bench import sweep_runs

    full = bench_plan(steps=7)
    lean = bench_plan(tokens=(1024,), steps=7, links="default")
    assert [v.name for v in full.links] == ["default", "bw x0.5", "bw x2", "latency 200us"]
    assert [v.name for v in lean.links] == ["default"]
    assert lean.token_counts == (1024,) == (lean.default_tokens,) and lean.steps == full.steps == 7
    assert [(t, v.name) for t, v in sweep_runs(lean)] == [(1024, "default")]
    assert len(sweep_runs(full)) * len(full.patterns) == 12 and len(lean.patterns) == 2
    assert main(["--links", "some"]) == 2


def test_quick_bench_writes_results(tmp_path, capsys):
    # --tokens: the default-link rows in the order given (one count twice: how one setting varies within a run)
    out = subprocess.run([sys.executable, "-m", "dbo_runtime.bench", "--out", str(tmp_path), "--quick",
                          "--tokens", "128", "--tokens", "96", "--tokens", "128", "--steps", "3"],
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "dbo_runtime.json").read_text())
    assert "stand-in for HCCS" in data["link_note"]
    # --steps: every row timed that many steps (the quick plan's own is 2), each kept in the order it ran
    assert all(r["steps"] == 3 and len(r["per_step_ms"]["off"]) == 3 for r in data["rows"])
    assert {r["pattern"] for r in data["rows"]} == {"a2", "a3"}
    for pattern in ("a2", "a3"):
        assert [r["tokens"] for r in data["rows"] if r["pattern"] == pattern and r["link"] == "default"] == [128, 96, 128]
    # every row, the repeated one too, has its own DBO-off trace for the what-if check (the tiny quick model may
    # leave a row without a prediction, never for a trace folder holding two runs)
    assert len(data["whatif"]) == len(data["rows"])
    assert len({w["trace"] for w in data["whatif"]}) == len(data["whatif"])
    assert not [w for w in data["whatif"] if "appears twice" in w.get("error_message", "")]
    # gloo's transfers in the real DBO-off traces are the collectives' host work, charged to the compute beside them
    predicted = [w for w in data["whatif"] if "error_message" not in w]
    assert predicted and all(w["host_work_ms"] >= 0 and math.isfinite(w["error_without_host_work"]) for w in predicted)
    assert any(w["host_work_ms"] > 0 for w in predicted)
    # the check run again from the folder alone (validate_whatif.py): the step pairs from the JSON's per_step_ms, the
    # same traces and settings, so the same table as the bench's
    from dbo_runtime.reference import whatif_check

    assert whatif_check.main([str(tmp_path)]) == 0
    again = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| a")]
    bench_md = (tmp_path / "dbo_runtime.md").read_text().splitlines()
    assert again and all(x in bench_md for x in again)
    assert whatif_check.main([str(tmp_path / "dbo-whatif-traces")]) == 2
    assert "no readable `dbo-runtime bench` JSON" in capsys.readouterr().err
    assert all(w["predicted_on_ms"] >= w["t_off_ms"] / (1 + w["error_without_host_work"]) / w["measured_speedup"]
               - 1e-9 for w in predicted)  # host work only ever lengthens the DBO-on step
    for row in data["rows"]:
        # half the tokens' compute over the row's own, per step (they ran one after the other), then the median. The
        # quick model is so small that fixed per-layer costs dominate: its ratio sits near 1, and one stalled step of
        # three moves it (a CI run saw 1.57), so the bound only rules out a run of the wrong size, not noise.
        steps = row["per_step_ms"]
        assert row["compute_scale_pairs"] == pytest.approx(statistics.median(
            h / o for h, o in zip(steps["compute_half"], steps["compute_off"], strict=True)))
        assert 0.1 < row["compute_scale_pairs"] < 3
        assert row["split_on"] and not row["split_off"]
        assert row["t_off_ms"] > 0 and row["t_on_ms"] > 0 and row["t_comm_ms"] > 0 and row["t_compute_ms"] > 0
        assert "modelled link" in row["link_text"]
        assert row["loadavg_1m"] is None or row["loadavg_1m"] >= 0  # recorded per row: was the machine shared?
    assert {r["link"] for r in data["rows"]} == {"default", "bw x2"}
    for row in data["no_split"]:
        assert row["split_on"] is False  # below the threshold DBO takes the plain path
    assert data["handoff_us"]["median_us"] > 0
    assert set(data["handoff_by_scheduler"]) == {"thread", "greenlet"}
    assert all(h["median_us"] > 0 for h in data["handoff_by_scheduler"].values())
    decode = {r["scheduler"]: r for r in data["decode"]}
    assert set(decode) == {"thread", "greenlet"}
    for row in decode.values():
        assert row["split_on"] and row["tokens"] == 64  # vLLM's default decode threshold (32) splits 64 tokens
        assert row["t_off_ms"] > 0 and row["t_on_ms"] > 0
    assert "effic" in out.stdout and "yield handoff" in out.stdout
    assert not list(tmp_path.glob(".tmp-*"))
    # the CPU rates both ranks timed right after each row, and the estimate validated with them
    for row in data["rows"]:
        rates = row["cpu_rates"]
        assert rates["ranks"] == 2 and rates["gflops"] > 0 and rates["layer_ms"] > 0 and rates["layer_tokens"] == 128
        # the same layer timed once after every step of the row (per step, the slowest rank's; in the rates, the
        # slowest rank's median)
        probe = row["per_step_ms"]["probe"]
        assert len(probe) == 3 and 0 < min(probe) and 0 < rates["layer_ms_beside_steps"] <= max(probe) * (
            2 / min(2, os.cpu_count() or 1))
    checked = estimate_check.validate(data)
    assert checked["rates_beside_rows"] is True and checked["rates"]["timings"] == len(data["rows"])
    # the prediction: the pooled rates at the speed the layer ran beside each row's steps; the pooled as they are beside
    assert checked["rates_at_steps"] is True
    assert [x["speed_at_steps"] for x in checked["rows"]] == pytest.approx(
        [checked["rates"]["layer_ms"] / r["cpu_rates"]["layer_ms_beside_steps"] for r in data["rows"]])
    assert all(math.isfinite(x["error_one_rate_set"]) for x in checked["rows"])
    assert checked["summary"]["within_10pct_one_rate_set"] is not None
    # the rows' timings pooled (their median) for the prediction; each row's own timing kept beside it
    assert checked["rates"]["gflops"] == pytest.approx(statistics.median(r["cpu_rates"]["gflops"] for r in data["rows"]))
    assert [x["row_gflops"] for x in checked["rows"]] == [r["cpu_rates"]["gflops"] for r in data["rows"]]
    assert all(0 < x["compute_efficiency"] <= 1 and x["pred_speedup"] > 0 for x in checked["rows"])
    assert all(math.isfinite(x["error_row_rates"]) for x in checked["rows"])
    assert "timed by the bench right after each row" in estimate_check.markdown(checked)
    assert data["estimate_check"]["summary"]["rows"] == len(data["rows"])
    assert "estimate check (dbo-runtime estimate, no profile)" in out.stdout
    assert "## Estimate check" in (tmp_path / "dbo_runtime.md").read_text()


def _per_rank(effs: dict[tuple[str, int, str], float]) -> list[dict]:
    """Two ranks' raw results with step times chosen so that each row has the given efficiency."""
    rows = []
    for (pattern, tokens, link), eff in effs.items():
        compute, comm = 0.6, 0.4  # T_off = 1.0, max = 0.6: T_on = 1.0 - 0.4 x eff
        on = 1.0 - 0.4 * eff
        run = {"split": True, "steps_s": [1.0], "computes_s": [compute], "comms_s": [comm]}
        rows.append({"pattern": pattern, "tokens": tokens, "link": link, "link_spec": "20,0.1", "link_text": "modelled",
                     "off": {**run, "split": False, "step_s": 1.0, "compute_s": compute, "comm_s": comm},
                     "on": {**run, "steps_s": [on], "step_s": on, "compute_s": compute, "comm_s": comm}})  # fmt: skip
    rank = {"rows": rows, "no_split": []}
    return [rank, rank]


def test_table_marks_the_default_rows_and_the_verdict():
    plan = BenchPlan(default_tokens=1024)
    effs = {("a2", 1024, "default"): 0.9, ("a2", 512, "default"): 0.3, ("a3", 1024, "default"): 0.7,
            ("a3", 1024, "bw x2"): 0.95}  # fmt: skip
    summary = summarize(_per_rank(effs), {"median_us": 40.0, "p99_us": 80.0, "samples": 10}, plan)
    by_key = {(r["pattern"], r["tokens"], r["link"]): r for r in summary["rows"]}
    assert [k for k, r in by_key.items() if r["is_default"]] == [("a2", 1024, "default"), ("a3", 1024, "default")]
    assert by_key[("a2", 1024, "default")]["meets_target"] is True
    assert by_key[("a3", 1024, "default")]["meets_target"] is False  # 70% < 80%
    assert by_key[("a3", 1024, "bw x2")]["meets_target"] is None  # the target is for the default setting only
    assert summary["meets_target"] is False and TARGET_EFFICIENCY == 0.80
    table = format_table(summary).splitlines()
    default_lines = [line for line in table if "DEFAULT:" in line]
    assert len(default_lines) == 2
    assert default_lines[0].startswith("a2") and default_lines[0].endswith("DEFAULT: meets 80%")
    assert default_lines[1].startswith("a3") and default_lines[1].endswith("DEFAULT: MISSES 80%")
    assert any("1024 tokens/rank" in line and "default setting" in line for line in table)
    assert "at the DEFAULT setting: a2 90.0%, a3 70.0%; MISSES the 80% target" in "\n".join(table)
    md = format_markdown(summary)
    assert "| **90%** |" in md and "DEFAULT: MISSES 80%" in md
    assert not any(r["disturbed"] for r in summary["rows"])  # the same compute time in both modes


def test_a_row_whose_compute_differs_between_modes_is_flagged_disturbed():
    per_rank = _per_rank({("a2", 1024, "default"): 0.9})
    for rank in per_rank:
        rank["rows"][0]["on"]["compute_s"] = 0.6 * 1.3  # other work slowed the DBO-on steps' compute
    summary = summarize(per_rank, {"median_us": 40.0, "p99_us": 80.0, "samples": 10}, BenchPlan(default_tokens=1024))
    assert summary["rows"][0]["disturbed"] is True
    table = format_table(summary)
    assert "disturbed" in table and "rerun on a quiet machine" in table


def test_each_row_gets_the_dbo_off_compute_at_half_its_tokens():
    """The what-if check's compute scale: the DBO-off compute of the same pattern at half the tokens, from the sweep's
    rows (any link: compute does not depend on it) and from the below-threshold rows; None where nothing ran it."""
    per_rank = _per_rank({("a2", 512, "default"): 0.5, ("a2", 256, "bw x2"): 0.5, ("a3", 512, "default"): 0.5})
    rows = per_rank[0]["rows"]
    rows[1]["off"] = {**rows[1]["off"], "compute_s": 0.45}
    per_rank[0]["no_split"] = [{"pattern": "a2", "tokens": 256, "off": {"step_s": 0.5, "compute_s": 0.35},
                                "on": {"step_s": 0.5, "compute_s": 0.35, "split": False}}]  # fmt: skip
    summary = summarize(per_rank, {"median_us": 40.0, "p99_us": 80.0, "samples": 10}, BenchPlan(default_tokens=1024))
    a2_512, a2_256, a3_512 = summary["rows"]
    assert summary["no_split"][0]["t_compute_ms"] == pytest.approx(350.0)
    assert a2_512["t_compute_half_ms"] == pytest.approx(400.0)  # the median of 450 (a sweep row) and 350
    assert a2_256["t_compute_half_ms"] is None and a3_512["t_compute_half_ms"] is None


def test_whatif_check_takes_the_compute_scale_from_the_two_dbo_off_computes():
    from dbo_runtime.reference.whatif_check import compute_scale

    assert compute_scale({"t_compute_ms": 600.0, "t_compute_half_ms": 450.0}) == 0.75
    assert compute_scale({"t_compute_ms": 600.0, "t_compute_half_ms": 700.0}) == 1.0  # noise: never above the whole
    assert compute_scale({"t_compute_ms": 600.0, "t_compute_half_ms": None}) is None  # the what-if's 1/2
    assert compute_scale({"t_compute_ms": 0.0, "t_compute_half_ms": 10.0}) is None


def test_the_paired_compute_scale_is_the_median_of_the_steps_ratios_and_wins():
    """Each row's half-token compute ran right after its DBO-off steps: the scale is the median of the per-step
    ratios (slowest rank each step), and the what-if check prefers it to the medians from other rows."""
    from dbo_runtime.reference.whatif_check import compute_scale

    per_rank = _per_rank({("a2", 1024, "default"): 0.5})
    for k, rank in enumerate(per_rank):  # two ranks with their own copies of the row
        row = dict(rank["rows"][0])
        row["off"] = {**row["off"], "computes_s": [0.6, 0.6, 0.6]}
        row["half"] = {"computes_s": [0.30 + 0.01 * k, 0.36, 0.42]}
        per_rank[k] = {**rank, "rows": [row]}
    summary = summarize(per_rank, {"median_us": 40.0, "p99_us": 80.0, "samples": 10}, BenchPlan(default_tokens=1024))
    r = summary["rows"][0]
    assert r["compute_scale_pairs"] == pytest.approx(0.6)  # ratios 0.5167, 0.6, 0.7
    # the steps the medians came from, in the order they ran, the slowest rank's per step (ms)
    assert r["per_step_ms"]["compute_half"] == pytest.approx([310.0, 360.0, 420.0])
    assert r["per_step_ms"]["compute_off"] == pytest.approx([600.0, 600.0, 600.0])
    assert r["per_step_ms"]["off"] == pytest.approx([1000.0]) and r["per_step_ms"]["on"] == pytest.approx([800.0])
    assert compute_scale({**r, "t_compute_half_ms": 150.0}) == pytest.approx(0.6)


def test_the_whatif_check_scores_each_step_against_its_own_prediction():
    """Each timed step gets the prediction made from its own DBO-off time and compute scale; the scatter of those
    errors around the row's median is what a row's median of n steps moves by, 1.25 sigma / sqrt(n)."""
    from dbo_runtime.reference.whatif_check import _step_errors, format_whatif_markdown, step_scatter

    calls = []

    def predict(*, compute_scale, measured_off_us):  # a stand-in for the simulation: on = off x (scale + 0.1)
        calls.append((compute_scale, measured_off_us))
        return {"summary": {"on_us": measured_off_us * (compute_scale + 0.1)}}

    steps = {"off": [1000.0, 1000.0, 800.0], "on": [660.0, 540.0, 480.0], "compute_off": [600.0, 600.0, 500.0],
             "compute_half": [300.0, 300.0, 250.0]}
    errors = _step_errors(predict, steps)
    assert calls == [(0.5, 1e6), (0.5, 1e6), (0.5, 8e5)]  # each step's own figures, in µs
    assert errors == pytest.approx([0.1, -0.1, 0.0])  # T_on / predicted T_on - 1
    assert _step_errors(predict, {**steps, "compute_half": []}) == []  # no half-token compute timed: no steps

    def refuses_short_steps(*, compute_scale, measured_off_us):  # as whatif does below the exposed communication
        from profile_analyzer import ProfileError

        if measured_off_us < 9e5:
            raise ProfileError("trace", "the measured DBO-off step must be longer than the exposed communication")
        return predict(compute_scale=compute_scale, measured_off_us=measured_off_us)

    assert _step_errors(refuses_short_steps, steps) == pytest.approx([0.1, -0.1])  # that step left out, not the row
    row = {"pattern": "a2", "tokens": 512, "link": "default", "t_off_ms": 1000.0, "t_on_ms": 600.0,
           "predicted_on_ms": 600.0, "predicted_speedup": 1.6, "measured_speedup": 1.6, "error": 0.0,
           "within": True, "checked": True, "disturbed": False, "compute_scale": 0.5,
           "compute_scale_measured": True, "error_scale_half": 0.0, "step_errors": errors}  # fmt: skip
    assert step_scatter([row]) == pytest.approx(math.sqrt(0.02 / 2))
    md = format_whatif_markdown([row])
    assert "| -5 / +0 / +5% |" in md and "scatter by 10.0%" in md and "median of 3 steps" in md
    assert step_scatter([{**row, "step_errors": []}]) is None
