"""Ping-pong detection without any micro-batch index in names: the two micro-batches compute on two streams."""

from __future__ import annotations

import json
from pathlib import Path

import profile_analyzer as pa


def _trace(alternate: bool) -> dict:
    """Four layers of two micro-batches on CUDA streams 7 and 8; each layer's all-to-all on the one communication stream
    20 right after the micro-batch's compute (so the two-communication-streams rule cannot apply). ``alternate``: the streams take turns (a ping-pong); else both compute at once."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 2000}]
    t = 10
    corr = 0

    def kernel(name: str, stream: int, ts: int, dur: int) -> None:
        nonlocal corr
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts - 2,
                   "dur": 1, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                   "args": {"stream": stream, "correlation": corr, "device": 0}})

    for _layer in range(4):
        for stream in (7, 8):
            kernel("void attn_fwd_kernel<bf16>(Params)", stream, t, 50)
            kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, t + 50, 40)
            if alternate:
                t += 60  # the other micro-batch computes while this one's all-to-all runs
        if not alternate:
            t += 100
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}


def test_two_compute_streams_taking_turns_are_the_micro_batches(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(_trace(alternate=True)))
    rep = pa.analyze(pa.load(tmp_path / "t.json")).to_dict()
    (d,) = rep["dual_batch"]
    assert d["detected"] and d["method"] == "two_compute_streams", d["reason"]
    ub = {u["ubatch"]: u for u in d["ubatches"]}
    assert ub[0]["comm_ops"] == ub[1]["comm_ops"] == 4
    # each transfer (40 µs, from the end of its compute) has the other micro-batch's compute over its last 30 µs;
    # the last one of micro-batch 1 has nothing after it
    assert [round(x["covered_pct"]) for x in d["layers"] if x["ubatch"] == 0] == [75, 75, 75, 75]
    assert [round(x["covered_pct"]) for x in d["layers"] if x["ubatch"] == 1] == [75, 75, 75, 0]
    assert [x["layer"] for x in d["layers"] if x["ubatch"] == 1] == [0, 1, 2, 3]


def test_two_compute_streams_running_at_once_are_not_a_ping_pong(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(_trace(alternate=False)))
    rep = pa.analyze(pa.load(tmp_path / "t.json")).to_dict()
    (d,) = rep["dual_batch"]
    assert not d["detected"] and d["reason"].startswith("no ping-pong found")
