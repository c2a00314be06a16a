"""Exact timestamp parsing and chunked decoding of Chrome-trace JSON."""

from __future__ import annotations

import json
from decimal import Decimal

import numpy as np
import pytest
from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders import _columns, _slicer, _timestamps
from profile_analyzer.loaders._columns import columnarise
from profile_analyzer.loaders._timestamps import parse_decimal_us_to_ns, to_ns


def test_decimal_strings_to_exact_ns():
    vals = ["1704161511422904.204", "1704161511422904.2", "17", "1736413971558972.912\t", "0.0005", "-3.5", "12.3456"]
    got = parse_decimal_us_to_ns(np.array(vals, dtype="S"))
    expect = [int((Decimal(v.strip()) * 1000).quantize(Decimal(1), rounding="ROUND_HALF_UP")) for v in vals]
    assert got.tolist() == expect


def test_float64_would_be_wrong_but_we_are_not():
    s = "1704161511422904.204"
    assert int(round(float(s) * 1000)) != 1704161511422904204  # why strings are parsed as decimals
    assert to_ns([s]).tolist() == [1704161511422904204]


def test_mixed_numbers_and_strings():
    assert to_ns(["1.5", 2, 2.25, None]).tolist() == [1500, 2000, 2250, 0]


def _events(n):
    ev = [{"ph": "M", "name": "process_name", "pid": 5_000_000_001, "tid": 0, "args": {"name": "Ascend Hardware"}},
          {"ph": "M", "name": "thread_name", "pid": 5_000_000_001, "tid": 7, "args": {"name": "Stream 7"}}]
    for i in range(n):
        ev.append({"ph": "X", "name": f"op{i % 7}", "pid": 5_000_000_001, "tid": 7, "ts": f"{1000 + i}.{i % 1000:03d}",
                   "dur": 0.5, "args": {"Task Type": "AI_CORE", "Physic Stream Id": 7, "nested": [{"a": {"b": [1, {"c": 2}]}}]}})
    return ev


def test_chunked_decode_equals_whole_decode(tmp_path, monkeypatch):
    p = tmp_path / "trace_view.json"
    p.write_text(json.dumps(_events(3000)))
    whole = columnarise(p)
    monkeypatch.setattr(_slicer, "CHUNK_BYTES", 4096)
    chunked = columnarise(p)
    assert chunked.n_events == whole.n_events == 3002
    assert chunked.start_ns.tolist() == whole.start_ns.tolist()
    assert [chunked.names[i] for i in chunked.name_id] == [whole.names[i] for i in whole.name_id]
    assert chunked.process_name == {5_000_000_001: "Ascend Hardware"}  # pid above 2**32 kept exactly


def test_mapped_and_gzip_streams_agree_with_json(tmp_path, monkeypatch):
    import gzip

    events = _events(2000)
    events[700]["args"]["nested"] = [{"k": list(range(3000))}]  # one event longer than a slice
    text = json.dumps(events, indent=1)
    p = tmp_path / "trace_view.json"
    p.write_text(text)
    g = tmp_path / "trace_view.json.gz"
    with gzip.open(g, "wt") as f:
        f.write(text)
    expect = [int(Decimal(e["ts"]) * 1000) for e in events if e["ph"] == "X"]
    monkeypatch.setattr(_slicer, "CHUNK_BYTES", 4096)
    seen: list[int] = []
    mapped = _columns.columnarise(p, on_bytes=lambda done, total, name: seen.append(done))
    streamed = _columns.columnarise(g)
    assert mapped.n_events == streamed.n_events == len(events)
    assert mapped.start_ns.tolist() == streamed.start_ns.tolist() == expect
    assert len(seen) > 10 and seen == sorted(seen) and seen[-1] == len(text.encode())
    assert p.read_text() == text  # the brackets written at the cuts stay in the private mapping


def test_truncated_json_is_reported(tmp_path, monkeypatch):
    p = tmp_path / "trace_view.json"
    text = json.dumps(_events(2000))
    p.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="truncated"):
        columnarise(p)
    monkeypatch.setattr(_slicer, "CHUNK_BYTES", 4096)
    with pytest.raises(ProfileError, match="truncated|invalid"):
        columnarise(p)


def test_args_null_and_missing(tmp_path):
    ev = _events(5)
    ev[3]["args"] = None
    del ev[4]["args"]
    ev.append({"ph": "M", "name": "thread_name", "pid": 5_000_000_001, "tid": 9, "args": None})
    p = tmp_path / "trace_view.json"
    p.write_text(json.dumps(ev))
    cols = columnarise(p)
    assert cols.start_ns.size == 5
    assert [cols.task_types[i] for i in cols.task_type_id] == ["AI_CORE", None, None, "AI_CORE", "AI_CORE"]


def test_fixed_format_fast_path_equals_general_parser(monkeypatch):
    vals = [f"{1704161511422904 + i}.{(i * 37) % 1000:03d}" for i in range(5000)] + ["1704161511422904.5"]
    fast = parse_decimal_us_to_ns(np.array(vals[:-1], dtype="S"))
    monkeypatch.setattr(_timestamps, "_parse_fixed_format", lambda u: None)
    slow = parse_decimal_us_to_ns(np.array(vals[:-1], dtype="S"))
    assert fast.tolist() == slow.tolist()
    # mixed widths take the general path and stay exact
    mixed = parse_decimal_us_to_ns(np.array(vals[-2:], dtype="S"))
    assert mixed.tolist() == [int(Decimal(v) * 1000) for v in vals[-2:]]


def test_json_number_ts_decoded_exactly(tmp_path):
    # float64 spacing at 1.7e15 µs is 0.25 µs: a number decoded through float loses the ns digits
    ts = ["1732412345678901.234", "1732412345678901.235", "1732412345678902.999", "1732412345678903"]
    assert len({round(float(v) * 1000) for v in ts[:2]}) == 1
    expect = [int(Decimal(v) * 1000) for v in ts]
    assert _timestamps.raw_us_to_ns([v.encode() for v in ts]).tolist() == expect
    # mixed widths, quoted strings, null, exponent, negative and rounding digits in one column
    raw = [b'1732412345678901.234', b'"1704161511422904.204"', b"null", b"", b"-3.5", b"12.3456", b"1.5e3", b"7"]
    assert _timestamps.raw_us_to_ns(raw).tolist() == [1732412345678901234, 1704161511422904204, 0, 0, -3500, 12346,
                                                 1500000, 7000]
    # through the file decoder: a top-level array (chunked) and a Kineto object
    events = [{"ph": "X", "name": "k", "pid": 1, "tid": 2, "ts": f"@{i}@", "dur": 1.5} for i in range(len(ts))]
    text = json.dumps(events)
    for i, v in enumerate(ts):
        text = text.replace(f'"@{i}@"', v)
    p = tmp_path / "trace_view.json"
    p.write_text(text)
    assert columnarise(p).start_ns.tolist() == expect
    k = tmp_path / "kineto.json"
    k.write_text('{"traceEvents": ' + text + "}")
    cols = columnarise(k)
    assert cols.start_ns.tolist() == expect and cols.dur_ns.tolist() == [1500] * len(ts)


def test_track_ids_numbering():
    tracks = _columns._Interner()
    ids = _columns._track_ids(tracks, [9, 2**40, 9, 2**40, 1], [5, 3, 4, 3, 7])
    # new integer pairs are numbered in (pid, tid) order; repeated pairs share an id
    assert tracks.values == [(1, 7), (9, 4), (9, 5), (2**40, 3)]
    assert [tracks.values[i] for i in ids] == [(9, 5), (2**40, 3), (9, 4), (2**40, 3), (1, 7)]
    ids2 = _columns._track_ids(tracks, ["gpu 0", 9, "gpu 0"], ["stream 7", 5, 3])  # mixed ids: first-seen order
    assert tracks.values[4:] == [("gpu 0", "stream 7"), ("gpu 0", 3)]
    assert [tracks.values[i] for i in ids2] == [("gpu 0", "stream 7"), (9, 5), ("gpu 0", 3)]
