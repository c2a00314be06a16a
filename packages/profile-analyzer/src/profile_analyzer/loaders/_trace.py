"""Fast decoding of Chrome-trace JSON (trace_view.json, msprof_*.json, Kineto) into columnar chunks.

Decoding uses msgspec typed structs that keep only the fields the analyses need; unknown keys are skipped
by the C decoder. A top-level JSON array (the Ascend files) and the ``traceEvents`` array of a Kineto
object (``{"traceEvents": [...], ...}``) are decoded in slices of about ``CHUNK_BYTES`` so that peak
memory stays near the size of the file rather than several times it: the array is cut after a ``}`` that
is followed by ``,`` and ``{``; a cut that lands inside a nested value makes the slice fail to decode and
the next candidate is tried. The rest of a Kineto object (its other keys, before or after the array) is
decoded on its own with the array left empty.
"""

from __future__ import annotations

import gc
import gzip
import mmap
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import msgspec
import numpy as np

from profile_analyzer.errors import ProfileError

CHUNK_BYTES = 1 << 20  # 1 MiB: measured faster than 4 MiB (the slice's objects stay in cache) and a smaller peak


class Args(msgspec.Struct, gc=False, frozen=True):
    name: str | None = None
    labels: str | None = None
    task_type: str | None = msgspec.field(default=None, name="Task Type")
    stream_id: int | str | None = msgspec.field(default=None, name="Stream Id")
    physic_stream_id: int | str | None = msgspec.field(default=None, name="Physic Stream Id")
    stream: int | str | None = None
    correlation: int | str | None = None
    rank: int | str | None = None


_NO_ARGS = Args()


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: msgspec.Raw = msgspec.Raw(b"")  # the JSON text itself: numbers are parsed exactly (see raw_us_to_ns)
    dur: float | int | str | None = None  # None: absent (an 'X' event without dur cannot be placed)
    cat: str | None = None
    id: int | str | None = None
    args: Args | None = _NO_ARGS  # one shared instance, not one per event; None only for an explicit "args": null


_TS = attrgetter("ts")
_ID = attrgetter("id")
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
    distributed_info: dict[str, object] | None  # of a Kineto file: set once ``chunks`` is exhausted
    wrapped: bool  # True for {"traceEvents": [...]} files


def read_bytes(path: Path) -> bytes:
    """The whole file, as immutable bytes (the decoded ``msgspec.Raw`` ts values point into it)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb", buffering=0) as f:
            return f.read()
    except FileNotFoundError:
        raise ProfileError(path, "file not found") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None


# A cut between two events: '}' ',' '{' with at most _GAP blanks on each side (pretty printers indent by a
# few). The bound keeps every match attempt short, so the search never walks a long run of blanks twice.
_GAP = 256
_CUT = re.compile(rb"\}[ \t\r\n]{0,%d},[ \t\r\n]{0,%d}\{" % (_GAP, _GAP))
_CUT_SPAN = 2 * _GAP + 3  # the longest match: a '}' further back than this cannot start an unfinished cut


def _decode_list(path: Path, data: bytes | memoryview, kineto: bool = False, first: int = 0) -> list[Event]:
    """One slice; ``first``: how many events of the file came before it (for the position in messages)."""
    try:
        return _list_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _bad_event(path, exc, kineto, first) from None
    except msgspec.DecodeError as exc:
        if kineto:
            raise _bad_kineto_json(path, exc) from None
        raise ProfileError(path, f"truncated or invalid JSON ({exc}); expected a complete Chrome trace") from None


_AT_INDEX = re.compile(r"`\$\[(\d+)\]")


def _bad_event(path: Path, exc: msgspec.ValidationError, kineto: bool, first: int) -> ProfileError:
    """An event of a slice that is not a trace event, named by its position in the file."""
    where = "$.traceEvents[" if kineto else "$["
    msg = _AT_INDEX.sub(lambda m: f"`{where}{first + int(m.group(1))}]", str(exc))
    if kineto:
        return _not_kineto(path, msg)
    return ProfileError(path, f"not a Chrome trace event list ({msg}); expected trace_view.json / msprof_*.json events")


def _not_kineto(path: Path, exc: Exception | str) -> ProfileError:
    return ProfileError(path, f"not a trace: {exc}; expected a Chrome/Kineto trace with traceEvents")


def _bad_kineto_json(path: Path, exc: Exception | str) -> ProfileError:
    return ProfileError(path, f"truncated or invalid JSON ({exc}); expected a complete Chrome/Kineto trace")


# Locating the traceEvents array of a Kineto object. The object's tokens are walked from its '{': strings
# whole (so a "traceEvents" inside a string, or a bracket inside one, is skipped), brackets counted (so a
# "traceEvents" key of a nested object is not at depth 1). Only the part before the array is walked.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"', re.S)
_EVENTS_KEY = b'"traceEvents"'
_HEAD_LIMIT = 8 << 20  # the array must start within this many bytes, else the whole file is decoded at once
_MORE = -1


_NON_WS = re.compile(rb"[^ \t\r\n]")


def _skip_ws(buf: bytes | bytearray | mmap.mmap, i: int, end: int) -> int:
    """Index of the first non-blank byte of ``buf[i:end]`` (``end`` when there is none), at C speed: a
    gigabyte of blanks is not walked byte by byte."""
    m = _NON_WS.search(buf, i, end)
    return m.start() if m else end


def _last_non_ws(buf: bytes | bytearray | mmap.mmap, lo: int, end: int) -> int:
    """Index of the last non-blank byte of ``buf[lo:end]``, ``lo - 1`` when there is none; reads backwards
    in blocks."""
    while end > lo:
        start = max(lo, end - (1 << 16))
        block = bytes(buf[start:end])
        stripped = len(block.rstrip(_WS))
        if stripped:
            return start + stripped - 1
        end = start
    return lo - 1


def _events_array_start(buf: bytes | bytearray | mmap.mmap, start: int, end: int) -> int | None:
    """Index of the ``[`` that opens the value of the top-level ``"traceEvents"`` key of the object whose
    ``{`` is at ``start``; ``None`` when the object has no such array (no such key, or its value is not an
    array); ``_MORE`` when ``buf[start:end]`` ends before that is known."""
    depth = 0
    for m in _TOKEN.finditer(buf, start, end):
        a, b = m.span()
        c = buf[a]
        if c == 0x22:  # '"'
            if b - a == 1:
                return _MORE  # a string not closed within the window
            if depth == 1 and b - a == len(_EVENTS_KEY) and buf[a:b] == _EVENTS_KEY:
                j = _skip_ws(buf, b, end)
                if j == end:
                    return _MORE
                if buf[j] != 0x3A:  # not followed by ':': a string value "traceEvents", not a key
                    continue
                j = _skip_ws(buf, j + 1, end)
                if j == end:
                    return _MORE
                return j if buf[j] == 0x5B else None
        elif c in (0x7B, 0x5B):
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return None  # the object closed without a top-level traceEvents array
    return _MORE


def _kineto_prefix_ok(prefix: bytes) -> bool:
    """The part of the object before the array (ending with its ``[``), closed right after, decodes."""
    try:
        _kineto_decoder.decode(prefix + b"]}")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


def _decode_kineto(path: Path, data: bytes) -> KinetoFile:
    try:
        return _kineto_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _not_kineto(path, exc) from None
    except msgspec.DecodeError as exc:
        raise _bad_kineto_json(path, exc) from None


def _kineto_rest(path: Path, out: DecodedFile, prefix: bytes, suffix: bytes | memoryview) -> None:
    """Decode the object without the array's contents (``prefix`` ends with its ``[``, ``suffix`` starts
    with its ``]``) and take the file-level metadata from it."""
    out.distributed_info = _decode_kineto(path, prefix + bytes(suffix)).distributedInfo


def _whole_object(path: Path, out: DecodedFile) -> Iterator[list[Event]]:
    """A Kineto object decoded at once: for files whose traceEvents array could not be located as above."""
    f = _decode_kineto(path, read_bytes(path))  # the ts values keep what they need of the bytes alive
    out.distributed_info = f.distributedInfo
    yield f.traceEvents


_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")


def _list_end(exc: msgspec.DecodeError, data: bytes | bytearray | memoryview) -> int | None:
    """When decoding ``data`` (a list) failed on bytes after the complete list: the index of the list's
    closing ``]``. msgspec reports the offset just past the first such byte."""
    m = _TRAILING.search(str(exc))
    if m is None:
        return None
    i = int(m.group(1)) - 2  # the byte before the first trailing one
    while i > 0 and data[i] in _WS:
        i -= 1
    return i if i > 0 and data[i] == 0x5D else None


def _open_binary(path: Path):
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except FileNotFoundError:
        raise ProfileError(path, "file not found") from None
    except OSError as exc:
        raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None


_TAIL = 1 << 16
_NEAR = 1 << 12
_TRIED = 8  # cuts tried per slice, the last first


def _last_cuts(buf: bytes | bytearray | mmap.mmap, lo: int, hi: int) -> list[re.Match]:
    """The last ``_TRIED`` cuts in ``buf[lo:hi]``: those of its last 64 KiB (all of it when that holds none). The last
    4 KiB are searched first: when they hold ``_TRIED`` cuts (the usual case) they are the same ones, found without
    scanning the rest."""
    near = list(_CUT.finditer(buf, max(lo, hi - _NEAR), hi))
    if len(near) >= _TRIED:
        # cuts cannot overlap (inside one there is no '}'), so a scan from a later start finds exactly the cuts
        # that begin there or later
        return near[-_TRIED:]
    cands = list(_CUT.finditer(buf, max(lo, hi - _TAIL), hi))
    if not cands:  # an unusually long event at the end: look further back
        cands = list(_CUT.finditer(buf, lo, hi))
    return cands[-_TRIED:]


ByteProgress = Callable[[int, int, str], None]


def _stream_array_chunks(path: Path, on_bytes: ByteProgress | None = None,
                         out: DecodedFile | None = None) -> Iterator[list[Event]]:
    """Decode a top-level JSON array while reading it in ``CHUNK_BYTES`` blocks: memory stays at a few
    blocks whatever the file size. Each slice ends at a ``}`` followed by ``,`` and ``{`` near the end of the
    data read so far; the byte after that ``}`` is overwritten with ``]`` and the first byte of the slice
    with ``[`` for decoding. A cut inside a nested value fails to decode and an earlier one is tried.

    With ``out`` the file is a Kineto object: the ``traceEvents`` array is streamed the same way, the
    array's end is where msgspec reports bytes after a complete list, and the rest of the object is decoded
    at the end into ``out.distributed_info``."""
    f = _open_binary(path)
    try:
        size = path.stat().st_size if on_bytes is not None and path.suffix != ".gz" else 0
        done = 0
        carry = bytearray()
        started = False
        prefix = b""  # Kineto: the object up to and including the array's '['
        last = -1  # Kineto: index in carry of the array's ']' once it is known
        n_done = 0  # events decoded so far
        scan_from = 1  # index in carry where the search for cuts starts
        while True:
            try:
                block = f.read(CHUNK_BYTES)
            except (OSError, EOFError, zlib.error) as exc:
                raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None
            if block:
                carry += block
                done += len(block)
                if size:
                    on_bytes(min(done, size), size, path.name)  # type: ignore[misc]
            if not started:
                stripped = carry.lstrip()
                if not stripped and block:
                    carry.clear()  # only blanks so far: keep nothing, so that each block is looked at once
                    continue
                if out is None:
                    if not stripped.startswith(b"["):
                        raise ProfileError(path, "not a JSON array of trace events; expected trace_view.json / msprof_*.json")
                    del carry[: len(carry) - len(stripped)]
                else:
                    del carry[: len(carry) - len(stripped)]
                    arr = _events_array_start(carry, 0, len(carry)) if carry.startswith(b"{") else None
                    if arr == _MORE and block and len(carry) < _HEAD_LIMIT:
                        continue
                    if arr is None or arr == _MORE or not _kineto_prefix_ok(bytes(carry[: arr + 1])):
                        # no top-level traceEvents array found near the start: decode the file at once
                        f.close()
                        yield from _whole_object(path, out)
                        return
                    prefix = bytes(carry[: arr + 1])
                    del carry[:arr]  # carry[0] is the array's '['
                started = True
            if last >= 0 and block:
                continue  # Kineto: the array has ended, the rest of the object is being read
            if not block:  # end of file: the rest must close the array
                if out is not None:
                    carry[0] = 0x5B
                    if last < 0:
                        last = _kineto_array_end(path, bytes(carry), 0, n_done)
                    yield _decode_list(path, bytes(carry[: last + 1]), True, n_done)
                    _kineto_rest(path, out, prefix, carry[last:])
                    return
                end = len(carry.rstrip())
                if end == 0 or carry[end - 1] != 0x5D:
                    raise ProfileError(path, "truncated JSON: the top-level array is not closed; expected a complete "
                                             "Chrome trace (JSON list of events)")
                carry[0] = 0x5B
                yield _decode_list(path, bytes(carry[:end]), False, n_done)
                return
            if len(carry) < CHUNK_BYTES:
                continue
            decoded = None
            # cuts before scan_from were tried in an earlier round and failed (the same bytes fail again):
            # never scanning them twice keeps a long stretch without cuts (1 GiB of blanks) linear
            cands = _last_cuts(carry, scan_from, len(carry))
            for m in reversed(cands):
                close = m.start() + 1
                saved = carry[close]
                carry[0] = 0x5B
                carry[close] = 0x5D
                try:
                    # a bytes copy: the msgspec.Raw ts values keep it alive, and carry stays resizable
                    with memoryview(carry) as view:
                        piece = bytes(view[: close + 1])
                    decoded = _list_decoder.decode(piece)
                except msgspec.ValidationError as exc:  # an event that is not one, whatever the cut
                    raise _bad_event(path, exc, out is not None, n_done) from None
                except msgspec.DecodeError as exc:
                    decoded = None
                    at = _list_end(exc, carry) if out is not None else None
                    if at is not None:  # Kineto: the array ended before this cut
                        carry[close] = saved
                        last = at
                        break
                carry[close] = saved
                if decoded is not None:
                    del carry[: m.end() - 2]  # keep from the byte just before the next '{'
                    break
            if decoded is not None:
                scan_from = 1
                n_done += len(decoded)
                yield decoded
            elif last < 0:  # only a cut within the last _CUT_SPAN bytes can still complete
                scan_from = max(scan_from, len(carry) - _CUT_SPAN)
    finally:
        f.close()


def _kineto_array_end(path: Path, data: bytes | memoryview, base: int, first: int) -> int:
    """Index (``base`` + offset) of the ``]`` that closes the array starting at ``data[0]``, which the
    rest of the object follows: msgspec reports where the bytes after the complete list begin."""
    try:
        _list_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _bad_event(path, exc, True, first) from None
    except msgspec.DecodeError as exc:
        at = _list_end(exc, data)
        if at is None:
            raise _bad_kineto_json(path, exc) from None
        return base + at
    raise _bad_kineto_json(path, "the top-level object is not closed")


_WS = b" \t\r\n"


def _mapped_array_chunks(path: Path, on_bytes: ByteProgress | None = None,
                         out: DecodedFile | None = None) -> Iterator[list[Event]]:
    """Like :func:`_stream_array_chunks`, for an uncompressed file, without copying it: the file is mapped
    copy-on-write (the brackets written at the cuts never reach the file) and each slice is decoded straight
    from the mapping. Pages already decoded are handed back (``MADV_DONTNEED``) so resident memory stays at
    about one slice; a private mapping re-reads such a page from the file if it is touched again.

    With ``out`` the file is a Kineto object: its ``traceEvents`` array is decoded in slices the same way
    (its end is found where msgspec reports bytes after a complete list), then the rest of the object."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise ProfileError(path, "empty file; expected a Chrome trace (JSON list of events)")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise ProfileError(path, "file not found") from None
    except OSError as exc:
        raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None
    view = memoryview(mm)
    can_drop = hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED")
    kineto = out is not None
    try:
        lo = _skip_ws(mm, 0, size)
        prefix = b""
        last: int | None
        if not kineto:
            if lo == size or mm[lo] != 0x5B:
                raise ProfileError(path, "not a JSON array of trace events; expected trace_view.json / msprof_*.json")
            last = max(_last_non_ws(mm, lo, size), lo)
            if last == lo or mm[last] != 0x5D:
                raise ProfileError(path, "truncated JSON: the top-level array is not closed; expected a complete "
                                         "Chrome trace (JSON list of events)")
        else:
            arr = _events_array_start(mm, lo, min(size, lo + _HEAD_LIMIT)) if lo < size and mm[lo] == 0x7B else None
            if arr is None or arr == _MORE or not _kineto_prefix_ok(mm[lo: arr + 1]):
                # no top-level traceEvents array found near the start: decode the file at once
                yield from _whole_object(path, out)  # type: ignore[arg-type]
                return
            prefix = mm[lo: arr + 1]
            lo = arr
            last = None  # found when a decode runs past the array's end
        dropped = 0
        reach = CHUNK_BYTES
        scan_from = 0
        n_done = 0  # events decoded so far
        while True:
            if (size if last is None else last + 1) - lo <= reach + (reach >> 2):  # the rest, up to the closing bracket
                mm[lo] = 0x5B
                if last is None:
                    last = _kineto_array_end(path, view[lo:], lo, n_done)
                yield _decode_list(path, view[lo: last + 1], kineto, n_done)
                if kineto:
                    _kineto_rest(path, out, prefix, view[last:])  # type: ignore[arg-type]
                if on_bytes is not None:
                    on_bytes(size, size, path.name)
                return
            target = lo + reach
            first = max(lo + 1, scan_from)  # cuts before it failed in an earlier round (see the gzip reader)
            cands = _last_cuts(mm, first, target)
            decoded = None
            mm[lo] = 0x5B
            for m in reversed(cands):
                close = m.start() + 1
                saved = mm[close]
                mm[close] = 0x5D
                try:
                    decoded = _list_decoder.decode(view[lo: close + 1])
                except msgspec.ValidationError as exc:  # an event that is not one, whatever the cut
                    raise _bad_event(path, exc, kineto, n_done) from None
                except msgspec.DecodeError as exc:
                    decoded = None
                    at = _list_end(exc, view[lo: close + 1]) if kineto else None
                    if at is not None:  # Kineto: the array ended before this cut
                        mm[close] = saved
                        last = lo + at
                        break
                mm[close] = saved
                if decoded is not None:
                    lo = m.end() - 2  # the byte just before the next '{'
                    break
            if decoded is None:
                if last is None or last >= lo + reach:  # no usable cut in this stretch: take a longer one
                    scan_from = max(scan_from, target - _CUT_SPAN)
                    reach += CHUNK_BYTES
                continue  # else the Kineto array's end was found in it: the rest is its last slice
            reach = CHUNK_BYTES
            n_done += len(decoded)
            yield decoded
            del decoded
            if on_bytes is not None:
                on_bytes(lo, size, path.name)
            page_end = (lo // mmap.PAGESIZE) * mmap.PAGESIZE
            if can_drop and page_end > dropped:
                mm.madvise(mmap.MADV_DONTNEED, dropped, page_end - dropped)
                dropped = page_end
    finally:
        try:
            view.release()
            mm.close()
        except BufferError:  # decoded values still point into it: it closes when they go
            pass


def decode_trace(path: Path, on_bytes: ByteProgress | None = None) -> DecodedFile:
    """The events of a trace file in slices. For a Kineto object ``distributed_info`` is filled in once
    ``chunks`` has been consumed (the rest of the object is decoded after the array)."""
    return _decode(path, on_bytes, whole_objects=False)


def decode_whole(path: Path, on_bytes: ByteProgress | None = None) -> DecodedFile:
    """Like :func:`decode_trace`, but a Kineto object is decoded at once (the reference the streamed decode
    is compared with; also what the streamed decode falls back to)."""
    return _decode(path, on_bytes, whole_objects=True)


def _decode(path: Path, on_bytes: ByteProgress | None, whole_objects: bool) -> DecodedFile:
    kind = peek_kind(path, strict=False)
    if kind == "list":
        chunks = _stream_array_chunks(path, on_bytes) if path.suffix == ".gz" else _mapped_array_chunks(path, on_bytes)
        return DecodedFile(chunks, None, False)
    if kind == "object":
        out = DecodedFile(iter(()), None, True)
        if whole_objects:
            out.chunks = _whole_object(path, out)
        elif path.suffix == ".gz":
            out.chunks = _stream_array_chunks(path, on_bytes, out)
        else:
            out.chunks = _mapped_array_chunks(path, on_bytes, out)
        return out
    if not path.exists():
        raise ProfileError(path, "file not found")
    raise ProfileError(path, "not JSON; expected a Chrome trace (trace_view.json, msprof_*.json or a Kineto trace)")


def peek_kind(path: Path, strict: bool = True) -> str:
    """'list' (Ascend style top-level array), 'object' (Kineto style), or 'other', from the first bytes.
    With ``strict`` an object must show a ``traceEvents`` key in its first 64 KiB to count as Kineto; one
    that does not is 'object_without_events'. A file that cannot be read (no permission, a corrupt or
    truncated gzip) raises ProfileError saying so."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                head = f.read(1 << 16)
        else:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
    except FileNotFoundError:
        return "other"
    except (OSError, EOFError, zlib.error) as exc:
        raise ProfileError(path, _read_problem(path, exc)) from None
    head = head.lstrip()
    if head.startswith(b"["):
        return "list"
    if head.startswith(b"{"):
        if b'"traceEvents"' in head or not strict:
            return "object"
        return "object_without_events"
    return "other"


def _read_problem(path: Path, exc: BaseException) -> str:
    """Why a file could not be read, as the tail of a one-line message."""
    if isinstance(exc, zlib.error | EOFError | gzip.BadGzipFile):
        return (f"not a complete gzip file ({exc.__class__.__name__}: {exc}); expected a .json.gz written whole "
                "by the profiler")
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    return f"cannot be read ({exc.__class__.__name__}: {exc})"


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
    if dot <= 0 or not 1 <= width - dot - 1 <= 3 or dot > _MAX_INT_DIGITS or width - 1 > 19:
        return None
    if dot == _MAX_INT_DIGITS and (u[:, 0] > ord("8")).any():  # 9e15 µs and more do not fit int64 ns
        return None
    if not (u[:, dot] == 46).all():
        return None
    d = u - np.uint8(48)  # digits as 0..9; anything else wraps to > 9
    d[:, dot] = 0
    if (d > 9).any():
        return None
    acc = np.zeros(n, dtype=np.int64)
    for j in range(width):  # one column at a time: no n x width int64 temporaries
        if j != dot:
            acc *= 10
            acc += d[:, j]
    return acc * int(_POW10[3 - (width - dot - 1)])


# Why an 'X' event cannot be placed on the timeline (0: it can). The loaders turn these into an error for a
# device task the breakdown needs, else into a skipped-events warning (docs/profile-analysis.md, "Events that
# cannot be placed").
OK, NO_TS, BAD_TS, NO_DUR, NEGATIVE_DUR, BAD_DUR = range(6)
PROBLEMS = {NO_TS: "without ts", BAD_TS: "with a ts that is not a number in range",
            NO_DUR: "without dur", NEGATIVE_DUR: "with a negative dur",
            BAD_DUR: "with a dur that is not a number in range"}
# |value| below 9e15 µs (285 years) fits int64 ns with room; 16 integer digits at most, the first below 9
_LIMIT_US = 9e15
_MAX_INT_DIGITS = 16
_NUMBER_BYTES = np.zeros(256, dtype=bool)
_NUMBER_BYTES[list(b'0123456789.-+eE" \t\n\x00')] = True


def _decimal_ok(u: np.ndarray) -> np.ndarray:
    """Per row of a fixed-width byte matrix (NUL padded): True when it reads as a decimal number in range
    (digits, one optional sign and dot, surrounding quotes or blanks; no other byte)."""
    n, width = u.shape
    if n == 0:
        return np.zeros(0, dtype=bool)
    only_number = _NUMBER_BYTES[u].all(axis=1)
    isd = (u >= 48) & (u <= 57)
    dot = u == 46
    dotpos = np.where(dot.any(axis=1), dot.argmax(axis=1), width)
    int_digits = (isd & (np.arange(width)[None, :] < dotpos[:, None])).sum(axis=1)
    first = np.where(isd.any(axis=1), u[np.arange(n), isd.argmax(axis=1)], 48)
    in_range = (int_digits < _MAX_INT_DIGITS) | ((int_digits == _MAX_INT_DIGITS) & (first <= ord("8")))
    return only_number & isd.any(axis=1) & in_range


def dur_to_ns_checked(values: list[object], path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Durations in µs (numbers, decimal strings or None) -> (int64 ns, problem code per value).

    A value that is absent, not a number, not finite, 9e15 µs or more, or negative gets a code (NO_DUR,
    BAD_DUR, NEGATIVE_DUR) and 0 ns; every other value converts exactly as :func:`to_ns` does.
    """
    n = len(values)
    code = np.zeros(n, dtype=np.uint8)
    if n == 0:
        return np.zeros(0, dtype=np.int64), code
    first = values[0]
    if not isinstance(first, str):
        try:
            arr = np.array(values)
        except (TypeError, ValueError, OverflowError):
            arr = None
        if arr is not None and arr.ndim == 1 and arr.dtype in (np.float64, np.int64):
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(arr) | (np.abs(arr) >= _LIMIT_US) if arr.dtype == np.float64 else (
                    np.abs(arr) >= int(_LIMIT_US))
                code[bad] = BAD_DUR
                code[(code == 0) & (arr < 0)] = NEGATIVE_DUR
            clean = np.where(code == 0, arr, 0)
            ns = np.rint(clean * 1000.0).astype(np.int64) if arr.dtype == np.float64 else clean.astype(np.int64) * 1000
            return ns, code
    out = np.zeros(n, dtype=np.int64)
    for i, v in enumerate(values):  # the general case: mixed types, strings, None, huge integers
        if v is None:
            code[i] = NO_DUR
            continue
        if isinstance(v, bool):
            code[i] = BAD_DUR
            continue
        if isinstance(v, str):
            raw = v.encode("utf-8", "replace").strip()
            u = np.frombuffer(raw, dtype=np.uint8)[None, :] if raw else np.zeros((1, 1), np.uint8)
            if not raw or b"e" in raw.lower() or not _decimal_ok(u)[0]:
                code[i] = BAD_DUR
                continue
            ns = int(parse_decimal_us_to_ns(np.array([raw], dtype="S"))[0])
        elif isinstance(v, int):
            if abs(v) >= _LIMIT_US:
                code[i] = BAD_DUR
                continue
            ns = v * 1000
        elif isinstance(v, float):
            if not (abs(v) < _LIMIT_US):
                code[i] = BAD_DUR
                continue
            ns = int(round(v * 1000.0))
        else:
            code[i] = BAD_DUR
            continue
        if ns < 0:
            code[i] = NEGATIVE_DUR
            continue
        out[i] = ns
    return out, code


def ts_to_ns_checked(values: list, path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw JSON ts values -> (int64 ns, problem code per value): NO_TS for an absent or null ts, BAD_TS for
    one that is not a decimal number below 9e15 µs (junk bytes, an exponent out of range ...); 0 ns then."""
    n = len(values)
    code = np.zeros(n, dtype=np.uint8)
    if n == 0:
        return np.zeros(0, dtype=np.int64), code
    values.append(b"")
    try:
        joined = b"\n".join(values)
    finally:
        values.pop()
    buf = np.frombuffer(joined, dtype=np.uint8)
    fast = _fixed_width_ns(buf, n)
    if fast is not None:  # the usual case: every value checked and parsed in a few passes over the bytes
        return fast, code
    if joined.count(b"\n") != n:
        return _ts_one_by_one(values, path)
    ends = np.flatnonzero(buf == _NL)
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts
    isd = (buf >= 48) & (buf <= 57)
    has_digit = np.add.reduceat(isd.astype(np.int64), starts) > 0 if buf.size else np.zeros(n, bool)
    has_digit &= lengths > 0
    junk = np.add.reduceat((~_NUMBER_BYTES[buf]).astype(np.int64), starts) > 0 if buf.size else np.zeros(n, bool)
    junk &= lengths > 0
    is_null = (lengths == 4) & junk & ~has_digit
    if is_null.any():
        nulls = np.flatnonzero(is_null)
        is_null[nulls] = [joined[starts[i]:ends[i]] == b"null" for i in nulls.tolist()]
    code[(lengths == 0) | is_null] = NO_TS
    code[(code == 0) & (junk | ~has_digit)] = BAD_TS
    # integer digits: those before the dot (or the exponent); bounded so that the sums below cannot wrap
    owner = np.repeat(np.arange(n), lengths + 1)
    pos = np.arange(buf.size, dtype=np.int64)
    stop = np.where((buf == 46) | (buf == 101) | (buf == 69), pos, np.iinfo(np.int64).max)
    first_stop = np.minimum.reduceat(stop, starts) if buf.size else np.zeros(n, np.int64)
    int_digits = np.add.reduceat((isd & (pos < first_stop[owner])).astype(np.int64), starts) if buf.size else code
    code[(code == 0) & (int_digits > _MAX_INT_DIGITS)] = BAD_TS
    if code.any():
        ok = np.flatnonzero(code == 0)
        ns = np.zeros(n, dtype=np.int64)
        if ok.size:
            sub = [values[i] for i in ok.tolist()]
            ns[ok], sub_code = _ts_to_ns_valid(sub, path)
            code[ok] = sub_code
        return np.where(code == 0, ns, 0), code
    ns, code = _ts_to_ns_valid(values, path)
    return ns, code


def _fixed_width_ns(buf: np.ndarray, n: int) -> np.ndarray | None:
    """``n`` values joined with a newline after each, when all have one width and are plain decimals with the
    dot at one place (optionally all quoted): int64 ns; None otherwise. Such values pass every check of
    :func:`ts_to_ns_checked` (digits only, at most 16 integer digits, below 9e15 µs), so the answer is the
    same as the general path's, without its per-byte bookkeeping."""
    width = buf.size // n
    if width < 2 or width * n != buf.size or not (buf[width - 1::width] == _NL).all():
        return None
    u = buf.reshape(n, width)[:, : width - 1]
    if width >= 4 and u[0, 0] == 34 and (u[:, 0] == 34).all() and (u[:, -1] == 34).all():
        u = u[:, 1:-1]
    return _parse_fixed_format(u)


def _ts_to_ns_valid(values: list, path: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """Values that passed the byte checks: parse, then range-check the ones that went through float."""
    ns = raw_us_to_ns(values, path)
    code = np.zeros(len(values), dtype=np.uint8)
    out_of_range = np.abs(ns) >= int(_LIMIT_US * 1000)
    code[out_of_range] = BAD_TS
    ns[out_of_range] = 0
    return ns, code


def _ts_one_by_one(values: list, path: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """A ts value holding a line break (only in a JSON string): check each value on its own."""
    ns = np.zeros(len(values), dtype=np.int64)
    code = np.zeros(len(values), dtype=np.uint8)
    for i, v in enumerate(values):
        if b"\n" in bytes(v):
            code[i] = BAD_TS
        else:
            ns[i:i + 1], code[i:i + 1] = ts_to_ns_checked([v], path)
    return ns, code


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


_NL = np.uint8(10)


def raw_us_to_ns(values: list, path: Path | None = None) -> np.ndarray:
    """The raw JSON text of ts values (``msgspec.Raw``/bytes: a number such as ``1732412345678901.234``, a
    string such as ``"1704161511422904.204"``, ``null`` or empty) -> exact int64 ns.

    JSON numbers are never converted through float64, which cannot hold absolute µs timestamps to the
    nanosecond (its spacing at 1.7e15 µs is 0.25 µs). All values are joined into one buffer and parsed by
    numpy: when every value has the same width (the usual Ascend string ts) as a fixed-width array with
    :func:`parse_decimal_us_to_ns`, else byte by byte (:func:`_parse_joined`). Digits beyond the third
    decimal are rounded half up; a value written with an exponent goes through float; anything without
    digits (``null``, missing) is 0.
    """
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    values.append(b"")
    try:
        joined = b"\n".join(values)  # every value followed by a newline
    finally:
        values.pop()
    buf = np.frombuffer(joined, dtype=np.uint8)
    width = buf.size // n
    if width >= 2 and width * n == buf.size and (buf[width - 1::width] == _NL).all():
        u = buf.reshape(n, width)[:, : width - 1]
        if width >= 4 and u[0, 0] == 34 and (u[:, 0] == 34).all() and (u[:, -1] == 34).all():
            u = u[:, 1:-1]  # all quoted: drop the quotes
        if b"e" not in joined and b"E" not in joined:
            fast = _parse_fixed_format(u)
            if fast is not None:
                return fast
            return parse_decimal_us_to_ns(np.ascontiguousarray(u).view(f"S{u.shape[1]}").ravel())
    return _parse_joined(buf, n, joined, path)


def _parse_joined(buf: np.ndarray, n: int, joined: bytes, path: Path | None) -> np.ndarray:
    """Variable-width values, each followed by a newline in ``buf`` -> int64 ns, vectorised over the bytes."""
    ends = np.flatnonzero(buf == _NL)
    if ends.size != n:
        raise ProfileError(path or "<trace>", "a ts value holds a line break; expected µs numbers or decimal strings")
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    owner = np.repeat(np.arange(n), ends - starts + 1)  # value index of every byte (newline included)
    pos = np.arange(buf.size, dtype=np.int64)
    c = buf.astype(np.int64) - 48
    isd = (c >= 0) & (c <= 9)
    # where the integer part ends: the dot, else just after the last digit
    last_digit = np.maximum.reduceat(np.where(isd, pos, -1), starts)
    point = np.where(last_digit >= 0, last_digit + 1, starts)
    dots = np.flatnonzero(buf == 46)
    point[owner[dots]] = dots
    k = pos - point[owner]  # < 0: integer digits, 1..3: ms..ns decimals, 4: the rounding digit
    exp = np.where(k < 0, 2 - k, 3 - k)
    use = isd & (exp >= 0) & (exp <= 18)
    contrib = np.where(use, c * _POW10[np.clip(exp, 0, 18)], 0)
    contrib += isd & (k == 4) & (c >= 5)
    ns = np.add.reduceat(contrib, starts)
    neg = np.zeros(n, dtype=bool)
    neg[owner[buf == 45]] = True
    ns = np.where(neg, -ns, ns)
    if b"e" in joined or b"E" in joined:  # exponent notation (rare): through float, like any JSON reader
        for i in np.unique(owner[(buf == 101) | (buf == 69)]).tolist():
            text = joined[starts[i]:ends[i]].strip(b'" \t')
            try:
                value = float(text)
            except ValueError:  # '1e', '0e-': flagged as out of range by ts_to_ns_checked
                value = float("inf")
            ns[i] = int(round(value * 1000.0)) if abs(value) < _LIMIT_US else np.iinfo(np.int64).max
    return ns


# ---------------------------------------------------------------------------------------------------
# columnar form of complete ('X') events, metadata and flows


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


_NONE_IS_MINUS_ONE = {None: -1}
_INT_OR_NONE = frozenset({int, type(None)})


def _int_column(values: list) -> np.ndarray:
    """``args.stream`` / ``args.correlation`` values -> int64: -1 where absent, else as :func:`_int_or` reads them
    (-1 for a string that is not an integer). Integers and nulls only (the usual case) go through C loops."""
    if set(map(type, values)) <= _INT_OR_NONE:
        # dict.get(v, v): None -> -1, an integer -> itself
        return np.fromiter(map(_NONE_IS_MINUS_ONE.get, values, values), dtype=np.int64, count=len(values))
    return np.fromiter((_int_or(v, -1) if v is not None else -1 for v in values), dtype=np.int64, count=len(values))


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
        others = [e for e in chunk if e.ph != "X"] if len(xs) != len(chunk) else []
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
        flow_evs = [e for e in others if e.cat in flow_cats and e.ph in _FLOW_PH and e.ts]
        del others
        if flow_evs:
            ids_all = flow_id_array(list(map(_ID, flow_evs)))
            ts_all, ts_problem = ts_to_ns_checked(list(map(_TS, flow_evs)), path)
            key_ids = _Interner()
            key_index = key_ids.index
            kid = np.array([key_index[(e.cat, e.ph)] for e in flow_evs], dtype=np.int32)
            if ts_problem.any():  # a flow end that cannot be placed links nothing
                placed = ts_problem == 0
                ids_all, ts_all, kid = ids_all[placed], ts_all[placed], kid[placed]
            for k_i, key in enumerate(key_ids.values):
                sel = kid == k_i
                entry = flows.setdefault(key, ([], []))
                entry[0].append(ids_all[sel])
                entry[1].append(ts_all[sel])
        del flow_evs
        host_pids = None
        if not keep_host_x and xs:
            host_pids = {pid for pid in set(process_name) | set(process_label)
                         if _is_host_process(process_name.get(pid), process_label.get(pid))}
        # every field in one pass over the events (each event's memory is touched once), then one column each
        if host_pids:
            rows = [(e.pid, e.tid, e.ts, e.dur, e.name, e.cat, e.args) for e in xs
                    if e.pid not in host_pids or e.name.startswith("ProfilerStep#")]
        else:
            rows = [(e.pid, e.tid, e.ts, e.dur, e.name, e.cat, e.args) for e in xs]
        del xs
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
        try:
            ttype = ttypes.ids([a.task_type for a in argl])
        except AttributeError:  # some event has "args": null
            ttype = ttypes.ids([a.task_type if a is not None else None for a in argl])
        if kineto_args:
            try:
                streams, corrs = [a.stream for a in argl], [a.correlation for a in argl]
            except AttributeError:  # some event has "args": null
                streams = [a.stream if a is not None else None for a in argl]
                corrs = [a.correlation if a is not None else None for a in argl]
            stream_arg, corr = _int_column(streams), _int_column(corrs)
            del streams, corrs
        else:
            stream_arg = corr = np.full(len(argl), -1, dtype=np.int64)
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
