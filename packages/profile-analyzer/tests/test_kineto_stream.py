"""Kineto traces (``{"traceEvents": [...], ...}``) are decoded in slices, like the Ascend arrays.

The streamed decode is compared with the whole-file decode (``_slicer.decode_whole`` in place of ``decode_trace``) on the real
HTA traces and on generated ones (keys before and after the array, "traceEvents" inside strings and nested
values, unicode, ``.json`` and ``.json.gz``, arrays over many slices): same columns, same timeline, same
report. Peak memory of a ~150 MB trace is measured in a child process; bad input stays one line, exit 2.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from profile_analyzer.cli import main
from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders import _columns, _slicer
from profile_analyzer.loaders.kineto import load_kineto

HTA = Path(__file__).resolve().parent / "data" / "hta-kineto"
HTA_FILES = sorted(HTA.glob("*.json.gz"))


def _steps(n_steps: int, ops: int = 40, t0: int = 1_700_000_000_000_000) -> list[dict]:
    """A GPU-style step loop: ProfilerStep, per op a cpu_op, its launch and its kernel (every 5th an NCCL
    kernel on another stream), flows, metadata; a few events carry "traceEvents" in strings and nested keys."""
    ev: list[dict] = [{"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python3 \u00e9\u4e2d"}},
                      {"ph": "M", "name": "thread_name", "pid": 100, "tid": 1, "args": {"name": "thread 1 (python)"}}]
    corr = 0
    t = t0
    for s in range(n_steps):
        ev.append({"ph": "X", "cat": "cpu_op", "name": f"ProfilerStep#{s + 1}", "pid": 100, "tid": 1, "ts": t,
                   "dur": ops * 10})
        for i in range(ops):
            corr += 1
            ts = t + i * 10
            comm = i % 5 == 4
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm" if i % 3 else "aten::add_\u2728", "pid": 100,
                       "tid": 1 if i % 7 else 2, "ts": ts, "dur": 4.25,
                       "args": {"External id": corr, "Input Dims": [[64, 64], [64, 64]],
                                "note": '"traceEvents": [{"ph": "X"}, {"ph": "X"}]' if i == 3 else "},{"}})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1,
                       "ts": ts + 1, "dur": 2, "args": {"correlation": corr, "cbid": 211}})
            ev.append({"ph": "X", "cat": "kernel", "pid": 0, "tid": 20 if comm else 7,
                       "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL" if comm else "void gemm<float, \u00e9\u4e2d>",
                       "ts": ts + 3, "dur": 6.5 + (i % 4),
                       "args": {"stream": 20 if comm else 7, "correlation": corr, "device": 0,
                                "traceEvents": [{"ph": "X", "name": "not an event of the file"}, {"a": "}, {"}]}})
            ev.append({"ph": "s", "id": corr, "pid": 100, "tid": 1, "ts": ts + 1, "cat": "ac2g", "name": "ac2g"})
            ev.append({"ph": "f", "id": corr, "pid": 0, "tid": 20 if comm else 7, "ts": ts + 3, "cat": "ac2g",
                       "name": "ac2g", "bp": "e"})
        t += ops * 10 + 50
    ev.append({"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
               "ts": t0, "dur": t - t0})
    return ev


BEFORE = {"schemaVersion": 1, "meta": {"traceEvents": [{"ph": "X", "name": "nested key"}], "s": "traceEvents"},
          "deviceProperties": [{"id": 0, "name": 'GPU "traceEvents": [', "totalGlobalMem": 85}, {"id": 1}],
          "label": "traceEvents", "record_shapes": 1}
AFTER = {"traceName": "\u4e2d.json", "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000,
         "extra": [{"traceEvents": []}, {"b": "]}"}]}


def _doc(events: list[dict], layout: str, rank: int = 3) -> dict:
    """The object with distributedInfo before the array ("before"), after it ("after"), or alone ("bare")."""
    dist = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 8}}
    if layout == "before":
        return {**BEFORE, **dist, "traceEvents": events, **AFTER}
    if layout == "after":
        return {**BEFORE, "traceEvents": events, **AFTER, **dist}
    return {"traceEvents": events, **dist}


def _write(path: Path, doc: dict, indent: int | None = None) -> Path:
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _assert_same(a: object, b: object, what: str) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), what
        for k in a:
            _assert_same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (tuple, list)) and any(isinstance(x, np.ndarray) for x in a):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{what}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), what
        for f in fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{what}.{f.name}")
    else:
        assert a == b, what


STREAMED = _columns.decode_trace  # the production decode (the tests swap in decode_whole for comparison)


def _no_whole_decode(*_a, **_k):
    raise AssertionError("the streamed decode fell back to decoding the file whole")


def _both_ways(path: Path, monkeypatch, chunk: int):
    """(streamed columns, timeline, number of slices), (whole-file columns, timeline)."""
    monkeypatch.setattr(_slicer, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(_columns, "decode_trace", _slicer.decode_whole)
    whole = _columns.columnarise(path), load_kineto(path, 0)
    monkeypatch.setattr(_columns, "decode_trace", STREAMED)
    with monkeypatch.context() as m:
        m.setattr(_slicer, "_whole_object", _no_whole_decode)
        slices = sum(1 for _ in _columns.decode_trace(path).chunks)
        streamed = _columns.columnarise(path), load_kineto(path, 0)
    return (*streamed, slices), whole


@pytest.mark.parametrize("name", [p.name for p in HTA_FILES])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_real_hta_traces_stream_like_whole(name, chunk, tmp_path, monkeypatch):
    gz = HTA / name
    plain = tmp_path / name.removesuffix(".gz")
    plain.write_bytes(gzip.decompress(gz.read_bytes()))
    for path in (gz, plain):
        (cols, tl, slices), (wcols, wtl) = _both_ways(path, monkeypatch, chunk)
        assert cols.n_events > 4000 and cols.distributed_info["rank"] in (0, 1)
        assert slices > (100 if chunk == 4096 else 0)
        _assert_same(cols, wcols, "columns")
        _assert_same(tl, wtl, "timeline")


@pytest.mark.parametrize("layout", ["before", "after", "bare"])
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_generated_traces_stream_like_whole(layout, suffix, tmp_path, monkeypatch):
    events = _steps(30)
    path = _write(tmp_path / f"t{suffix}", _doc(events, layout), indent=1 if layout == "after" else None)
    (cols, tl, slices), (wcols, wtl) = _both_ways(path, monkeypatch, 4096)
    assert slices > 50  # the array spans many slices
    assert cols.n_events == len(events) and cols.distributed_info["rank"] == 3
    assert "aten::add_\u2728" in cols.names and "python3 \u00e9\u4e2d" in cols.process_name.values()
    assert ("Spans", "PyTorch Profiler") in cols.tracks  # string ids beside integer ones
    _assert_same(cols, wcols, "columns")
    _assert_same(tl, wtl, "timeline")
    assert tl.rank == 3


def test_report_json_is_the_same_streamed_or_whole(tmp_path, monkeypatch):
    path = _write(tmp_path / "rank3.json.gz", _doc(_steps(12), "after"))
    hta = tmp_path / "hta.json"
    hta.write_bytes(gzip.decompress(HTA_FILES[0].read_bytes()))
    monkeypatch.setattr(_slicer, "CHUNK_BYTES", 8192)
    for p in (path, hta):
        outs = []
        for stream in (True, False):
            monkeypatch.setattr(_columns, "decode_trace", STREAMED if stream else _slicer.decode_whole)
            out = tmp_path / f"{p.stem}-{stream}.json"
            assert main(["report", str(p), "--format", "json", "--output", str(out)]) == 0
            outs.append(out.read_text())
        assert outs[0] == outs[1]
        assert json.loads(outs[0])["breakdown"]


def test_array_far_from_the_start_falls_back_to_whole_decode(tmp_path, monkeypatch):
    events = _steps(3)
    path = _write(tmp_path / "t.json", {"big": ["x" * 100] * 200, **_doc(events, "before")})
    monkeypatch.setattr(_slicer, "_HEAD_LIMIT", 4096)  # the array starts past it
    calls = []
    whole = _slicer._whole_object
    monkeypatch.setattr(_slicer, "_whole_object", lambda p, out: calls.append(p) or whole(p, out))
    cols = _columns.columnarise(path)
    assert calls == [path] and cols.n_events == len(events) and cols.distributed_info["rank"] == 3


def test_events_array_start_ignores_strings_and_nested_keys():
    doc = json.dumps({**BEFORE, "traceEvents": [{"ph": "X"}], **AFTER}).encode()
    at = _slicer._events_array_start(doc, 0, len(doc))
    assert doc[at - 15: at + 1] == b'"traceEvents": [' and doc.count(b'"traceEvents"') > 2
    assert doc.index(b'"traceEvents"') < at - 15  # earlier occurrences (nested, in strings) were skipped
    assert _slicer._events_array_start(doc, 0, 40) == _slicer._MORE  # the window ends inside the object
    assert _slicer._events_array_start(b'{"a": {"traceEvents": []}}', 0, 26) is None
    assert _slicer._events_array_start(b'{"traceEvents": {"x": []}}', 0, 26) is None


def test_bad_event_is_named_by_its_position_in_the_file(tmp_path, monkeypatch):
    events = _steps(20)
    events[2345]["ph"] = 7
    path = _write(tmp_path / "t.json", _doc(events, "before"))
    msgs = []
    for stream in (True, False):
        monkeypatch.setattr(_columns, "decode_trace", STREAMED if stream else _slicer.decode_whole)
        monkeypatch.setattr(_slicer, "CHUNK_BYTES", 4096)
        with pytest.raises(ProfileError) as exc:
            _columns.columnarise(path)
        msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] and "$.traceEvents[2345].ph" in msgs[0]


# ---------------------------------------------------------------------------------------------------
# peak memory

# The child's own peak resident memory: VmHWM of its address space. (ru_maxrss would do, but on Linux it
# keeps the peak of the process it was forked from across exec: here, pytest's.)
_PEAK = """
import sys
from pathlib import Path
from profile_analyzer.loaders import _columns, _slicer
from profile_analyzer.loaders.kineto import load_kineto
if sys.argv[2] != "stream":
    _columns.decode_trace = _slicer.decode_whole
tl = load_kineto(Path(sys.argv[1]), 0)
assert len(tl) > 100_000 and tl.rank == 5
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
print(int(hwm.split()[1]) * 1024)
"""


def _write_big(path: Path, target_bytes: int) -> int:
    """A Kineto trace of about ``target_bytes``, written slice by slice (never whole in memory)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        head = json.dumps({**BEFORE, "distributedInfo": {"backend": "nccl", "rank": 5, "world_size": 8}})
        f.write(head[:-1] + ', "traceEvents": [')
        written, step, t0 = 0, 0, 1_700_000_000_000_000
        while written < target_bytes:
            text = json.dumps(_steps(10, ops=100, t0=t0 + step * 1_000_000))[1:-1]
            f.write((", " if step else "") + text)
            written += len(text) + 2
            step += 1
        f.write("], " + json.dumps(AFTER)[1:])
    return path.stat().st_size


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_peak_memory_of_a_150_mb_trace(tmp_path):
    path = tmp_path / "big.json"
    size = _write_big(path, 150 << 20)
    gz = tmp_path / "big.json.gz"
    with open(path, "rb") as src, gzip.open(gz, "wb", compresslevel=1) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    peaks = {}
    for p, mode in ((path, "stream"), (gz, "stream"), (path, "whole")):
        res = subprocess.run([sys.executable, "-c", _PEAK, str(p), mode], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        peak = peaks[p.name, mode] = int(res.stdout.split()[-1])
        print(f"{p.name} ({mode}): {size / 2**20:.0f} MiB trace (uncompressed), load peak {peak / 2**20:.0f} MiB = "
              f"{peak / size:.2f}x")  # shown with -s; docs/profile-analysis.md quotes it
    assert peaks["big.json", "stream"] < 1.5 * size and peaks["big.json.gz", "stream"] < 1.5 * size, peaks
    assert peaks["big.json", "whole"] > 2 * peaks["big.json", "stream"], peaks  # what streaming saves


# ---------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written


def _report(path: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profile_analyzer", "report", str(path), "--format", "json",
                           "--output", str(out)], capture_output=True, text=True, timeout=120)


def _cut(text: str, at: int, suffix: str, tmp_path: Path, name: str) -> Path:
    p = tmp_path / (name + suffix)
    data = text[:at].encode()
    p.write_bytes(gzip.compress(data) if suffix == ".json.gz" else data)
    return p


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_bad_kineto_input_is_one_line_exit_2(suffix, tmp_path):
    text = json.dumps(_doc(_steps(40), "after"))
    end = text.index('], "traceName"')
    cases = {
        "cut-in-array": (_cut(text, len(text) // 2, suffix, tmp_path, "a"), "truncated or invalid JSON"),
        "cut-after-array": (_cut(text, end + 1, suffix, tmp_path, "b"), "truncated or invalid JSON"),
        "cut-in-tail": (_cut(text, len(text) - 30, suffix, tmp_path, "c"), "truncated or invalid JSON"),
        "not-json": (_cut('{"traceEvents": [{"ph": "X",, }]}', 99, suffix, tmp_path, "d"), "truncated or invalid JSON"),
        "not-a-list": (_cut('{"traceEvents": {"ph": "X"}, "x": 1}', 99, suffix, tmp_path, "e"), "not a trace"),
        "not-events": (_cut('{"traceEvents": [1, 2], "x": 1}', 99, suffix, tmp_path, "f"), "not a trace"),
    }
    for what, (path, needle) in cases.items():
        out = tmp_path / f"{what}.out.json"
        res = _report(path, out)
        assert res.returncode == 2, (what, res.stderr)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in res.stderr, (what, res.stderr)
        assert path.name in lines[0] and needle in lines[0], (what, lines[0])
        assert not out.exists()
