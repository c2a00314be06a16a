"""Ping-pong detection from phase annotations that carry no micro-batch index (attn / mlp / dispatch / combine
ranges, each twice per layer when two micro-batches interleave): the ``repeated_ranges`` rule of
``analyses/dual_batch.py``."""

from __future__ import annotations

import json
from pathlib import Path

import profile_analyzer as pa


def _trace(dbo: bool, layers: int = 4, layer_tokens: bool = False) -> dict:
    """A GPU trace: compute kernels on stream 7, all-to-all kernels on stream 20, each under a
    ``gpu_user_annotation`` range named after its phase (no micro-batch index anywhere).

    ``dbo``: per layer A.attn, A.dispatch | B.attn, B.dispatch | A.mlp, A.combine | B.mlp, B.combine | next A.attn,
    each 50 µs compute step hiding the other micro-batch's 40 µs collective (the very last one has nothing after it).
    Else one batch: attn, dispatch, mlp, combine, each collective exposed."""
    ev: list[dict] = []

    def k(name: str, stream: int, s: int, e: int, phase: str, layer: int) -> None:
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": s, "dur": e - s,
                   "args": {"stream": stream}})
        label = f"{phase}.layer{layer}" if layer_tokens else phase
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": label, "pid": 0, "tid": stream, "ts": s,
                   "dur": e - s, "args": {"stream": stream}})

    gemm, a2a = "void gemm_kernel<bf16>(Params)", "ncclDevKernel_AllToAll_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    t = 0
    for layer in range(layers):
        if dbo:
            k(gemm, 7, t, t + 50, "attn", layer)           # A
            k(a2a, 20, t + 50, t + 90, "dispatch", layer)  # A's dispatch under B's attn
            k(gemm, 7, t + 50, t + 100, "attn", layer)     # B
            k(a2a, 20, t + 100, t + 140, "dispatch", layer)
            k(gemm, 7, t + 100, t + 150, "mlp", layer)     # A
            k(a2a, 20, t + 150, t + 190, "combine", layer)
            k(gemm, 7, t + 150, t + 200, "mlp", layer)     # B
            k(a2a, 20, t + 200, t + 240, "combine", layer)  # under the next layer's A.attn
            t += 200
        else:
            k(gemm, 7, t, t + 50, "attn", layer)
            k(a2a, 20, t + 50, t + 90, "dispatch", layer)
            k(gemm, 7, t + 90, t + 140, "mlp", layer)
            k(a2a, 20, t + 140, t + 180, "combine", layer)
            t += 180
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}


def _dual_batch(tmp_path: Path, trace: dict) -> dict:
    (tmp_path / "t.json").write_text(json.dumps(trace))
    (d,) = pa.analyze(pa.load(tmp_path / "t.json")).to_dict()["dual_batch"]
    return d


def test_index_free_ping_pong_is_found_with_the_right_per_layer_overlap(tmp_path: Path) -> None:
    d = _dual_batch(tmp_path, _trace(dbo=True))
    assert d["detected"] and d["method"] == "repeated_ranges", d["reason"]
    ub = {u["ubatch"]: u for u in d["ubatches"]}
    assert ub[0]["comm_ops"] == ub[1]["comm_ops"] == 8
    assert ub[0]["op_kinds"] == ub[1]["op_kinds"]
    per_layer: dict[tuple[int, int], list[float]] = {}
    for x in d["layers"]:
        per_layer.setdefault((x["ubatch"], x["layer"]), []).append(round(x["covered_pct"]))
    # every collective of micro-batch 0 runs under micro-batch 1's compute and vice versa; only micro-batch 1's last
    # combine (nothing computes after it) is exposed
    assert {k: v for k, v in per_layer.items() if k[0] == 0} == {(0, layer): [100, 100] for layer in range(4)}
    assert {k: v for k, v in per_layer.items() if k[0] == 1} == {(1, 0): [100, 100], (1, 1): [100, 100],
                                                                  (1, 2): [100, 100], (1, 3): [100, 0]}


def test_index_free_ping_pong_with_layer_tokens_in_the_range_names(tmp_path: Path) -> None:
    d = _dual_batch(tmp_path, _trace(dbo=True, layers=3, layer_tokens=True))
    assert d["detected"] and d["method"] == "repeated_ranges", d["reason"]
    assert sorted({x["layer"] for x in d["layers"]}) == [0, 1, 2]
    assert sum(x["covered_us"] for x in d["layers"]) == 11 * 40.0  # 12 collectives, the last one exposed


def test_index_free_sequential_run_is_not_a_ping_pong(tmp_path: Path) -> None:
    d = _dual_batch(tmp_path, _trace(dbo=False))
    assert not d["detected"] and d["reason"].startswith("no ping-pong found"), d


def test_two_back_to_back_copies_of_a_layer_are_not_a_ping_pong(tmp_path: Path) -> None:
    """attn, dispatch, mlp, combine run twice in a row per layer (two batches one after the other): each phase
    name comes twice per layer, but the second copy starts after the first ends, so nothing interleaves."""
    import re

    trace = _trace(dbo=False, layers=8, layer_tokens=True)
    for e in trace["traceEvents"]:  # layers 2j and 2j+1 become one layer j with every phase twice
        if e["cat"] == "gpu_user_annotation":
            e["name"] = re.sub(r"layer(\d+)", lambda m: f"layer{int(m.group(1)) // 2}", e["name"])
    d = _dual_batch(tmp_path, trace)
    assert not d["detected"], d
