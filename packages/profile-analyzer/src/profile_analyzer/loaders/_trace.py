"""Fast decoding of Chrome-trace JSON (trace_view.json, msprof_*.json, Kineto) into columnar chunks.

Decoding uses msgspec typed structs that keep only the fields the analyses need; unknown keys are skipped
by the C decoder. A top-level JSON array (the Ascend files) is decoded in slices of about
``CHUNK_BYTES`` so that peak memory stays near the size of the file rather than several times it: the
file is cut after a ``}`` that is followed by ``,`` and ``{``; a cut that lands inside a nested value
makes the slice fail to decode and the next candidate is tried.
"""

from __future__ import annotations

import gc
import gzip
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import msgspec
import numpy as np

from profile_analyzer.errors import ProfileError

CHUNK_BYTES = 4 << 20


class Args(msgspec.Struct, gc=False):
    name: str | None = None
    labels: str | None = None
    task_type: str | None = msgspec.field(default=None, name="Task Type")
    stream_id: int | str | None = msgspec.field(default=None, name="Stream Id")
    physic_stream_id: int | str | None = msgspec.field(default=None, name="Physic Stream Id")
    stream: int | str | None = None
    correlation: int | str | None = None
    rank: int | str | None = None


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: str | int | float | None = None
    dur: float | int | str | None = 0.0
    cat: str | None = None
    id: int | str | None = None
    args: Args | None = msgspec.field(default_factory=Args)  # None only for an explicit "args": null


_PID = attrgetter("pid")
_TID = attrgetter("tid")
_TS = attrgetter("ts")
_DUR = attrgetter("dur")
_NAME = attrgetter("name")
_CAT = attrgetter("cat")
_ARGS = attrgetter("args")
_TTYPE = attrgetter("args.task_type")
_ID = attrgetter("id")
_FLOW_KEY = attrgetter("cat", "ph")
_FLOW_PH = frozenset({"s", "f", "t"})


class KinetoFile(msgspec.Struct):
    traceEvents: list[Event] = []
    distributedInfo: dict[str, object] | None = None
    deviceProperties: list[object] | None = None


_list_decoder = msgspec.json.Decoder(list[Event])
_kineto_decoder = msgspec.json.Decoder(KinetoFile)


@dataclass
class DecodedFile:
    """All events of one file, plus file-level metadata (Kineto ``distributedInfo``)."""

    chunks: Iterator[list[Event]]
    distributed_info: dict[str, object] | None
    wrapped: bool  # True for {"traceEvents": [...]} files


def read_bytes(path: Path) -> bytearray:
    """The whole file as a mutable buffer (the chunked decoder writes brackets into it in place)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return bytearray(f.read())
        size = path.stat().st_size
        buf = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf)
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        return buf if got == size else buf[:got]
    except FileNotFoundError:
        raise ProfileError(path, "file not found") from None
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None


_CUT = re.compile(rb"\}\s*,\s*\{")


def _decode_list(path: Path, data: bytes | memoryview) -> list[Event]:
    try:
        return _list_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProfileError(path, f"not a Chrome trace event list ({exc}); expected trace_view.json / msprof_*.json events") from None
    except msgspec.DecodeError as exc:
        raise ProfileError(path, f"truncated or invalid JSON ({exc}); expected a complete Chrome trace") from None


def _open_binary(path: Path):
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except FileNotFoundError:
        raise ProfileError(path, "file not found") from None
    except OSError as exc:
        raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None


_TAIL = 1 << 16


ByteProgress = Callable[[int, int, str], None]


def _stream_array_chunks(path: Path, on_bytes: ByteProgress | None = None) -> Iterator[list[Event]]:
    """Decode a top-level JSON array while reading it in ``CHUNK_BYTES`` blocks: memory stays at a few
    blocks whatever the file size. Each slice ends at a ``}`` followed by ``,`` and ``{`` near the end of the
    data read so far; the byte after that ``}`` is overwritten with ``]`` and the first byte of the slice
    with ``[`` for decoding. A cut inside a nested value fails to decode and an earlier one is tried."""
    f = _open_binary(path)
    try:
        size = path.stat().st_size if on_bytes is not None and path.suffix != ".gz" else 0
        done = 0
        carry = bytearray()
        started = False
        while True:
            try:
                block = f.read(CHUNK_BYTES)
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None
            if block:
                carry += block
                done += len(block)
                if size:
                    on_bytes(min(done, size), size, path.name)  # type: ignore[misc]
            if not started:
                stripped = carry.lstrip()
                if not stripped and block:
                    continue
                if not stripped.startswith(b"["):
                    raise ProfileError(path, "not a JSON array of trace events; expected trace_view.json / msprof_*.json")
                del carry[: len(carry) - len(stripped)]
                started = True
            if not block:  # end of file: the rest must close the array
                end = len(carry.rstrip())
                if end == 0 or carry[end - 1] != 0x5D:
                    raise ProfileError(path, "truncated JSON: the top-level array is not closed; expected a complete "
                                             "Chrome trace (JSON list of events)")
                carry[0] = 0x5B
                yield _decode_list(path, bytes(carry[:end]) if len(carry) > end else carry)
                return
            if len(carry) < CHUNK_BYTES:
                continue
            decoded = None
            cands = [m for m in _CUT.finditer(carry, max(1, len(carry) - _TAIL))]
            if not cands:  # an unusually long event at the end: look further back
                cands = [m for m in _CUT.finditer(carry, 1)]
            for m in reversed(cands[-8:]):
                close = m.start() + 1
                saved = carry[close]
                carry[0] = 0x5B
                carry[close] = 0x5D
                try:
                    with memoryview(carry) as view:
                        decoded = _list_decoder.decode(view[: close + 1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    decoded = None
                carry[close] = saved
                if decoded is not None:
                    del carry[: m.end() - 2]  # keep from the byte just before the next '{'
                    break
            if decoded is not None:
                yield decoded
    finally:
        f.close()


def decode_trace(path: Path, on_bytes: ByteProgress | None = None) -> DecodedFile:
    kind = peek_kind(path, strict=False)
    if kind == "list":
        return DecodedFile(_stream_array_chunks(path, on_bytes), None, False)
    if kind == "object":
        buf = read_bytes(path)
        try:
            f = _kineto_decoder.decode(buf)
        except msgspec.ValidationError as exc:
            raise ProfileError(path, f"not a trace: {exc}; expected a Chrome/Kineto trace with traceEvents") from None
        except msgspec.DecodeError as exc:
            raise ProfileError(path, f"truncated or invalid JSON ({exc}); expected a complete Chrome/Kineto trace") from None
        return DecodedFile(iter([f.traceEvents]), f.distributedInfo, True)
    if not path.exists():
        raise ProfileError(path, "file not found")
    raise ProfileError(path, "not JSON; expected a Chrome trace (trace_view.json, msprof_*.json or a Kineto trace)")


def peek_kind(path: Path, strict: bool = True) -> str:
    """'list' (Ascend style top-level array), 'object' (Kineto style), or 'other', from the first bytes.
    With ``strict`` an object must show a ``traceEvents`` key in its first 64 KiB to count as Kineto."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                head = f.read(1 << 16)
        else:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
    except (OSError, EOFError):
        return "other"
    head = head.lstrip()
    if head.startswith(b"["):
        return "list"
    if head.startswith(b"{"):
        return "object" if (b'"traceEvents"' in head or not strict) else "other"
    return "other"


# ---------------------------------------------------------------------------------------------------
# timestamps

_POW10 = 10 ** np.arange(19, dtype=np.int64)


def parse_decimal_us_to_ns(values: np.ndarray) -> np.ndarray:
    """Exact decimal µs strings (bytes array, dtype S) -> int64 ns, vectorised column by column.

    ``"1704161511422904.204"`` -> 1704161511422904204. Digits beyond the third decimal are rounded;
    surrounding whitespace/tabs are ignored.
    """
    n = values.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    width = values.dtype.itemsize
    u = np.ascontiguousarray(values).view(np.uint8).reshape(n, width)
    fast = _parse_fixed_format(u)
    if fast is not None:
        return fast
    dot = u == 46
    has_dot = dot.any(axis=1)
    dotpos = np.where(has_dot, dot.argmax(axis=1), width)
    neg = (u == 45).any(axis=1)
    acc = np.zeros(n, dtype=np.int64)
    frac = np.zeros(n, dtype=np.int64)
    round_up = np.zeros(n, dtype=bool)
    for j in range(width):
        c = u[:, j].astype(np.int64) - 48
        isd = (c >= 0) & (c <= 9)
        in_int = isd & (j < dotpos)
        acc = np.where(in_int, acc * 10 + c, acc)
        k = j - dotpos
        in_frac = isd & (k >= 1) & (k <= 3)
        frac += np.where(in_frac, c * _POW10[np.clip(3 - k, 0, 18)], 0)
        round_up |= isd & (k == 4) & (c >= 5)
    ns = acc * 1000 + frac + round_up
    return np.where(neg, -ns, ns)


def _parse_fixed_format(u: np.ndarray) -> np.ndarray | None:
    """Fast path for the usual case: every value has the same width, all digits, with the dot at the same
    place and 1 to 3 decimals (``"1704161511422904.204"``). None when that does not hold."""
    n, width = u.shape
    dot = int(np.argmax(u[0] == 46)) if (u[0] == 46).any() else -1
    if dot <= 0 or not 1 <= width - dot - 1 <= 3 or dot > 18:
        return None
    if not (u[:, dot] == 46).all():
        return None
    digits = np.delete(u, dot, axis=1).astype(np.int64) - 48
    if ((digits < 0) | (digits > 9)).any():
        return None
    frac_digits = width - dot - 1
    weights = _POW10[::-1][-(width - 1):] if width - 1 <= 19 else None
    if weights is None:
        return None
    return (digits @ weights) * int(_POW10[3 - frac_digits])


def to_ns(values: list[object], path: Path | None = None) -> np.ndarray:
    """A list of ts/dur values in µs (str, int or float, possibly mixed) -> int64 ns."""
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    first = values[0]
    if isinstance(first, str):
        # numbers among strings become their repr, which parses the same; None becomes b"None" -> 0
        try:
            return parse_decimal_us_to_ns(np.array(values, dtype="S"))
        except (UnicodeEncodeError, ValueError):
            pass
    if not isinstance(first, str):
        try:
            arr = np.array(values)
        except (TypeError, ValueError):
            arr = None
        if arr is not None and arr.ndim == 1:
            if arr.dtype == np.float64:
                return np.rint(arr * 1000.0).astype(np.int64)
            if arr.dtype == np.int64:
                return arr * 1000
    out = np.zeros(n, dtype=np.int64)
    is_str = np.fromiter((type(v) is str for v in values), dtype=bool, count=n)
    if is_str.any():
        idx = np.flatnonzero(is_str)
        out[idx] = parse_decimal_us_to_ns(np.array([values[i] for i in idx], dtype="S"))
    rest = np.flatnonzero(~is_str)
    if rest.size:
        try:
            nums = np.array([values[i] if values[i] is not None else 0 for i in rest], dtype=np.float64)
        except (TypeError, ValueError):
            raise ProfileError(path or "<trace>", "non-numeric ts/dur values; expected µs numbers or decimal strings") from None
        ints = np.array([type(values[i]) is int for i in rest], dtype=bool)
        vals = np.where(ints, 0, np.rint(nums * 1000.0)).astype(np.int64)
        if ints.any():
            ii = rest[ints]
            vals[ints] = np.array([values[i] for i in ii], dtype=np.int64) * 1000
        out[rest] = vals
    return out


# ---------------------------------------------------------------------------------------------------
# columnar form of complete ('X') events, metadata and flows


class _Interner:
    def __init__(self) -> None:
        self.index: dict[object, int] = {}
        self.values: list = []

    def ids(self, items: list) -> np.ndarray:
        d = self.index
        for k in dict.fromkeys(items):  # unique values in first-seen order, at C speed
            if k not in d:
                d[k] = len(self.values)
                self.values.append(k)
        return np.fromiter(map(d.__getitem__, items), dtype=np.int32, count=len(items))


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


def _track_ids(tracks: _Interner, pids: list, tids: list) -> np.ndarray:
    """Per-event index of its (pid, tid) pair, with numpy doing the per-event work when ids are integers."""
    try:
        pa = np.array(pids)
        ta = np.array(tids)
        if pa.dtype.kind not in "iu" or ta.dtype.kind not in "iu" or pa.ndim != 1 or ta.ndim != 1:
            raise TypeError
    except (TypeError, ValueError, OverflowError):
        return tracks.ids(list(zip(pids, tids, strict=False)))
    up, pinv = np.unique(pa, return_inverse=True)
    ut, tinv = np.unique(ta, return_inverse=True)
    key = pinv.astype(np.int64) * ut.size + tinv
    uk, kinv = np.unique(key, return_inverse=True)
    pairs = [(int(up[k // ut.size]), int(ut[k % ut.size])) for k in uk.tolist()]
    return tracks.ids(pairs)[kinv]


def flow_id_array(ids: list[object]) -> np.ndarray:
    """Flow ids as int64 when they all are integers that fit, else as strings."""
    try:
        a = np.array(ids)
    except (OverflowError, ValueError):
        a = None
    if a is None or a.dtype.kind not in "iu" or a.dtype == np.uint64:
        return np.array([str(i) for i in ids])
    return a.astype(np.int64)


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


def _int_or(v: object, default: int) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return default
    return default


def columnarise(path: Path, flow_cats: frozenset[str] = frozenset({"async_npu", "ac2g", "HostToDevice"}),
                kineto_args: bool = True, keep_host_x: bool = True, on_bytes: ByteProgress | None = None) -> Columns:
    """All 'X' events of a trace file as columns. With ``keep_host_x=False``, 'X' events of processes already
    known (from metadata seen earlier in the file) to be CPU-side are dropped on the fly, except the
    ``ProfilerStep#N`` ranges; events of processes not yet named are always kept."""
    # millions of short-lived tuples and lists: the cyclic GC would rescan them over and over
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _columnarise(path, flow_cats, kineto_args, keep_host_x, on_bytes)
    finally:
        if enabled:
            gc.enable()


def _is_host_process(name: str | None, label: str | None) -> bool:
    return (label or "").startswith("CPU") or (name or "").startswith(("Python", "CANN"))


def _columnarise(path: Path, flow_cats: frozenset[str], kineto_args: bool, keep_host_x: bool,
                 on_bytes: ByteProgress | None) -> Columns:
    decoded = decode_trace(path, on_bytes)
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
        n_events += len(chunk)
        xs = [e for e in chunk if e.ph == "X"]
        others = [e for e in chunk if e.ph != "X"]
        del chunk
        for e in [e for e in others if e.ph == "M"]:
            a = e.args
            if a is None:
                continue
            if e.name == "process_name" and a.name is not None:
                process_name[e.pid] = a.name
            elif e.name == "thread_name" and a.name is not None:
                thread_name[(e.pid, e.tid)] = a.name
            elif e.name == "process_labels" and a.labels is not None:
                process_label[e.pid] = a.labels
        flow_evs = [e for e in others if e.cat in flow_cats and e.ph in _FLOW_PH and e.ts is not None]
        del others
        if flow_evs:
            keys = list(map(_FLOW_KEY, flow_evs))
            ids_all = flow_id_array(list(map(_ID, flow_evs)))
            ts_all = to_ns(list(map(_TS, flow_evs)), path)
            key_ids = _Interner()
            kid = key_ids.ids(keys)
            for k_i, key in enumerate(key_ids.values):
                sel = kid == k_i
                entry = flows.setdefault(key, ([], []))
                entry[0].append(ids_all[sel])
                entry[1].append(ts_all[sel])
        del flow_evs
        if not keep_host_x and xs:
            host_pids = {pid for pid in set(process_name) | set(process_label)
                         if _is_host_process(process_name.get(pid), process_label.get(pid))}
            if host_pids:
                xs = [e for e in xs if e.pid not in host_pids or e.name.startswith("ProfilerStep#")]
        if not xs:
            continue
        track = _track_ids(tracks, list(map(_PID, xs)), list(map(_TID, xs)))
        start = to_ns(list(map(_TS, xs)), path)
        dur = to_ns(list(map(_DUR, xs)), path)
        name_id = names.ids(list(map(_NAME, xs)))
        cat_id = cats.ids(list(map(_CAT, xs)))
        try:
            ttype = ttypes.ids(list(map(_TTYPE, xs)))
        except AttributeError:  # some event has "args": null
            ttype = ttypes.ids([e.args.task_type if e.args is not None else None for e in xs])
        argl = list(map(_ARGS, xs)) if kineto_args else []
        if kineto_args:
            stream_arg = np.fromiter(
                (_int_or(a.stream, -1) if a is not None and a.stream is not None else -1 for a in argl), dtype=np.int64,
                count=len(xs))
            corr = np.fromiter(
                (_int_or(a.correlation, -1) if a is not None and a.correlation is not None else -1 for a in argl),
                dtype=np.int64, count=len(xs))
        else:
            stream_arg = corr = np.full(len(xs), -1, dtype=np.int64)
        parts.append((track, start, dur, name_id, cat_id, ttype, stream_arg, corr))
        del xs, argl
    flow_arrays = {k: (concat_ids(v[0]), np.concatenate(v[1])) for k, v in flows.items()}
    if parts:
        cols = [np.concatenate([p[i] for p in parts]) for i in range(8)]
    else:
        cols = [np.zeros(0, dtype=t) for t in (np.int32, np.int64, np.int64, np.int32, np.int32, np.int32, np.int64, np.int64)]
    return Columns(track=cols[0], start_ns=cols[1], dur_ns=cols[2], name_id=cols[3], cat_id=cols[4],
                   task_type_id=cols[5], stream_arg=cols[6], correlation=cols[7], tracks=tracks.values,
                   names=names.values, cats=cats.values, task_types=ttypes.values, process_name=process_name,
                   process_label=process_label, thread_name=thread_name, flows=flow_arrays,
                   distributed_info=decoded.distributed_info, n_events=n_events)
