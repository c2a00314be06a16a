"""A hand-written torch_npu trace in the older CANN dialect (process "HCCL", "Stream Id" args, a pid above
2**32, string timestamps) whose every figure is worked out by hand below, including Bubble, Stage,
Preparing and the synchronization wait that the generated profiles do not exercise."""

from __future__ import annotations

import json

import profile_analyzer as pa
import pytest

BASE = 1_704_161_511_000_000  # µs


def ts(us: float) -> str:
    return f"{BASE + us:.3f}"


def trace() -> list[dict]:
    hw, hccl, py = 800, 5_000_000_123, 437675
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": py, "tid": 0, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_labels", "pid": py, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": hw, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_labels", "pid": hw, "tid": 0, "args": {"labels": "NPU"}},
        {"ph": "M", "name": "thread_name", "pid": hw, "tid": 5, "args": {"name": "Stream 5"}},
        {"ph": "M", "name": "process_name", "pid": hccl, "tid": 0, "args": {"name": "HCCL"}},
        {"ph": "M", "name": "thread_name", "pid": hccl, "tid": 0, "args": {"name": "Group 42 Communication"}},
        {"ph": "M", "name": "thread_name", "pid": hccl, "tid": 1, "args": {"name": "Plane 0"}},
        {"ph": "X", "name": "ProfilerStep#7", "pid": py, "tid": py, "ts": ts(90), "dur": 310.0, "cat": "cpu_op"},
        {"ph": "s", "name": "torch_to_npu", "cat": "async_npu", "id": 1, "pid": py, "tid": py, "ts": ts(95)},
        {"ph": "f", "name": "torch_to_npu", "cat": "async_npu", "id": 1, "pid": hw, "tid": 5, "ts": ts(100), "bp": "e"},
    ]

    def x(pid, tid, name, s, e, args=None):
        ev.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts(s), "dur": e - s, "args": args or {}})

    x(hw, 5, "aclnnMatmul_MatMulV3", 100, 150, {"Task Type": "AI_CORE", "Stream Id": 5})
    x(hw, 5, "EVENT_WAIT", 150, 200, {"Task Type": "EVENT_WAIT", "Stream Id": 5})
    x(hw, 5, "aclnnAdd_AddAiCore_Add", 200, 260, {"Task Type": "AI_VECTOR_CORE", "Stream Id": 5})
    x(hccl, 0, "hcom_allReduce__42_1_1", 140, 210)
    x(hccl, 0, "hcom_receive__42_2_1", 300, 340)
    x(hccl, 1, "Notify_Wait", 140, 180)
    x(hccl, 1, "Memcpy", 180, 205)
    x(hccl, 1, "Notify_Record", 205, 210)
    return ev


EXPECTED = {  # µs, by hand
    "computing": 110.0,  # [100,150] + [200,260]
    "communication": 110.0,  # [140,210] + [300,340]
    "communication_not_overlapped": 90.0,  # [150,200] + [300,340]
    "overlapped": 20.0,  # [140,150] + [200,210]
    "free": 40.0,  # span [100,340] minus [100,260] and [300,340]
    "bubble": 40.0,  # hcom_receive
    "communication_not_overlapped_exclude_receive": 50.0,
    "stage": 200.0,  # (340 - 100) - bubble
    "preparing": 10.0,  # first task 100 - ProfilerStep start 90
}


def test_every_column_by_hand(tmp_path):
    out = tmp_path / "w_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    (out / "trace_view.json").write_text(json.dumps(trace()))
    rep = pa.analyze(pa.load(out.parent)).to_dict()
    (row,) = rep["breakdown"]
    assert row["step"] == 7
    for k, v in EXPECTED.items():
        assert row[k] == pytest.approx(v, abs=1e-9), k
    assert rep["ranks"]["per_rank"][0]["sync_wait_us"] == 40.0  # Notify_Wait before the Memcpy
    streams = {s["stream"]: s for s in rep["streams"]}
    assert streams["Stream 5"]["busy_us"] == 110.0 and streams["Stream 5"]["wait_us"] == 50.0
    ex = rep["exposed_communication"][0]
    assert {r["operator"]: r["exposed_us"] for r in ex["by_operator"]} == {"hcom_allReduce": 50.0, "hcom_receive": 40.0}
    assert ex["worst_gaps"][0]["comm_op"] == "hcom_allReduce__42_1_1"
    assert ex["worst_gaps"][0]["preceding_compute"] == "aclnnMatmul_MatMulV3"
    assert any(w["missing"] == "the 'Overlap Analysis' track" for w in rep["warnings"])


@pytest.mark.parametrize("op_type,label", [("N/A", "aclnnMatmul_MatMulV3"),
                                           ("MatMulV3", "MatMulV3 (aclnnMatmul_MatMulV3)")])
def test_level0_operators_are_named_by_their_kernel(tmp_path, op_type, label):
    # Level 0 writes Type "N/A" in kernel_details.csv (reference/msprof.md 3a): an operator is then its kernel's name,
    # never "N/A (aclnnMatmul_MatMulV3)"; with a real Type the label keeps it
    out = tmp_path / "w_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    (out / "trace_view.json").write_text(json.dumps(trace()))
    (out / "kernel_details.csv").write_text(
        "Step Id,Device_id,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),Block Num\n"
        f'7,0,aclnnMatmul_MatMulV3,{op_type},AI_CORE,"{ts(100)}\t",50,0,24\n'
        f'7,0,aclnnAdd_AddAiCore_Add,{op_type},AI_VECTOR_CORE,"{ts(200)}\t",60,0,8\n')
    rep = pa.analyze(pa.load(out.parent)).to_dict()
    ex = rep["exposed_communication"][0]
    assert ex["worst_gaps"][0]["preceding_compute"] == label
    add = "aclnnAdd_AddAiCore_Add" if op_type == "N/A" else "MatMulV3 (aclnnAdd_AddAiCore_Add)"
    assert add in {r["preceding_compute"] for r in ex["by_preceding_compute"]}
    assert not any("N/A" in (r["preceding_compute"] or "") for r in ex["by_preceding_compute"])
