"""Per-stream utilisation and idle gaps on compute streams."""

from __future__ import annotations

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.timeline import Kind, RankTimeline


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
        wait = iv.difference(iv.clip(iv.union(*rt.select(waiting)), lo, hi), busy)
        compute = iv.clip(iv.union(*rt.select(on & (rt.kind == int(Kind.COMPUTE)))), lo, hi)
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

    Returns per-stream totals and the ``top`` longest gaps with the tasks on either side.
    """
    per_stream = []
    all_gaps: list[tuple[int, int, int, int, int]] = []  # (dur, start, end, stream, before idx)
    t0 = rt.t0_ns()
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
        ends_sorted = np.sort(rt.end_ns[idx])
        order_end = idx[np.argsort(rt.end_ns[idx], kind="stable")]
        dur = ge - gs
        per_stream.append({"rank": rt.rank, "stream": s.label, "gaps": int(gs.size), "idle_us": int(dur.sum()) / 1000.0,
                           "max_gap_us": (int(dur.max()) / 1000.0) if dur.size else 0.0,
                           "median_gap_us": float(np.median(dur)) / 1000.0 if dur.size else 0.0})
        if dur.size:
            sel = np.argsort(-dur, kind="stable")[:top]
            for j in sel:
                b = np.searchsorted(ends_sorted, gs[j], side="right") - 1
                all_gaps.append((int(dur[j]), int(gs[j]), int(ge[j]), s.index, int(order_end[b]) if b >= 0 else -1))
    all_gaps.sort(key=lambda g: -g[0])
    starts_sorted = None
    gaps = []
    for dur, s0, e0, si, bi in all_gaps[:top]:
        on = np.flatnonzero((rt.stream == si) & (rt.start_ns >= e0))
        after = rt.names[int(rt.name_id[on[np.argmin(rt.start_ns[on])]])] if on.size else None
        gaps.append({"rank": rt.rank, "stream": rt.streams[si].label, "start_us": (s0 - t0) / 1000.0,
                     "end_us": (e0 - t0) / 1000.0, "dur_us": dur / 1000.0,
                     "before": rt.names[int(rt.name_id[bi])] if bi >= 0 else None, "after": after})
    del starts_sorted
    return {"per_stream": per_stream, "largest": gaps}
