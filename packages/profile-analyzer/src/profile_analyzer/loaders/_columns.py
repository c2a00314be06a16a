"""The columnar form of a trace's complete ('X') events, metadata and flows: parallel numpy arrays per file
(:class:`Columns`), built from the slicer's events (:mod:`._slicer`) with timestamps from :mod:`._timestamps`."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from profile_analyzer.loaders._slicer import (
    _FLOW_PH,
    ByteProgress,
    Event,
    Scanner,
    _event_decoder,
    decode_trace,
)
from profile_analyzer.loaders._timestamps import (
    dur_array_to_ns_checked,
    dur_to_ns_checked,
    ts_joined_to_ns_checked,
    ts_to_ns_checked,
)

try:  # the compiled slice scanner (loaders/_scan.c), built where a C compiler was at install time
    from profile_analyzer.loaders import _scan
except ImportError:  # pragma: no cover - depends on the install
    _scan = None

# PROFILE_ANALYZER_NO_SCAN=1: decode every slice with msgspec and read kernel_details.csv with the csv module
# (the references the compiled readers are tested against)
SCAN_AVAILABLE = _scan is not None


def compiled() -> object | None:
    """The compiled readers' module, or None when it is not built or ``PROFILE_ANALYZER_NO_SCAN`` is set."""
    return _scan if SCAN_AVAILABLE and not os.environ.get("PROFILE_ANALYZER_NO_SCAN") else None


class _Index(dict):
    """value -> id; a value not seen before gets the next id (``__missing__`` runs once per distinct value,
    every other lookup stays in C)."""

    __slots__ = ("values",)

    def __missing__(self, key: object) -> int:
        i = self[key] = len(self.values)
        self.values.append(key)
        return i


class _Interner:
    def __init__(self) -> None:
        self.values: list = []
        self.index = _Index()
        self.index.values = self.values

    def ids(self, items: list) -> np.ndarray:
        """Ids of ``items``, in first-seen order."""
        return np.fromiter(map(self.index.__getitem__, items), dtype=np.int32, count=len(items))


@dataclass
class Columns:
    """Every 'X' event of a file as parallel arrays; ``track`` indexes ``tracks`` ((pid, tid) pairs)."""

    track: np.ndarray
    start_ns: np.ndarray
    dur_ns: np.ndarray
    name_id: np.ndarray
    cat_id: np.ndarray
    task_type_id: np.ndarray
    stream_arg: np.ndarray  # int64, -1 when absent (Kineto args.stream)
    correlation: np.ndarray  # int64, -1 when absent
    tracks: list[tuple[object, object]]
    names: list[str]
    cats: list[str | None]
    task_types: list[str | None]
    process_name: dict[object, str]
    process_label: dict[object, str]
    thread_name: dict[tuple[object, object], str]
    flows: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]  # (cat, ph) -> (flow ids, ts_ns)
    distributed_info: dict[str, object] | None
    n_events: int
    # uint8 per event: 0, or why it cannot be placed (NO_TS, BAD_TS, NO_DUR, NEGATIVE_DUR, BAD_DUR)
    problem: np.ndarray | None = None

    def take(self, keep: np.ndarray) -> Columns:
        """The same columns with only the events where ``keep`` is True (tables and metadata shared)."""
        return Columns(track=self.track[keep], start_ns=self.start_ns[keep], dur_ns=self.dur_ns[keep],
                       name_id=self.name_id[keep], cat_id=self.cat_id[keep], task_type_id=self.task_type_id[keep],
                       stream_arg=self.stream_arg[keep], correlation=self.correlation[keep], tracks=self.tracks,
                       names=self.names, cats=self.cats, task_types=self.task_types, process_name=self.process_name,
                       process_label=self.process_label, thread_name=self.thread_name, flows=self.flows,
                       distributed_info=self.distributed_info, n_events=self.n_events,
                       problem=None if self.problem is None else self.problem[keep])


def _track_ids(tracks: _Interner, pids: list, tids: list) -> np.ndarray:
    """Per-event index of its (pid, tid) pair. Integer ids: pid and tid are interned separately (one C dict
    lookup per event each), the pairs go through a dense table, and new pairs are numbered in (pid, tid)
    order; other ids: the pairs themselves are interned."""
    pi, ti = _Index(), _Index()
    pi.values, ti.values = [], []
    n = len(pids)
    p = np.fromiter(map(pi.__getitem__, pids), dtype=np.int64, count=n)
    t = np.fromiter(map(ti.__getitem__, tids), dtype=np.int64, count=n)
    n_t = len(ti.values)
    if (len(pi.values) * n_t > (1 << 22) or not all(type(v) is int for v in pi.values)
            or not all(type(v) is int for v in ti.values)):
        return tracks.ids(list(zip(pids, tids, strict=False)))
    key = p * n_t + t
    present = np.flatnonzero(np.bincount(key, minlength=len(pi.values) * n_t))
    pairs = [(pi.values[k // n_t], ti.values[k % n_t]) for k in present.tolist()]
    order = sorted(range(len(pairs)), key=pairs.__getitem__)
    table = np.zeros(len(pi.values) * n_t, dtype=np.int32)
    table[present[order]] = tracks.ids([pairs[i] for i in order])
    return table[key]


def _renumber_tracks(tracks: _Interner, track: np.ndarray) -> np.ndarray:
    """Track ids as :func:`_track_ids` numbers them over a whole file in one go, for columns built slice by
    slice (where each slice numbers its new tracks on its own): sorted (pid, tid) order when all ids are
    integers and the dense table fits, else first-seen order. So a Kineto trace gives the same ids, and
    streams in the same order, whether it was decoded in slices or at once."""
    pairs = tracks.values
    n = len(pairs)
    if n < 2:
        return track
    pids = {p for p, _ in pairs}
    tids = {t for _, t in pairs}
    if (len(pids) * len(tids) <= (1 << 22) and all(type(v) is int for v in pids)
            and all(type(v) is int for v in tids)):
        order = sorted(range(n), key=pairs.__getitem__)
    else:
        ids, first = np.unique(track, return_index=True)
        order = ids[np.argsort(first, kind="stable")].tolist()
    if order == list(range(n)):
        return track
    lut = np.empty(n, dtype=np.int32)
    lut[order] = np.arange(n, dtype=np.int32)
    tracks.values[:] = [pairs[i] for i in order]
    tracks.index.clear()
    tracks.index.update((p, i) for i, p in enumerate(tracks.values))
    return lut[track]


def flow_id_array(ids: list[object]) -> np.ndarray:
    """Flow ids as int64 when they all are integers that fit, or strings that are such integers written the way
    ``str`` writes them (msprof's ``"id": "4563402751"``: matched as numbers, the same pairs as matching their
    text, since :func:`match_flows` compares ids of mixed kinds as ``str`` of each), else as strings."""
    try:
        a = np.array(ids)
    except (OverflowError, ValueError):
        a = None
    if a is not None and a.dtype.kind == "U" and a.size:
        v = _canonical_ints(a)
        if v is not None:
            return v
    if a is None or a.dtype.kind not in "iu" or a.dtype == np.uint64:
        return np.array([str(i) for i in ids])
    return a.astype(np.int64)


def _canonical_ints(a: np.ndarray) -> np.ndarray | None:
    """A string array whose every value is a non-negative integer of at most 18 digits written without a sign or
    leading zeros (so ``str`` of the number gives it back) -> int64; else None. Vectorised over the code points."""
    width = a.dtype.itemsize // 4
    if width > 18:
        return None
    c = np.ascontiguousarray(a).view(np.uint32).reshape(a.size, width)
    digit = (c >= 48) & (c <= 57)
    pad = c == 0  # values shorter than the array's width end in NULs
    length = digit.sum(axis=1)
    if not (digit | pad).all() or not (length > 0).all() or (pad[:, 0]).any():
        return None
    if not (digit.argmin(axis=1) == np.where(pad.any(axis=1), length, 0)).all():  # a NUL before a digit
        return None
    if ((c[:, 0] == 48) & (length > 1)).any():  # a leading zero
        return None
    acc = np.zeros(a.size, dtype=np.int64)
    for j in range(width):
        d = digit[:, j]
        acc = np.where(d, acc * 10 + (c[:, j].astype(np.int64) - 48), acc)
    return acc


def concat_ids(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, np.int64)
    if any(p.dtype.kind not in "iu" for p in parts):
        parts = [p.astype(str) for p in parts]
    return np.concatenate(parts)


def match_flows(flows: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]], cat: str) -> tuple[np.ndarray, np.ndarray]:
    """(start ts, end ts) of the flows of ``cat`` whose 's' and 'f' ids match."""
    z = np.zeros(0, np.int64)
    sid, sts = flows.get((cat, "s"), (z, z))
    fid, fts = flows.get((cat, "f"), (z, z))
    if sid.size == 0 or fid.size == 0:
        return z, z
    if sid.dtype.kind != fid.dtype.kind:
        sid, fid = sid.astype(str), fid.astype(str)
    _, si, fi = np.intersect1d(sid, fid, return_indices=True)
    return sts[si], fts[fi]


_NONE_IS_MINUS_ONE = {None: -1}
_INT_OR_NONE = frozenset({int, type(None)})


def _int_column(values: list) -> np.ndarray:
    """``args.stream`` / ``args.correlation`` values -> int64: -1 where absent, else as :func:`_int_or` reads them
    (-1 for a string that is not an integer). Integers and nulls only (the usual case) go through C loops."""
    if set(map(type, values)) <= _INT_OR_NONE:
        try:  # dict.get(v, v): None -> -1, an integer -> itself
            return np.fromiter(map(_NONE_IS_MINUS_ONE.get, values, values), dtype=np.int64, count=len(values))
        except OverflowError:  # an integer past int64: -1, as for a string that is not one
            pass
    return np.fromiter((_int_or(v, -1) if v is not None else -1 for v in values), dtype=np.int64, count=len(values))


def _spread(values: np.ndarray, at: np.ndarray, n: int) -> np.ndarray:
    """``n`` values, -1 except ``values`` at the positions ``at``."""
    out = np.full(n, -1, dtype=np.int64)
    out[at] = values
    return out


_INT64 = range(-(1 << 63), 1 << 63)


def _int_or(v: object, default: int) -> int:
    """An integer (or a string of one) that int64 holds, else ``default``."""
    if isinstance(v, str):
        try:
            v = int(v)
        except ValueError:
            return default
    if isinstance(v, int) and not isinstance(v, bool) and v in _INT64:
        return v
    return default


def columnarise(path: Path, flow_cats: frozenset[str] = frozenset({"async_npu", "ac2g", "HostToDevice"}),
                kineto_args: bool = True, keep_host_x: bool = True, on_bytes: ByteProgress | None = None,
                args_cats: frozenset[str] | None = None, task_types: bool = True,
                scan: bool | None = None) -> Columns:
    """All 'X' events of a trace file as columns. With ``keep_host_x=False``, 'X' events of processes already
    known (from metadata seen earlier in the file) to be CPU-side are dropped on the fly, except the
    ``ProfilerStep#N`` ranges; events of processes not yet named are always kept. ``args_cats``: with
    ``kineto_args``, ``args.stream`` / ``args.correlation`` are read only for events of these categories (-1 for the
    others; None: for every event). ``task_types=False`` leaves ``args["Task Type"]`` unread (every event None).
    ``scan``: read plain slices with the compiled scanner (the same columns, several times faster); None: when it
    is built and ``PROFILE_ANALYZER_NO_SCAN`` is not set."""
    # millions of short-lived tuples and lists: the cyclic GC would rescan them over and over
    enabled = gc.isenabled()
    gc.disable()
    try:
        if scan is None:
            scan = compiled() is not None
        elif scan and not SCAN_AVAILABLE:
            raise RuntimeError("the compiled scanner (profile_analyzer.loaders._scan) is not built in this install")
        return _columnarise(path, flow_cats, kineto_args, keep_host_x, on_bytes, args_cats, task_types, scan)
    finally:
        if enabled:
            gc.enable()


def _is_host_process(name: str | None, label: str | None) -> bool:
    return (label or "").startswith("CPU") or (name or "").startswith(("Python", "CANN"))


def _columnarise(path: Path, flow_cats: frozenset[str], kineto_args: bool, keep_host_x: bool,
                 on_bytes: ByteProgress | None, args_cats: frozenset[str] | None = None,
                 task_types: bool = True, scan: bool = False) -> Columns:
    scanner = _make_scanner(flow_cats, task_types, kineto_args) if scan else None
    decoded = decode_trace(path, on_bytes, scanner)
    tracks = _Interner()
    names = _Interner()
    cats = _Interner()
    ttypes = _Interner()
    process_name: dict[object, str] = {}
    process_label: dict[object, str] = {}
    thread_name: dict[tuple[object, object], str] = {}
    flows: dict[tuple[str, str], tuple[list[np.ndarray], list[np.ndarray]]] = {}
    parts: list[tuple[np.ndarray, ...]] = []
    n_events = 0
    for chunk in decoded.chunks:
        if type(chunk) is _Scanned:
            n_events += chunk.n_events
            _read_metadata(chunk.meta, process_name, thread_name, process_label)
            if chunk.flow_cat:
                _add_flows(flows, chunk.flow_cat, list(chunk.flow_ph.decode("ascii")), chunk.flow_id,
                           *ts_joined_to_ns_checked(chunk.flow_ts, len(chunk.flow_cat), path))
            part = _scanned_columns(chunk, path, keep_host_x, process_name, process_label, tracks, names, cats,
                                    ttypes, task_types, kineto_args, args_cats) if chunk.n_x else None
            if part is not None:
                parts.append(part)
            continue
        n_events += len(chunk)
        others = [e for e in chunk if e.ph != "X"]
        n_others = len(others)
        _read_metadata([e for e in others if e.ph == "M"], process_name, thread_name, process_label)
        # the fields of the flows in one pass, as for the complete events below
        flow_rows = [(e.cat, e.ph, e.id, e.ts) for e in others if e.cat in flow_cats and e.ph in _FLOW_PH and e.ts]
        del others
        if flow_rows:
            f_cats, f_phs, f_ids, f_ts = zip(*flow_rows, strict=True)
            del flow_rows
            _add_flows(flows, f_cats, f_phs, f_ids, *ts_to_ns_checked(list(f_ts), path))
            del f_cats, f_phs, f_ids, f_ts
        host_pids = None
        if not keep_host_x and n_others != len(chunk):
            host_pids = _host_pids(process_name, process_label)
        # every field of the kept 'X' events in one pass over the slice (each event's memory is touched once, no
        # list of the 'X' events in between), then one column each
        if host_pids:
            # ("in" first: no method call for the host events that are not steps)
            rows = [(e.pid, e.tid, e.ts, e.dur, e.name, e.cat, e.args) for e in chunk if e.ph == "X" and (
                e.pid not in host_pids or ("ProfilerStep#" in e.name and e.name.startswith("ProfilerStep#")))]
        elif n_others:
            rows = [(e.pid, e.tid, e.ts, e.dur, e.name, e.cat, e.args) for e in chunk if e.ph == "X"]
        else:
            rows = [(e.pid, e.tid, e.ts, e.dur, e.name, e.cat, e.args) for e in chunk]
        del chunk
        if not rows:
            continue
        pids, tids, tss, durs, name_l, cat_l, argl = zip(*rows, strict=True)
        del rows
        track = _track_ids(tracks, pids, tids)
        start, ts_problem = ts_to_ns_checked(list(tss), path)
        dur, dur_problem = dur_to_ns_checked(durs, path)
        problem = np.where(ts_problem != 0, ts_problem, dur_problem)
        name_id = names.ids(name_l)
        cat_id = cats.ids(cat_l)
        del pids, tids, tss, durs, name_l, cat_l
        if task_types:
            try:
                ttype = ttypes.ids([a.task_type for a in argl])
            except AttributeError:  # some event has "args": null
                ttype = ttypes.ids([a.task_type if a is not None else None for a in argl])
        else:
            ttype = np.zeros(len(argl), dtype=np.int32) if ttypes.values else ttypes.ids([None] * len(argl))
        if kineto_args:
            sel = None
            if args_cats is not None:  # only the events of these categories
                sel = np.flatnonzero(np.isin(cat_id, [i for i, c in enumerate(cats.values) if c in args_cats]))
                if sel.size == len(argl):
                    sel = None
                else:
                    argl = [argl[i] for i in sel.tolist()]
            try:
                streams, corrs = [a.stream for a in argl], [a.correlation for a in argl]
            except AttributeError:  # some event has "args": null
                streams = [a.stream if a is not None else None for a in argl]
                corrs = [a.correlation if a is not None else None for a in argl]
            stream_arg, corr = _int_column(streams), _int_column(corrs)
            del streams, corrs
            if sel is not None:
                stream_arg, corr = _spread(stream_arg, sel, track.size), _spread(corr, sel, track.size)
        else:
            stream_arg = corr = np.full(track.size, -1, dtype=np.int64)
        parts.append((track, start, dur, name_id, cat_id, ttype, stream_arg, corr, problem))
        del argl
    flow_arrays = {k: (concat_ids(v[0]), np.concatenate(v[1])) for k, v in flows.items()}
    if parts:
        cols = [np.concatenate([p[i] for p in parts]) for i in range(9)]
    else:
        cols = [np.zeros(0, dtype=t) for t in (np.int32, np.int64, np.int64, np.int32, np.int32, np.int32, np.int64, np.int64,
                                               np.uint8)]
    if decoded.wrapped and len(parts) > 1:
        cols[0] = _renumber_tracks(tracks, cols[0])
    return Columns(track=cols[0], start_ns=cols[1], dur_ns=cols[2], name_id=cols[3], cat_id=cols[4],
                   task_type_id=cols[5], stream_arg=cols[6], correlation=cols[7], tracks=tracks.values,
                   names=names.values, cats=cats.values, task_types=ttypes.values, process_name=process_name,
                   process_label=process_label, thread_name=thread_name, flows=flow_arrays,
                   distributed_info=decoded.distributed_info, n_events=n_events, problem=cols[8])


def _read_metadata(meta: list[Event], process_name: dict, thread_name: dict, process_label: dict) -> None:
    """The process and thread names and process labels of 'M' events."""
    for e in meta:
        a = e.args
        if a is None:
            continue
        if e.name == "process_name" and a.name is not None:
            process_name[e.pid] = a.name
        elif e.name == "thread_name" and a.name is not None:
            thread_name[(e.pid, e.tid)] = a.name
        elif e.name == "process_labels" and a.labels is not None:
            process_label[e.pid] = a.labels


def _host_pids(process_name: dict, process_label: dict) -> set:
    return {pid for pid in set(process_name) | set(process_label)
            if _is_host_process(process_name.get(pid), process_label.get(pid))}


def _add_flows(flows: dict, f_cats, f_phs, f_ids, ts_all: np.ndarray, ts_problem: np.ndarray) -> None:
    """One slice's flow events (category, ph, id, ts in ns with its problem code) into ``flows``."""
    ids_all = flow_id_array(list(f_ids))
    key_ids = _Interner()
    kid = np.fromiter(map(key_ids.index.__getitem__, zip(f_cats, f_phs, strict=True)), dtype=np.int32,
                      count=len(f_cats))
    if ts_problem.any():  # a flow end that cannot be placed links nothing
        placed = ts_problem == 0
        ids_all, ts_all, kid = ids_all[placed], ts_all[placed], kid[placed]
    for k_i, key in enumerate(key_ids.values):
        sel = kid == k_i
        entry = flows.setdefault(key, ([], []))
        entry[0].append(ids_all[sel])
        entry[1].append(ts_all[sel])


@dataclass
class _Scanned:
    """One slice as the compiled scanner read it (loaders/_scan.c): the 'X' events' fields as arrays (names,
    categories and task types as ids into the file's scratch tables, in first-seen order over every 'X' event),
    the 'M' events decoded, the kept flow events' fields."""

    n_events: int
    n_x: int
    pid: np.ndarray
    tid: np.ndarray
    ts: bytes
    dur: np.ndarray
    dur_kind: np.ndarray  # 0 a float, 1 an integer, 2 absent or null, 3 an integer past 2**53 (dur: its int64 bits)
    name: np.ndarray
    cat: np.ndarray
    ttype: np.ndarray
    stream: np.ndarray
    corr: np.ndarray
    meta: list[Event]
    flow_cat: list[str]
    flow_ph: bytes
    flow_id: list
    flow_ts: bytes
    names: _Scratch  # the scratch tables (shared by every slice of the file, grown as slices are read)
    cats: _Scratch
    ttypes: _Scratch
    is_step: list[bool]  # per scratch name: a ProfilerStep#N range

    def __len__(self) -> int:  # the slicer counts events
        return self.n_events


class _Scratch:
    """A file's scratch table of one column (names, categories or task types) as the scanner fills it: the
    values (str or None) in first-seen order over every 'X' event, the scanner's lookup (bytes or None -> id), and
    the id each has in the columns' interner once a kept event used it (-1 before)."""

    __slots__ = ("values", "ids", "lut")

    def __init__(self) -> None:
        self.values: list = []
        self.ids: dict = {}
        self.lut = np.zeros(0, dtype=np.int32)

    def to_ids(self, interner: _Interner, sids: np.ndarray) -> np.ndarray:
        """Scratch ids -> the interner's ids, values new to it numbered in their first-seen order in ``sids`` (as
        :meth:`_Interner.ids` numbers them over the same values)."""
        if sids.size == 0:
            return np.zeros(0, dtype=np.int32)
        if self.lut.size < len(self.values):
            self.lut = np.concatenate([self.lut, np.full(len(self.values) - self.lut.size, -1, dtype=np.int32)])
        got = self.lut[sids]
        new = got < 0
        if new.any():
            u, first = np.unique(sids[new], return_index=True)
            order = u[np.argsort(first, kind="stable")]
            self.lut[order] = interner.ids([self.values[i] for i in order.tolist()])
            got = self.lut[sids]
        return got


def _make_scanner(flow_cats: frozenset[str], task_types: bool, kineto_args: bool) -> Scanner:
    """A scanner for one file: the compiled scan of a slice, with the file's scratch tables."""
    names, cats, ttypes = _Scratch(), _Scratch(), _Scratch()
    tables = ((names.values, names.ids), (cats.values, cats.ids), (ttypes.values, ttypes.ids))
    is_step: list[bool] = []
    fc = frozenset(flow_cats)

    def scanner(piece: bytes | memoryview) -> _Scanned | None:
        r = _scan.scan(piece, *tables, fc, task_types, kineto_args)
        if r is None:
            return None
        spans = np.frombuffer(r[12], dtype=np.int64).tolist()
        meta = [_event_decoder.decode(piece[spans[k]:spans[k + 1]]) for k in range(0, len(spans), 2)]
        is_step.extend(v.startswith("ProfilerStep#") for v in names.values[len(is_step):])
        return _Scanned(r[0], r[1], np.frombuffer(r[2], np.int64), np.frombuffer(r[3], np.int64), r[4],
                        np.frombuffer(r[5], np.float64), np.frombuffer(r[6], np.uint8), np.frombuffer(r[7], np.int32),
                        np.frombuffer(r[8], np.int32), np.frombuffer(r[9], np.int32), np.frombuffer(r[10], np.int64),
                        np.frombuffer(r[11], np.int64), meta, r[13], r[14], r[15], r[16], names, cats, ttypes,
                        is_step)

    return scanner


def _track_ids_arrays(tracks: _Interner, pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """:func:`_track_ids` for integer pid and tid arrays: the same ids (new pairs numbered in (pid, tid) order, or
    in first-seen order past the dense table's bound)."""
    up, pinv = np.unique(pid, return_inverse=True)
    ut, tinv = np.unique(tid, return_inverse=True)
    key = pinv.astype(np.int64) * len(ut) + tinv
    present, first, inv = np.unique(key, return_index=True, return_inverse=True)
    up_l, ut_l, nt = up.tolist(), ut.tolist(), len(ut)
    pairs = [(up_l[k // nt], ut_l[k % nt]) for k in present.tolist()]
    if len(up) * nt > (1 << 22):  # _track_ids interns the pairs as they come
        order = np.argsort(first, kind="stable")
        ids = np.zeros(len(pairs), dtype=np.int32)
        ids[order] = tracks.ids([pairs[i] for i in order.tolist()])
    else:
        ids = tracks.ids(pairs)
    return ids[inv.ravel()]


def _scanned_columns(c: _Scanned, path: Path, keep_host_x: bool, process_name: dict, process_label: dict,
                     tracks: _Interner, names: _Interner, cats: _Interner, ttypes: _Interner, task_types: bool,
                     kineto_args: bool, args_cats: frozenset[str] | None) -> tuple[np.ndarray, ...] | None:
    """The columns of a scanned slice's kept 'X' events, as the msgspec path builds them for the same events
    (None when none is kept)."""
    start, ts_problem = ts_joined_to_ns_checked(c.ts, c.n_x, path)
    pid, tid, name_s, cat_s, ttype_s, stream, corr = c.pid, c.tid, c.name, c.cat, c.ttype, c.stream, c.corr
    dur_v, dur_kind = c.dur, c.dur_kind
    keep = None
    if not keep_host_x:
        host = [p for p in _host_pids(process_name, process_label) if type(p) is int]
        if host:
            keep = ~np.isin(pid, host) | np.asarray(c.is_step, dtype=bool)[name_s]
            if keep.all():
                keep = None
    if keep is not None:
        pid, tid, name_s, cat_s = pid[keep], tid[keep], name_s[keep], cat_s[keep]
        start, ts_problem, dur_v, dur_kind = start[keep], ts_problem[keep], dur_v[keep], dur_kind[keep]
    # durations of the kept events only, as the msgspec path converts them (its choice of conversion depends on
    # the set of values: all numbers go through one array)
    if (dur_kind >= 2).any():  # a dur absent or null, or an integer past 2**53: the general conversion
        big = dur_v.view(np.int64).tolist()
        values = [d if k == 0 else int(d) if k == 1 else None if k == 2 else b
                  for d, k, b in zip(dur_v.tolist(), dur_kind.tolist(), big, strict=True)]
        dur, dur_problem = dur_to_ns_checked(values, path)
    else:  # as np.array() of the same numbers: int64 when every one is an integer, else float64
        dur, dur_problem = dur_array_to_ns_checked(dur_v.astype(np.int64) if (dur_kind == 1).all() else dur_v)
    if keep is not None:
        if task_types:
            ttype_s = ttype_s[keep]
        if kineto_args:
            stream, corr = stream[keep], corr[keep]
    n = pid.size
    if n == 0:
        return None
    track = _track_ids_arrays(tracks, pid, tid)
    problem = np.where(ts_problem != 0, ts_problem, dur_problem)
    name_id = c.names.to_ids(names, name_s)
    cat_id = c.cats.to_ids(cats, cat_s)
    if task_types:
        ttype = c.ttypes.to_ids(ttypes, ttype_s)
    else:
        ttype = np.zeros(n, dtype=np.int32) if ttypes.values else ttypes.ids([None] * n)
    if kineto_args:
        stream_arg, corr_arg = stream.copy(), corr.copy()
        if args_cats is not None:
            other = ~np.isin(cat_id, [i for i, v in enumerate(cats.values) if v in args_cats])
            stream_arg[other] = -1
            corr_arg[other] = -1
    else:
        stream_arg = corr_arg = np.full(n, -1, dtype=np.int64)
    return (track, start, dur, name_id, cat_id, ttype, stream_arg, corr_arg, problem)
