"""Running the reference model on local gloo ranks: one step with or without DBO, timing, checks, tasks.

``forward_step`` is what a model runner does per step: every rank votes (vLLM's token thresholds), the ranks
agree (``dp_sync.coordinate_ubatching``), and then either the plain forward runs on the whole batch or the batch
is cut into two micro-batches (``ubatch.split_ubatches``) that ping-pong (``context.run_ubatches``). When the
batch is not split, the code path is the plain one: DBO costs nothing there.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from dbo_runtime.context import run_ubatches
from dbo_runtime.devices.cpu import CPUBackend
from dbo_runtime.dp_sync import coordinate_ubatching
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.reference.comm import LINK_STAND_IN_NOTE, Collectives, LinkModel
from dbo_runtime.reference.model import (
    DTYPES,
    Batch,
    KVCache,
    MoEConfig,
    ReferenceMoE,
    StepTimer,
    _Part,
    batch_inputs,
)
from dbo_runtime.reference.profiling import kineto_trace
from dbo_runtime.ubatch import (
    DEFAULT_DECODE_TOKEN_THRESHOLD,
    DEFAULT_PREFILL_TOKEN_THRESHOLD,
    pad_ubatch_slices,
    should_ubatch,
    slice_request_metadata,
    split_ubatches,
)

__all__ = [
    "COMM_SHARE_TARGET",
    "StepResult",
    "RunSpec",
    "forward_step",
    "check_ranks_agree",
    "calibrate_link",
    "measure",
    "reference_task",
    "equality_task",
]

COMM_SHARE_TARGET = 0.40
"""Default link calibration: communication about 40% of a DBO-off step (the prefill share reported for 910B)."""

_CPU = CPUBackend()


@dataclass
class StepResult:
    output: torch.Tensor
    split: bool
    step_s: float
    compute_s: float
    comm_s: float
    num_collectives: int
    wire_bytes: int


def forward_step(
    model: ReferenceMoE,
    batch: Batch,
    x: torch.Tensor,
    kv: KVCache,
    *,
    dbo: bool,
    decode_threshold: int = DEFAULT_DECODE_TOKEN_THRESHOLD,
    prefill_threshold: int = DEFAULT_PREFILL_TOKEN_THRESHOLD,
    timeout_s: float = 60.0,
    scheduler: str | None = None,
    vote: bool | None = None,
) -> StepResult:
    """One step of the model on this rank (every rank calls it; they agree whether to split).

    ``scheduler``: ``thread`` or ``greenlet`` (:func:`dbo_runtime.workers.run_ubatches`' ``mode``; None reads
    ``$DBO_RUNTIME_SCHEDULER``). ``vote``: this rank's vote from a split policy (``auto``) in place of the token
    thresholds' (with ``dbo`` on)."""
    comm, timer = model.comm, model.timer
    comm.reset_records()
    timer.compute_s = 0.0
    t0 = time.perf_counter()
    if vote is not None:
        vote = dbo and vote
    else:
        vote = dbo and should_ubatch(
            batch.num_tokens,
            is_decode_only=batch.is_decode_only,
            decode_token_threshold=decode_threshold,
            prefill_token_threshold=prefill_threshold,
        )
    decision = coordinate_ubatching(
        should_split=vote, num_tokens=batch.num_tokens, timeout_s=timeout_s, dp_size=comm.world_size, dp_rank=comm.rank
    )
    padded = max(decision.num_tokens_across_dp)  # all-gather needs the same row count on every rank
    if padded > batch.num_tokens:
        x = torch.cat([x, x.new_zeros((padded - batch.num_tokens, x.shape[1]))])
    if not decision.split:
        out = model.forward_part(model.whole_part(x, batch), kv)
    else:
        positions = batch.positions()
        slices = split_ubatches(list(batch.num_scheduled_tokens), num_tokens_padded=padded)
        parts = []
        for real, with_pad in zip(slices, pad_ubatch_slices(slices, num_tokens_padded=padded), strict=True):
            qsl, _ = slice_request_metadata(batch.query_start_loc, batch.seq_lens, real)
            requests = list(range(real.request_slice.start, real.request_slice.stop))
            parts.append(_Part(x[with_pad.token_slice], positions[real.token_slice], requests, qsl))
        fns: list[Callable[[], torch.Tensor]] = [lambda p=p: model.forward_part(p, kv) for p in parts]
        out = torch.cat(run_ubatches(fns, backend=_CPU, timeout_s=timeout_s, mode=scheduler))
    step_s = time.perf_counter() - t0
    records = comm.reset_records()
    return StepResult(
        output=out[: batch.num_tokens],
        split=decision.split,
        step_s=step_s,
        compute_s=timer.compute_s,
        comm_s=sum(r.duration_s for r in records),
        num_collectives=len(records),
        wire_bytes=sum(r.wire_bytes for r in records),
    )


def check_ranks_agree(config: MoEConfig, world_size: int, pattern: str, *, expected_world_size: int | None = None) -> None:
    """Every rank runs the same model and pattern with the world size it was told; else every rank raises."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([config.fingerprint(), world_size, rank, ["a2", "a3"].index(pattern)], dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine)
    problems = []
    if expected_world_size is not None and expected_world_size != world:
        problems.append(f"expected {expected_world_size} ranks but the process group has {world}")
    for r, row in enumerate(table):
        fp, ws, claimed_rank, pat = (int(v) for v in row.tolist())
        if ws != world:
            problems.append(f"rank {r} was configured for {ws} ranks, the group has {world}")
        if claimed_rank != r:
            problems.append(f"rank {r} believes it is rank {claimed_rank}")
        if fp != int(table[0][0]) or pat != int(table[0][3]):
            problems.append(f"rank {r} runs a different model configuration or pattern than rank 0")
    if problems:
        raise DBOConfigError("ranks disagree: " + "; ".join(problems))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def calibrate_link(
    model: ReferenceMoE,
    batch: Batch,
    dtype: torch.dtype,
    *,
    latency_us: float = 20.0,
    share: float = COMM_SHARE_TARGET,
    steps: int = 4,
    timeout_s: float = 60.0,
) -> LinkModel:
    """A link such that communication is ``share`` of a DBO-off step of ``batch`` on this machine.

    Runs DBO-off steps with a latency-only link (the first one as warm-up), takes the smallest compute time (the
    least disturbed by other work on the machine) and the wire bytes, the largest over ranks so that every rank
    computes the same link, and solves latency x collectives + bytes / bandwidth =
    compute x share / (1 - share).
    """
    saved = model.comm.link
    model.comm.link = LinkModel(latency_us, math.inf)
    try:
        computes, wires, counts = [], [], []
        for step in range(steps):
            x = batch_inputs(model.config, batch, rank=model.rank, step=step, dtype=dtype)
            kv = KVCache(model.config, batch, rank=model.rank, dtype=dtype)
            dist.barrier()
            r = forward_step(model, batch, x, kv, dbo=False, timeout_s=timeout_s)
            if step > 0 or steps == 1:
                computes.append(r.compute_s)
            wires.append(r.wire_bytes)
            counts.append(r.num_collectives)
    finally:
        model.comm.link = saved
    compute = _max_over_ranks(min(computes))
    wire = _max_over_ranks(float(max(wires)))
    count = _max_over_ranks(float(max(counts)))
    target = compute * share / (1.0 - share)
    bandwidth_time = target - count * latency_us * 1e-6
    if bandwidth_time <= 0 or wire <= 0:
        return LinkModel(latency_us, math.inf)
    return LinkModel(latency_us, wire / bandwidth_time / 1e9)


@dataclass(frozen=True)
class RunSpec:
    """One reference run: what to run, on which link, how many steps; pickled to every rank."""

    pattern: str = "a2"
    dbo: bool = True
    config: MoEConfig = field(default_factory=MoEConfig)
    batch: Batch = field(default_factory=lambda: Batch.prefill([256] * 4))
    dtype: str = "float32"
    link: str = "auto"  # "auto", "none" or "LAT_US,GBPS"
    steps: int = 5
    warmup: int = 1
    decode_threshold: int = DEFAULT_DECODE_TOKEN_THRESHOLD
    prefill_threshold: int = DEFAULT_PREFILL_TOKEN_THRESHOLD
    trace_dir: str | None = None
    timeout_s: float = 60.0
    expected_world_size: int | None = None
    # Also measure with DBO off on the same link (bench: one process start for both).
    compare_off: bool = False
    scheduler: str = "thread"  # how the two micro-batches run: "thread" (upstream's) or "greenlet"


def measure(
    model: ReferenceMoE, spec: RunSpec, *, modes: tuple[bool, ...] = (True,), trace_dir: str | None = None,
    half_batch: Any = None, probe: Callable[[], Any] | None = None,
) -> list[dict[str, Any]]:
    """Median timings of ``spec.steps`` steps (after ``spec.warmup``) per DBO mode in ``modes``, as this rank saw.

    The modes alternate step by step (in alternating order), so that a machine shared with other work slows them
    alike. A trace, if
    asked for, covers one extra step of the first mode after the timed ones. With ``half_batch`` (a Batch), every
    step also runs that batch with DBO off right after the modes, and one more entry (``"half": True``) holds its
    timings: the compute of a micro-batch-sized batch measured beside the whole one, step by step. With ``probe`` (a
    call of fixed work, e.g. one reference layer alone), every step also times it once, all ranks at once, after the
    step's batches, and a last entry (``"probe": True``) holds its times: the machine's speed at the moments the
    steps ran (on a machine whose speed moves from minute to minute, rates timed once before or after are another
    machine's).
    """
    dtype = DTYPES[spec.dtype]
    acc: list[dict[str, Any]] = [
        {"dbo": dbo, "split": False, "steps_s": [], "compute": [], "comm": [], "wire_bytes": 0, "num_collectives": 0}
        for dbo in modes
    ]
    runs = [(i, dbo, spec.batch) for i, dbo in enumerate(modes)]
    if half_batch is not None:
        acc.append({"dbo": False, "half": True, "split": False, "steps_s": [], "compute": [], "comm": [],
                    "wire_bytes": 0, "num_collectives": 0})  # fmt: skip
    probe_s: list[float] = []
    total = spec.warmup + spec.steps
    for step in range(total):
        order = list(runs)
        if step % 2:
            order.reverse()  # neither mode always runs right after the other
        if half_batch is not None:
            order.append((len(modes), False, half_batch))
        for i, dbo, batch in order:
            x = batch_inputs(model.config, batch, rank=model.rank, step=step, dtype=dtype)
            kv = KVCache(model.config, batch, rank=model.rank, dtype=dtype)
            dist.barrier()
            r = forward_step(
                model, batch, x, kv, dbo=dbo, decode_threshold=spec.decode_threshold,
                prefill_threshold=spec.prefill_threshold, timeout_s=spec.timeout_s, scheduler=spec.scheduler,
            )  # fmt: skip
            a = acc[i]
            if step >= spec.warmup:
                a["steps_s"].append(r.step_s)
                a["compute"].append(r.compute_s)
                a["comm"].append(r.comm_s)
            a["split"], a["wire_bytes"], a["num_collectives"] = r.split, r.wire_bytes, r.num_collectives
        if probe is not None:
            dist.barrier()  # the ranks time it at once, as they compute a step's layers at once
            t0 = time.perf_counter()
            probe()
            if step >= spec.warmup:
                probe_s.append(time.perf_counter() - t0)
    if trace_dir is not None:
        # One more step of the first mode, profiled and not timed (starting the profiler takes a while).
        x = batch_inputs(model.config, spec.batch, rank=model.rank, step=total, dtype=dtype)
        kv = KVCache(model.config, spec.batch, rank=model.rank, dtype=dtype)
        with kineto_trace(trace_dir, model.rank, total, sync=dist.barrier):
            forward_step(
                model, spec.batch, x, kv, dbo=modes[0], decode_threshold=spec.decode_threshold,
                prefill_threshold=spec.prefill_threshold, timeout_s=spec.timeout_s, scheduler=spec.scheduler,
            )  # fmt: skip
    out = []
    for a in acc:
        steps = a.pop("steps_s")
        out.append({
            **{k: v for k, v in a.items() if k not in ("compute", "comm")},
            "step_s": _median(steps),
            "step_min_s": min(steps) if steps else 0.0,
            "compute_s": _median(a["compute"]),
            "comm_s": _median(a["comm"]),
            "steps_s": steps,
            "computes_s": a["compute"],
            "comms_s": a["comm"],
        })  # fmt: skip
    if probe is not None:
        out.append({"probe": True, "step_s": _median(probe_s), "steps_s": probe_s})
    return out


def reference_task(rank: int, world_size: int, spec: RunSpec) -> dict[str, Any]:
    """Rank task of ``dbo-runtime reference`` and of the benchmark."""
    check_ranks_agree(spec.config, world_size, spec.pattern, expected_world_size=spec.expected_world_size)
    dtype = DTYPES[spec.dtype]
    comm = Collectives(link=LinkModel(), timeout_s=spec.timeout_s)
    try:
        model = ReferenceMoE(spec.config, pattern=spec.pattern, comm=comm, dtype=dtype, timer=StepTimer())
        calibrated = spec.link == "auto"
        if calibrated:
            comm.link = calibrate_link(model, spec.batch, dtype, timeout_s=spec.timeout_s)
        else:
            comm.link = LinkModel.parse(spec.link)
        modes = (spec.dbo, not spec.dbo) if spec.compare_off else (spec.dbo,)
        runs = measure(model, spec, modes=modes, trace_dir=spec.trace_dir)
        return {
            "rank": rank,
            "link": comm.link.spec(),
            "link_text": comm.link.describe(),
            "link_note": LINK_STAND_IN_NOTE,
            "calibrated": calibrated,
            "runs": runs,
        }
    finally:
        comm.close()


@dataclass(frozen=True)
class EqualityCase:
    """One on/off comparison: a pattern, a dtype and this rank's batch (ranks may differ: uneven DP batches)."""

    name: str
    pattern: str
    dtype: str
    batches: tuple[Batch, ...]  # one per rank
    decode_threshold: int = 2
    prefill_threshold: int = 2


EQUALITY_CONFIG = MoEConfig(hidden_size=64, num_heads=2, head_dim=32, num_layers=2, num_experts=4, top_k=2,
                            expert_intermediate=64, shared_intermediate=96)  # fmt: skip


def equality_cases() -> list[EqualityCase]:
    """On/off comparisons for both patterns and dtypes, prefill and decode, with uneven splits.

    The two ranks run different batches (DP padding to the larger one), token totals are odd, and the token-balanced
    cut falls inside a request (it straddles the two micro-batches). The last case is below vLLM's default
    thresholds, where DBO on must not split.
    """
    prefill = (Batch((20, 13, 6), (5, 0, 9)), Batch((9, 30), (0, 3)))
    decode = (Batch.decode(40, 17), Batch.decode(33, 9))
    cases = []
    for pattern in ("a2", "a3"):
        for dtype in ("float32", "bfloat16"):
            cases.append(EqualityCase(f"{pattern}-{dtype}-prefill", pattern, dtype, prefill))
            cases.append(EqualityCase(f"{pattern}-{dtype}-decode", pattern, dtype, decode))
    small = (Batch.prefill([30, 20]), Batch.prefill([40]))
    cases.append(EqualityCase("a2-below-threshold", "a2", "float32", small, decode_threshold=32, prefill_threshold=512))
    return cases


def equality_task(rank: int, world_size: int, payload: tuple) -> list[dict]:
    """DBO on vs off on each case; returns per case whether it split, bitwise equality and the max abs diff.

    ``payload``: ``(config, cases, trace_dir)`` or ``(config, cases, trace_dir, scheduler)``; DBO on runs under
    ``scheduler`` (default: ``$DBO_RUNTIME_SCHEDULER``, else thread)."""
    config, cases, trace_dir = payload[:3]
    scheduler = payload[3] if len(payload) > 3 else None
    out = []
    comm = Collectives(link=LinkModel(0.0, math.inf), timeout_s=30.0)
    try:
        for i, case in enumerate(cases):
            dtype = DTYPES[case.dtype]
            model = ReferenceMoE(config, pattern=case.pattern, comm=comm, dtype=dtype)
            batch = case.batches[rank]
            x = batch_inputs(config, batch, rank=rank, step=0, dtype=dtype)
            results = {}
            for dbo in (False, True):
                kv = KVCache(config, batch, rank=rank, dtype=dtype)
                with kineto_trace(trace_dir if (dbo and i == 0) else None, rank):
                    results[dbo] = forward_step(
                        model, batch, x, kv, dbo=dbo, decode_threshold=case.decode_threshold,
                        prefill_threshold=case.prefill_threshold, timeout_s=30.0, scheduler=scheduler,
                    )  # fmt: skip
            off, on = results[False].output, results[True].output
            out.append({
                "name": case.name,
                "split": results[True].split,
                "split_off": results[False].split,
                "bitwise_equal": bool(torch.equal(off, on)),
                "max_abs_diff": float((off.float() - on.float()).abs().max()),
                "finite": bool(torch.isfinite(on.float()).all()),
                "rows": int(on.shape[0]),
                "checksum": float(off.double().sum()),
            })  # fmt: skip
    finally:
        comm.close()
    return out


@dataclass(frozen=True)
class FaultSpec:
    """Fault injection for tests: what goes wrong, on which rank, micro-batch and hook site."""

    kind: str  # "raise" (an exception at a hook site), "mismatch" (a different model on one rank), "stall" (one
    # rank's micro-batch computes for 3 x timeout_s at a hook site before it launches its collective: the other
    # rank waits on a collective that does not complete in time)
    rank: int = 1
    ubatch: int = 1
    site: str = "layer1.moe.prepare"
    pattern: str = "a2"
    config: MoEConfig = field(default_factory=lambda: MoEConfig(hidden_size=64, num_heads=2, head_dim=32,
                                                                num_layers=3, num_experts=4, expert_intermediate=128,
                                                                shared_intermediate=128))  # fmt: skip
    timeout_s: float = 5.0
    scheduler: str = "thread"


class InjectedFault(RuntimeError):
    """The exception fault injection raises."""


def fault_task(rank: int, world_size: int, fault: FaultSpec) -> dict[str, Any]:
    """Run DBO steps with ``fault`` injected; the failure must reach every rank as a clear error."""
    import dbo_runtime.hooks as hooks
    from dbo_runtime.context import dbo_current_ubatch_id

    config = fault.config
    if fault.kind == "mismatch" and rank == fault.rank:
        config = replace(config, num_layers=config.num_layers + 1)
    check_ranks_agree(config, world_size, fault.pattern)
    comm = Collectives(link=LinkModel(0.0, math.inf), timeout_s=fault.timeout_s)
    original = hooks.dbo_async_site
    model_module = __import__("dbo_runtime.reference.model", fromlist=["dbo_async_site"])

    def faulty_site(site, launch):
        if rank == fault.rank and site == fault.site and dbo_current_ubatch_id() == fault.ubatch:
            if fault.kind == "stall":
                time.sleep(3 * fault.timeout_s)
            else:
                raise InjectedFault(f"injected at hook site {site} in micro-batch {fault.ubatch} on rank {rank}")
        return original(site, launch)

    model_module.dbo_async_site = faulty_site
    try:
        model = ReferenceMoE(config, pattern=fault.pattern, comm=comm, dtype=torch.float32)
        batch = Batch.prefill([24, 16])
        x = batch_inputs(config, batch, rank=rank, step=0, dtype=torch.float32)
        kv = KVCache(config, batch, rank=rank, dtype=torch.float32)
        forward_step(model, batch, x, kv, dbo=True, prefill_threshold=2, timeout_s=fault.timeout_s,
                     scheduler=fault.scheduler)
        return {"rank": rank, "completed": True}
    finally:
        model_module.dbo_async_site = original
        comm.close()


def compile_task(rank: int, world_size: int, schedulers: tuple[str, ...]) -> dict[str, Any]:
    """torch.compile (CPU inductor) of the reference model's ``forward_part``, DBO off and on under each scheduler.

    Returns, per scheduler, whether the compiled DBO-on step ran and whether it equals the compiled DBO-off step
    bitwise (and a second DBO-on step, i.e. once the micro-batch shapes are compiled), or the error it raised.
    The finding is in docs/dbo.md (scheduler modes, torch.compile).
    """
    config = EQUALITY_CONFIG
    comm = Collectives(link=LinkModel(0.0, math.inf), timeout_s=60.0)
    out: dict[str, Any] = {"rank": rank}
    try:
        model = ReferenceMoE(config, pattern="a2", comm=comm, dtype=torch.float32)
        batch = Batch.prefill([24, 16])
        x = batch_inputs(config, batch, rank=rank, step=0, dtype=torch.float32)

        def step(dbo: bool, scheduler: str) -> torch.Tensor:
            kv = KVCache(config, batch, rank=rank, dtype=torch.float32)
            return forward_step(model, batch, x, kv, dbo=dbo, prefill_threshold=2, timeout_s=60.0,
                                scheduler=scheduler).output

        eager_off = step(False, "thread")
        model.forward_part = torch.compile(model.forward_part)  # type: ignore[method-assign]
        compiled_off = step(False, "thread")
        out["compiled_off_max_abs_diff_vs_eager"] = float((compiled_off - eager_off).abs().max())
        for scheduler in schedulers:
            try:
                first, second = step(True, scheduler), step(True, scheduler)
                out[scheduler] = {"ran": True, "equal_to_compiled_off": bool(torch.equal(first, compiled_off)),
                                  "repeat_equal": bool(torch.equal(first, second))}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the finding is what failed, reported to the caller
                out[scheduler] = {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        comm.close()
    return out
