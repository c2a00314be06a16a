"""Property-based fuzzing (hypothesis) of profile-analyzer's inputs: timestamps and durations, trace events
and archive contents. The promise under test: a trace gives a report or ProfileError (one line), never
another exception; numbers are exact where they are valid and flagged where they are not. A few seconds in
all (derandomized, no example database).
"""

from __future__ import annotations

import gzip
import json
import tempfile
from decimal import Decimal
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profile_analyzer.api import analyze
from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders import _timestamps, load

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

decimal_us = st.builds(lambda i, f: f"{i}.{f}" if f else str(i), st.integers(min_value=0, max_value=8_999_999_999_999_999),
                       st.from_regex(r"[0-9]{0,6}", fullmatch=True))


@FUZZ
@given(st.lists(st.one_of(decimal_us.map(lambda t: t.encode()), decimal_us.map(lambda t: f'"{t}"'.encode())),
                min_size=1, max_size=30))
def test_valid_timestamps_are_exact(raws):
    ns, problem = _timestamps.ts_to_ns_checked(list(raws))
    expect = [int((Decimal(r.strip(b'"').decode()) * 1000).quantize(Decimal(1), rounding="ROUND_HALF_UP"))
              for r in raws]
    assert problem.tolist() == [0] * len(raws)
    assert ns.tolist() == expect


any_raw = st.one_of(
    st.binary(max_size=30),
    st.sampled_from([b"null", b"", b"1e300", b"-1e308", b'"nan"', b"NaN", b"Infinity", b'"12\xff"', b"9" * 30]),
    decimal_us.map(str.encode),
)


@FUZZ
@given(st.lists(any_raw, min_size=1, max_size=30))
def test_any_timestamp_is_placed_or_flagged(raws):
    ns, problem = _timestamps.ts_to_ns_checked(list(raws))
    assert ns.shape == problem.shape == (len(raws),)
    assert np.all(np.abs(ns) < 9 * 10**18)
    assert np.all(ns[problem != 0] == 0)


dur_value = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**25), max_value=10**25), st.floats(),
                      st.text(max_size=12), decimal_us)


@FUZZ
@given(st.lists(dur_value, min_size=1, max_size=30))
def test_any_duration_is_converted_or_flagged(values):
    ns, problem = _timestamps.dur_to_ns_checked(list(values))
    assert np.all(ns >= 0) and np.all(ns[problem != 0] == 0)
    for v, p in zip(values, problem.tolist(), strict=True):
        if v is None:
            assert p == _timestamps.NO_DUR
        elif isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e15:
            assert p == 0


HW, HCCL, PY = 800, 900, 437675
META = [
    {"ph": "M", "name": "process_name", "pid": PY, "tid": 0, "args": {"name": "Python"}},
    {"ph": "M", "name": "process_labels", "pid": PY, "tid": 0, "args": {"labels": "CPU"}},
    {"ph": "M", "name": "process_name", "pid": HW, "tid": 0, "args": {"name": "Ascend Hardware"}},
    {"ph": "M", "name": "thread_name", "pid": HW, "tid": 5, "args": {"name": "Stream 5"}},
    {"ph": "M", "name": "process_name", "pid": HCCL, "tid": 0, "args": {"name": "HCCL"}},
    {"ph": "M", "name": "thread_name", "pid": HCCL, "tid": 0, "args": {"name": "Group 1 Communication"}},
]
ts_field = st.one_of(decimal_us, st.integers(min_value=-10, max_value=10**16), st.floats(), st.none(),
                     st.text(max_size=8))
event = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "X", "X", "M", "s", "f", "i", "B", ""]),
     "name": st.sampled_from(["aclnnMatmul", "hcom_allReduce__1_1_1", "ProfilerStep#1", "aten::mm", "Notify_Wait"]),
     "pid": st.sampled_from([HW, HCCL, PY, 1, "x"]), "tid": st.sampled_from([0, 5, "t"])},
    optional={"ts": ts_field, "dur": dur_value, "args": st.one_of(st.none(), st.just({"Task Type": "AI_CORE"})),
              "cat": st.sampled_from(["async_npu", "cpu_op", None]), "id": st.integers(0, 3)},
)


def _load_or_refuse(path: Path) -> None:
    try:
        analyze(load(path))
    except ProfileError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.lists(event, max_size=25), st.sampled_from(["list", "kineto", "gzip"]))
def test_any_trace_gives_a_report_or_one_line(events, shape):
    with tempfile.TemporaryDirectory() as folder:
        if shape == "list":
            path = Path(folder) / "x_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(META + events))
            _load_or_refuse(path.parent.parent)
        else:
            data = json.dumps({"traceEvents": META + events}).encode()
            path = Path(folder) / ("trace.json.gz" if shape == "gzip" else "trace.json")
            path.write_bytes(gzip.compress(data) if shape == "gzip" else data)
            _load_or_refuse(path)


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(["trace.json", "trace.json.gz", "raw.json.gz"]))
def test_any_archive_bytes_give_a_report_or_one_line(blob, name):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(gzip.compress(blob) if name == "trace.json.gz" else blob)
        _load_or_refuse(path)


number_text = st.one_of(
    st.floats().map(repr), st.floats(allow_nan=False).map(lambda x: f"{x:.3e}"),
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-Infinity", "1e400", "-1e400", "1_000", "1__0", "_1", ".5", "5.",
                     "٣", "３.５", "0x10", "", " ", "1e", "+.e1"]),
    st.text(alphabet="0123456789.eE+-_ naif", max_size=12), st.text(max_size=8),
)


@FUZZ
@given(number_text, st.sampled_from([(0.0, 1.0, True), (0.0, 1e6, False), (0.0, 1e12, True), (0.0, 1000.0, False)]))
def test_a_numeric_option_gives_a_finite_number_in_range_or_one_line(text, bounds):
    import math

    import click
    from profile_analyzer._params import FiniteFloat

    lo, hi, min_open = bounds
    try:
        number = FiniteFloat(lo, hi, min_open=min_open).convert(text, None, None)
    except click.BadParameter as exc:
        assert "\n" not in exc.format_message() and "expected a finite number" in exc.format_message()
        return
    assert math.isfinite(number) and (number > lo if min_open else number >= lo) and number <= hi
    assert not any(ch.isdigit() and not ch.isascii() for ch in text)


_DB_TEMPLATE: list[bytes] = []


def _db_template() -> bytes:
    """One rank's torch_npu DB export, written once by the synthesizer (profile_analyzer.synth, --export db)."""
    if not _DB_TEMPLATE:
        from profile_analyzer.synth import write_profile

        with tempfile.TemporaryDirectory() as folder:
            root = write_profile(Path(folder) / "p", ranks=1, steps=1, layers=2, export="db").root
            _DB_TEMPLATE.append(next(root.glob("**/ascend_pytorch_profiler_*.db")).read_bytes())
    return _DB_TEMPLATE[0]


db_time = st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(), st.text(max_size=12),
                    st.binary(max_size=4), decimal_us, st.integers(0, 10**12).map(str))


@settings(FUZZ, max_examples=40)
@given(st.sampled_from(["TASK", "COMMUNICATION_OP", "PYTORCH_API"]), st.integers(0, 30), db_time, db_time)
def test_any_db_time_gives_a_report_or_one_line(table, row, start, end):
    import sqlite3

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ascend_pytorch_profiler_0.db"
        path.write_bytes(_db_template())
        con = sqlite3.connect(path)
        con.execute(f"UPDATE {table} SET startNs = ?, endNs = ? WHERE rowid = "
                    f"(SELECT rowid FROM {table} ORDER BY rowid LIMIT 1 OFFSET ?)", (start, end, row))
        con.commit()
        con.close()
        _load_or_refuse(path)


regex_text = st.one_of(st.text(alphabet="a+*?()|[]{}^$\\.1dwb<=!:P,-", max_size=14), st.text(max_size=10),
                       st.sampled_from(["(a+)+$", "(a|a)*b", "(a*)*$", "(.*a){20}", "(x+x+)+y", "(a)\\1", "(?<=a)b",
                                        "\x00", "a{1000}{1000}", "[\ud800]"]))


@settings(FUZZ, max_examples=200)
@given(st.lists(regex_text, min_size=1, max_size=3), st.text(alphabet="ab!x_", max_size=200))
def test_any_comm_pattern_is_refused_in_one_line_or_matches_in_bounded_time(patterns, name):
    import time

    from profile_analyzer.loaders.comm_rules import classify_name, compile_patterns

    try:
        compiled = compile_patterns(patterns)
    except ProfileError as exc:
        assert "\n" not in str(exc) and "RE2" in str(exc)
        return
    begin = time.monotonic()
    classify_name(name * 50, compiled)  # up to 10,000 characters: a backtracking engine takes ages on some
    assert time.monotonic() - begin < 2


# Oversized input (gzip bombs and their plain twins): one stretch without an event boundary, larger or smaller than
# the slicer's cap, placed anywhere an event or the file's structure can hold it. Caps shrunk so the stretch is small.
_CAP = 64 << 10
oversize_place = st.sampled_from(["name", "args", "blanks-between", "blanks-first", "kineto-rest", "kineto-head"])


def _oversized_trace(place: str, filler: bytes, size: int) -> tuple[bytes, bool]:
    """(the file's bytes, whether it is a Kineto object) with ``size`` bytes of ``filler`` at ``place``."""
    run = (filler * (size // len(filler) + 1))[:size]
    blanks = (b" \t\r\n" * size)[:size]
    event = {"ph": "X", "name": "aclnnAdd", "pid": HW, "tid": 5, "ts": "1.0", "dur": 1.0, "args": {}}
    body = json.dumps(META + [event]).encode()
    if place == "name":
        body = body.replace(b'"aclnnAdd"', b'"' + run + b'"')
    elif place == "args":
        body = body.replace(b'"args": {}', b'"args": {"x": "' + run + b'"}')
    elif place == "blanks-between":
        body = body.replace(b"}, {", b"}, " + blanks + b"{", 1)
    elif place == "blanks-first":
        body = b"[" + blanks + body[1:]
    if place == "kineto-rest":
        return b'{"traceEvents": ' + body + b', "x": "' + run + b'"}', True
    if place == "kineto-head":
        return b'{"a": "traceEvents", "x": "' + run + b'", "traceEvents": ' + body + b"}", True
    return body, False


@settings(FUZZ, max_examples=60)
@given(oversize_place, st.sampled_from([b"a", b" ", b"\\u00e9", b"x}, {"]),
       st.one_of(st.integers(_CAP // 8, _CAP // 2), st.integers(2 * _CAP, 6 * _CAP)), st.booleans())
def test_an_oversized_stretch_is_read_or_refused_at_a_bounded_peak(monkeypatch, place, filler, size, zipped):
    import tracemalloc

    from profile_analyzer.loaders import _slicer

    monkeypatch.setattr(_slicer, "CHUNK_BYTES", 4 << 10)
    monkeypatch.setattr(_slicer, "MAX_EVENT_BYTES", _CAP)
    monkeypatch.setattr(_slicer, "MAX_WHOLE_GZ_BYTES", _CAP)
    monkeypatch.setattr(_slicer, "_HEAD_LIMIT", _CAP // 4)
    data, kineto = _oversized_trace(place, filler, size)
    with tempfile.TemporaryDirectory() as folder:
        if kineto or zipped:  # a .gz is read as a Kineto trace (its events a list or an object's traceEvents)
            path = Path(folder) / ("trace.json.gz" if zipped else "trace.json")
        else:
            path = Path(folder) / "x_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
            path.parent.mkdir(parents=True)
        path.write_bytes(gzip.compress(data, 1) if zipped else data)
        tracemalloc.start()
        try:
            load(path if kineto or zipped else path.parent.parent)
            refused = None
        except ProfileError as exc:
            refused = str(exc)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    if refused is not None:
        assert "\n" not in refused
    if size > 2 * _CAP and not (place == "kineto-head" and not zipped):  # a plain file is read whole there
        assert refused is not None and "KiB" in refused, refused
        assert peak < 8 * _CAP + (4 << 20), peak  # a few caps, plus the loader's own fixed needs
    elif size < _CAP // 2 and place not in ("kineto-head",):
        assert refused is None or "KiB" not in refused, refused
