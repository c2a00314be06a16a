"""Benchmark of the DBO runtime on the reference MoE model (``make bench``, ``dbo-runtime bench``).

Measures, on 2 local gloo ranks (one CPU thread each):

- step time with DBO off and on, and the overlap efficiency
  ``(T_off - T_on) / (T_off - max(T_compute, T_comm))`` (T_compute and T_comm measured in the DBO-off step), for
  both patterns (A2, A3), several token counts and several settings of the modelled link (a stand-in for HCCS;
  the default is calibrated so communication is about 40% of a DBO-off step);
- the same efficiency per adjacent off/on pair of steps, median over the pairs (``pairs``; steady under a load
  that changes from step to step);
- the same efficiency with T_compute taken from the DBO-on steps (``eff(on)``; on CPU half-size micro-batches
  compute faster than the whole batch, which alone can push the first figure past 100%);
- the median and p99 cost of one yield handoff between the two micro-batches, in microseconds, under both
  schedulers (``thread``: two OS threads and events, upstream's; ``greenlet``: one thread, two greenlets);
- a decode step (64 tokens per rank, 16 layers, the link calibrated as ``dbo-runtime reference`` does by default)
  with DBO off and on under each scheduler (``decode`` rows): where the handoff cost weighs most;
- the cost of DBO on a batch below the split thresholds, where the plain path runs (expected: none).

Off and on steps alternate, and medians are reported, because the machine may be shared with other work.
Writes ``<out>/dbo_runtime.json`` and ``<out>/dbo_runtime.md`` (atomically) and prints a table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["BenchPlan", "sweep_runs", "measure_handoff", "bench_task", "run_bench", "quick_plan", "main", "TARGET_EFFICIENCY"]

TARGET_EFFICIENCY = 0.80
HANDOFF_TARGET_US = 2.0
"""Issue 15's target for the greenlet scheduler's median handoff."""
DISTURBED_COMPUTE_RATIO = 0.15
"""A row whose compute time with DBO on differs from DBO off by more than this fraction is flagged as disturbed."""


def _equality_figures(summary: dict) -> tuple[int, int, float] | None:
    """(fp32 split cases bitwise equal, fp32 split cases, bf16 max abs diff) of the on/off equality check."""
    split = [e for e in summary.get("equality") or [] if e["split"]]
    if not split:
        return None
    fp32 = [e for e in split if "float32" in e["case"]]
    bf16 = [e for e in split if "bfloat16" in e["case"]]
    return (sum(e["bitwise_equal"] for e in fp32), len(fp32),
            max((e["max_abs_diff"] for e in bf16), default=float("nan")))


def measure_handoff(num_yields: int = 2000, mode: str = "thread") -> dict[str, float]:
    """Median and p99 time of one handoff (one micro-batch parks, the other resumes), in microseconds.

    Both micro-batches do nothing but yield, so each of micro-batch 0's yields returns after two handoffs (there and
    back); micro-batch 0 times them. Micro-batch 1 only yields (a micro-batch with no compute), so that what lies
    between the two handoffs is the other side of the yield, not the measurement's own clock reads and bookkeeping.
    ``mode``: the scheduler (``thread`` or ``greenlet``).
    """
    from dbo_runtime.context import dbo_yield, run_ubatches
    from dbo_runtime.devices.cpu import CPUBackend

    samples: list[float] = []

    def timed() -> None:
        clock = time.perf_counter
        for _ in range(num_yields):
            t0 = clock()
            dbo_yield("bench")
            samples.append((clock() - t0) / 2)

    def other() -> None:
        for _ in range(num_yields):
            dbo_yield("bench")

    run_ubatches([timed, other], backend=CPUBackend(), timeout_s=60, mode=mode)
    samples.sort()
    return {
        "scheduler": mode,
        "median_us": statistics.median(samples) * 1e6,
        "p99_us": samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1e6,
        "samples": len(samples),
    }


def handoff_by_cpu(mode: str = "thread", num_yields: int = 2000) -> dict[int, float]:
    """The handoff median (µs) with the process pinned to each CPU it may run on in turn ({} with one CPU, or where
    the OS cannot pin). On this project's 2-vCPU virtual machine the two vCPUs' greenlet figures have differed by up
    to 1.7x, which one was faster changing from run to run (docs/dbo.md): an unpinned figure is whichever vCPU the
    OS picked, at the machine's speed of that moment."""
    if not hasattr(os, "sched_getaffinity"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    out: dict[int, float] = {}
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})  # this thread; the thread mode's micro-batch threads inherit it
            out[cpu] = measure_handoff(num_yields, mode)["median_us"]
    finally:
        os.sched_setaffinity(0, cpus)
    return out


def _handoffs() -> dict[str, dict[str, Any]]:
    """Both schedulers' handoff, unpinned (the figure the target is judged on) and pinned to each CPU."""
    out: dict[str, dict[str, Any]] = {}
    for mode in ("thread", "greenlet"):
        out[mode] = {**measure_handoff(mode=mode), "median_us_by_cpu": handoff_by_cpu(mode)}
    return out


@dataclass(frozen=True)
class LinkVariant:
    """A link setting relative to the calibrated default: bandwidth scaled, latency replaced."""

    name: str
    bandwidth_scale: float = 1.0
    latency_us: float | None = None


@dataclass(frozen=True)
class BenchPlan:
    patterns: tuple[str, ...] = ("a2", "a3")
    num_layers: int = 4
    requests: int = 4
    default_tokens: int = 1024
    token_counts: tuple[int, ...] = (512, 1024, 2048)
    links: tuple[LinkVariant, ...] = (
        LinkVariant("default"),
        LinkVariant("bw x0.5", bandwidth_scale=0.5),
        LinkVariant("bw x2", bandwidth_scale=2.0),
        LinkVariant("latency 200us", latency_us=200.0),
    )
    # Timed steps per sweep row. On this 2-core machine one step's DBO-on time scatters around the what-if's
    # prediction from the DBO-off step beside it by more than the 10 % the check allows (the what-if table prints
    # the scatter per row); a row's median over 7 steps then still moved from run to run by half that. 15 steps
    # halve the variance of the median, for about 5 more minutes of bench.
    steps: int = 15
    no_split_steps: int = 14  # the below-threshold rows (DBO on must cost nothing there)
    warmup: int = 1
    no_split_tokens: int = 256  # below the 512-token prefill threshold
    hidden_size: int = 256
    expert_intermediate: int = 2048  # the reference model's defaults (MoEConfig): see its docstring
    shared_intermediate: int = 2048
    config_overrides: dict[str, int] = field(default_factory=dict)
    smoke: bool = False  # a quick smoke plan: its "default" row is not the benchmark's default setting
    scheduler: str = "thread"  # the scheduler of the sweep's DBO-on steps
    # The decode comparison: DBO off vs on under each scheduler.
    decode_tokens: int = 64
    decode_layers: int = 16
    decode_schedulers: tuple[str, ...] = ("thread", "greenlet")
    # one extra DBO-off step per row, profiled into <trace_dir>/<row>/ (what `profile-analyzer whatif` is checked on)
    trace_dir: str | None = None
    # After each sweep row, both ranks time this CPU's rates at once for this long (reference.rates'
    # time_rank_rates, a reference layer included): the rates `dbo-runtime estimate` is validated with, taken
    # beside the row's steps rather than minutes later. 0: not timed.
    row_rate_seconds: float = 2.0


def _loadavg_1m() -> float | None:
    """The 1-minute load average right after a row: about 2 is this benchmark's own two ranks; more means other
    work shared the 2 cores while the row was measured."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _batch(tokens: int, requests: int):
    from dbo_runtime.reference.model import Batch

    requests = max(1, min(requests, tokens))
    base, extra = divmod(tokens, requests)
    return Batch.prefill([base + (1 if i < extra else 0) for i in range(requests)])


def bench_task(rank: int, world_size: int, plan: BenchPlan) -> dict[str, Any]:
    """Rank task: every measurement of the plan, in one process start."""
    from dbo_runtime.reference.comm import Collectives, LinkModel
    from dbo_runtime.reference.model import DTYPES, MoEConfig, ReferenceMoE, StepTimer
    from dbo_runtime.reference.run import RunSpec, calibrate_link, check_ranks_agree, measure

    config = MoEConfig(
        num_layers=plan.num_layers,
        hidden_size=plan.hidden_size,
        expert_intermediate=plan.expert_intermediate,
        shared_intermediate=plan.shared_intermediate,
        **plan.config_overrides,
    )
    out: dict[str, Any] = {"rank": rank, "rows": [], "no_split": []}
    comm = Collectives(link=LinkModel(), timeout_s=120.0)
    done, total = 0, len(plan.patterns) * len(sweep_runs(plan))
    probe = _rate_layer_probe(config, plan, world_size)
    try:
        for pattern in plan.patterns:
            check_ranks_agree(config, world_size, pattern)
            model = ReferenceMoE(config, pattern=pattern, comm=comm, dtype=DTYPES["float32"], timer=StepTimer())
            default_batch = _batch(plan.default_tokens, plan.requests)
            default_link = calibrate_link(model, default_batch, DTYPES["float32"], timeout_s=120.0)
            runs = sweep_runs(plan)
            from dbo_runtime.reference.whatif_check import occurrences, row_trace_dir

            nth = occurrences([(pattern, tokens, variant.name) for tokens, variant in runs])
            for (tokens, variant), occurrence in zip(runs, nth, strict=True):
                comm.link = LinkModel(
                    default_link.latency_us if variant.latency_us is None else variant.latency_us,
                    default_link.bandwidth_gbps * variant.bandwidth_scale,
                )
                spec = RunSpec(pattern=pattern, config=config, batch=_batch(tokens, plan.requests), steps=plan.steps,
                               warmup=plan.warmup, prefill_threshold=2, decode_threshold=2, timeout_s=120.0,
                               scheduler=plan.scheduler)  # fmt: skip
                trace = None
                if plan.trace_dir is not None:
                    trace = str(row_trace_dir(plan.trace_dir, pattern, tokens, variant.name, occurrence))
                # each step also runs half the tokens with DBO off: the what-if check's compute scale, measured
                # beside the row's own compute (not in another row, minutes apart on a machine whose speed moves)
                # and, with the row's rates, the rates' reference layer once, at the moments the steps ran
                off, on, half, *probed = measure(model, spec, modes=(False, True), trace_dir=trace,
                                                 half_batch=_batch(max(1, tokens // 2), plan.requests), probe=probe)
                rates = _row_rates(config, plan, world_size)
                if rates is not None and probed:
                    rates["layer_ms_beside_steps"] = probed[0]["step_s"] * 1e3
                out["rows"].append({"pattern": pattern, "tokens": tokens, "link": variant.name,
                                    "link_spec": comm.link.spec(), "link_text": comm.link.describe(),
                                    "off": off, "on": on, "half": half, "loadavg_1m": _loadavg_1m(),
                                    "rates": rates, **({"probe": probed[0]} if probed else {})})  # fmt: skip
                done += 1
                _progress(rank, f"[{done}/{total} sweep rows] {pattern} {tokens} tokens, link {variant.name}: "
                                f"off {off['step_s'] * 1e3:.0f} ms, on {on['step_s'] * 1e3:.0f} ms (rank 0)")
            # Below the thresholds (vLLM defaults): DBO on must take the plain path and cost nothing.
            comm.link = default_link
            spec = RunSpec(pattern=pattern, config=config, batch=_batch(plan.no_split_tokens, plan.requests),
                           steps=plan.no_split_steps, warmup=plan.warmup, timeout_s=120.0)  # fmt: skip
            off, on = measure(model, replace(spec), modes=(False, True))
            out["no_split"].append({"pattern": pattern, "tokens": plan.no_split_tokens, "off": off, "on": on})
        out["decode"] = _decode_rows(plan, comm, world_size)
    finally:
        comm.close()
    return out


def sweep_runs(plan: BenchPlan) -> list[tuple[int, LinkVariant]]:
    """The (tokens, link) rows of one pattern's sweep: every token count at the default link, then the default token
    count at each other link setting."""
    return [(t, plan.links[0]) for t in plan.token_counts] + [(plan.default_tokens, v) for v in plan.links[1:]]


def _row_rates(config: Any, plan: BenchPlan, world_size: int) -> dict[str, Any] | None:
    """This rank's CPU rates, timed while the other ranks time theirs (they meet at a barrier of the ranks' process
    group), on the shapes ``dbo-runtime estimate --hardware cpu-link`` times for this model (its MLP: the routed
    experts' width; float32, as the bench runs)."""
    if plan.row_rate_seconds <= 0:
        return None
    import types

    import torch.distributed as dist

    from dbo_runtime.reference.rates import RATE_REPEATS, RATE_ROWS, time_rank_rates

    barrier = types.SimpleNamespace(wait=dist.barrier) if dist.is_initialized() else None
    return time_rank_rates(config.hidden_size, config.expert_intermediate, 4, RATE_ROWS, RATE_REPEATS,
                           plan.row_rate_seconds, barrier, _rate_layer_spec(config, plan), world_size)


def _rate_layer_probe(config: Any, plan: BenchPlan, world_size: int) -> Callable[[], None] | None:
    """The reference layer :func:`_row_rates` times (None where the rows time no rates), as a call that ``measure``
    times once per step beside the row's steps (``layer_ms_beside_steps``)."""
    if plan.row_rate_seconds <= 0:
        return None
    from dbo_runtime.reference.rates import _reference_layer

    layer = _reference_layer(_rate_layer_spec(config, plan), world_size)
    layer()  # its first call allocates
    return layer


def _rate_layer_spec(config: Any, plan: BenchPlan) -> dict[str, Any]:
    from dbo_runtime.reference.rates import rate_layer

    return rate_layer(config, tokens=min(512, plan.default_tokens), requests=plan.requests)


def _progress(rank: int, line: str) -> None:
    """One progress line on stderr from rank 0 (make bench's log shows the sweep advancing, row by row)."""
    if rank == 0:
        print(f"dbo-runtime bench: {line}", file=sys.stderr, flush=True)


def _decode_rows(plan: BenchPlan, comm: Any, world_size: int) -> list[dict[str, Any]]:
    """A decode step (``decode_tokens`` per rank, ``decode_layers`` layers, vLLM's default decode threshold, the
    link calibrated on this batch as ``dbo-runtime reference --link auto`` does): DBO off vs on per scheduler.

    DBO off and DBO on under each scheduler run in the same loop, one step each per round, in an order that rotates
    every round: on a machine shared with other work, the three see the same load (run one after the other they
    did not, and the scheduler comparison was noise). Each row's ``off`` is that shared DBO-off series."""
    import torch.distributed as dist

    from dbo_runtime.reference.model import (
        DTYPES,
        Batch,
        KVCache,
        MoEConfig,
        ReferenceMoE,
        StepTimer,
        batch_inputs,
    )
    from dbo_runtime.reference.run import calibrate_link, check_ranks_agree, forward_step

    config = MoEConfig(num_layers=plan.decode_layers, hidden_size=plan.hidden_size,
                       expert_intermediate=plan.expert_intermediate, shared_intermediate=plan.shared_intermediate,
                       **plan.config_overrides)  # fmt: skip
    pattern = plan.patterns[0]
    check_ranks_agree(config, world_size, pattern)
    dtype = DTYPES["float32"]
    model = ReferenceMoE(config, pattern=pattern, comm=comm, dtype=dtype, timer=StepTimer())
    batch = Batch.decode(plan.decode_tokens, 1)
    comm.link = calibrate_link(model, batch, dtype, timeout_s=120.0)
    modes = [("off", False, "thread")] + [(s, True, s) for s in plan.decode_schedulers]
    series: dict[str, dict[str, Any]] = {m[0]: {"split": False, "steps_s": [], "compute": [], "comm": []} for m in modes}
    steps = plan.steps * 2
    for step in range(plan.warmup + steps):
        k = step % len(modes)
        for name, dbo, scheduler in modes[k:] + modes[:k]:
            x = batch_inputs(config, batch, rank=model.rank, step=step, dtype=dtype)
            kv = KVCache(config, batch, rank=model.rank, dtype=dtype)
            dist.barrier()
            r = forward_step(model, batch, x, kv, dbo=dbo, timeout_s=120.0, scheduler=scheduler)
            entry = series[name]
            entry["split"] = r.split
            if step >= plan.warmup:
                entry["steps_s"].append(r.step_s)
                entry["compute"].append(r.compute_s)
                entry["comm"].append(r.comm_s)

    def run(name: str) -> dict[str, Any]:
        e = series[name]
        return {"split": e["split"], "steps_s": e["steps_s"], "step_s": statistics.median(e["steps_s"]),
                "compute_s": statistics.median(e["compute"]), "comm_s": statistics.median(e["comm"])}  # fmt: skip

    return [{"pattern": pattern, "scheduler": s, "tokens": plan.decode_tokens, "layers": plan.decode_layers,
             "link_text": comm.link.describe(), "off": run("off"), "on": run(s)} for s in plan.decode_schedulers]  # fmt: skip


def decode_task(rank: int, world_size: int, plan: BenchPlan) -> dict[str, Any]:
    """Rank task of :func:`scheduler_figures`: only the decode rows of the benchmark."""
    from dbo_runtime.reference.comm import Collectives, LinkModel

    comm = Collectives(link=LinkModel(), timeout_s=120.0)
    try:
        return {"decode": _decode_rows(plan, comm, world_size)}
    finally:
        comm.close()


def scheduler_figures(plan: BenchPlan | None = None) -> dict[str, Any]:
    """The benchmark's scheduler figures alone (a minute or two instead of the whole sweep): the handoff under
    each scheduler and the decode step DBO off vs on per scheduler; printed as the benchmark prints them.

    ``python -c 'from dbo_runtime.reference.bench import scheduler_figures; scheduler_figures()'``
    """
    from dbo_runtime.reference.launcher import run_ranks

    plan = plan or BenchPlan()
    summary = {"handoff_by_scheduler": _handoffs(),
               "handoff_target_us": {"greenlet": HANDOFF_TARGET_US}}  # fmt: skip
    summary["handoff_us"] = summary["handoff_by_scheduler"]["thread"]
    per_rank = run_ranks("dbo_runtime.reference.bench:decode_task", plan, world_size=2, timeout_s=1200,
                         pg_timeout_s=300)  # fmt: skip
    summary["decode"] = _decode_summary(per_rank)
    summary["loadavg"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print("\n".join(_handoff_lines(summary, "us") + _decode_lines(summary)))
    print(f"load average (1, 5, 15 min) at the end: {summary['loadavg']}")
    return summary


def _half_compute(rows: list[dict[str, Any]], no_split: list[dict[str, Any]]) -> None:
    """Per row, ``t_compute_half_ms``: the DBO-off compute of the same pattern at half the tokens (median over the
    sweep's rows and the below-threshold rows that ran it, whatever their link: compute does not depend on the
    link); None where nothing ran it. It is the what-if check's compute scale (``whatif_check.compute_scale``)."""
    for r in rows:
        found = [o["t_compute_ms"] for o in [*rows, *no_split]
                 if o["pattern"] == r["pattern"] and 2 * o["tokens"] == r["tokens"] and o.get("t_compute_ms", 0) > 0]
        r["t_compute_half_ms"] = statistics.median(found) if found else None


def _slowest(per_rank: list[dict[str, Any]], section: str, index: int, mode: str, key: str) -> float:
    return max(r[section][index][mode][key] for r in per_rank)


def efficiency(t_off: float, t_on: float, t_compute: float, t_comm: float) -> float:
    """(T_off - T_on) / (T_off - max(T_compute, T_comm)): 1.0 when all hideable communication is hidden."""
    hideable = t_off - max(t_compute, t_comm)
    return (t_off - t_on) / hideable if hideable > 0 else float("nan")


def _per_step_ms(per_rank: list[dict[str, Any]], i: int) -> dict[str, list[float]]:
    """Row ``i``'s timed steps in the order they ran, the slowest rank's per step (ms): the DBO-off and DBO-on step,
    the compute and communication inside them, the DBO-off compute of half the tokens where it was timed, and the
    rates' reference layer timed after each step (``probe``). The medians above come from these; kept so that a
    reading of the sweep can pair what ran side by side."""
    series = {"off": ("off", "steps_s"), "on": ("on", "steps_s"), "compute_off": ("off", "computes_s"),
              "compute_on": ("on", "computes_s"), "comm_off": ("off", "comms_s"), "compute_half": ("half", "computes_s"),
              "probe": ("probe", "steps_s")}
    out: dict[str, list[float]] = {}
    for name, (mode, key) in series.items():
        runs = [r["rows"][i].get(mode, {}).get(key) for r in per_rank]
        if all(runs):
            out[name] = [max(step) * 1e3 for step in zip(*runs, strict=False)]
    return out


def summarize(per_rank: list[dict[str, Any]], handoff: dict[str, Any], plan: BenchPlan) -> dict[str, Any]:
    """``handoff``: the figures of :func:`measure_handoff` per scheduler (or one scheduler's figures)."""
    from dbo_runtime.reference.comm import LINK_STAND_IN_NOTE
    from dbo_runtime.reference.rates import combine_rank_rates

    by_scheduler = handoff if "median_us" not in handoff else {handoff.get("scheduler", "thread"): handoff}

    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        t_off = _slowest(per_rank, "rows", i, "off", "step_s")
        t_on = _slowest(per_rank, "rows", i, "on", "step_s")
        t_comp = _slowest(per_rank, "rows", i, "off", "compute_s")
        t_comp_on = _slowest(per_rank, "rows", i, "on", "compute_s")
        t_comm = _slowest(per_rank, "rows", i, "off", "comm_s")
        # Per adjacent off/on pair (they ran back to back, under the same load), then the median over pairs.
        pairs = []
        for k in range(len(row["off"]["steps_s"])):
            p_off = max(r["rows"][i]["off"]["steps_s"][k] for r in per_rank)
            p_on = max(r["rows"][i]["on"]["steps_s"][k] for r in per_rank)
            p_comp = max(r["rows"][i]["off"]["computes_s"][k] for r in per_rank)
            p_comm = max(r["rows"][i]["off"]["comms_s"][k] for r in per_rank)
            value = efficiency(p_off, p_on, p_comp, p_comm)
            if not math.isnan(value):
                pairs.append(value)
        # the compute of half the tokens over the row's DBO-off compute, per step (they ran one after the other)
        scales = [max(r["rows"][i]["half"]["computes_s"][k] for r in per_rank)
                  / max(r["rows"][i]["off"]["computes_s"][k] for r in per_rank)
                  for k in range(len(row.get("half", {}).get("computes_s", ())))
                  if max(r["rows"][i]["off"]["computes_s"][k] for r in per_rank) > 0]
        rates = [r["rows"][i].get("rates") for r in per_rank]
        rows.append({
            # the rates both ranks timed right after the row (reference.rates.combine_rank_rates)
            "cpu_rates": combine_rank_rates(rates, len(per_rank)) if all(rates) else None,
            "compute_scale_pairs": statistics.median(scales) if scales else None,
            "efficiency_pairs": statistics.median(pairs) if pairs else float("nan"),
            "pattern": row["pattern"], "tokens": row["tokens"], "link": row["link"], "link_spec": row["link_spec"],
            "link_text": row["link_text"], "split_on": row["on"]["split"], "split_off": row["off"]["split"],
            "t_off_ms": t_off * 1e3, "t_on_ms": t_on * 1e3, "t_compute_ms": t_comp * 1e3,
            "t_compute_on_ms": t_comp_on * 1e3, "t_comm_ms": t_comm * 1e3,
            "comm_share_off": t_comm / t_off if t_off else float("nan"),
            "speedup": t_off / t_on if t_on else float("nan"),
            "efficiency": efficiency(t_off, t_on, t_comp, t_comm),
            # The same formula with the compute time DBO-on steps showed: T_off' = T_compute_on + T_comm.
            "efficiency_on_compute": efficiency(t_comp_on + t_comm, t_on, t_comp_on, t_comm),
            "steps": plan.steps,
            "loadavg_1m": row.get("loadavg_1m"),
            # The same compute ran in both modes; if their medians differ this much, other work took the cores
            # during part of the row (a lagging load average alone does not show it).
            "disturbed": t_comp > 0 and abs(t_comp_on / t_comp - 1.0) > DISTURBED_COMPUTE_RATIO,
            "per_step_ms": _per_step_ms(per_rank, i),
        })  # fmt: skip
        r = rows[-1]
        r["is_default"] = r["link"] == "default" and r["tokens"] == plan.default_tokens
        # Only the default setting carries the target; the other rows show how the efficiency moves around it.
        r["meets_target"] = (not math.isnan(r["efficiency"]) and r["efficiency"] >= TARGET_EFFICIENCY) if r["is_default"] else None
    no_split = []
    for i, row in enumerate(per_rank[0]["no_split"]):
        t_off = _slowest(per_rank, "no_split", i, "off", "step_s")
        t_on = _slowest(per_rank, "no_split", i, "on", "step_s")
        no_split.append({"pattern": row["pattern"], "tokens": row["tokens"], "split_on": row["on"]["split"],
                         "t_off_ms": t_off * 1e3, "t_on_ms": t_on * 1e3,
                         "t_compute_ms": _slowest(per_rank, "no_split", i, "off", "compute_s") * 1e3,
                         "overhead_pct": (t_on / t_off - 1.0) * 100 if t_off else float("nan")})  # fmt: skip
    _half_compute(rows, no_split)
    default = {r["pattern"]: r["efficiency"] for r in rows if r["is_default"]}
    import torch

    return {
        "benchmark": "dbo_runtime reference MoE, 2 gloo ranks, 1 CPU thread each",
        "link_note": LINK_STAND_IN_NOTE,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},  # fmt: skip
        "model": {"layers": plan.num_layers, "hidden": plan.hidden_size, "experts": 8, "top_k": 2,
                  "expert_intermediate": plan.expert_intermediate, "shared_intermediate": plan.shared_intermediate,
                  "requests": plan.requests},  # fmt: skip
        "default_setting": {"tokens": plan.default_tokens, "link": "default (calibrated: communication ~40% of a "
                            "DBO-off step)", "layers": plan.num_layers, "hidden": plan.hidden_size,
                            "intermediate": plan.expert_intermediate},  # fmt: skip
        "target_efficiency": TARGET_EFFICIENCY,
        "smoke": plan.smoke,
        "default_efficiency": default,
        "meets_target": all(not math.isnan(v) and v >= TARGET_EFFICIENCY for v in default.values()) and bool(default),
        "scheduler": plan.scheduler,
        "handoff_us": by_scheduler.get(plan.scheduler) or next(iter(by_scheduler.values())),
        "handoff_by_scheduler": by_scheduler,
        "handoff_target_us": {"greenlet": HANDOFF_TARGET_US},
        "rows": rows,
        "no_split": no_split,
        "decode": _decode_summary(per_rank),
    }


def _decode_summary(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(per_rank[0].get("decode") or []):
        t_off = _slowest(per_rank, "decode", i, "off", "step_s")
        t_on = _slowest(per_rank, "decode", i, "on", "step_s")
        # per adjacent off/on pair (same load), the median of on/off
        ratios = []
        for k in range(len(row["off"]["steps_s"])):
            p_off = max(r["decode"][i]["off"]["steps_s"][k] for r in per_rank)
            p_on = max(r["decode"][i]["on"]["steps_s"][k] for r in per_rank)
            ratios.append(p_on / p_off)
        out.append({
            "pattern": row["pattern"], "scheduler": row["scheduler"], "tokens": row["tokens"], "layers": row["layers"],
            "link_text": row["link_text"], "split_on": row["on"]["split"], "t_off_ms": t_off * 1e3,
            "t_on_ms": t_on * 1e3, "on_over_off": t_on / t_off if t_off else float("nan"),
            "on_over_off_pairs": statistics.median(ratios) if ratios else float("nan"),
            "t_compute_off_ms": _slowest(per_rank, "decode", i, "off", "compute_s") * 1e3,
            "t_compute_on_ms": _slowest(per_rank, "decode", i, "on", "compute_s") * 1e3,
            "t_comm_off_ms": _slowest(per_rank, "decode", i, "off", "comm_s") * 1e3,
            "on_no_slower": t_on <= t_off,
        })  # fmt: skip
    return out


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"DBO reference benchmark ({summary['benchmark']}); {summary['link_note']}",
        _default_setting_line(summary),
        f"{'pattern':7} {'tokens':>6} {'link':14} {'comm%':>6} {'T_off ms':>9} {'T_on ms':>9} {'compute':>8} "
        f"{'cmp(on)':>8} {'comm':>8} {'speedup':>7} {'effic.':>7} {'pairs':>7} {'eff(on)':>7} {'load':>5}  setting",
    ]
    for r in summary["rows"]:
        lines.append(
            f"{r['pattern']:7} {r['tokens']:6d} {r['link']:14} {r['comm_share_off'] * 100:5.1f}% {r['t_off_ms']:9.1f} "
            f"{r['t_on_ms']:9.1f} {r['t_compute_ms']:8.1f} {r['t_compute_on_ms']:8.1f} {r['t_comm_ms']:8.1f} "
            f"{r['speedup']:6.2f}x {r['efficiency'] * 100:6.1f}% {r['efficiency_pairs'] * 100:6.1f}% "
            f"{r['efficiency_on_compute'] * 100:6.1f}% {_load_cell(r):>5}  {_setting_cell(r, summary)}"
        )
    lines += _handoff_lines(summary, "us")
    lines += _decode_lines(summary)
    for r in summary["no_split"]:
        lines.append(
            f"below threshold ({r['pattern']}, {r['tokens']} tokens, not split: {not r['split_on']}): off "
            f"{r['t_off_ms']:.1f} ms, on {r['t_on_ms']:.1f} ms ({r['overhead_pct']:+.1f}%, the same plain path)"
        )
    lines.append(_verdict_line(summary))
    if any(r.get("disturbed") for r in summary["rows"]):
        lines.append(f"rows marked ! were disturbed (compute on vs off differ by more than {DISTURBED_COMPUTE_RATIO:.0%}: "
                     "other work took the cores); rerun on a quiet machine before reading them")  # fmt: skip
    for name, row in (summary.get("default_links") or {}).items():
        lines.append(f"default link ({name}): {row}")
    eq = _equality_figures(summary)
    if eq:
        equal, cases, bf16_max = eq
        lines.append(f"DBO on vs off: fp32 bitwise equal in {equal}/{cases} split cases; bf16 max abs diff {bf16_max:.3g}")
    lines += _check_lines(summary)
    return "\n".join(lines)


def _check_lines(summary: dict[str, Any]) -> list[str]:
    """One line per prediction checked against the sweep: the what-if (from each row's DBO-off trace) and the
    estimate (from the config and the rates timed beside each row); the tables are in dbo_runtime.md."""
    lines = []
    whatif = [r for r in summary.get("whatif") or () if r.get("checked")]
    if whatif:
        lines.append(f"what-if check (profile-analyzer whatif): {sum(bool(r['within']) for r in whatif)} of "
                     f"{len(whatif)} rows within 10% of the measured speed-up")
    est = (summary.get("estimate_check") or {}).get("summary")
    if est:
        lines.append(f"estimate check (dbo-runtime estimate, no profile): {est['within_10pct']} of "
                     f"{est['long_step_rows']} rows within 10% of the measured speed-up")
    return lines


def _handoff_lines(summary: dict[str, Any], unit: str) -> list[str]:
    lines = []
    for name, h in (summary.get("handoff_by_scheduler") or {"thread": summary["handoff_us"]}).items():
        target = (summary.get("handoff_target_us") or {}).get(name)
        verdict = "" if target is None else (f" (target: median <= {target:g} {unit}: "
                                             f"{'met' if h['median_us'] <= target else 'MISSED'})")
        lead = "yield handoff" if unit == "us" else "Yield handoff"
        pinned = sorted((int(c), v) for c, v in (h.get("median_us_by_cpu") or {}).items())  # JSON keys are str
        per_cpu = ""
        if pinned:
            per_cpu = "; pinned to one CPU: " + ", ".join(f"cpu{c} {v:.2f} {unit}" for c, v in pinned)
            if target is not None:
                per_cpu += f" (met on {sum(v <= target for _, v in pinned)} of {len(pinned)})"
        lines.append(f"{lead}, {name} scheduler: median {h['median_us']:.2f} {unit}, p99 {h['p99_us']:.2f} "
                     f"{unit} ({h['samples']} samples){verdict}{per_cpu}")
    return lines


def _decode_lines(summary: dict[str, Any]) -> list[str]:
    rows = summary.get("decode") or []
    if not rows:
        return []
    first = rows[0]
    lines = [f"Decode step ({first['pattern']}, {first['tokens']} tokens/rank, {first['layers']} layers, "
             f"{first['link_text']}), DBO off vs on per scheduler"]  # fmt: skip
    for r in rows:
        lines.append(f"  {r['scheduler']:8} off {r['t_off_ms']:8.1f} ms  on {r['t_on_ms']:8.1f} ms  on/off "
                     f"{r['on_over_off']:.3f} (pairs {r['on_over_off_pairs']:.3f}); compute off/on "
                     f"{r['t_compute_off_ms']:.1f}/{r.get('t_compute_on_ms', float('nan')):.1f} ms, comm (off) "
                     f"{r['t_comm_off_ms']:.1f} ms; split {r['split_on']}")
    verdicts = ", ".join(f"{r['scheduler']} {'no slower' if r['on_no_slower'] else 'SLOWER'}" for r in rows)
    lines.append(f"Decode with DBO on vs off (medians): {verdicts}")
    return lines


def _load_cell(row: dict[str, Any]) -> str:
    load = row.get("loadavg_1m")
    return ("" if load is None else f"{load:.1f}") + ("!" if row.get("disturbed") else "")


def _setting_cell(row: dict[str, Any], summary: dict[str, Any]) -> str:
    """``DEFAULT: meets 80%`` / ``DEFAULT: MISSES 80%`` on the default rows, empty on the others."""
    if not row.get("is_default"):
        return ""
    if summary.get("smoke"):
        return "smoke plan's default (not the figures)"
    return f"DEFAULT: {'meets' if row['meets_target'] else 'MISSES'} {summary['target_efficiency']:.0%}"


def _default_setting_line(summary: dict[str, Any]) -> str:
    d = summary.get("default_setting") or {}
    if summary.get("smoke"):
        return "SMOKE RUN (--quick, tiny model): not the default setting; its efficiencies say nothing about the target"
    return (
        f"default setting (rows marked DEFAULT; the {summary['target_efficiency']:.0%} target applies to them): "
        f"{d.get('tokens')} tokens/rank, {d.get('layers')} layers, hidden {d.get('hidden')}, intermediate "
        f"{d.get('intermediate')}, link {d.get('link')}"
    )


def _verdict_line(summary: dict[str, Any]) -> str:
    eff = ", ".join(f"{k} {v * 100:.1f}%" for k, v in summary["default_efficiency"].items())
    verdict = "MEETS" if summary["meets_target"] else "MISSES"
    if any(r.get("disturbed") for r in summary["rows"] if r.get("is_default")):
        verdict += " (a default row was disturbed: rerun on a quiet machine)"
    if summary.get("smoke"):
        return f"overlap efficiency in this smoke run: {eff} (not measured at the default setting)"
    return (
        f"overlap efficiency at the DEFAULT setting: {eff}; {verdict} the {summary['target_efficiency']:.0%} target"
    )


def format_markdown(summary: dict[str, Any]) -> str:
    """The table as Markdown (written next to the JSON, for docs/dbo.md)."""
    lines = [
        _default_setting_line(summary) + ".",
        "",
        "| pattern | tokens/rank | link | comm share (off) | T_off ms | T_on ms | T_compute off / on ms | T_comm ms "
        "| speedup | efficiency | eff. (pairs) | eff. (on-compute) | load | setting |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary["rows"]:
        bold = "**" if r.get("is_default") else ""
        lines.append(
            f"| {r['pattern']} | {r['tokens']} | {r['link']} | {r['comm_share_off'] * 100:.0f}% | {r['t_off_ms']:.0f} "
            f"| {r['t_on_ms']:.0f} | {r['t_compute_ms']:.0f} / {r['t_compute_on_ms']:.0f} | {r['t_comm_ms']:.0f} "
            f"| {r['speedup']:.2f}x | {bold}{r['efficiency'] * 100:.0f}%{bold} | {r['efficiency_pairs'] * 100:.0f}% "
            f"| {r['efficiency_on_compute'] * 100:.0f}% | {_load_cell(r)} | {_setting_cell(r, summary)} |"
        )
    lines += ["", _verdict_line(summary) + ".", "",
              "`load`: the 1-minute load average right after the row; about 2 is the benchmark's own two ranks, more "
              "means other work shared the cores while the row was measured. `!`: disturbed, the compute time with DBO "
              f"on and off differ by more than {DISTURBED_COMPUTE_RATIO:.0%} (other work took the cores during part "
              "of the row): rerun on a quiet machine before reading its efficiency."]  # fmt: skip
    lines += [""] + [line + "." for line in _handoff_lines(summary, "µs")]
    decode = _decode_lines(summary)
    if decode:
        lines += ["", decode[0] + ":", "",
                  "| scheduler | split | T_off ms | T_on ms | on/off | on/off (pairs) | compute off ms | comm off ms |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in summary.get("decode") or []:
            lines.append(f"| {r['scheduler']} | {r['split_on']} | {r['t_off_ms']:.1f} | {r['t_on_ms']:.1f} | "
                         f"{r['on_over_off']:.3f} | {r['on_over_off_pairs']:.3f} | {r['t_compute_off_ms']:.1f} | "
                         f"{r['t_comm_off_ms']:.1f} |")
        lines += ["", decode[-1] + "."]
    lines.append("")
    for r in summary["no_split"]:
        lines.append(
            f"Below the threshold ({r['pattern']}, {r['tokens']} tokens, not split): DBO off {r['t_off_ms']:.1f} ms, "
            f"on {r['t_on_ms']:.1f} ms ({r['overhead_pct']:+.1f}%; the same code path)."
        )
    for name, text in (summary.get("default_links") or {}).items():
        lines.append(f"Default link ({name}): {text}.")
    eq = _equality_figures(summary)
    if eq:
        equal, cases, bf16_max = eq
        lines.append(
            f"DBO on vs off (2 ranks, A2 and A3, prefill and decode, uneven splits): fp32 bitwise equal in "
            f"{equal}/{cases} cases; bf16 max abs difference {bf16_max:.3g}."
        )
    load = summary["machine"].get("loadavg_1m")
    start = summary["machine"].get("loadavg_start")
    at_start = f"load average (1, 5, 15 min) at the start {', '.join(f'{v:.2f}' for v in start)}; " if start else ""
    lines.append(f"Machine: {summary['machine']['cpus']} CPUs, torch {summary['machine']['torch']}, {at_start}"
                 f"1-minute load average at the end {load:.2f}." if load is not None else "")  # fmt: skip
    return "\n".join(lines) + "\n"


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".md", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, allow_nan=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_bench(out_dir: str | os.PathLike[str], plan: BenchPlan | None = None, *, timeout_s: float = 1800.0,
              checks: Sequence[Callable[[dict], tuple[str, Any, str] | None]] = ()) -> dict:
    """Run the whole benchmark, write ``out_dir/dbo_runtime.json``, return the summary.

    ``checks``: predictions checked against the sweep by layers above this one (``dbo-runtime bench`` passes
    :func:`dbo_runtime.estimate_check.bench_check`); each gets the summary and returns ``(key, result, markdown)``
    (``result`` goes into the JSON under ``key``, ``markdown`` into dbo_runtime.md) or None."""
    from dbo_runtime.reference.launcher import run_ranks

    plan = plan or BenchPlan()
    if plan.trace_dir is None:
        plan = replace(plan, trace_dir=str(Path(out_dir) / "dbo-whatif-traces"))
        import shutil

        shutil.rmtree(plan.trace_dir, ignore_errors=True)  # the benchmark's own folder: last run's traces go
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    handoff = _handoffs()
    per_rank = run_ranks("dbo_runtime.reference.bench:bench_task", plan, world_size=2, timeout_s=timeout_s, pg_timeout_s=300)
    summary = summarize(per_rank, handoff, plan)
    summary["machine"]["loadavg_start"] = list(load_start) if load_start else None
    summary["machine"]["loadavg_end"] = list(os.getloadavg()) if load_start else None
    summary["equality"] = equality_summary()
    summary["default_links"] = {
        r["pattern"]: r["link_text"] for r in summary["rows"] if r["link"] == "default" and r["tokens"] == plan.default_tokens
    }
    if plan.trace_dir is not None:
        from dbo_runtime.reference.whatif_check import validate

        summary["whatif"] = validate(summary, plan.trace_dir, per_rank)
    sections = []
    for check in checks:
        got = check(summary)
        if got is not None:
            key, result, section = got
            summary[key] = result
            sections.append(section)
    _write_json_atomic(Path(out_dir) / "dbo_runtime.json", summary)
    markdown = format_markdown(summary)
    if summary.get("whatif"):
        from dbo_runtime.reference.whatif_check import format_whatif_markdown

        markdown += "\n" + format_whatif_markdown(summary["whatif"])
    markdown += "".join("\n\n" + section for section in sections)
    _write_text_atomic(Path(out_dir) / "dbo_runtime.md", markdown)
    return summary


def equality_summary() -> list[dict[str, Any]]:
    """DBO on vs off on the equality cases (2 ranks): bitwise equality and max abs difference, per case and rank."""
    from dbo_runtime.reference.launcher import run_ranks
    from dbo_runtime.reference.run import EQUALITY_CONFIG, equality_cases

    per_rank = run_ranks("dbo_runtime.reference.run:equality_task", (EQUALITY_CONFIG, equality_cases(), None),
                         world_size=2, timeout_s=600)  # fmt: skip
    return [
        {"rank": rank, "case": c["name"], "split": c["split"], "bitwise_equal": c["bitwise_equal"],
         "max_abs_diff": c["max_abs_diff"]}
        for rank, cases in enumerate(per_rank) for c in cases
    ]  # fmt: skip


def quick_plan() -> BenchPlan:
    """A few seconds of measurements with a tiny model: for tests and a smoke check, not for the figures."""
    return BenchPlan(num_layers=2, default_tokens=128, token_counts=(128,), steps=2, no_split_steps=4, warmup=1,
                     no_split_tokens=64, hidden_size=64, expert_intermediate=128, shared_intermediate=128,
                     links=(LinkVariant("default"), LinkVariant("bw x2", bandwidth_scale=2.0)), smoke=True,
                     decode_layers=2, row_rate_seconds=0.1)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m dbo_runtime.bench [--out DIR] [--quick]``: the same as ``dbo-runtime bench``."""
    from dbo_runtime.cli import cli

    return cli.run(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
