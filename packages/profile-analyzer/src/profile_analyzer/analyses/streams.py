"""Per-stream utilisation and idle gaps on compute streams."""

from __future__ import annotations

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.analyses import _sets
from profile_analyzer.timeline import COMPUTE_KINDS, Kind, RankTimeline


def stream_utilisation(rt: RankTimeline, lo: int, hi: int) -> list[dict[str, object]]:
    """For each device stream inside ``[lo, hi)``: busy time (union of its tasks, waits excluded), wait
    time (EVENT_WAIT / Notify_Wait), and busy / window."""
    out = []
    window = max(hi - lo, 1)
    in_win = (rt.end_ns > lo) & (rt.start_ns < hi)
    for s in rt.streams:
        if s.kind == "host":
            continue
        on = in_win & (rt.stream == s.index) & (rt.kind != int(Kind.HOST))
        if not on.any():
            continue
        waiting = on & (rt.kind == int(Kind.IDLE_WAIT))
        busy = iv.clip(iv.union(*rt.select(on & ~waiting)), lo, hi)
        wait = _sets.difference(iv.clip(iv.union(*rt.select(waiting)), lo, hi), busy)
        compute = iv.clip(iv.union(*rt.select(on & rt.of_kind(*COMPUTE_KINDS))), lo, hi)
        out.append({
            "rank": rt.rank, "stream": s.label, "kind": s.kind, "tasks": int(np.count_nonzero(on)),
            "busy_us": iv.total(busy) / 1000.0, "wait_us": iv.total(wait) / 1000.0,
            "compute_us": iv.total(compute) / 1000.0,
            "window_us": window / 1000.0, "utilisation": iv.total(busy) / window,
        })
    out.sort(key=lambda r: (r["kind"] != "compute", -r["busy_us"]))  # type: ignore[operator]
    return out


def idle_gaps(rt: RankTimeline, lo: int, hi: int, top: int = 20, min_gap_ns: int = 0) -> dict[str, object]:
    """Gaps between consecutive tasks on each compute stream (within its first..last task in the window).

    Each gap is split by cause where the launch time of the task that ends it is known (``launch_ns``):
    the part before the host launched that task is *host-bound* (the device waited for the host, like
    HTA's ``host_wait``); the rest is the device waiting on something else (an event/notify, a dependency
    on another stream). Returns per-stream totals and the ``top`` longest gaps with the tasks around them.
    """
    per_stream = []
    cand: list[tuple[int, int, int, int, int, int, int]] = []  # dur, start, end, stream, before, after, host
    t0 = rt.t0_ns()
    launch = rt.launch_ns
    for s in rt.streams:
        if s.kind != "compute":
            continue
        idx = np.flatnonzero((rt.stream == s.index) & (rt.start_ns >= lo) & (rt.start_ns < hi)
                             & (rt.kind != int(Kind.IDLE_WAIT)) & (rt.kind != int(Kind.HOST)))
        if idx.size < 2:
            continue
        busy = iv.union(rt.start_ns[idx], rt.end_ns[idx])
        gs, ge = iv.gaps(busy)
        keep = (ge - gs) > min_gap_ns
        gs, ge = gs[keep], ge[keep]
        dur = ge - gs
        starts = rt.start_ns[idx]
        after = idx[np.clip(np.searchsorted(starts, ge), 0, idx.size - 1)]
        order_end = idx[np.argsort(rt.end_ns[idx], kind="stable")]
        before_pos = np.searchsorted(rt.end_ns[order_end], gs, side="right") - 1
        before = np.where(before_pos >= 0, order_end[np.maximum(before_pos, 0)], -1)
        if launch is not None:
            la = launch[after]
            known = la >= 0
            host = np.where(known, np.clip(la - gs, 0, dur), 0)
        else:
            known = np.zeros(dur.size, dtype=bool)
            host = np.zeros(dur.size, dtype=np.int64)
        per_stream.append({
            "rank": rt.rank, "stream": s.label, "gaps": int(gs.size), "idle_us": int(dur.sum()) / 1000.0,
            "host_bound_us": int(host.sum()) / 1000.0,
            "launch_known_pct": 100.0 * float(known.mean()) if known.size else 0.0,
            "max_gap_us": (int(dur.max()) / 1000.0) if dur.size else 0.0,
            "median_gap_us": float(np.median(dur)) / 1000.0 if dur.size else 0.0})
        for j in np.argsort(-dur, kind="stable")[:top]:
            cand.append((int(dur[j]), int(gs[j]), int(ge[j]), s.index, int(before[j]), int(after[j]),
                         int(host[j]) if known[j] else -1))
    cand.sort(key=lambda g: -g[0])
    gaps = []
    for dur_, s0, e0, si, bi, ai, host_ns in cand[:top]:
        gaps.append({"rank": rt.rank, "stream": rt.streams[si].label, "start_us": (s0 - t0) / 1000.0,
                     "end_us": (e0 - t0) / 1000.0, "dur_us": dur_ / 1000.0,
                     "host_bound_us": host_ns / 1000.0 if host_ns >= 0 else None,
                     "before": rt.names[int(rt.name_id[bi])] if bi >= 0 else None,
                     "after": rt.names[int(rt.name_id[ai])]})
    return {"per_stream": per_stream, "largest": gaps}
