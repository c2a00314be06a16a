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

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders._trace import peek_kind
from profile_analyzer.timeline import RankTimeline, Timeline

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


def _release_memory() -> None:
    """Hand freed heap pages back to the OS between ranks (glibc keeps them otherwise, and the next rank's
    peak would stack on top). A no-op where malloc_trim does not exist."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_single(p: Path, fmt: str, rank: int, host_events: bool = False,
                 on_bytes: Callable[[int, int, str], None] | None = None,
                 comm_patterns: tuple[re.Pattern[str], ...] = ()) -> list[RankTimeline]:
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
        _release_memory()


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
    from profile_analyzer.loaders._trace import columnarise

    cols = columnarise(p, kineto_args=False, keep_host_x=host_events, on_bytes=on_bytes)
    rts = ascend.columns_to_ranks(cols, rank=rank, source=str(p), fmt="torch_npu", kernel_details=None,
                                  step_trace=None, warnings=[], host_events=host_events)
    for rt in rts:
        ascend._check_tracks(rt, p)
    return rts


def _load_and_run(p: Path, fmt: str, rank: int, host_events: bool,
                  per_rank: Callable[[RankTimeline], object] | None,
                  comm_patterns: tuple[re.Pattern[str], ...] = ()) -> list[tuple[RankTimeline, object]]:
    """A worker's job: load one entry and run ``per_rank`` (if any) on each of its ranks there, while they are
    at hand."""
    return [(rt, per_rank(rt) if per_rank is not None else None)
            for rt in _load_single(p, fmt, rank, host_events, comm_patterns=comm_patterns)]


def load(path: str | Path, *, ranks: list[int] | None = None,
         progress: Callable[[int, int, str], None] | None = None, workers: int = 1,
         host_events: bool = False, per_rank: Callable[[RankTimeline], object] | None = None,
         comm_patterns: Sequence[str] = ()) -> Timeline:
    """Load any supported profile. ``ranks`` restricts a multi-rank directory to those ranks.

    ``progress(done, total, label)`` reports bytes read for a single profile and ranks loaded for a
    directory of ranks (the CLI shows it as a bar on a terminal).
    ``workers`` > 1 loads the ranks of a multi-rank directory in that many processes (each process peaks at
    about twice the size of the rank it loads). ``host_events=True`` keeps CPU-side events (torch ops, CANN
    API calls) as ``Kind.HOST`` tasks; by default they are read for steps and launch times and then dropped
    (CPU-only Kineto traces keep them, since there they are the work).
    ``comm_patterns``: regexes (``--comm-pattern``) naming further communication kernels or ranges, on top of the
    vendor rule table (:mod:`profile_analyzer.loaders.comm_rules`); a bad one raises ProfileError.
    """
    from profile_analyzer.loaders.comm_rules import compile_patterns

    p = Path(path)
    patterns = compile_patterns(comm_patterns)
    try:
        return _load(p, ranks, progress, workers, host_events, per_rank, patterns)
    except OSError as exc:
        raise _os_problem(p, exc) from None


def _load(p: Path, ranks: list[int] | None, progress: Callable[[int, int, str], None] | None, workers: int,
          host_events: bool, per_rank: Callable[[RankTimeline], object] | None,
          patterns: tuple[re.Pattern[str], ...] = ()) -> Timeline:
    fmt = detect(p)
    if fmt != "multi_rank":
        r = _rank_of(p, fmt)
        rts = _load_single(p, fmt, r if r is not None else 0, host_events, progress, patterns)
        tl = Timeline(source=str(p), format=fmt if len(rts) == 1 else "multi_rank", ranks={rt.rank: rt for rt in rts})
        if progress:
            progress(1, 1, p.name)
        return tl
    entries = _rank_entries(p)
    kinds = {"ascend" if f in ASCEND_FORMATS else f for _, f in entries}
    if len(kinds) > 1:
        listing = ", ".join(f"{e.name} ({f})" for e, f in entries[:4])
        raise ProfileError(p, f"mixed formats in one directory ({listing}); expected one profile per rank, all of one format")
    loaded: dict[int, RankTimeline] = {}
    results: dict[int, object] = {}
    jobs = []
    for i, (entry, f) in enumerate(entries):
        r = _rank_of(entry, f)
        if ranks is not None and r is not None and r not in ranks:
            continue
        jobs.append((entry, f, r if r is not None else i))
    total = len(jobs)

    def add(entry: Path, rts: list[RankTimeline], done: int) -> None:
        for rt in rts:
            if rt.rank in loaded:
                raise ProfileError(entry, f"rank {rt.rank} appears twice (also {loaded[rt.rank].source}); expected one "
                                          "profile per rank")
            loaded[rt.rank] = rt
        if progress:
            progress(done, total, entry.name)

    if workers > 1 and total > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        pool = ProcessPoolExecutor(max_workers=min(workers, total), mp_context=ctx, initializer=_worker_init,
                                   initargs=(os.getpid(),))
        try:
            futures = [(entry, pool.submit(_load_and_run, entry, f, rank, host_events, per_rank, patterns))
                       for entry, f, rank in jobs]
            for done, (entry, fut) in enumerate(futures, 1):
                got = fut.result()
                add(entry, [rt for rt, _ in got], done)
                if per_rank is not None:
                    results.update((rt.rank, res) for rt, res in got)
        except BaseException:
            # an error, Ctrl-C or SIGTERM: stop the workers now instead of waiting for the ranks they load
            _stop_workers(pool)
            raise
        pool.shutdown(wait=True)
    else:
        for done, (entry, f, rank) in enumerate(jobs, 1):
            add(entry, _load_single(entry, f, rank, host_events, progress if total == 1 else None, patterns), done)
    if ranks is not None:
        loaded = {k: v for k, v in loaded.items() if k in ranks}
        if not loaded:
            raise ProfileError(p, f"none of ranks {ranks} found; ranks present: {sorted(_all_ranks(entries))}")
    fmts = {f for _, f in entries}
    return Timeline(source=str(p), format="multi_rank" if len(loaded) > 1 else next(iter(fmts)),
                    ranks=dict(sorted(loaded.items())), per_rank_results={k: v for k, v in results.items() if k in loaded})


def _worker_init(parent: int) -> None:
    """In each loader worker: die with the parent. Linux delivers SIGTERM to the worker when the process that
    started it ends (even by SIGKILL), so no worker outlives a killed `report`."""
    import signal

    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a worker forked from a handler-installing parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    if os.getppid() != parent:  # the parent is already gone
        os._exit(1)


def _stop_workers(pool) -> None:
    """Terminate a ProcessPoolExecutor's processes and wait for them (the executor has no public way)."""
    processes = list(getattr(pool, "_processes", {}).values())
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    pool.shutdown(wait=False, cancel_futures=True)


def _all_ranks(entries: list[tuple[Path, str]]) -> list[int]:
    return [(_rank_of(e, f) if _rank_of(e, f) is not None else i) for i, (e, f) in enumerate(entries)]  # type: ignore[misc]
