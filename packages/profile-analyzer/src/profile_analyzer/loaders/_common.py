"""Pieces shared by the loaders: step ranges from framework steps and launch links, CSV helpers."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from profile_analyzer.errors import ProfileError
from profile_analyzer.timeline import STEP_NAME, VLLM_STEP_NAME, Steps, is_step_name

__all__ = ["STEP_NAME", "VLLM_STEP_NAME", "is_step_name"]

def merge_columns(parts: list) -> object:
    """Merge the Columns of several files (sliced msprof JSON) into one, re-indexing the tables."""
    from profile_analyzer.loaders._columns import Columns, _Interner

    if len(parts) == 1:
        return parts[0]
    tracks, names, cats, ttypes = _Interner(), _Interner(), _Interner(), _Interner()
    arrays: list[list[np.ndarray]] = [[] for _ in range(9)]
    pn: dict = {}
    pl: dict = {}
    tn: dict = {}
    flows: dict = {}
    n = 0
    for c in parts:
        remap_t = tracks.ids(c.tracks) if c.tracks else np.zeros(0, np.int32)
        remap_n = names.ids(c.names) if c.names else np.zeros(0, np.int32)
        remap_c = cats.ids(c.cats) if c.cats else np.zeros(0, np.int32)
        remap_tt = ttypes.ids(c.task_types) if c.task_types else np.zeros(0, np.int32)
        arrays[0].append(remap_t[c.track] if c.track.size else c.track)
        arrays[1].append(c.start_ns)
        arrays[2].append(c.dur_ns)
        arrays[3].append(remap_n[c.name_id] if c.name_id.size else c.name_id)
        arrays[4].append(remap_c[c.cat_id] if c.cat_id.size else c.cat_id)
        arrays[5].append(remap_tt[c.task_type_id] if c.task_type_id.size else c.task_type_id)
        arrays[6].append(c.stream_arg)
        arrays[7].append(c.correlation)
        arrays[8].append(c.problem if c.problem is not None else np.zeros(c.track.size, np.uint8))
        pn.update(c.process_name)
        pl.update(c.process_label)
        tn.update(c.thread_name)
        for k, (ids, ts) in c.flows.items():
            e = flows.setdefault(k, ([], []))
            e[0].append(ids)
            e[1].append(ts)
        n += c.n_events
    from profile_analyzer.loaders._columns import concat_ids

    flows = {k: (concat_ids(v[0]), np.concatenate(v[1])) for k, v in flows.items()}
    cols = [np.concatenate(a) for a in arrays]
    return Columns(track=cols[0].astype(np.int32), start_ns=cols[1], dur_ns=cols[2], name_id=cols[3].astype(np.int32),
                   cat_id=cols[4].astype(np.int32), task_type_id=cols[5].astype(np.int32), stream_arg=cols[6],
                   correlation=cols[7], tracks=tracks.values, names=names.values, cats=cats.values,
                   task_types=ttypes.values, process_name=pn, process_label=pl, thread_name=tn, flows=flows,
                   distributed_info=parts[0].distributed_info, n_events=n, problem=cols[8])


def set_aside_unplaceable(cols, needed: np.ndarray, source: str, warnings: list) -> object:
    """The rule for events that cannot be placed (no ts, a ts or dur that is not a number in range, a
    negative dur; docs/profile-analysis.md): one that ``needed`` marks (a device task the breakdown counts) is
    an error; the others are left out and counted in one warning. Returns the columns without them."""
    from profile_analyzer.loaders._timestamps import PROBLEMS
    from profile_analyzer.timeline import Warning_

    problem = cols.problem
    if problem is None or not problem.any():
        return cols
    bad = problem != 0

    def tally(mask: np.ndarray) -> str:
        counts = np.bincount(problem[mask], minlength=len(PROBLEMS) + 1)
        return ", ".join(f"{int(counts[c]):,} {PROBLEMS[c]}" for c in sorted(PROBLEMS) if counts[c])

    fatal = bad & needed
    if fatal.any():
        first = int(np.flatnonzero(fatal)[0])
        raise ProfileError(source, f"{int(fatal.sum()):,} device task(s) cannot be placed on the timeline "
                                   f"({tally(fatal)}; the first is {cols.names[int(cols.name_id[first])][:60]!r}); "
                                   "expected every device task with a numeric ts and a numeric dur >= 0 (µs)")
    warnings.append(Warning_(source, f"a usable ts or dur on {int(bad.sum()):,} event(s) ({tally(bad)})",
                             ["those events were skipped (none is a device task the breakdown counts)"]))
    return cols.take(~bad)


def build_steps(step_ids: np.ndarray, host_start: np.ndarray, host_end: np.ndarray, launch_host_ts: np.ndarray,
                launch_dev_start: np.ndarray, launch_dev_end: np.ndarray, dev_start_all: int, dev_end_all: int) -> Steps:
    """Device-clock step ranges the way torch_npu derives them.

    A step starts at the first device task launched from inside its ``ProfilerStep#N`` host range and ends
    at ``max(last such task's end, host step end)`` (torch_npu ``FwkCANNRelationParser.get_step_range``).
    Without steps, one pseudo-step (id -1) covers the whole device span.
    """
    if step_ids.size == 0:
        return Steps(np.array([-1], np.int64), np.array([dev_start_all], np.int64), np.array([dev_end_all + 1], np.int64),
                     np.array([dev_start_all], np.int64))
    order = np.argsort(host_start)
    step_ids, host_start, host_end = step_ids[order], host_start[order], host_end[order]
    start = host_start.copy()
    end = host_end.copy()
    if launch_host_ts.size:
        idx = np.searchsorted(host_start, launch_host_ts, side="right") - 1
        ok = (idx >= 0) & (launch_host_ts <= host_end[np.maximum(idx, 0)])
        idx, ds, de = idx[ok], launch_dev_start[ok], launch_dev_end[ok]
        for i in range(step_ids.size):
            sel = idx == i
            if sel.any():
                start[i] = ds[sel].min()
                end[i] = max(int(de[sel].max()), int(host_end[i]))
    return Steps(step_ids.astype(np.int64), start.astype(np.int64), end.astype(np.int64), host_start.astype(np.int64))


def read_csv_rows(path: Path, materialise: bool = True) -> tuple[list[str], Iterator[list[str]] | list[list[str]]]:
    """Header and rows of a CSV file; with ``materialise=False`` the rows are streamed (decode errors then
    surface while iterating, as ProfileError)."""
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise ProfileError(path, f"cannot be read ({exc})") from None
    reader = csv.reader(f)
    try:
        first = next(reader)
    except StopIteration:
        f.close()
        raise ProfileError(path, "empty CSV; expected a header row and data rows") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        f.close()
        raise ProfileError(path, f"not a CSV file ({exc}); expected the profiler's CSV output") from None
    header = [h.strip() for h in first]

    def rows() -> Iterator[list[str]]:
        try:
            yield from reader
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ProfileError(path, f"malformed CSV ({exc})") from None
        finally:
            f.close()

    return header, (list(rows()) if materialise else rows())


def to_float(s: str) -> float | None:
    s = s.strip().strip('"').strip()
    if not s or s == "N/A":
        return None
    try:
        return float(s)
    except ValueError:
        return None
