"""The slicer: Chrome-trace JSON (trace_view.json, msprof_*.json, Kineto) decoded into lists of events, in slices.

Decoding uses msgspec typed structs that keep only the fields the analyses need; unknown keys are skipped
by the C decoder. A top-level JSON array (the Ascend files) and the ``traceEvents`` array of a Kineto
object (``{"traceEvents": [...], ...}``) are decoded in slices of about ``CHUNK_BYTES`` so that peak
memory stays near the size of the file rather than several times it: the array is cut after a ``}`` that
is followed by ``,`` and ``{``; a cut that lands inside a nested value makes the slice fail to decode and
the next candidate is tried. The rest of a Kineto object (its other keys, before or after the array) is
decoded on its own with the array left empty. Timestamps are parsed in :mod:`._timestamps`, columns built in
:mod:`._columns`.
"""

from __future__ import annotations

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

from profile_analyzer.errors import ProfileError

CHUNK_BYTES = 1 << 20  # 1 MiB: measured faster than 4 MiB (the slice's objects stay in cache) and a smaller peak
# The longest stretch of a trace without an event boundary that is read: one event (or the blanks between two, or
# the part of a Kineto object after its array) beyond it is refused, so a small .gz that expands to gigabytes of one
# name or of blanks is refused after reading this much, at a bounded peak (about three times it), instead of
# being expanded whole. Real events are a few hundred bytes; the largest seen in profiler output is under 1 MiB.
MAX_EVENT_BYTES = 64 << 20
# A .gz read whole (a Kineto object whose traceEvents array does not start near the top) is refused past this.
MAX_WHOLE_GZ_BYTES = 64 << 20


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
_event_decoder = msgspec.json.Decoder(Event)

# A scanner reads a slice (``[...]`` bytes) straight into columns, or answers None when the slice is not plain
# enough for it; the slice is then decoded with msgspec as usual (see ``_columns.make_scanner``).
Scanner = Callable[[bytes | memoryview], object | None]
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
                data = f.read(MAX_WHOLE_GZ_BYTES + 1)
            if len(data) > MAX_WHOLE_GZ_BYTES:
                raise ProfileError(path, f"expands to more than {_size(MAX_WHOLE_GZ_BYTES)} and its traceEvents "
                                         f"array does not start in the first {_size(_HEAD_LIMIT)} (such a file is "
                                         "read whole); expected a Kineto trace with traceEvents near the top, or the "
                                         "trace uncompressed")
            return data
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


def _decode_list(path: Path, data: bytes | memoryview, kineto: bool = False, first: int = 0,
                 scanner: Scanner | None = None) -> list[Event]:
    """One slice; ``first``: how many events of the file came before it (for the position in messages)."""
    if scanner is not None:
        scanned = scanner(data)
        if scanned is not None:
            return scanned  # type: ignore[return-value]
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


class _Source:
    """The bytes of one file as the chunk loop sees them: ``buf[lo:hi]`` has been read and is not decoded yet;
    ``eof`` once nothing more will come. The loop writes brackets into ``buf`` at the cuts."""

    buf: bytearray | mmap.mmap
    lo: int = 0
    hi: int = 0
    eof: bool = False
    total: int = 0  # the file's size for progress reports; 0: unknown (gzip)

    def more(self) -> bool:
        """Read about ``CHUNK_BYTES`` more into ``buf``; False (and ``eof``) when there is nothing more."""
        raise NotImplementedError

    def piece(self, a: int, b: int) -> bytes | memoryview:
        """``buf[a:b]`` to decode; the decoded ``msgspec.Raw`` values keep it alive."""
        raise NotImplementedError

    def drop(self, upto: int) -> None:
        """The bytes before ``upto`` are decoded: ``lo`` moves there (indices may shift: read ``lo`` again)."""
        raise NotImplementedError

    def position(self) -> int:
        """Bytes of the file done with so far."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Streamed(_Source):
    """A compressed (or otherwise unmappable) file read in blocks into a bytearray; what is decoded is deleted
    from its front, so memory stays at a few blocks whatever the file size."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f = _open_binary(path)
        self.buf = bytearray()
        self.base = 0  # file offset of buf[0]
        self.total = path.stat().st_size if path.suffix != ".gz" else 0

    def more(self) -> bool:
        if self.eof:
            return False
        try:
            block = self.f.read(CHUNK_BYTES)
        except (OSError, EOFError, zlib.error) as exc:
            raise ProfileError(self.path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None
        if not block:
            self.eof = True
            return False
        self.buf += block
        self.hi = len(self.buf)
        return True

    def piece(self, a: int, b: int) -> bytes:
        # a bytes copy: the msgspec.Raw ts values keep it alive, and buf stays resizable
        with memoryview(self.buf) as view:
            return bytes(view[a:b])

    def drop(self, upto: int) -> None:
        del self.buf[:upto]
        self.base += upto
        self.lo = 0
        self.hi = len(self.buf)

    def position(self) -> int:
        return self.base + self.lo

    def close(self) -> None:
        self.f.close()


class _Mapped(_Source):
    """An uncompressed file, not copied: mapped copy-on-write (the brackets written at the cuts never reach the
    file), each slice decoded straight from the mapping. Pages already decoded are handed back
    (``MADV_DONTNEED``) so resident memory stays at about one slice; a private mapping re-reads such a page
    from the file if it is touched again."""

    def __init__(self, path: Path) -> None:
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    raise ProfileError(path, "empty file; expected a Chrome trace (JSON list of events)")
                self.buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            raise ProfileError(path, "file not found") from None
        except OSError as exc:
            raise ProfileError(path, f"cannot be read ({exc.__class__.__name__}: {exc})") from None
        self.view = memoryview(self.buf)
        self.hi = self.total = size
        self.eof = True  # all of it is mapped from the start
        self.dropped = 0
        self.can_drop = hasattr(self.buf, "madvise") and hasattr(mmap, "MADV_DONTNEED")

    def more(self) -> bool:
        return False

    def piece(self, a: int, b: int) -> memoryview:
        return self.view[a:b]

    def drop(self, upto: int) -> None:
        self.lo = upto
        page_end = (upto // mmap.PAGESIZE) * mmap.PAGESIZE
        if self.can_drop and page_end > self.dropped:
            self.buf.madvise(mmap.MADV_DONTNEED, self.dropped, page_end - self.dropped)  # type: ignore[union-attr]
            self.dropped = page_end

    def position(self) -> int:
        return self.lo

    def close(self) -> None:
        try:
            self.view.release()
            self.buf.close()
        except BufferError:  # decoded values still point into it: it closes when they go
            pass


def _array_chunks(path: Path, on_bytes: ByteProgress | None = None,
                  out: DecodedFile | None = None, scanner: Scanner | None = None) -> Iterator[list[Event]]:
    """Decode a top-level JSON array in slices of about ``CHUNK_BYTES``: a file is mapped, a ``.gz`` read in
    blocks (:class:`_Mapped`, :class:`_Streamed`); one loop serves both. Each slice ends at a ``}`` followed
    by ``,`` and ``{`` near ``CHUNK_BYTES`` past its start; the byte after that ``}`` is overwritten with ``]``
    and the slice's first byte with ``[`` for decoding. A cut inside a nested value fails to decode and an
    earlier one is tried; when none in the stretch decodes, a longer stretch is taken.

    With ``out`` the file is a Kineto object: its ``traceEvents`` array is decoded in slices the same way (its
    end is found where msgspec reports bytes after a complete list), then the rest of the object into
    ``out.distributed_info``.

    With a ``scanner``, each slice is offered to it first; what it returns (not None) is yielded instead of the
    decoded events. A slice it declines is decoded as usual, so a cut inside a nested value is still found by
    msgspec's error."""
    src: _Source = _Streamed(path) if path.suffix == ".gz" else _Mapped(path)
    kineto = out is not None
    try:
        while True:  # leading blanks: dropped as they are read, so each block is looked at once
            src.drop(_skip_ws(src.buf, src.lo, src.hi))
            if src.lo < src.hi or not src.more():
                break
        buf = src.buf
        prefix = b""  # Kineto: the object up to and including the array's '['
        if not kineto:
            if src.lo == src.hi or buf[src.lo] != 0x5B:
                raise ProfileError(path, "not a JSON array of trace events; expected trace_view.json / msprof_*.json")
        else:
            while True:
                lo = src.lo
                arr = (_events_array_start(buf, lo, min(src.hi, lo + _HEAD_LIMIT))
                       if lo < src.hi and buf[lo] == 0x7B else None)
                if arr == _MORE and src.hi - lo < _HEAD_LIMIT and src.more():
                    continue
                break
            if arr is None or arr == _MORE or not _kineto_prefix_ok(bytes(buf[lo: arr + 1])):
                # no top-level traceEvents array found near the start: decode the file at once
                src.close()
                yield from _whole_object(path, out)  # type: ignore[arg-type]
                return
            prefix = bytes(buf[lo: arr + 1])
            src.drop(arr)  # buf[src.lo] is the array's '['
        last: int | None = None  # index in buf of the array's closing ']' once known
        reach = CHUNK_BYTES
        scan_from = src.lo + 1  # cuts before it failed in an earlier round (the same bytes fail again): never
        # scanning them twice keeps a long stretch without cuts (1 GiB of blanks) linear
        n_done = 0  # events decoded so far
        while True:
            if last is None:  # more than a slice's worth, or all there is
                while src.hi - src.lo <= reach and src.more():
                    pass
            else:  # Kineto: the array has ended; the rest of the object is read whole
                while src.hi - last <= MAX_EVENT_BYTES and src.more():
                    pass
                if src.hi - last > MAX_EVENT_BYTES:
                    raise _too_long(path, src.position() + last - src.lo, "the object after its traceEvents array does not end")
            lo = src.lo
            if src.eof and (last is not None or src.hi - lo <= reach + (reach >> 2)):  # the last slice
                buf[lo] = 0x5B
                if last is None and kineto:
                    last = _kineto_array_end(path, src.piece(lo, src.hi), lo, n_done)
                elif last is None:
                    last = _last_non_ws(buf, lo, src.hi)
                    if last == lo or buf[last] != 0x5D:
                        raise ProfileError(path, "truncated JSON: the top-level array is not closed; expected a "
                                                 "complete Chrome trace (JSON list of events)")
                yield _decode_list(path, src.piece(lo, last + 1), kineto, n_done, scanner)
                if kineto:
                    _kineto_rest(path, out, prefix, src.piece(last, src.hi))  # type: ignore[arg-type]
                if on_bytes is not None and src.total:
                    on_bytes(src.total, src.total, path.name)
                return
            target = min(src.hi, lo + reach)
            cands = _last_cuts(buf, max(lo + 1, scan_from), target)
            decoded = None
            buf[lo] = 0x5B
            for m in reversed(cands):
                close = m.start() + 1
                saved = buf[close]
                buf[close] = 0x5D
                piece = src.piece(lo, close + 1)
                try:
                    decoded = scanner(piece) if scanner is not None else None
                    if decoded is None:
                        decoded = _list_decoder.decode(piece)
                except msgspec.ValidationError as exc:  # an event that is not one, whatever the cut
                    raise _bad_event(path, exc, kineto, n_done) from None
                except msgspec.DecodeError as exc:
                    decoded = None
                    at = _list_end(exc, piece) if kineto else None
                    if at is not None:  # Kineto: the array ended before this cut
                        buf[close] = saved
                        last = lo + at
                        break
                finally:
                    del piece
                buf[close] = saved
                if decoded is not None:
                    break
            if decoded is None:
                if last is None:  # no usable cut in this stretch: take a longer one
                    scan_from = max(scan_from, target - _CUT_SPAN)
                    reach += CHUNK_BYTES
                    if reach > MAX_EVENT_BYTES:
                        raise _too_long(path, src.position(), "no event boundary")
                continue  # else the Kineto array's end was found in it: the rest is its last slice
            reach = CHUNK_BYTES
            n_done += len(decoded)
            yield decoded
            del decoded
            src.drop(m.end() - 2)  # keep from the byte just before the next '{'
            scan_from = src.lo + 1
            if on_bytes is not None and src.total:
                on_bytes(src.position(), src.total, path.name)
    finally:
        src.close()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _too_long(path: Path, at: int, what: str) -> ProfileError:
    where = f"byte {at} of the decompressed text" if path.suffix == ".gz" else f"byte {at}"
    cap = _size(MAX_EVENT_BYTES)
    return ProfileError(path, f"{what} within {cap} after {where}; expected a Chrome trace whose events (and the "
                              f"blanks between them) are each under {cap}")


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


def decode_trace(path: Path, on_bytes: ByteProgress | None = None, scanner: Scanner | None = None) -> DecodedFile:
    """The events of a trace file in slices. For a Kineto object ``distributed_info`` is filled in once
    ``chunks`` has been consumed (the rest of the object is decoded after the array). With a ``scanner``, a
    slice may come as what the scanner made of it instead of a list of events (see :func:`_array_chunks`)."""
    return _decode(path, on_bytes, whole_objects=False, scanner=scanner)


def decode_whole(path: Path, on_bytes: ByteProgress | None = None, scanner: Scanner | None = None) -> DecodedFile:
    """Like :func:`decode_trace`, but a Kineto object is decoded at once (the reference the streamed decode
    is compared with; also what the streamed decode falls back to)."""
    return _decode(path, on_bytes, whole_objects=True, scanner=scanner)


def _decode(path: Path, on_bytes: ByteProgress | None, whole_objects: bool,
            scanner: Scanner | None = None) -> DecodedFile:
    kind = peek_kind(path, strict=False)
    if kind == "list":
        return DecodedFile(_array_chunks(path, on_bytes, scanner=scanner), None, False)
    if kind == "object":
        out = DecodedFile(iter(()), None, True)
        if whole_objects:
            out.chunks = _whole_object(path, out)
        else:
            out.chunks = _array_chunks(path, on_bytes, out, scanner)
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
