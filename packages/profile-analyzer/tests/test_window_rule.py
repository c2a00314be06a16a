"""The window that Free is counted in, against the profiler's own Overlap Analysis.

msprof's rule, as its own output shows it: Free is the gaps of Computing ∪ Communication between their first start
and last end; device tasks that are neither (MEMCPY_ASYNC, EVENT_RECORD on other streams) do not widen it. The real
profiles below carry such tasks milliseconds before the first compute, and the profiler's track starts at the first
compute all the same (docs/profile-analysis.md, "The window of Free"). The built profile carries them after the
last compute, in each export kind (torch_npu text, torch_npu DB, plain msprof JSON)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import profile_analyzer as pa
import pytest
from profile_analyzer import intervals as iv
from profile_analyzer.synth.db_export import write_db_export
from profile_analyzer.timeline import COMM_KINDS, COMPUTE_KINDS

DATA = Path(__file__).parent / "data" / "msinsight"
BASE = 1_704_161_511_000_000  # µs


def _busy_extent(rt) -> tuple[int, int]:
    both = iv.union_sets(iv.union(*rt.select(rt.of_kind(*COMPUTE_KINDS))), iv.union(*rt.select(rt.of_kind(*COMM_KINDS))))
    return int(both[0][0]), int(both[1][-1])


def _track_extent(rt) -> tuple[int, int]:
    po = rt.profiler_overlap
    return (min(int(s.min()) for s, _ in po.values() if s.size), max(int(e.max()) for _, e in po.values() if e.size))


@pytest.mark.parametrize("export", ["text", "db"])
def test_real_profiles_window_ends_at_compute_not_at_other_tasks(tmp_path, export):
    src = DATA / export / "level1" / "rank0_ascend_pt"
    rank = tmp_path / src.name
    shutil.copytree(src, rank)
    for gz in rank.rglob("trace_view.json.gz"):
        gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
        gz.unlink()
    (rt,) = pa.load(rank).ranks.values()
    lo, hi = _busy_extent(rt)
    names = np.array(rt.names, dtype=object)[rt.name_id]
    before = rt.device_mask & (rt.start_ns < lo) & (names == "MEMCPY_ASYNC")
    assert before.sum() >= 2 and lo - int(rt.start_ns[before].min()) > 3_000_000  # > 3 ms of copies before compute
    # ... and the profiler's own Overlap Analysis starts and ends with Computing ∪ Communication all the same
    assert _track_extent(rt) == (lo, hi)
    rep = pa.analyze(pa.load(rank)).to_dict()
    free = [a for a in rep["profiler_agreement"] if a["item"] == "free" and a["source"] == "overlap_analysis_track"]
    assert free and all(abs(a["delta_us"]) < 1.0 for a in free)  # the text track is in µs floats


def _ts(us: float) -> str:
    return f"{BASE + us:.3f}"


def _trace() -> list[dict]:
    """Compute [100,150) and [400,460) on stream 5, hcom_allReduce [140,210), then on stream 7 a MEMCPY_ASYNC
    [500,3500) and an EVENT_RECORD [3500,3501): 3 ms of device tasks after the last compute. The Overlap Analysis
    track as msprof writes it: Free = [210,400) only."""
    hw, comm, py, cann, ov = 800, 900, 437675, 437676, 1000
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": py, "tid": 0, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_labels", "pid": py, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": cann, "tid": 0, "args": {"name": "CANN"}},
        {"ph": "M", "name": "process_labels", "pid": cann, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": hw, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_labels", "pid": hw, "tid": 0, "args": {"labels": "NPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": hw, "tid": 5, "args": {"name": "Stream 5"}},
        {"ph": "M", "name": "thread_name", "pid": hw, "tid": 7, "args": {"name": "Stream 7"}},
        {"ph": "M", "name": "process_name", "pid": comm, "tid": 0, "args": {"name": "Communication"}},
        {"ph": "M", "name": "process_labels", "pid": comm, "tid": 0, "args": {"labels": "NPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": comm, "tid": 0, "args": {"name": "Group 42 Communication"}},
        {"ph": "M", "name": "thread_name", "pid": comm, "tid": 1, "args": {"name": "Plane 0"}},
        {"ph": "M", "name": "process_name", "pid": ov, "tid": 0, "args": {"name": "Overlap Analysis"}},
        {"ph": "M", "name": "process_labels", "pid": ov, "tid": 0, "args": {"labels": "NPU 0"}},
        {"ph": "X", "name": "ProfilerStep#3", "pid": py, "tid": py, "ts": _ts(90), "dur": 3500.0, "cat": "cpu_op"},
    ]
    for tid, name in enumerate(("Computing", "Communication", "Communication(Not Overlapped)", "Free")):
        ev.append({"ph": "M", "name": "thread_name", "pid": ov, "tid": tid, "args": {"name": name}})

    def x(pid, tid, name, s, e, args=None):
        ev.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": _ts(s), "dur": e - s, "args": args or {}})

    x(hw, 5, "aclnnMatmul_MatMulV3", 100, 150, {"Task Type": "AI_CORE", "Physic Stream Id": 5})
    x(hw, 5, "aclnnAdd_AddAiCore_Add", 400, 460, {"Task Type": "AI_VECTOR_CORE", "Physic Stream Id": 5})
    x(hw, 7, "MEMCPY_ASYNC", 500, 3500, {"Task Type": "MEMCPY_ASYNC", "Physic Stream Id": 7})
    x(hw, 7, "EVENT_RECORD", 3500, 3501, {"Task Type": "EVENT_RECORD", "Physic Stream Id": 7})
    x(comm, 0, "hcom_allReduce__42_1_1", 140, 210)
    x(comm, 1, "Memcpy", 150, 205)
    for tid, s, e in ((0, 100, 150), (0, 400, 460), (1, 140, 210), (2, 150, 210), (3, 210, 400)):
        x(ov, tid, ("Computing", "Communication", "Communication(Not Overlapped)", "Free")[tid], s, e)
    return ev


FREE_US = 190.0  # [210,400): msprof's Free; the 3 ms of copies after the last compute are not in it


def _text_export(root: Path) -> Path:
    rank = root / "node0_1_1_ascend_pt"
    out = rank / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    (out / "trace_view.json").write_text(json.dumps(_trace()))
    (out / "kernel_details.csv").write_text(
        "Step Id,Device_id,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),Block Num\n"
        f'3,0,aclnnMatmul_MatMulV3,MatMulV3,AI_CORE,"{_ts(100)}\t",50,0,24\n'
        f'3,0,aclnnAdd_AddAiCore_Add,Add,AI_VECTOR_CORE,"{_ts(400)}\t",60,0,8\n')
    # torch_npu's step_trace_time.csv sums the track's events per step (reference/msprof.md 3b)
    (out / "step_trace_time.csv").write_text(
        "Device_id,Step,Computing,Communication(Not Overlapped),Overlapped,Communication,Free,Stage,Bubble,"
        "Communication(Not Overlapped and Exclude Receive),Preparing\n"
        f"0,3,110.0,60.0,10.0,70.0,{FREE_US},360.0,0.0,60.0,10.0\n")
    (out / "communication.json").write_text("{}")
    (rank / "profiler_info_0.json").write_text("{}")
    return rank


def _exports(tmp_path: Path) -> dict[str, Path]:
    text = _text_export(tmp_path / "text")
    db_root = tmp_path / "db"
    shutil.copytree(text.parent, db_root)
    db_rank = db_root / text.name
    write_db_export(db_rank, 0)
    for f in ("trace_view.json", "kernel_details.csv", "step_trace_time.csv", "communication.json"):
        (db_rank / "ASCEND_PROFILER_OUTPUT" / f).unlink()
    msprof = tmp_path / "msprof" / "PROF_000001_20240102_000000_AAA" / "mindstudio_profiler_output"
    msprof.mkdir(parents=True)
    (msprof / "msprof_20240102000000.json").write_text(json.dumps(_trace()))
    return {"torch_npu": text, "torch_npu_db": db_rank, "msprof": msprof.parent}


@pytest.mark.parametrize("kind", ["torch_npu", "torch_npu_db", "msprof"])
def test_trailing_non_compute_tasks_do_not_widen_free(tmp_path, kind):
    path = _exports(tmp_path)[kind]
    assert pa.detect(path) == kind
    tl = pa.load(path)
    (rt,) = tl.ranks.values()
    names = {rt.names[i] for i in rt.name_id.tolist()}
    assert {"MEMCPY_ASYNC", "EVENT_RECORD"} <= names  # read, and neither compute nor communication
    rep = pa.analyze(tl).to_dict()
    (row,) = rep["breakdown"]
    assert row["free"] == pytest.approx(FREE_US, abs=1e-6)
    assert row["computing"] == pytest.approx(110.0) and row["communication"] == pytest.approx(70.0)
    track = {a["item"]: a for a in rep["profiler_agreement"] if a["source"] == "overlap_analysis_track"}
    assert track["free"]["profiler_us"] == pytest.approx(FREE_US) and track["free"]["delta_us"] == pytest.approx(0.0)
    # the stream with only the copies is still busy for them: its utilisation counts them
    assert any(s["stream"] == "Stream 7" and s["busy_us"] >= 3000.0 for s in rep["streams"])
