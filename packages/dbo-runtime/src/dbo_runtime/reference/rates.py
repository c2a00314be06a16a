"""This CPU's rates for one rank of the reference model (``dbo-runtime estimate --hardware cpu-link``), timed in
the calling process while the other ranks time theirs: the matrix rate of the model's MLP shapes, the copy
bandwidth, the elementwise rate of a SwiGLU, the fixed cost of one operator, optionally one whole layer of the
reference model and, where the ranks share a process group (gloo), the rate at which gloo moves each collective's
bytes with the ranks' own cores (``host_gbps`` and ``host_call_us``: the collectives' host work, which DBO overlaps
with compute). :func:`dbo_runtime.estimate.measure_cpu_rates` runs :func:`time_rank_rates` in as many spawned
processes as ranks; ``dbo-runtime bench`` runs it in its own ranks beside each sweep row. Both combine the ranks'
timings with :func:`combine_rank_rates`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

RATE_ROWS = 512
"""Token rows of the timed matrix products (the shape of a prefill chunk's MLP)."""
RATE_REPEATS = 9
"""Rounds of the probes at the least (more where the time window allows)."""
CURVE_ROWS = (128, 256, 512, 1024, 2048)
"""Token rows at which the matrix rate is also timed: a matrix product's rate depends on its rows (small ones
use the vector units poorly, large ones spill the caches), so a micro-batch of half the tokens is not simply half
the time. The range covers the reference sweep's products, whole batch and micro-batch (experts: 128-1024 rows
each, attention and shared experts: 256-2048)."""

COLLECTIVE_ROWS = 1024
"""Token rows per rank of the timed collectives (the reference sweep's default batch): smaller ones are mostly
gloo's fixed cost per call, and their rate moved by 3x from one timing to the next here."""
COLLECTIVE_ROUNDS = 31
"""Timed calls of each collective kind (about half a second in all at ``COLLECTIVE_ROWS`` here)."""
COLLECTIVE_SMALL_ROWS = 64
"""Token rows per rank of the second, small timing of each collective: its time is mostly gloo's fixed cost per
call (``host_call_us``), which a micro-batch pays again; ``COLLECTIVE_ROWS`` gives the rate of the bytes beyond it."""


def rate_layer(reference: Any, tokens: int = 512, requests: int = 4) -> dict[str, Any]:
    """The reference-model layer :func:`measure_cpu_rates` / :func:`time_rank_rates` time whole."""
    return {"config": asdict(reference), "tokens": tokens, "requests": requests}


def combine_rank_rates(got: Sequence[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """The rates of ``ranks`` ranks timed at once (one :func:`time_rank_rates` result per process that ran): the
    slowest rank's, scaled by cores / ranks where more ranks than cores share the cores."""
    cores = os.cpu_count() or 1
    share = min(1.0, cores / ranks)
    m = {"gflops": min(x["gflops"] for x in got) * share, "copy_gbps": min(x["copy_gbps"] for x in got) * share,
         "gflops_by_rows": {r: min(x["gflops_by_rows"][r] for x in got) * share for r in got[0]["gflops_by_rows"]}
         if all("gflops_by_rows" in x for x in got) else {},
         "elementwise_gbps": min(x["elementwise_gbps"] for x in got) * share,
         "op_us": max(x["op_us"] for x in got) / share, "shape": got[0]["shape"], "ranks": ranks, "cores": cores}
    if all(x.get("host_gbps") for x in got):  # the rank that waited least for its peers: the transfer itself
        m["host_gbps"] = {k: max(x["host_gbps"][k] for x in got) for k in got[0]["host_gbps"]}
        if all("host_call_us" in x for x in got):
            m["host_call_us"] = {k: min(x["host_call_us"][k] for x in got) for k in got[0]["host_call_us"]}
    if all("layer_ms" in x for x in got):
        m.update(layer_ms=max(x["layer_ms"] for x in got) / share, layer_tokens=got[0]["layer_tokens"],
                 layer_requests=got[0]["layer_requests"])
        if all("layer_ms_beside_steps" in x for x in got):
            m["layer_ms_beside_steps"] = max(x["layer_ms_beside_steps"] for x in got) / share
    return m


def at_moment(rates: dict[str, Any], layer_ms: float) -> dict[str, Any]:
    """``rates`` as the machine ran at another moment, at which the same reference layer took ``layer_ms``: every
    compute rate scaled by ``rates["layer_ms"] / layer_ms`` (the matrix rate and its curve, the copy and elementwise
    rates, the cost per operator), so that the layer's share of the matrix rate (``compute_efficiency``) is
    unchanged. The collectives' host rates are kept: gloo's transfers were not timed at that moment.

    ``dbo-runtime bench`` times the layer once after every step of a row (``layer_ms_beside_steps``): the rates
    timed in the seconds after the row, or their median over the sweep, brought to the moments the row's steps ran.
    """
    if not layer_ms or layer_ms <= 0 or not rates.get("layer_ms"):
        raise ValueError(f"layer_ms {layer_ms!r} (rates' {rates.get('layer_ms')!r}) is invalid; accepted: > 0")
    f = rates["layer_ms"] / layer_ms  # > 1: the machine ran faster then
    out = {**rates, "gflops": rates["gflops"] * f, "copy_gbps": rates["copy_gbps"] * f,
           "elementwise_gbps": rates["elementwise_gbps"] * f, "op_us": rates["op_us"] / f, "layer_ms": layer_ms,
           "speed_factor": f}
    if rates.get("gflops_by_rows"):
        out["gflops_by_rows"] = {r: g * f for r, g in rates["gflops_by_rows"].items()}
    return out


def pool_rates(timings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One set of rates from several timings of the same ranks on the same machine (``dbo-runtime bench`` times them
    beside each sweep row, a few seconds each): the median of every measured figure (a float), the rate curve
    point by point; the rest (the shape, the counts of ranks and cores, the layer's size) from the first."""
    out = dict(timings[0])
    for key, value in timings[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(float(t[key]) for t in timings)
    for key in ("gflops_by_rows", "host_gbps", "host_call_us"):
        curves = [t.get(key) or {} for t in timings]
        if all(curves):
            out[key] = {k: statistics.median(c[k] for c in curves) for k in curves[0]}
    out["timings"] = len(timings)
    return out


def time_rank_rates(hidden: int, intermediate: int, dtype_bytes: int, rows: int, repeats: int, seconds: float,
                    barrier: Any = None, layer: dict[str, Any] | None = None, ranks: int = 1) -> dict[str, Any]:
    """One rank's timings (see measure_cpu_rates): ``repeats`` rounds at least, for ``seconds`` at least after the
    ranks meet at ``barrier`` (twice that with a ``layer``). Each round times every probe once, the layer too: on
    a machine whose speed moves from second to second, the rates and the layer are timed at the same moments (timed
    one after the other, the fraction of the matrix rate a layer reaches moved between 0.6 and the cap 1 from one
    sweep row to the next)."""
    import torch
    import torch.nn.functional as F

    dtype = {2: torch.bfloat16, 4: torch.float32}.get(dtype_bytes, torch.float32)
    b = torch.finfo(dtype).bits // 8
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w13 = torch.randn(hidden, 2 * intermediate, dtype=dtype)
        w2 = torch.randn(intermediate, hidden, dtype=dtype)
        curve = sorted({*CURVE_ROWS, rows})
        inputs = {n: (torch.randn(n, hidden, dtype=dtype), torch.randn(n, intermediate, dtype=dtype)) for n in curve}
        gate_up = torch.randn(rows, 2 * intermediate, dtype=dtype)
        src = torch.randn(8 << 20)  # 32 MiB of float32
        dst = torch.empty_like(src)
        tiny = torch.randn(8, hidden, dtype=dtype)
        ops = 64

        def swiglu() -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        run_layer = _reference_layer(layer, ranks) if layer is not None else None
        for x, mid in inputs.values():  # warm-up
            x @ w13, mid @ w2  # noqa: B018
        swiglu(), dst.copy_(src), tiny + tiny  # noqa: B018
        if run_layer is not None:
            run_layer()
        if barrier is not None:
            barrier.wait()
        mm: dict[int, list[float]] = {n: [] for n in curve}
        act, copy, op, layer_times = [], [], [], []
        end = time.perf_counter() + seconds * (1 if run_layer is None else 2)
        while len(act) < repeats or time.perf_counter() < end:
            for n, (x, mid) in inputs.items():
                t0 = time.perf_counter()
                x @ w13
                mid @ w2
                mm[n].append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            swiglu()
            t2 = time.perf_counter()
            dst.copy_(src)
            t3 = time.perf_counter()
            for _ in range(ops):
                tiny + tiny  # noqa: B018
            t4 = time.perf_counter()
            act.append(t2 - t1), copy.append(t3 - t2), op.append((t4 - t3) / ops)
            if run_layer is not None:
                run_layer()
                layer_times.append(time.perf_counter() - t4)
    finally:
        torch.set_num_threads(threads)
    host = time_collectives(hidden, COLLECTIVE_ROWS, COLLECTIVE_ROUNDS, COLLECTIVE_SMALL_ROWS)
    q = statistics.median  # as the bench's step times: a rate that predicts a typical step, not a best one
    timed_layer = {} if layer is None else {"layer_ms": q(layer_times) * 1e3, "layer_tokens": int(layer["tokens"]),
                                            "layer_requests": int(layer["requests"])}
    return {**timed_layer, **host,
            "gflops": 2 * rows * hidden * 3 * intermediate / q(mm[rows]) / 1e9,
            "gflops_by_rows": {n: 2 * n * hidden * 3 * intermediate / q(mm[n]) / 1e9 for n in curve},
            "copy_gbps": 2 * src.numel() * 4 / q(copy) / 1e9,
            "elementwise_gbps": 3 * rows * intermediate * b / q(act) / 1e9,  # read gate and up, write the product
            "op_us": q(op) * 1e6,
            "shape": f"[{rows}x{hidden}]@[{hidden}x{2 * intermediate}] + [{rows}x{intermediate}]@[{intermediate}x{hidden}]"}


def collective_wire_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """What one rank moves over its link in a collective whose per-rank tensor is ``nbytes`` (the input of an
    all-gather, all-to-all or all-reduce, the output of a reduce-scatter), as ``dbo-runtime estimate`` counts it."""
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks * nbytes
    if kind == "all_to_all":
        return (ranks - 1) / ranks * nbytes
    return (ranks - 1) * nbytes


def time_collectives(hidden: int, rows: int, rounds: int, small_rows: int | None = None) -> dict[str, dict[str, float]]:
    """Where this process is one rank of an initialised process group of two or more ranks (``dbo-runtime bench``'s
    ranks, ``measure_cpu_rates``' workers): each collective kind of ``dbo-runtime estimate`` on ``rows`` x ``hidden``
    float32 per rank, ``rounds`` times after a barrier (a fixed count: every rank makes the same calls). On a CPU
    backend (gloo) that time is the host's cores moving the bytes. Returns ``host_gbps``, per kind the wire bytes it
    moves over the median time (GB/s), and with ``small_rows`` (a second timing on that many rows) the time split
    in two: ``host_call_us``, the fixed cost of one call, and ``host_gbps``, the rate of the bytes beyond it (the
    time's growth from the small call to the large one; where the large call was no slower, noise: all of it is
    rate, no fixed cost). Empty without such a group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    n = dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as reference.comm calls them
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def median_times(m: int) -> dict[str, tuple[float, float]]:
        """Per kind: (wire bytes, median seconds) on ``m`` rows."""
        x = torch.randn(m, hidden)
        gathered, wide, out = torch.empty(n * m, hidden), torch.randn(n * m, hidden), torch.empty(m, hidden)
        ops = {"all_gather": lambda: gather(gathered, x),
               "reduce_scatter": lambda: scatter(out, wide),
               "all_reduce": lambda: dist.all_reduce(out),
               "all_to_all": lambda: dist.all_to_all_single(gathered[:m], x)}
        got = {}
        for kind, op in ops.items():
            op()  # warm-up
            times = []
            for _ in range(rounds):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            got[kind] = (collective_wire_bytes(kind, x.numel() * 4, n), statistics.median(times))
        return got

    large = median_times(rows)
    small = median_times(small_rows) if small_rows else {}
    rates, calls = {}, {}
    for kind, (wire, t) in large.items():
        rate, call = wire / t, 0.0
        if kind in small:
            wire_s, t_s = small[kind]
            if t > t_s and wire > wire_s:
                rate = (wire - wire_s) / (t - t_s)
                call = max(0.0, t_s - wire_s / rate)
        rates[kind], calls[kind] = rate / 1e9, call * 1e6
    return {"host_gbps": rates, **({"host_call_us": calls} if small else {})}


def _reference_layer(layer: dict[str, Any], ranks: int) -> Callable[[], None]:
    """A call that runs the compute of one reference-model layer as one rank of ``ranks`` (A2 layout: the experts
    run over every rank's tokens, as the all-gather delivers them; no collective is run)."""
    import types

    import torch

    from dbo_runtime.reference.model import Batch, KVCache, MoEConfig, ReferenceMoE, batch_inputs

    config = MoEConfig(**{**layer["config"], "num_layers": 1})
    model = ReferenceMoE(config, pattern="a2", comm=types.SimpleNamespace(rank=0, world_size=ranks),
                         dtype=torch.float32)
    tokens, requests = int(layer["tokens"]), int(layer["requests"])
    batch = Batch.prefill([tokens // requests + (i < tokens % requests) for i in range(requests)])
    kv = KVCache(config, batch, rank=0, dtype=torch.float32)
    x0 = batch_inputs(config, batch, rank=0, step=0, dtype=torch.float32)
    part = model.whole_part(x0, batch)
    moe = model.local_moe(ranks)

    def run() -> None:
        model.layer_forward(part, x0, 0, kv, moe=moe)

    return run
