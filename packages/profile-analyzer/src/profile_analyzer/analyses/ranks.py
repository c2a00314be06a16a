"""Rank-to-rank comparison: the slowest rank, each rank's communication wait, who makes the others wait.

Waiting is measured without comparing clocks across machines: the same collective finishes together on
every rank, so on each instance (matched by operator name, else by kind and occurrence index) the rank
with the *shortest* span arrived last, and every other rank waited ``its span - shortest span``. The
rank that makes the others wait is the one charged with most of that waiting; the slowest rank is the
one with the most Computing time (its compute is what the collectives wait for).
"""

from __future__ import annotations

import re

import numpy as np

from profile_analyzer.analyses.exposed import op_kind
from profile_analyzer.timeline import COMM_KINDS, Kind, RankTimeline

_PLANE = re.compile(r"^Plane (\d+)$")


def op_instances(rt: RankTimeline, lo: int | None = None, hi: int | None = None) -> dict[str, np.ndarray]:
    """The collective instances of one rank that :func:`compare_ranks` matches across ranks: per operator kind
    (:func:`~profile_analyzer.analyses.exposed.op_kind`), the durations (ns) of its operators starting in
    ``[lo, hi)``, in start order (the i-th of a kind is instance ``(kind, i)``). A few KB per rank: what a rank
    keeps of its timeline for the rank comparison."""
    ops = np.flatnonzero(rt.of_kind(*COMM_KINDS))
    if lo is not None and hi is not None:
        ops = ops[(rt.start_ns[ops] >= lo) & (rt.start_ns[ops] < hi)]
    ops = ops[np.argsort(rt.start_ns[ops], kind="stable")]
    ids, of_op = np.unique(rt.name_id[ops], return_inverse=True)  # op_kind once per distinct name
    kind_of_id = [op_kind(rt.names[i]) for i in ids.tolist()]
    kinds = sorted(set(kind_of_id))
    code = np.array([kinds.index(k) for k in kind_of_id], dtype=np.int64)[of_op] if ops.size else np.zeros(0, np.int64)
    dur = (rt.end_ns[ops] - rt.start_ns[ops]).astype(np.int64)
    return {k: dur[code == i].copy() for i, k in enumerate(kinds)}


def op_sync_wait(rt: RankTimeline) -> tuple[np.ndarray, np.ndarray]:
    """(indices of communication operators, synchronization wait of each in ns), vectorised per plane.

    On a plane, an operator's wait is the Notify_Wait time inside its span before the plane's first transit
    task (not ``Notify_*``). The operator's value is that of its master plane, the lowest-numbered plane with
    a Notify_Wait inside it (a plane that only runs the local reduce or copies waits for no one); 0 without
    plane tasks (Level0 profiles). This is CANN's communication analysis (communication.json / analysis.db
    CommAnalyzerTime): it matches torch_npu's own figures on every operator of MindStudio Insight's real DB
    samples (tests/data/msinsight/db), where the least wait over planes (msprof-analyze compare's choice) does not.
    """
    cached = getattr(rt, "_op_sync_wait", None)
    if cached is not None:
        return cached
    ops = np.flatnonzero(rt.of_kind(*COMM_KINDS))
    best = np.full(ops.size, -1, dtype=np.int64)
    planes = [s.index for s in sorted((s for s in rt.streams if s.kind == "communication" and _PLANE.match(s.label)),
                                      key=lambda s: int(_PLANE.match(s.label).group(1)))]
    # among the names of the trace's tasks (the only ones it is compared with)
    present = np.flatnonzero(np.bincount(rt.name_id, minlength=len(rt.names))).tolist()
    notify_ids = np.array([i for i in present if rt.names[i].startswith("Notify")], dtype=np.int32)
    os_, oe = rt.start_ns[ops], rt.end_ns[ops]
    for p in planes:
        idx = np.flatnonzero(rt.stream == p)
        if idx.size == 0:
            continue
        ps, pe = rt.start_ns[idx], rt.end_ns[idx]
        wait = rt.kind[idx] == int(Kind.IDLE_WAIT)
        transit = ~wait & ~np.isin(rt.name_id[idx], notify_ids)
        n = idx.size
        # next transit task at or after each position (n when none)
        nxt = np.where(transit, np.arange(n), n)
        nxt = np.minimum.accumulate(nxt[::-1])[::-1]
        nxt = np.append(nxt, n)
        wsum = np.concatenate([[0], np.cumsum(np.where(wait, pe - ps, 0))])
        wcount = np.concatenate([[0], np.cumsum(wait)])
        a = np.searchsorted(ps, os_, side="left")
        b = np.searchsorted(ps, oe, side="right")
        has = wcount[b] > wcount[a]
        cut = np.minimum(nxt[a], b)
        val = wsum[cut] - wsum[a]
        best = np.where(has & (best < 0), val, best)
    best = np.maximum(best, 0)
    result = (ops, best)
    try:
        rt._op_sync_wait = result  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return result


def sync_wait_ns(rt: RankTimeline, lo: int | None = None, hi: int | None = None) -> int:
    """msprof's Synchronization time summed over the communication operators starting in ``[lo, hi)``."""
    ops, wait = op_sync_wait(rt)
    if lo is not None and hi is not None:
        sel = (rt.start_ns[ops] >= lo) & (rt.start_ns[ops] < hi)
        return int(wait[sel].sum())
    return int(wait.sum())


def rank_comparison(ranks: dict[int, RankTimeline], per_rank: dict[int, dict[str, float]],
                    windows: dict[int, tuple[int, int]] | None = None) -> dict[str, object]:
    """``per_rank``: rank -> summed breakdown (µs) from the step breakdown; ``windows``: rank -> the ``[lo, hi)``
    whose operators count."""
    win = {r: (windows.get(r, (None, None)) if windows else (None, None)) for r in ranks}
    return compare_ranks(list(ranks), {r: op_instances(rt, *win[r]) for r, rt in ranks.items()}, per_rank,
                         {r: sync_wait_ns(rt, *win[r]) for r, rt in ranks.items()})


def compare_ranks(order: list[int], instances: dict[int, dict[str, np.ndarray]],
                  per_rank: dict[int, dict[str, float]], sync_wait: dict[int, int]) -> dict[str, object]:
    """The rank comparison from what each rank keeps of its timeline (:func:`op_instances`, :func:`sync_wait_ns`):
    rows in ``order``. An instance ``(kind, i)`` seen on two or more ranks is matched; the rank with the shortest
    span (the lowest rank among equals) arrived last."""
    rank_ids = sorted(instances)
    pos = {r: i for i, r in enumerate(rank_ids)}
    n = len(rank_ids)
    # waits add up in integer ns: exact, whatever the order they are summed in
    wait = np.zeros(n, dtype=np.int64)
    caused = np.zeros(n, dtype=np.int64)
    last_count = np.zeros(n, dtype=np.int64)
    lates = []  # the late rank of each matched instance, in (kind, i) order
    matched = 0
    for k in sorted({k for d in instances.values() for k in d}):
        width = max(d[k].size for d in instances.values() if k in d)
        if width == 0:
            continue
        have = np.zeros((n, width), dtype=bool)
        dur = np.zeros((n, width), dtype=np.int64)
        for r, d in instances.items():
            if k in d and d[k].size:
                have[pos[r], :d[k].size] = True
                dur[pos[r], :d[k].size] = d[k]
        cols = have.sum(axis=0) >= 2
        if not cols.any():
            continue
        have, dur = have[:, cols], dur[:, cols]
        matched += int(cols.sum())
        big = np.iinfo(np.int64).max
        masked = np.where(have, dur, big)
        shortest = masked.min(axis=0)
        late = np.argmin(masked, axis=0)  # the first (lowest) rank among equals
        extra = np.where(have, dur - shortest, 0)
        wait += extra.sum(axis=1)
        np.add.at(caused, late, extra.sum(axis=0))
        np.add.at(last_count, late, 1)
        lates.append(late)
    # ties for "who made the others wait" go to the rank that was first late (in instance order)
    late_all = np.concatenate(lates) if lates else np.zeros(0, dtype=np.int64)
    firsts, first_at = np.unique(late_all, return_index=True)
    late_order = [int(firsts[i]) for i in np.argsort(first_at, kind="stable")]
    rows = []
    for r in order:
        pr = per_rank.get(r, {})
        i = pos.get(r)
        rows.append({"rank": r, "computing_us": pr.get("computing", 0.0), "communication_us": pr.get("communication", 0.0),
                     "exposed_communication_us": pr.get("communication_not_overlapped", 0.0),
                     "free_us": pr.get("free", 0.0), "comm_wait_us": (int(wait[i]) if i is not None else 0) / 1000.0,
                     "caused_wait_us": (int(caused[i]) if i is not None else 0) / 1000.0,
                     "arrived_last": int(last_count[i]) if i is not None else 0,
                     "sync_wait_us": sync_wait.get(r, 0) / 1000.0})
    out: dict[str, object] = {"per_rank": rows, "matched_collectives": matched, "slowest_rank": None,
                              "waited_for_rank": None, "explanation": ""}
    if len(order) < 2:
        out["explanation"] = "single rank: no rank-to-rank comparison"
        return out
    slow = max(rows, key=lambda x: x["computing_us"])
    out["slowest_rank"] = slow["rank"]
    if matched and caused.any():
        wi = max(late_order, key=lambda i: int(caused[i]))
        w = rank_ids[wi]
        out["waited_for_rank"] = w
        out["explanation"] = (f"rank {w} arrived last at {int(last_count[wi])} of {matched} matched collectives; the "
                              f"other ranks waited {int(caused[wi]) / 1000.0:.1f} µs in all for it. Rank {slow['rank']} "
                              f"has the most Computing ({slow['computing_us']:.1f} µs).")
    else:
        out["explanation"] = (f"no collective instance matched across ranks; rank {slow['rank']} has the most Computing "
                              f"({slow['computing_us']:.1f} µs)")
    return out
