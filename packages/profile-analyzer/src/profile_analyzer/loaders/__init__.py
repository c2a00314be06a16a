"""Format detection and loading: any supported path -> :class:`~profile_analyzer.timeline.Timeline`.

``detect(path)`` returns one of:

* ``torch_npu``: a ``*_ascend_pt`` directory, its ``ASCEND_PROFILER_OUTPUT``, or a ``trace_view.json``;
* ``msprof``: a ``PROF_*`` directory, its ``mindstudio_profiler_output``, or an ``msprof_*.json``;
* ``kineto``: a PyTorch profiler trace (``{"traceEvents": [...]}``, ``.json`` or ``.json.gz``);
* ``torch_npu_db`` / ``msprof_db``: the DB export (``export_type=db``) of either, an ``ascend_pytorch_profiler*.db``
  or ``msprof_*.db`` file or a directory holding one and no JSON timeline (where both exports exist, the JSON is
  read); see :mod:`profile_analyzer.loaders.msprof_db`;
* ``multi_rank``: a directory whose entries are profiles of one of the formats above (one per rank).

The rank of each entry comes from ``profiler_info_{rank}.json`` (torch_npu), ``distributedInfo.rank``
(Kineto), the ``NPU <id>`` device label (msprof), else the entry's position in sorted order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders._slicer import peek_kind
from profile_analyzer.timeline import RankTimeline, Timeline, UnreadableRank

_T = TypeVar("_T")

FORMATS = ("torch_npu", "msprof", "kineto", "multi_rank", "torch_npu_db", "msprof_db")
ASCEND_FORMATS = ("torch_npu", "msprof", "torch_npu_db", "msprof_db")
ACCEPTED = ("expected a torch_npu *_ascend_pt directory (ASCEND_PROFILER_OUTPUT/trace_view.json or "
            "ascend_pytorch_profiler*.db), a msprof PROF_* directory (mindstudio_profiler_output/msprof_*.json or "
            "msprof_*.db), a Kineto trace (.json/.json.gz), or a directory of one such profile per rank")

_RANK_FILE = re.compile(r"^profiler_info_(\d+)\.json$")


def _single_format(p: Path) -> str | None:
    """The format of one single-rank entry, or None if it is not a profile."""
    fmt = _json_format(p)
    if fmt in ("torch_npu", "msprof") and p.is_dir() and not _has_json_timeline(p, fmt):
        from profile_analyzer.loaders.msprof_db import db_format, find_db

        db = find_db(p)
        if db is not None:
            return db_format(db)
    if fmt is None and p.is_file() and p.name.endswith(".db"):
        from profile_analyzer.loaders.msprof_db import db_format, find_db

        if find_db(p) is not None:
            return db_format(p)
    return fmt


def _has_json_timeline(p: Path, fmt: str) -> bool:
    """Whether an Ascend profile directory holds the text export's timeline (trace_view.json / msprof_*.json)."""
    if fmt == "torch_npu":
        out = p / "ASCEND_PROFILER_OUTPUT" if (p / "ASCEND_PROFILER_OUTPUT").is_dir() else p
        base = out.parent if out.name == "ASCEND_PROFILER_OUTPUT" else out
        return (out / "trace_view.json").is_file() or any(base.glob("PROF_*/mindstudio_profiler_output/msprof_*.json"))
    out = p / "mindstudio_profiler_output" if (p / "mindstudio_profiler_output").is_dir() else p
    return any(out.glob("msprof_*.json"))


def _json_format(p: Path) -> str | None:
    if p.is_dir():
        if (p / "ASCEND_PROFILER_OUTPUT").is_dir() or p.name == "ASCEND_PROFILER_OUTPUT" or p.name.endswith(("_ascend_pt", "_ascend_ms")):
            return "torch_npu"
        if (p / "mindstudio_profiler_output").is_dir() or p.name == "mindstudio_profiler_output":
            return "msprof"
        if p.name.startswith("PROF_"):
            return "msprof"
        return None
    if p.is_file():
        name = p.name
        if not (name.endswith(".json") or name.endswith(".json.gz")):
            return None
        kind = peek_kind(p)
        if kind == "object":
            return "kineto"
        if kind == "list":
            return "msprof" if name.startswith("msprof_") else "torch_npu"
    return None


def detect(path: str | Path) -> str:
    """The format of ``path`` (see module doc); raises ProfileError naming what is accepted."""
    p = Path(path)
    try:
        return _detect(p)
    except OSError as exc:
        raise _os_problem(p, exc) from None


def _os_problem(p: Path, exc: OSError) -> ProfileError:
    """A file system error met while looking at or reading a profile, as ProfileError naming the file."""
    import errno

    where = exc.filename if isinstance(exc.filename, str) else p
    reason = "a symbolic link loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
    return ProfileError(where, f"cannot be read ({reason}); expected a readable profile")


def _detect(p: Path) -> str:
    if not p.exists():
        raise ProfileError(p, f"does not exist; {ACCEPTED}")
    fmt = _single_format(p)
    if fmt is not None:
        return fmt
    if p.is_dir():
        entries = _rank_entries(p)
        if entries:
            return "multi_rank"
        raise ProfileError(p, f"no profile found in this directory; {ACCEPTED}")
    if p.is_file() and (p.name.endswith(".json") or p.name.endswith(".json.gz")):
        if peek_kind(p) == "object_without_events":
            raise ProfileError(p, "a JSON object without a traceEvents key (in its first 64 KiB); expected a "
                                  "Chrome/Kineto trace ({\"traceEvents\": [...]}) or a JSON list of trace events")
        raise ProfileError(p, "not JSON (or empty); expected a Chrome/Kineto trace")
    raise ProfileError(p, f"not a profile; {ACCEPTED}")


def _rank_entries(p: Path, depth: int = 2) -> list[tuple[Path, str]]:
    """Profiles directly in ``p``; if there are none, profiles one level further down (e.g. one folder per
    node, each holding its ranks' ``*_ascend_pt``)."""
    out = []
    subdirs = []
    for c in sorted(p.iterdir()):
        if c.name.startswith("."):
            continue
        f = _single_format(c)
        if f is not None:
            out.append((c, f))
        elif c.is_dir():
            subdirs.append(c)
    if not out and depth > 1:
        for d in subdirs:
            out.extend(_rank_entries(d, depth - 1))
    return out


def _rank_of(entry: Path, fmt: str) -> int | None:
    if fmt in ("torch_npu_db", "msprof_db"):
        from profile_analyzer.loaders.msprof_db import find_db, rank_in_name

        db = find_db(entry)
        r = rank_in_name(db) if db is not None else None
        if r is not None:
            return r
        if entry.is_file():
            return None
        entry = entry.parent if entry.name == "ASCEND_PROFILER_OUTPUT" else entry
    if fmt in ("torch_npu", "torch_npu_db"):
        root = entry.parent if entry.name == "ASCEND_PROFILER_OUTPUT" else entry
        if root.is_dir():
            for f in root.iterdir():
                m = _RANK_FILE.match(f.name)
                if m:
                    return int(m.group(1))
    return None


def release_memory() -> None:
    """Hand freed heap pages back to the OS between ranks (glibc keeps them otherwise, and the next rank's
    peak would stack on top). A no-op where malloc_trim does not exist."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_single(p: Path, fmt: str, rank: int, host_events: bool = False,
                 on_bytes: Callable[[int, int, str], None] | None = None,
                 comm_patterns: tuple[Any, ...] = ()) -> list[RankTimeline]:
    """One profile entry -> its rank (one per NPU when an Ascend trace holds several devices), with the vendor
    communication rules (and the user's ``comm_patterns``) applied."""
    from profile_analyzer.loaders.comm_rules import apply_comm_rules

    try:
        rts = _load_single_inner(p, fmt, rank, host_events, on_bytes)
        for rt in rts:
            apply_comm_rules(rt, comm_patterns, host_ranges=rt.host_is_work)
        return rts
    except OSError as exc:  # no permission, a directory where a file belongs, a symlink loop ...
        raise _os_problem(p, exc) from None
    finally:
        release_memory()


def _load_single_inner(p: Path, fmt: str, rank: int, host_events: bool = False,
                       on_bytes: Callable[[int, int, str], None] | None = None) -> list[RankTimeline]:
    from profile_analyzer.loaders import ascend, kineto

    if fmt == "torch_npu":
        if p.is_file():
            return (ascend.load_torch_npu(p.parent, rank, host_events, on_bytes) if p.name == "trace_view.json"
                    else _trace_file(p, rank, host_events, on_bytes))
        return ascend.load_torch_npu(p, rank, host_events, on_bytes)
    if fmt == "msprof":
        return ascend.load_msprof(p, rank, host_events, on_bytes)
    if fmt == "kineto":
        return [kineto.load_kineto(p, rank, host_events)]
    if fmt in ("torch_npu_db", "msprof_db"):
        from profile_analyzer.loaders.msprof_db import find_db, load_db

        db = find_db(p)
        if db is None:
            raise ProfileError(p, f"no ascend_pytorch_profiler*.db or msprof_*.db; {ACCEPTED}")
        return load_db(db, rank, host_events)
    raise ProfileError(p, f"unknown format {fmt}")


def _trace_file(p: Path, rank: int, host_events: bool = False,
                on_bytes: Callable[[int, int, str], None] | None = None) -> list[RankTimeline]:
    from profile_analyzer.loaders import ascend
    from profile_analyzer.loaders._columns import columnarise

    cols = columnarise(p, kineto_args=False, keep_host_x=host_events, on_bytes=on_bytes)
    rts = ascend.columns_to_ranks(cols, rank=rank, source=str(p), fmt="torch_npu", kernel_details=None,
                                  step_trace=None, warnings=[], host_events=host_events)
    for rt in rts:
        ascend._check_tracks(rt, p)
    return rts


def load_entry(p: Path, fmt: str, rank: int, host_events: bool = False,
               comm_patterns: tuple[Any, ...] = (),
               on_bytes: Callable[[int, int, str], None] | None = None) -> list[RankTimeline]:
    """One entry of a load plan (:func:`load_plan`) -> its ranks (a worker's job in ``load(workers=N)`` and in
    ``profile_analyzer.api.load_and_analyze``). ``on_bytes(done, total, label)``: bytes read, as it goes."""
    return _load_single(p, fmt, rank, host_events, on_bytes, comm_patterns=comm_patterns)


def load_entry_or_unreadable(p: Path, fmt: str, rank: int, host_events: bool = False,
                             comm_patterns: tuple[Any, ...] = (),
                             on_bytes: Callable[[int, int, str], None] | None = None
                             ) -> list[RankTimeline] | UnreadableRank:
    """:func:`load_entry`, with a rank that cannot be read returned as :class:`UnreadableRank` (a worker's job when
    a directory of ranks is read leniently: one bad rank must not stop the others)."""
    try:
        return _load_single(p, fmt, rank, host_events, on_bytes, comm_patterns=comm_patterns)
    except ProfileError as exc:
        return unreadable_rank(p, rank, exc)


def unreadable_rank(entry: Path, rank: int, exc: ProfileError) -> UnreadableRank:
    """The record of a rank whose entry raised ``exc``; the reason names the file inside the entry that failed."""
    where = exc.path
    try:
        inner = Path(exc.path).relative_to(entry)
        where = str(inner) if str(inner) != "." else ""
    except ValueError:
        pass
    reason = f"{where}: {exc.problem}" if where and where != str(entry) else exc.problem
    return UnreadableRank(rank=rank, path=str(entry), reason=reason)


def load(path: str | Path, *, ranks: list[int] | None = None,
         progress: Callable[[int, int, str], None] | None = None, workers: int = 1,
         host_events: bool = False, comm_patterns: Sequence[str] = (), strict: bool = False) -> Timeline:
    """Load any supported profile. ``ranks`` restricts a multi-rank directory to those ranks.

    ``progress(done, total, label)`` reports bytes read for a single profile and ranks loaded for a
    directory of ranks (the CLI shows it as a bar on a terminal).
    ``workers`` > 1 loads the ranks of a multi-rank directory in that many processes (each process peaks at
    about twice the size of the rank it loads). ``host_events=True`` keeps CPU-side events (torch ops, CANN
    API calls) as ``Kind.HOST`` tasks; by default they are read for steps and launch times and then dropped
    (CPU-only Kineto traces keep them, since there they are the work).
    ``comm_patterns``: regexes (``--comm-pattern``) naming further communication kernels or ranges, on top of the
    vendor rule table (:mod:`profile_analyzer.loaders.comm_rules`); a bad one raises ProfileError.
    In a directory of ranks, a rank that cannot be read is left out and listed in ``Timeline.unreadable`` (in a
    cluster some ranks are always missing or still being written); ``strict=True`` raises its error instead. A
    directory where no rank reads raises ProfileError either way.
    """
    from profile_analyzer.loaders.comm_rules import compile_patterns

    p = Path(path)
    patterns = compile_patterns(comm_patterns)
    try:
        return _load(p, ranks, progress, workers, host_events, patterns, strict)
    except OSError as exc:
        raise _os_problem(p, exc) from None


@dataclass(frozen=True)
class LoadPlan:
    """What loading a path means: its format, and for a directory of ranks one job (entry, format, rank) per rank
    to load, in rank-directory order."""

    path: Path
    format: str
    jobs: tuple[tuple[Path, str, int], ...]
    entries: tuple[tuple[Path, str], ...]

    @property
    def multi_rank(self) -> bool:
        return self.format == "multi_rank"


def load_plan(path: str | Path, ranks: list[int] | None = None) -> LoadPlan:
    """Detect the format and list the per-rank jobs of a directory of ranks (``ranks`` keeps only those)."""
    p = Path(path)
    try:
        fmt = detect(p)
        if fmt != "multi_rank":
            r = _rank_of(p, fmt)
            return LoadPlan(p, fmt, ((p, fmt, r if r is not None else 0),), ((p, fmt),))
        entries = _rank_entries(p)
    except OSError as exc:
        raise _os_problem(p, exc) from None
    kinds = {"ascend" if f in ASCEND_FORMATS else f for _, f in entries}
    if len(kinds) > 1:
        listing = ", ".join(f"{e.name} ({f})" for e, f in entries[:4])
        raise ProfileError(p, f"mixed formats in one directory ({listing}); expected one profile per rank, all of one format")
    jobs = []
    for i, (entry, f) in enumerate(entries):
        r = _rank_of(entry, f)
        if ranks is not None and r is not None and r not in ranks:
            continue
        jobs.append((entry, f, r if r is not None else i))
    return LoadPlan(p, fmt, tuple(jobs), tuple(entries))


def assemble(plan: LoadPlan, loaded: list[list[RankTimeline]], ranks: list[int] | None = None,
             unreadable: Sequence[UnreadableRank] = ()) -> Timeline:
    """The Timeline of a plan from each job's ranks (in job order; an unreadable job's entry is empty and its record
    is in ``unreadable``): one profile per rank, ``ranks`` kept. Raises ProfileError when no rank was read."""
    if unreadable and not any(loaded):
        raise no_rank_readable(plan, list(unreadable))
    if not plan.multi_rank:
        rts = loaded[0]
        return Timeline(source=str(plan.path), format=plan.format if len(rts) == 1 else "multi_rank",
                        ranks={rt.rank: rt for rt in rts})
    by_rank = ranks_of_plan(plan, loaded, ranks, lambda rt: (rt.rank, rt.source))
    return Timeline(source=str(plan.path), format=plan_format(plan, len(by_rank)),
                    ranks=dict(sorted(by_rank.items())), unreadable=sorted(unreadable, key=lambda u: u.rank))


def ranks_of_plan(plan: LoadPlan, loaded: Sequence[Sequence[_T]], ranks: list[int] | None,
                  rank_and_source: Callable[[_T], tuple[int, str]]) -> dict[int, _T]:
    """Each job's loaded items (a rank's timeline, or what was kept of it) by rank number: one profile per rank,
    only ``ranks`` when given; ProfileError for a rank met twice or for ``ranks`` of which none is present."""
    by_rank: dict[int, _T] = {}
    for (entry, _, _), items in zip(plan.jobs, loaded, strict=True):
        for item in items:
            r, source = rank_and_source(item)
            if r in by_rank:
                raise ProfileError(entry, f"rank {r} appears twice (also {rank_and_source(by_rank[r])[1]}); "
                                          "expected one profile per rank")
            by_rank[r] = item
    if ranks is not None:
        by_rank = {k: v for k, v in by_rank.items() if k in ranks}
        if not by_rank:
            raise ProfileError(plan.path, f"none of ranks {ranks} found; ranks present: "
                                          f"{sorted(_all_ranks(list(plan.entries)))}")
    return by_rank


def plan_format(plan: LoadPlan, n_ranks: int) -> str:
    """The Timeline format of a multi-rank plan that kept ``n_ranks`` ranks."""
    return "multi_rank" if n_ranks > 1 else next(iter({f for _, f in plan.entries}))


def no_rank_readable(plan: LoadPlan, unreadable: list[UnreadableRank]) -> ProfileError:
    """The one-line error of a directory of ranks where not one rank could be read."""
    first = unreadable[0]
    n = len(unreadable)
    return ProfileError(plan.path, f"none of its {n} rank profile{'s' if n != 1 else ''} could be read (rank "
                                   f"{first.rank}, {Path(first.path).name}: {first.reason}"
                                   f"{f'; and {n - 1} more' if n > 1 else ''})")


def _load(p: Path, ranks: list[int] | None, progress: Callable[[int, int, str], None] | None, workers: int,
          host_events: bool, patterns: tuple[Any, ...] = (), strict: bool = False) -> Timeline:
    plan = load_plan(p, ranks)
    total = len(plan.jobs)
    loaded: list[list[RankTimeline]] = []
    unreadable: list[UnreadableRank] = []

    def got(i: int, rts: list[RankTimeline] | UnreadableRank) -> None:
        if isinstance(rts, UnreadableRank):
            unreadable.append(rts)
            rts = []
        loaded.append(rts)
        if progress:
            progress(i + 1, total, plan.jobs[i][0].name)

    if not plan.multi_rank:
        entry, f, rank = plan.jobs[0]
        got(0, _load_single(entry, f, rank, host_events, progress, patterns))
    elif workers > 1 and total > 1:
        from profile_analyzer._pool import map_in_processes

        map_in_processes(load_entry if strict else load_entry_or_unreadable,
                         [(e, f, r, host_events, patterns) for e, f, r in plan.jobs], workers, got)
    else:
        for i, (entry, f, rank) in enumerate(plan.jobs):
            try:
                got(i, _load_single(entry, f, rank, host_events, progress if total == 1 else None, patterns))
            except ProfileError as exc:
                if strict:
                    raise
                got(i, unreadable_rank(entry, rank, exc))
    return assemble(plan, loaded, ranks, unreadable)


def _all_ranks(entries: list[tuple[Path, str]]) -> list[int]:
    return [(_rank_of(e, f) if _rank_of(e, f) is not None else i) for i, (e, f) in enumerate(entries)]  # type: ignore[misc]
