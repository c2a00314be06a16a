"""``analyze(timeline, rank=None, step=None) -> Report``: every analysis over the selected ranks/steps;
``load_and_analyze(path, jobs=N)``: load and analyse with each rank's own analyses run in the worker process that
loaded it (the loader itself only loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.analyses import _sets
from profile_analyzer.analyses.breakdown import (
    BREAKDOWN_ITEMS,
    overlap_sets,
    profiler_agreement,
    step_breakdown,
)
from profile_analyzer.analyses.dual_batch import dual_batch
from profile_analyzer.analyses.exposed import exposed_communication
from profile_analyzer.analyses.ranks import compare_ranks, op_instances, sync_wait_ns
from profile_analyzer.analyses.streams import idle_gaps, stream_utilisation
from profile_analyzer.errors import ProfileError
from profile_analyzer.report.model import Report
from profile_analyzer.timeline import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KIND_NAMES,
    STEP_NAME,
    Kind,
    RankTimeline,
    Timeline,
    Warning_,
)

_TIME_KEYS = [k for k, _ in BREAKDOWN_ITEMS]
MAX_LANE_TASKS = 400
TIMELINE_WINDOWS = 3  # windows around the worst exposed gaps drawn in the HTML report


def _us(row: dict[str, Any], t0: int) -> dict[str, Any]:
    out = {"rank": row["rank"], "step": row["step"], "t0_ns": t0,
           "start_us": (row["start_ns"] - t0) / 1000.0, "end_us": (row["end_ns"] - t0) / 1000.0}
    for k in _TIME_KEYS:
        out[k] = row[k] / 1000.0
    out["overlap_pct"] = (100.0 * row["overlapped"] / row["communication"]) if row["communication"] else None
    return out


@dataclass
class RankAnalysis:
    """Everything :func:`analyze` needs of one rank: its own analyses, and what the cross-rank parts (the rank
    comparison, the timeline windows of the worst gaps) keep of its timeline, so that the timeline itself can be
    dropped before the next rank is loaded (:func:`load_and_analyze` holds one rank's events at a time).

    Computed by :func:`analyze_rank`: in :func:`load_and_analyze`'s worker processes when they run (``--jobs N``),
    else in the process that loaded the rank. Small: it travels back from a worker pickled.
    """

    rank: int
    step: int | None
    top: int
    breakdown: list[dict[str, Any]]
    agreement: list[dict[str, Any]]
    totals: dict[str, float]
    window: tuple[int, int]
    exposed: dict[str, Any]
    streams: list[dict[str, Any]]
    gaps: dict[str, Any]
    dual_batch: dict[str, Any]
    fused_us: float = 0.0
    # HTA's get_comm_comp_overlap: over every task of the trace, not per step
    whole_trace: dict[str, Any] | None = None
    # for the rank comparison: the durations of the collectives in the window per kind, and msprof's
    # Synchronization time (analyses.ranks.op_instances / sync_wait_ns)
    op_instances: dict[str, np.ndarray] = field(default_factory=dict)
    sync_wait_ns: int = 0
    # the SVG timeline windows around this rank's worst exposed gaps: (gap µs, window), the worst first
    timeline_windows: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    comm_rules: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[Warning_] = field(default_factory=list)
    n_events: int = 0
    source: str = ""


def analyze_rank(rt: RankTimeline, step: int | None = None, top: int = 20) -> RankAnalysis:
    """The per-rank analyses of one rank. Raises ProfileError for a step that is not there or has no tasks."""
    sets = overlap_sets(rt)
    all_rows = step_breakdown(rt, sets)
    rows = all_rows
    if step is not None:
        present = [x["step"] for x in all_rows]
        rows = [x for x in all_rows if x["step"] == step]
        if not rows:
            raise ProfileError(rt.source, f"step {step} not found; steps present: {present}")
        if not rows[0]["has_tasks"]:
            raise ProfileError(rt.source, f"step {step} has no device tasks; expected a step that ran kernels")
        lo, hi = int(rows[0]["start_ns"]), int(rows[0]["end_ns"])
    else:  # the steps' extent, as the breakdown counts only what starts inside a step
        lo, hi = int(rt.steps.start_ns.min()), int(rt.steps.end_ns.max())
    t0 = rt.t0_ns()
    ex = exposed_communication(rt, sets.comp, sets.comm_not_overlapped, lo, hi, top)
    ex["rank"] = rt.rank
    g = idle_gaps(rt, lo, hi, top)
    g["rank"] = rt.rank
    fused = iv.clip(iv.union(*rt.select(rt.kind == int(Kind.FUSED))), lo, hi)
    return RankAnalysis(
        rank=rt.rank, step=step, top=top, breakdown=[_us(x, t0) for x in rows],
        agreement=[a for a in profiler_agreement(rt, all_rows) if step is None or a["step"] == step],
        totals={k: sum(x[k] for x in rows) / 1000.0 for k in _TIME_KEYS}, window=(lo, hi), exposed=ex,
        streams=stream_utilisation(rt, lo, hi), gaps=g, dual_batch=dual_batch(rt, lo, hi),
        fused_us=iv.total(fused) / 1000.0, whole_trace=whole_trace_overlap(rt, sets),
        op_instances=op_instances(rt, lo, hi), sync_wait_ns=sync_wait_ns(rt, lo, hi),
        timeline_windows=rank_timeline_windows(rt, ex["worst_gaps"], sets.comm_not_overlapped),
        comm_rules=[{"rank": rt.rank, "rule": name, "kind": kind, "tasks": n}
                    for name, (kind, n) in sorted(rt.comm_rules_applied.items())],
        warnings=list(rt.warnings), n_events=len(rt), source=rt.source)


def whole_trace_overlap(rt: RankTimeline, sets: Any = None) -> dict[str, Any]:
    """HTA's ``get_comm_comp_overlap`` figure for one rank: |comm ∩ comp| / |comm| over the kernels of the whole
    trace, not per step. Exactly HTA's selection (``Trace._filter_irrelevant_gpu_kernels`` with its default
    ``include_last_profiler_step=False``): with two or more ``ProfilerStep#N`` ranges, only the kernels whose launch
    is known and came before the last step started; with fewer, every kernel; times in whole µs as HTA reads them.
    The step breakdown's
    ``overlap_pct`` counts instead what starts inside each step range (msprof's way)."""
    launch = rt.launch_ns
    n_profiler_steps = sum(1 for n in rt.names if STEP_NAME.match(n))
    keep = np.ones(rt.start_ns.size, dtype=bool)
    if launch is not None and n_profiler_steps >= 2 and rt.steps.host_start_ns.size >= 2 and (launch >= 0).any():
        last = -(-int(rt.steps.host_start_ns.max()) // 1000)
        keep = (launch >= 0) & (-(-launch // 1000) < last)
    # HTA rounds a trace with sub-µs times to whole µs, start up and end down (trace_parser.round_down_time_stamps,
    # pytorch/pytorch#122425); a trace in whole µs is unchanged by it
    starts = -(-rt.start_ns // 1000) * 1000
    ends = np.maximum(rt.end_ns // 1000 * 1000, starts)
    comp = iv.union(starts[keep & rt.of_kind(*COMPUTE_KINDS)], ends[keep & rt.of_kind(*COMPUTE_KINDS)])
    comm_set = iv.union(starts[keep & rt.of_kind(*COMM_KINDS)], ends[keep & rt.of_kind(*COMM_KINDS)])
    cno = _sets.difference(comm_set, comp)  # both normalised by iv.union: the binary-search difference applies
    comm = iv.total(comm_set)
    overlapped = comm - iv.total(cno)
    return {"rank": rt.rank, "communication_us": comm / 1000.0, "overlapped_us": overlapped / 1000.0,
            "overlap_pct": (100.0 * overlapped / comm) if comm else None}


def _load_and_analyze_entry(entry: Any, fmt: str, rank: int, patterns: tuple[Any, ...], step: int | None,
                            top: int, wanted: tuple[int, ...] | None, strict: bool = False, reduce: bool = False,
                            on_bytes: Any = None) -> list[tuple[Any, RankAnalysis | None]] | Any:
    """A worker's job: load one rank of a directory of ranks and run its per-rank analyses while it is at hand (a
    rank that cannot be read comes back as its UnreadableRank record unless ``strict``). Each rank comes back as
    (its RankTimeline, its analysis), or with ``reduce`` as ((rank, source, events), its analysis): the analysis
    holds all the report needs of the rank, so its events are dropped here."""
    from profile_analyzer.loaders import load_entry, load_entry_or_unreadable

    got = (load_entry if strict else load_entry_or_unreadable)(entry, fmt, rank, comm_patterns=patterns,
                                                               on_bytes=on_bytes)
    if not isinstance(got, list):
        return got
    out = [(rt, analyze_rank(rt, step, top) if wanted is None or rt.rank in wanted else None) for rt in got]
    if reduce:
        out = [((rt.rank, rt.source, len(rt)), ra) for rt, ra in out]
    return out


def load_and_analyze(path: Any, *, rank: int | None = None, step: int | None = None, top: int = 20, jobs: int = 1,
                     comm_patterns: Any = (), progress: Any = None, strict: bool = False,
                     keep_timeline: bool = True) -> tuple[Timeline | None, Report]:
    """Load a profile and analyse it. With ``jobs`` > 1 and a directory of ranks, each rank is loaded and its
    per-rank analyses run in one of ``jobs`` worker processes (the report is the same for any ``jobs``). A rank
    that cannot be read is left out and reported (``unreadable``) unless ``strict``.

    ``keep_timeline=False`` (what ``profile-analyzer report`` does): each rank of a directory of ranks is reduced
    to its :class:`RankAnalysis` before the next rank's events are held (in the worker that loaded it with
    ``jobs`` > 1), so peak memory is that of the largest rank, not of them all; the timeline returned is then
    None (a single profile is one rank: its timeline is returned either way). The report is the same either way."""
    from profile_analyzer.loaders import assemble, load, load_plan
    from profile_analyzer.loaders.comm_rules import compile_patterns
    from profile_analyzer.timeline import UnreadableRank

    ranks = [rank] if rank is not None else None
    plan = load_plan(path, ranks)
    if not plan.multi_rank or (keep_timeline and (jobs <= 1 or len(plan.jobs) <= 1)):
        tl = load(path, ranks=ranks, progress=progress, workers=1, comm_patterns=comm_patterns, strict=strict)
        return tl, analyze(tl, rank=rank, step=step, top=top)
    from profile_analyzer._pool import map_in_processes

    patterns = compile_patterns(comm_patterns)
    loaded: list[list[Any]] = []
    unreadable: list[UnreadableRank] = []
    done: dict[int, RankAnalysis] = {}

    def got(i: int, pairs: list[tuple[Any, RankAnalysis | None]] | UnreadableRank) -> None:
        if isinstance(pairs, UnreadableRank):
            unreadable.append(pairs)
            pairs = []
        loaded.append([rt for rt, _ in pairs])
        done.update((ra.rank, ra) for _, ra in pairs if ra is not None)
        if not keep_timeline:
            _keep_worst_windows(done.values())
        if progress:
            progress(i + 1, len(plan.jobs), plan.jobs[i][0].name)

    wanted = tuple(ranks) if ranks is not None else None
    args = [(e, f, r, patterns, step, top, wanted, strict, not keep_timeline) for e, f, r in plan.jobs]
    if jobs <= 1 or len(plan.jobs) <= 1:  # one rank at a time in this process, its events dropped before the next
        from profile_analyzer.loaders import release_memory

        for i, job in enumerate(args):
            got(i, _load_and_analyze_entry(*job, on_bytes=progress if len(args) == 1 else None))
            release_memory()
    else:
        map_in_processes(_load_and_analyze_entry, args, jobs, got)
    if keep_timeline:
        tl = assemble(plan, loaded, ranks, unreadable)
        return tl, analyze(tl, rank=rank, step=step, top=top, done=done)
    return None, _analyze_reduced(plan, loaded, done, ranks, unreadable, rank, step, top)


def _keep_worst_windows(analyses: Any, n: int = TIMELINE_WINDOWS) -> None:
    """Drop the timeline windows that can no longer be among the report's ``n`` (the worst gaps of all ranks, ties
    in rank order): what is held of them stays ``n`` windows, whatever the rank count."""
    ranked = sorted(((-dur, ra.rank, j) for ra in analyses for j, (dur, _) in enumerate(ra.timeline_windows)))
    keep = {(r, j) for _, r, j in ranked[:n]}
    for ra in analyses:
        if any((ra.rank, j) not in keep for j in range(len(ra.timeline_windows))):
            ra.timeline_windows = [w for j, w in enumerate(ra.timeline_windows) if (ra.rank, j) in keep]


def _analyze_reduced(plan: Any, loaded: list[list[tuple[int, str, int]]], done: dict[int, RankAnalysis],
                     ranks: list[int] | None, unreadable: list[Any], rank: int | None, step: int | None,
                     top: int) -> Report:
    """:func:`analyze` of the Timeline that ``loaders.assemble`` would make of the plan, from each rank's
    (rank, source, events) and analysis alone: the same checks and errors, the same report."""
    from profile_analyzer.loaders import no_rank_readable, plan_format, ranks_of_plan

    if unreadable and not any(loaded):
        raise no_rank_readable(plan, list(unreadable))
    by_rank = ranks_of_plan(plan, loaded, ranks, lambda item: (item[0], item[1]))
    fmt = plan_format(plan, len(by_rank))
    if rank is not None and rank not in by_rank:
        raise ProfileError(str(plan.path), f"rank {rank} not in the profile; ranks present: {sorted(by_rank)}")
    analyses = [done[r] for r in sorted(by_rank)]
    for ra in analyses:
        if (ra.step, ra.top) != (step, top):  # cannot happen: every rank was analysed with these
            raise AssertionError(f"rank {ra.rank} analysed for step {ra.step}, top {ra.top}")
    return _report(str(plan.path), fmt, sum(ev for _, _, ev in by_rank.values()), [],
                   sorted(unreadable, key=lambda u: u.rank), analyses, rank, step)


def analyze(timeline: Timeline, rank: int | None = None, step: int | None = None, top: int = 20,
            done: dict[int, RankAnalysis] | None = None) -> Report:
    """Run every analysis. ``rank``/``step`` restrict to one rank / one ``ProfilerStep#N``. ``done`` holds
    per-rank results already computed (by :func:`load_and_analyze`'s workers) for the same ``step`` and ``top``.

    Raises ProfileError for a rank or step that is not in the profile, or a step with no device tasks.
    """
    if rank is not None and rank not in timeline.ranks:
        raise ProfileError(timeline.source, f"rank {rank} not in the profile; ranks present: {sorted(timeline.ranks)}")
    ranks = {rank: timeline.ranks[rank]} if rank is not None else timeline.ranks
    analyses = []
    for r, rt in ranks.items():
        ra = (done or {}).get(r)
        if ra is None or (ra.step, ra.top) != (step, top):
            ra = analyze_rank(rt, step, top)
        analyses.append(ra)
    return _report(timeline.source, timeline.format, timeline.n_events, timeline.warnings, timeline.unreadable,
                   analyses, rank, step)


def _report(source: str, fmt: str, n_events: int, timeline_warnings: list[Warning_], unreadable_ranks: list[Any],
            analyses: list[RankAnalysis], rank: int | None, step: int | None) -> Report:
    """The report from each selected rank's analysis (in rank order): no rank's events are needed here."""
    breakdown: list[dict[str, Any]] = []
    agreement: list[dict[str, Any]] = []
    exposed: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    gaps: list[dict[str, Any]] = []
    dbo: list[dict[str, Any]] = []
    per_rank: dict[int, dict[str, float]] = {}
    fused_us = 0.0
    rules: list[dict[str, Any]] = []
    whole: list[dict[str, Any]] = []
    for ra in analyses:
        breakdown.extend(ra.breakdown)
        agreement.extend(ra.agreement)
        per_rank[ra.rank] = ra.totals
        exposed.append(ra.exposed)
        streams.extend(ra.streams)
        gaps.append(ra.gaps)
        dbo.append(ra.dual_batch)
        fused_us += ra.fused_us
        whole.append(ra.whole_trace)
        rules.extend(ra.comm_rules)
    rank_cmp = compare_ranks([ra.rank for ra in analyses], {ra.rank: ra.op_instances for ra in analyses}, per_rank,
                             {ra.rank: ra.sync_wait_ns for ra in analyses})
    tot = {k: sum(p[k] for p in per_rank.values()) for k in _TIME_KEYS}
    wall = sum((x["end_us"] - x["start_us"]) for x in breakdown)
    summary = {
        "ranks": len(analyses), "steps": len({x["step"] for x in breakdown}), "wall_us": wall,
        "computing_us": tot["computing"], "communication_us": tot["communication"],
        "communication_not_overlapped_us": tot["communication_not_overlapped"], "overlapped_us": tot["overlapped"],
        "free_us": tot["free"],
        "overlap_pct": (100.0 * tot["overlapped"] / tot["communication"]) if tot["communication"] else None,
        "exposed_comm_pct_of_wall": (100.0 * tot["communication_not_overlapped"] / wall) if wall else None,
        # fused compute+communication kernels (MC2): in Computing and in Communication, so all Overlapped
        "fused_us": fused_us,
        # tasks the vendor communication rule table (loaders/comm_rules.py) or --comm-pattern reclassified
        "comm_rules": rules,
        # HTA's get_comm_comp_overlap (comp_comm_overlap_pctg): every kernel of the trace, per rank; overlap_pct
        # above is per step range (what starts inside a ProfilerStep), the msprof figure
        "whole_trace_overlap": whole,
        "whole_trace_overlap_pct": ((100.0 * sum(w["overlapped_us"] for w in whole)
                                     / sum(w["communication_us"] for w in whole))
                                    if sum(w["communication_us"] for w in whole) else None),
    }
    warnings = [{"file": w.file, "missing": w.missing, "affects": w.affects, "message": w.message()}
                for w in list(timeline_warnings) + [w for ra in analyses for w in ra.warnings]]
    unreadable = [{"rank": u.rank, "path": u.path, "reason": u.reason} for u in unreadable_ranks]
    warnings += [{"file": u.path, "missing": f"rank {u.rank}", "affects": ["every cluster figure"],
                  "message": u.message()} for u in unreadable_ranks]
    report = Report.from_parts(
        source={"path": source, "format": fmt, "ranks": sorted(per_rank), "events": n_events},
        selection={"rank": rank, "step": step}, warnings=warnings, verdict="", summary=summary, breakdown=breakdown,
        profiler_agreement=agreement, exposed_communication=exposed, streams=streams, idle_gaps=gaps, dual_batch=dbo,
        ranks=rank_cmp, timeline=_timeline_windows(analyses), unreadable=unreadable)
    report.verdict = verdict(report)
    return report


def _timeline_windows(analyses: list[RankAnalysis], n: int = TIMELINE_WINDOWS) -> list[dict[str, Any]]:
    """The windows around the ``n`` worst exposed gaps of all ranks (ties: rank order, then each rank's own): each
    rank's own ``n`` worst are all that can be among them."""
    cands = [c for ra in analyses for c in ra.timeline_windows]
    cands.sort(key=lambda c: -c[0])
    return [w for _, w in cands[:n]]


def rank_timeline_windows(rt: RankTimeline, worst_gaps: list[dict[str, Any]], cno: tuple[np.ndarray, np.ndarray],
                          n: int = TIMELINE_WINDOWS) -> list[tuple[float, dict[str, Any]]]:
    """Windows around the ``n`` worst of one rank's exposed gaps, with the device tasks of each stream (for the SVG
    timeline), as (gap µs, window), the worst first."""
    cands = sorted(worst_gaps, key=lambda g: -g["dur_us"])
    out = []
    for g in cands[:n]:
        t0 = rt.t0_ns()
        pad = max(g["dur_us"], 20.0) * 1.5
        lo_us, hi_us = g["start_us"] - pad, g["end_us"] + pad
        lo, hi = t0 + int(lo_us * 1000), t0 + int(hi_us * 1000)
        sel = (rt.end_ns > lo) & (rt.start_ns < hi) & rt.device_mask
        lanes = []
        for s in rt.streams:
            if s.kind == "host":
                continue
            idx = np.flatnonzero(sel & (rt.stream == s.index))
            if idx.size == 0:
                continue
            if idx.size > MAX_LANE_TASKS:
                idx = idx[np.argsort(-(rt.end_ns[idx] - rt.start_ns[idx]))[:MAX_LANE_TASKS]]
            lanes.append({"stream": s.label, "kind": s.kind, "tasks": [
                {"start_us": (int(rt.start_ns[i]) - t0) / 1000.0, "end_us": (int(rt.end_ns[i]) - t0) / 1000.0,
                 "name": rt.names[int(rt.name_id[i])], "kind": KIND_NAMES[Kind(int(rt.kind[i]))]} for i in idx]})
        ex_s, ex_e = iv.clip(cno, lo, hi)
        out.append((g["dur_us"], {
            "rank": g["rank"], "t0_ns": t0, "start_us": lo_us, "end_us": hi_us,
            "title": f"rank {g['rank']}: {g['dur_us']:.1f} µs exposed in {g['comm_op']}", "lanes": lanes,
            "exposed": [{"start_us": (int(a) - t0) / 1000.0, "end_us": (int(b) - t0) / 1000.0}
                        for a, b in zip(ex_s, ex_e, strict=False)]}))
    return out


def verdict(report: Report) -> str:
    s = report.summary
    parts = []
    nr, ns = s.ranks, s.steps
    scope = f"{ns} step{'s' if ns != 1 else ''} on {nr} rank{'s' if nr != 1 else ''}"
    wall = s.wall_us or 0.0
    if s.communication_us <= 0:
        parts.append(f"Over {scope}, no communication operators were found: the device computed for "
                     f"{s.computing_us:.1f} µs and was free for {s.free_us:.1f} µs "
                     f"({(100 * s.free_us / wall) if wall else 0:.1f}% of the step time).")
    else:
        parts.append(f"Over {scope}, communication took {s.communication_us:.1f} µs, of which "
                     f"{s.communication_not_overlapped_us:.1f} µs ({100 - (s.overlap_pct or 0):.1f}%) ran with no "
                     f"compute beside it; that exposed time is {s.exposed_comm_pct_of_wall or 0:.1f}% of the step time.")
        worst = max((row for ex in report.exposed_communication for row in ex.by_operator),
                    key=lambda r: r.exposed_us, default=None)
        if worst and worst.exposed_us > 0:
            parts.append(f"The largest share is {worst.operator} ({worst.exposed_us:.1f} µs exposed over "
                         f"{worst.count} calls).")
        prev = max((row for ex in report.exposed_communication for row in ex.by_preceding_compute),
                   key=lambda r: r.exposed_us, default=None)
        if prev and prev.exposed_us > 0:
            parts.append(f"Most exposed communication follows {prev.preceding_compute}.")
        if s.whole_trace_overlap_pct is not None:
            parts.append(f"Over the whole trace (HTA's get_comm_comp_overlap: every kernel, not per step), "
                         f"{s.whole_trace_overlap_pct:.2f}% of communication overlapped compute.")
        if wall:
            parts.append(f"The device was free (neither computing nor communicating) {100 * s.free_us / wall:.1f}% of the time.")
    idle = sum(g.idle_us for x in report.idle_gaps for g in x.per_stream)
    host = sum(g.host_bound_us for x in report.idle_gaps for g in x.per_stream)
    if idle > 0 and host > 0:
        parts.append(f"Of the compute streams' idle time ({idle:.1f} µs), {100 * host / idle:.0f}% was spent waiting for "
                     f"the host to launch the next kernel (host-bound).")
    det = [d for d in report.dual_batch if d.detected]
    if det:
        pct = [u.covered_pct or 0.0 for d in det for u in d.ubatches]
        parts.append(f"Dual-batch ping-pong found ({det[0].method}): each micro-batch's communication is "
                     f"{min(pct):.0f}–{max(pct):.0f}% covered by the other's compute.")
    elif s.communication_us > 0:
        parts.append("No dual-batch ping-pong pattern was found.")
    rk = report.ranks
    if rk.waited_for_rank is not None:
        parts.append(f"Rank {rk.waited_for_rank} makes the others wait ({rk.explanation})")
    if report.unreadable:
        gone = ", ".join(str(u.rank) for u in report.unreadable)
        parts.append(f"{len(report.unreadable)} rank(s) could not be read ({gone}): every cluster figure here leaves "
                     f"them out.")
    if report.warnings:
        parts.append(f"{len(report.warnings)} warning(s) apply (see warnings).")
    return " ".join(parts)
