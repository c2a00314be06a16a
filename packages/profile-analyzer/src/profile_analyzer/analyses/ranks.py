"""Rank-to-rank comparison: the slowest rank, each rank's communication wait, who makes the others wait.

Waiting is measured without comparing clocks across machines: the same collective finishes together on
every rank, so on each instance (matched by operator name, else by kind and occurrence index) the rank
with the *shortest* span arrived last, and every other rank waited ``its span - shortest span``. The
rank that makes the others wait is the one charged with most of that waiting; the slowest rank is the
one with the most Computing time (its compute is what the collectives wait for).
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from profile_analyzer.analyses.exposed import op_kind
from profile_analyzer.timeline import COMM_KINDS, Kind, RankTimeline

_PLANE = re.compile(r"^Plane (\d+)$")


def _op_instances(rt: RankTimeline, lo: int | None, hi: int | None) -> dict[tuple[str, int], int]:
    ops = np.flatnonzero(rt.of_kind(*COMM_KINDS))
    if lo is not None and hi is not None:
        ops = ops[(rt.start_ns[ops] >= lo) & (rt.start_ns[ops] < hi)]
    ops = ops[np.argsort(rt.start_ns[ops], kind="stable")]
    out: dict[tuple[str, int], int] = {}
    seen: dict[str, int] = defaultdict(int)
    ids, of_op = np.unique(rt.name_id[ops], return_inverse=True)  # op_kind once per distinct name
    kinds = [op_kind(rt.names[i]) for i in ids.tolist()]
    for j, dur in zip(of_op.tolist(), (rt.end_ns[ops] - rt.start_ns[ops]).tolist(), strict=True):
        k = kinds[j]
        out[(k, seen[k])] = dur
        seen[k] += 1
    return out


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
    """``per_rank``: rank -> summed breakdown (µs) from the step breakdown."""
    inst = {r: _op_instances(rt, *(windows.get(r, (None, None)) if windows else (None, None))) for r, rt in ranks.items()}
    keys = set()
    for d in inst.values():
        keys |= set(d)
    # waits add up in integer ns: exact, so the figures do not depend on the order the instances are visited
    # in (a set of strings is ordered by per-process hash seeds)
    wait: dict[int, int] = defaultdict(int)
    caused: dict[int, int] = defaultdict(int)
    last_count = defaultdict(int)
    matched = 0
    for k in sorted(keys):
        have = {r: d[k] for r, d in inst.items() if k in d}
        if len(have) < 2:
            continue
        matched += 1
        shortest = min(have.values())
        late = min(have, key=lambda r: (have[r], r))
        last_count[late] += 1
        for r, d in have.items():
            wait[r] += d - shortest
            caused[late] += d - shortest
    rows = []
    for r in ranks:
        pr = per_rank.get(r, {})
        rows.append({"rank": r, "computing_us": pr.get("computing", 0.0), "communication_us": pr.get("communication", 0.0),
                     "exposed_communication_us": pr.get("communication_not_overlapped", 0.0),
                     "free_us": pr.get("free", 0.0), "comm_wait_us": wait.get(r, 0) / 1000.0,
                     "caused_wait_us": caused.get(r, 0) / 1000.0, "arrived_last": last_count.get(r, 0),
                     "sync_wait_us": sync_wait_ns(ranks[r], *(windows.get(r, (None, None)) if windows else (None, None))) / 1000.0})
    out: dict[str, object] = {"per_rank": rows, "matched_collectives": matched, "slowest_rank": None,
                              "waited_for_rank": None, "explanation": ""}
    if len(ranks) < 2:
        out["explanation"] = "single rank: no rank-to-rank comparison"
        return out
    slow = max(rows, key=lambda x: x["computing_us"])
    out["slowest_rank"] = slow["rank"]
    if matched and any(caused.values()):
        w = max(caused, key=lambda r: caused[r])
        out["waited_for_rank"] = w
        out["explanation"] = (f"rank {w} arrived last at {last_count[w]} of {matched} matched collectives; the other ranks "
                              f"waited {caused[w] / 1000.0:.1f} µs in all for it. Rank {slow['rank']} has the most Computing "
                              f"({slow['computing_us']:.1f} µs).")
    else:
        out["explanation"] = (f"no collective instance matched across ranks; rank {slow['rank']} has the most Computing "
                              f"({slow['computing_us']:.1f} µs)")
    return out
