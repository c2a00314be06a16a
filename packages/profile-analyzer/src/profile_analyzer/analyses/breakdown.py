"""The step breakdown exactly as msprof / torch_npu define it (reference: msprof.md §3b).

Per device, from raw tasks (integer ns):

* ``comp`` = union of compute-task intervals;
* ``comm`` = union of whole communication-operator spans (waits inside an op count as communication);
* ``Communication(Not Overlapped)`` = ``comm - comp``; ``Overlapped`` = ``|comm| - |comm - comp|``;
* ``Free`` = ``[begin, end] - (comp ∪ comm)`` with ``begin``/``end`` the first start and last end of any
  device task.

Then, as torch_npu's step_trace_time.csv does, each resulting interval is assigned to the step whose
device range contains its *start* (no clipping at step boundaries) and summed. ``Bubble`` is the time of
``hcom_receive*`` operators, ``Communication(Not Overlapped and Exclude Receive)`` = max(NotOverlapped -
Bubble, 0), ``Stage`` = span of everything counted in the step minus Bubble, ``Preparing`` = first
Computing/Communication start minus the framework ``ProfilerStep#N`` start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.analyses import _sets
from profile_analyzer.timeline import COMM_KINDS, COMPUTE_KINDS, Kind, RankTimeline

# (json key, msprof column name)
BREAKDOWN_ITEMS: tuple[tuple[str, str], ...] = (
    ("computing", "Computing"),
    ("communication_not_overlapped", "Communication(Not Overlapped)"),
    ("overlapped", "Overlapped"),
    ("communication", "Communication"),
    ("free", "Free"),
    ("stage", "Stage"),
    ("bubble", "Bubble"),
    ("communication_not_overlapped_exclude_receive", "Communication(Not Overlapped and Exclude Receive)"),
    ("preparing", "Preparing"),
)


def derived_columns(computing: float, communication: float, communication_not_overlapped: float,
                    bubble: float) -> dict[str, float]:
    """The step_trace_time columns that torch_npu derives from the summed ones."""
    return {
        "overlapped": communication - communication_not_overlapped,
        "communication_not_overlapped_exclude_receive": max(communication_not_overlapped - bubble, 0),
    }


@dataclass
class OverlapSets:
    comp: iv.IntervalSet
    comm: iv.IntervalSet
    comm_not_overlapped: iv.IntervalSet
    free: iv.IntervalSet
    begin: int
    end: int


def overlap_sets(rt: RankTimeline) -> OverlapSets:
    """The four Overlap Analysis interval sets recomputed from raw tasks."""
    comp = iv.union(*rt.select(rt.of_kind(*COMPUTE_KINDS)))
    comm_mask = rt.of_kind(*COMM_KINDS)
    comm = iv.union(*rt.select(comm_mask))
    cno = _sets.difference(comm, comp)
    dev = rt.device_mask
    if dev.any():
        begin = int(rt.start_ns[dev].min())
        end = int(rt.end_ns[dev].max())
    else:
        begin = end = 0
    both = iv.union_sets(comp, comm)
    if both[0].size:
        begin = int(both[0][0])
        end = int(both[1][-1])
    free = iv.gaps(both, begin, end)
    return OverlapSets(comp, comm, cno, free, begin, end)


def _sum_by_step(rt: RankTimeline, s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: Σdur, first start, last end of the intervals whose start lies in the step."""
    steps = rt.steps
    n = len(steps)
    total = np.zeros(n, np.int64)
    first = np.full(n, np.iinfo(np.int64).max, np.int64)
    last = np.full(n, np.iinfo(np.int64).min, np.int64)
    if s.size == 0 or n == 0:
        return total, first, last
    order = np.argsort(steps.start_ns)
    ss, se = steps.start_ns[order], steps.end_ns[order]
    idx = np.searchsorted(ss, s, side="right") - 1
    ok = idx >= 0
    ok[ok] &= s[ok] < se[idx[ok]]
    idx, s, e = order[idx[ok]], s[ok], e[ok]
    np.add.at(total, idx, e - s)
    np.minimum.at(first, idx, s)
    np.maximum.at(last, idx, e)
    return total, first, last


def _breakdown_from_sets(rt: RankTimeline, comp: iv.IntervalSet, comm: iv.IntervalSet, cno: iv.IntervalSet,
                         free: iv.IntervalSet) -> list[dict[str, object]]:
    recv = rt.kind == int(Kind.COMMUNICATION)
    if recv.any():
        # among the names of communication tasks only (not every name of the trace)
        present = np.flatnonzero(np.bincount(rt.name_id[recv], minlength=len(rt.names))).tolist()
        recv_ids = np.array([i for i in present if rt.names[i].startswith("hcom_receive")], dtype=np.int32)
        recv &= np.isin(rt.name_id, recv_ids)
    sums = {}
    firsts = []
    lasts = []
    for key, (s, e) in (("computing", comp), ("communication", comm), ("communication_not_overlapped", cno),
                        ("free", free), ("bubble", rt.select(recv))):
        t, f, l_ = _sum_by_step(rt, s, e)
        sums[key] = t
        firsts.append(f)
        lasts.append(l_)
        if key in ("computing", "communication"):
            sums.setdefault("_first_task", f.copy())
            sums["_first_task"] = np.minimum(sums["_first_task"], f)
    first = np.min(np.vstack(firsts), axis=0)
    last = np.max(np.vstack(lasts), axis=0)
    rows: list[dict[str, object]] = []
    steps = rt.steps
    for i in range(len(steps)):
        has = first[i] <= last[i]
        comp_i = int(sums["computing"][i])
        comm_i = int(sums["communication"][i])
        cno_i = int(sums["communication_not_overlapped"][i])
        bubble = int(sums["bubble"][i])
        ft = int(sums["_first_task"][i])
        row = {
            "rank": rt.rank,
            "step": None if int(steps.ids[i]) < 0 else int(steps.ids[i]),
            "start_ns": int(steps.start_ns[i]),
            "end_ns": int(steps.end_ns[i]),
            "has_tasks": bool(has),
            "computing": comp_i,
            "communication_not_overlapped": cno_i,
            "overlapped": derived_columns(comp_i, comm_i, cno_i, bubble)["overlapped"],
            "communication": comm_i,
            "free": int(sums["free"][i]),
            "stage": int(last[i] - first[i]) - bubble if has else 0,
            "bubble": bubble,
            "communication_not_overlapped_exclude_receive":
                derived_columns(comp_i, comm_i, cno_i, bubble)["communication_not_overlapped_exclude_receive"],
            "preparing": (ft - int(steps.host_start_ns[i])) if ft != np.iinfo(np.int64).max else 0,
        }
        rows.append(row)
    return rows


def step_breakdown(rt: RankTimeline, sets: OverlapSets | None = None) -> list[dict[str, object]]:
    """One row per step (values in ns, keys as in :data:`BREAKDOWN_ITEMS`), recomputed from raw tasks."""
    sets = sets or overlap_sets(rt)
    return _breakdown_from_sets(rt, sets.comp, sets.comm, sets.comm_not_overlapped, sets.free)


def profiler_breakdown(rt: RankTimeline) -> list[dict[str, object]] | None:
    """The same per-step sums taken from the profiler's own Overlap Analysis track (None if absent)."""
    po = rt.profiler_overlap
    if po is None:
        return None
    return _breakdown_from_sets(rt, po["Computing"], po["Communication"], po["Communication(Not Overlapped)"], po["Free"])


def profiler_agreement(rt: RankTimeline, ours: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    """Ours vs the profiler's own answer, per step and item (µs), from the Overlap Analysis track,
    step_trace_time.csv and communication.json (Σ op elapse, Σ synchronization wait) when present."""
    ours = ours if ours is not None else step_breakdown(rt)
    out: list[dict[str, object]] = []
    theirs = profiler_breakdown(rt)
    if theirs is not None:
        for a, b in zip(ours, theirs, strict=False):
            for key in ("computing", "communication", "communication_not_overlapped", "free"):
                out.append({"rank": rt.rank, "step": a["step"], "item": key, "source": "overlap_analysis_track",
                            "ours_us": a[key] / 1000.0, "profiler_us": b[key] / 1000.0,
                            "delta_us": (a[key] - b[key]) / 1000.0})
    if rt.profiler_step_trace:
        by_step = {}
        for r in rt.profiler_step_trace:
            st = r.get("Step")
            key_ = None if st in ("", None) else int(float(st))  # type: ignore[arg-type]
            by_step[key_] = r
        for a in ours:
            r = by_step.get(a["step"]) or (by_step.get(None) if len(by_step) == 1 else None)
            if r is None:
                continue
            for key, col in BREAKDOWN_ITEMS:
                v = r.get(col)
                if isinstance(v, float):
                    out.append({"rank": rt.rank, "step": a["step"], "item": key, "source": rt.profiler_step_trace_source,
                                "ours_us": a[key] / 1000.0, "profiler_us": v, "delta_us": a[key] / 1000.0 - v})
    if rt.profiler_comm:
        from profile_analyzer.analyses.ranks import sync_wait_ns

        comm_ops = rt.of_kind(*COMM_KINDS)
        for a in ours:
            theirs_c = rt.profiler_comm.get(a["step"])  # type: ignore[call-overload]
            if theirs_c is None:
                continue
            lo, hi = int(a["start_ns"]), int(a["end_ns"])  # type: ignore[call-overload]
            sel = comm_ops & (rt.start_ns >= lo) & (rt.start_ns < hi)
            elapse = int((rt.end_ns[sel] - rt.start_ns[sel]).sum())
            for item, ours_ns, key in (("communication_elapse", elapse, "elapse_us"),
                                       ("synchronization_wait", sync_wait_ns(rt, lo, hi), "sync_wait_us")):
                out.append({"rank": rt.rank, "step": a["step"], "item": item, "source": rt.profiler_comm_source,
                            "ours_us": ours_ns / 1000.0, "profiler_us": theirs_c[key],
                            "delta_us": ours_ns / 1000.0 - theirs_c[key]})
    return out
