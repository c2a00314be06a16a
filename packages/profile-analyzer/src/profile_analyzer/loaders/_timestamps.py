"""Timestamps and durations of trace events: exact decimal µs (strings or numbers) -> int64 ns, vectorised, with
the reason an event cannot be placed on the timeline (no ts, a negative dur, ...)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from profile_analyzer.errors import ProfileError

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
            return dur_array_to_ns_checked(arr)
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
            if v < 0:  # as the array path: a negative dur is flagged even where it rounds to 0 ns
                code[i] = NEGATIVE_DUR
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


def dur_array_to_ns_checked(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Durations in µs as one float64 or int64 array (every value a number) -> as :func:`dur_to_ns_checked`."""
    code = np.zeros(arr.size, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(arr) | (np.abs(arr) >= _LIMIT_US) if arr.dtype == np.float64 else (
            np.abs(arr) >= int(_LIMIT_US))
        code[bad] = BAD_DUR
        code[(code == 0) & (arr < 0)] = NEGATIVE_DUR
    clean = np.where(code == 0, arr, 0)
    ns = np.rint(clean * 1000.0).astype(np.int64) if arr.dtype == np.float64 else clean.astype(np.int64) * 1000
    return ns, code


def ts_joined_to_ns_checked(joined: bytes, n: int, path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`ts_to_ns_checked`, for ``n`` raw ts values already joined with a newline after each (none of
    them holding a newline itself)."""
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    fast = _fixed_width_ns(np.frombuffer(joined, dtype=np.uint8), n)
    if fast is not None:
        return fast, np.zeros(n, dtype=np.uint8)
    return ts_to_ns_checked(joined.split(b"\n")[:-1], path)


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
