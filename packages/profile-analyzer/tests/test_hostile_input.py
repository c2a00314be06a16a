"""Hostile and careless input (issue 11): one line naming the input and what is accepted, exit 2, nothing
written; events that cannot be placed follow the documented rule; big or endless input stays bounded."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from profile_analyzer.cli import main
from profile_analyzer.loaders import _columns, _slicer, _timestamps
from toolkit_cli.testing import run_module_measured

BASE = 1_704_161_511_000_000  # µs
DEVICE = {"matmul": -3, "add": -2, "allreduce": -1}  # index from the end of trace()
STEP = 7  # index of the ProfilerStep#7 host range


def ts(us: float) -> str:
    return f"{BASE + us:.3f}"


def trace() -> list[dict]:
    """One step on one NPU: two kernels on a compute stream and an all-reduce on a communication track."""
    hw, hccl, py = 800, 900, 437675
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": py, "tid": 0, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_labels", "pid": py, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": hw, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_labels", "pid": hw, "tid": 0, "args": {"labels": "NPU"}},
        {"ph": "M", "name": "thread_name", "pid": hw, "tid": 5, "args": {"name": "Stream 5"}},
        {"ph": "M", "name": "process_name", "pid": hccl, "tid": 0, "args": {"name": "HCCL"}},
        {"ph": "M", "name": "thread_name", "pid": hccl, "tid": 0, "args": {"name": "Group 42 Communication"}},
        {"ph": "X", "name": "ProfilerStep#7", "pid": py, "tid": py, "ts": ts(90), "dur": 310.0, "cat": "cpu_op"},
    ]
    for pid, tid, name, s, e, args in (
        (hw, 5, "aclnnMatmul_MatMulV3", 100, 150, {"Task Type": "AI_CORE"}),
        (hw, 5, "aclnnAdd", 200, 260, {"Task Type": "AI_VECTOR_CORE"}),
        (hccl, 0, "hcom_allReduce__42_1_1", 140, 210, {}),
    ):
        ev.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts(s), "dur": e - s, "args": args})
    return ev


def profile(tmp_path: Path, events: list[dict], name: str = "p", raw: tuple[bytes, bytes] | None = None) -> Path:
    out = tmp_path / f"{name}_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    text = json.dumps(events).encode()
    if raw:
        text = text.replace(*raw)
    (out / "trace_view.json").write_bytes(text)
    return out.parent


def run(capsys, *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(capsys, *args: str) -> str:
    status, out, err = run(capsys, *args)
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == ""
    return err


def test_the_valid_trace_reports(capsys, tmp_path):
    status, out, _ = run(capsys, "report", str(profile(tmp_path, trace())), "--format", "json")
    assert status == 0 and json.loads(out)["summary"]["steps"] == 1


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda e: e[DEVICE["matmul"]].update(ts=1e300), "with a ts that is not a number in range"),
        (lambda e: e[DEVICE["allreduce"]].update(dur=1e308), "with a dur that is not a number in range"),
        (lambda e: e[DEVICE["matmul"]].pop("ts"), "without ts"),
        (lambda e: [e[i].pop("ts") for i in (DEVICE["matmul"], DEVICE["add"])], "2 without ts"),
        (lambda e: e[DEVICE["add"]].pop("dur"), "without dur"),
        (lambda e: e[DEVICE["add"]].update(dur=-5.0), "with a negative dur"),
        (lambda e: e[DEVICE["add"]].update(dur="fast"), "with a dur that is not a number in range"),
        (lambda e: e[DEVICE["add"]].update(ts="17041615110002x0.000"), "with a ts that is not a number in range"),
        (lambda e: e[DEVICE["add"]].update(ts="9" * 25), "with a ts that is not a number in range"),
    ],
)
def test_a_device_task_that_cannot_be_placed_is_an_error(capsys, tmp_path, change, reason):
    events = trace()
    change(events)
    line = one_line_error(capsys, "report", str(profile(tmp_path, events)))
    assert "cannot be placed" in line and reason in line and "trace_view.json" in line


def test_a_ts_with_bytes_that_are_not_utf8_is_an_error(capsys, tmp_path):
    events = trace()
    events[DEVICE["matmul"]]["ts"] = "@@"
    path = profile(tmp_path, events, raw=(b'"@@"', b'"1704161511000100.000\xff\xfe"'))
    assert "with a ts that is not a number in range" in one_line_error(capsys, "report", str(path))


def test_a_host_event_that_cannot_be_placed_is_skipped_with_a_warning(capsys, tmp_path):
    events = trace()
    del events[STEP]["ts"]
    status, out, err = run(capsys, "report", str(profile(tmp_path, events)), "--format", "json")
    assert status == 0
    warnings = [w["message"] for w in json.loads(out)["warnings"]]
    assert any("1 event(s) (1 without ts)" in w for w in warnings), warnings
    assert "1 without ts" in err  # and on stderr
    status, out, _ = run(capsys, "report", str(profile(tmp_path, events, "text")))
    assert status == 0 and "1 without ts" in out  # and in the text report


def test_numbers_are_parsed_exactly_and_bounded():
    ns, problem = _timestamps.ts_to_ns_checked([b'"1704161511422904.204"', b"1e300", b"null", b"", b'"12x"', b"-3.5",
                                           b"8999999999999999", b"9000000000000000"])
    assert ns.tolist()[:1] == [1704161511422904204] and ns[5] == -3500 and ns[6] == 8999999999999999000
    assert problem.tolist() == [0, _timestamps.BAD_TS, _timestamps.NO_TS, _timestamps.NO_TS, _timestamps.BAD_TS, 0, 0, _timestamps.BAD_TS]
    # found by the fuzzing suite: an exponent without digits raised, one out of range kept a sentinel value
    ns, problem = _timestamps.ts_to_ns_checked([b"0e", b"1e20", b"1.5e3"])
    assert ns.tolist() == [0, 0, 1500000] and problem.tolist() == [_timestamps.BAD_TS, _timestamps.BAD_TS, 0]
    ns, problem = _timestamps.dur_to_ns_checked([1.5, None, -1.0, float("inf"), "2.25", "x", 10**30, True])
    assert ns.tolist()[:1] == [1500] and ns[4] == 2250
    assert problem.tolist() == [0, _timestamps.NO_DUR, _timestamps.NEGATIVE_DUR, _timestamps.BAD_DUR, 0, _timestamps.BAD_DUR,
                                _timestamps.BAD_DUR, _timestamps.BAD_DUR]


def test_a_gzip_with_a_random_body_is_one_line(capsys, tmp_path):
    head = gzip.compress(b"[" + b" " * 100)[:10]
    bad = tmp_path / "trace.json.gz"
    bad.write_bytes(head + bytes(range(256)) * 4)
    assert "not a complete gzip file" in one_line_error(capsys, "report", str(bad))
    truncated = tmp_path / "cut.json.gz"
    truncated.write_bytes(gzip.compress(json.dumps({"traceEvents": trace()}).encode())[:-30])
    assert "not a complete gzip file" in one_line_error(capsys, "report", str(truncated))


def test_a_json_object_without_trace_events_is_named_as_such(capsys, tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"a": 1}')
    line = one_line_error(capsys, "report", str(path))
    assert "without a traceEvents key" in line and "not JSON" not in line


def test_unreadable_and_odd_places_are_one_line(capsys, tmp_path, monkeypatch):
    loop = tmp_path / "loop.json"
    os.symlink(loop, loop)
    assert "loop.json" in one_line_error(capsys, "report", str(loop))
    good = profile(tmp_path, trace())
    real_iterdir = Path.iterdir

    def denied(self):
        if self.name == "ASCEND_PROFILER_OUTPUT" or self.name.endswith("_ascend_pt"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", denied)
    line = one_line_error(capsys, "report", str(good))
    assert "Permission denied" in line


def test_a_trace_file_that_cannot_be_opened_is_not_called_not_json(capsys, tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": trace()}))
    real_open = open

    def denied(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)
    line = one_line_error(capsys, "report", str(path))
    assert "Permission denied" in line and "not JSON" not in line


def test_blank_runs_inside_the_array_are_read_in_linear_time(tmp_path, monkeypatch):
    # before: every 1 MiB block re-scanned all the blanks seen so far (64 MB: 1.3 s, 128 MB: 3.9 s, 1 GiB:
    # past 120 s). With 4 KiB blocks the quadratic scan of 16 MiB would take minutes; linear, well under 10 s.
    monkeypatch.setattr(_slicer, "CHUNK_BYTES", 4096)
    events = trace()
    text = json.dumps(events).encode()
    cut = text.index(b"}, {", len(text) // 2) + 2
    body = text[:cut] + b" " * (16 << 20) + text[cut:]
    for name, data in (("t.json.gz", gzip.compress(body, 1)), ("t.json", body)):
        path = tmp_path / name
        path.write_bytes(data)
        begin = time.monotonic()
        cols = _columns.columnarise(path)
        assert time.monotonic() - begin < 10, name
        assert cols.start_ns.size == 4


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("seen", [1, 2], ids=["while-forking", "workers-running"])
def test_sigterm_stops_the_loader_workers(tmp_path, seen):
    # seen=1 sends SIGTERM as soon as one worker exists: the window where a worker is forked but has not reset the
    # parent's handler, and the executor's manager thread may not have started (it once failed with
    # "cannot join thread before it is started" under CI load).
    synth = pytest.importorskip("profile_analyzer.synth")
    root = tmp_path / "ranks"
    synth.write_profile(root, ranks=4, steps=6, layers=48, dbo=True)
    proc = subprocess.Popen([sys.executable, "-m", "profile_analyzer", "report", str(root), "--jobs", "2",
                             "-o", str(tmp_path / "report.txt")], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and len(workers) < seen and proc.poll() is None:
            workers = [c for c in _children(proc.pid) if _alive(c)]
            time.sleep(0.05 if seen > 1 else 0.001)
        if proc.poll() is not None:
            pytest.skip("the report finished before its workers were seen")
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip() == "profile-analyzer: terminated"  # one line: no worker's traceback either
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    assert workers and not any(_alive(w) for w in workers)
    assert not (tmp_path / "report.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ranks"]  # no temporary file left


def test_output_naming_an_input_trace_is_refused_and_the_trace_kept(capsys, tmp_path):
    folder = profile(tmp_path, trace())
    trace_view = folder / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
    single = tmp_path / "rank0.pt.trace.json"
    single.write_bytes(trace_view.read_bytes())
    before = trace_view.read_bytes()
    for args in (["report", str(single), "-o", str(single)],
                 ["report", "-d", str(single), "--format", "json", "-o", str(tmp_path / "." / single.name)],
                 ["report", str(folder), "-o", str(trace_view)],
                 ["compare", str(folder), str(single), "-o", str(single)],
                 ["whatif", str(folder), "-o", str(trace_view)]):
        line = one_line_error(capsys, *args)
        assert "input" in line and "-o" in line, line
        assert single.read_bytes() == before and trace_view.read_bytes() == before
    status, _, _ = run(capsys, "report", str(single), "-o", str(tmp_path / "report.txt"))
    assert status == 0 and (tmp_path / "report.txt").stat().st_size > 0


@pytest.mark.parametrize("option", ["--switch-us", "--comm-fixed-us", "--compute-scale", "--comm-scale",
                                    "--measured-off-us"])
@pytest.mark.parametrize("value", ["nan", "NaN", "-nan", "inf", "-inf", "1e400", "٣"])
def test_whatif_refuses_a_number_that_is_not_finite(capsys, tmp_path, option, value):
    line = one_line_error(capsys, "whatif", str(profile(tmp_path, trace())), option, value)
    assert option in line and "finite number" in line, line


@pytest.mark.parametrize("option", ["--exposed-factor", "--pp-receive-us", "--comm-fraction"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
def test_synth_refuses_a_number_that_is_not_finite_and_writes_nothing(capsys, tmp_path, option, value):
    out = tmp_path / "synth"
    line = one_line_error(capsys, "synth", str(out), "--dbo", "--exposed-layers", "1", option, value)
    assert option in line and "finite number" in line, line
    assert not out.exists()


@pytest.mark.parametrize("field", ["pp_receive_us", "exposed_factor"])
def test_the_synth_api_refuses_a_number_that_is_not_finite(tmp_path, field):
    synth = pytest.importorskip("profile_analyzer.synth")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            synth.write_profile(tmp_path / "out", **{field: bad})
    assert not (tmp_path / "out").exists()


def gzip_bomb(path: Path, head: bytes, filler: bytes, mib: int, tail: bytes) -> Path:
    """A .gz that expands to ``head + filler * mib MiB + tail``, written in a few milliseconds: one deflated MiB of
    filler repeated as gzip members (a reader joins the members, as gunzip does)."""
    def member(data: bytes) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        return packer.compress(data) + packer.flush()

    block = member(filler * (1 << 20))
    with open(path, "wb") as handle:
        handle.write(member(head))
        for _ in range(mib):
            handle.write(block)
        handle.write(member(tail))
    return path


def run_measured(*args: str) -> tuple[int, str, float, int]:
    """(exit status, stderr, seconds, peak RSS in bytes) of ``python -m profile_analyzer ARGS``, the peak as the
    child measured it (``ru_maxrss`` of a child carries the pytest process's own peak)."""
    return run_module_measured("profile_analyzer", *args)


EVENT_TAIL = b'", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]'


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status VmHWM as on Linux")
@pytest.mark.parametrize("head,filler,mib,tail", [
    (b"[", b" ", 2048, b"]"),  # 2 MB of gzip, 2 GiB of blanks inside the array
    (b'[{"ph": "X", "name": "', b"a", 1024, EVENT_TAIL),  # 1 MB of gzip, one event with a 1 GiB name
    (b'{"traceEvents": [{"ph": "X", "name": "', b"a", 1024, EVENT_TAIL + b"}"),  # the same in a Kineto object
    (b'{"traceEvents": [], "x": "', b"a", 1024, b'"}'),  # 1 GiB after the Kineto array
    (b'{"a": "traceEvents", "x": "', b"a", 1024, b'", "traceEvents": []}'),  # the array past the head: read whole
], ids=["blanks", "name", "kineto-name", "kineto-rest", "kineto-whole"])
def test_a_gzip_bomb_is_refused_in_seconds_at_a_bounded_peak(tmp_path, head, filler, mib, tail):
    # before: the 2 GiB of blanks exited 2 after 22 s at a 4.2 GB peak, the 1 GiB name ran past 60 s at 4.1 GB
    bomb = gzip_bomb(tmp_path / "trace.json.gz", head, filler, mib, tail)
    assert bomb.stat().st_size < 3 << 20
    status, err, seconds, peak = run_measured("report", str(bomb))
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "MiB" in err and "trace.json.gz" in err, err
    assert peak < 512 << 20, f"peak RSS {peak >> 20} MiB"
    assert seconds < 20, seconds


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("workers", [2, 1])
def test_sigterm_during_synth_leaves_nothing(tmp_path, workers):
    # before: exit 143 with a traceback line per pool worker ("Process ForkPoolWorker-2:" ...) and an empty OUT_DIR
    out = tmp_path / "synth"
    proc = subprocess.Popen([sys.executable, "-m", "profile_analyzer", "synth", str(out), "--ranks", "4", "--steps",
                             "20", "--layers", "48", "--dbo", "--workers", str(workers)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not any(tmp_path.rglob("*_ascend_pt")):
            time.sleep(0.01)  # until the first rank folder is being written
        if workers > 1:
            while time.monotonic() < deadline and proc.poll() is None and not _children(proc.pid):
                time.sleep(0.01)
        time.sleep(0.2)
        if proc.poll() is not None:
            pytest.skip("synth finished before the signal")
        workers_seen = [c for c in _children(proc.pid) if _alive(c)]
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and err.strip() == "profile-analyzer: terminated", err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers_seen):
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers_seen)
    assert list(tmp_path.iterdir()) == []  # no OUT_DIR, no temporary folder beside it


def test_synth_into_a_folder_that_holds_something_is_refused_unless_overwrite(capsys, tmp_path):
    # before: a second synth into the same OUT_DIR replaced the first profile's rank folders without a word
    out = tmp_path / "prof"
    args = ["synth", str(out), "--ranks", "1", "--steps", "1", "--layers", "2"]
    assert run(capsys, *args)[0] == 0
    truth = (out / "ground_truth.json").read_bytes()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    line = one_line_error(capsys, *args, "--seed", "5")
    assert "not empty" in line and "--overwrite" in line
    assert (out / "ground_truth.json").read_bytes() == truth and sorted(p.relative_to(out) for p in out.rglob("*")) == before
    (tmp_path / "file").write_text("x")
    assert "not a folder" in one_line_error(capsys, "synth", str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "x"
    (out / "notes.txt").write_text("kept")
    assert run(capsys, *args, "--seed", "5", "--overwrite")[0] == 0
    assert (out / "ground_truth.json").read_bytes() != truth and (out / "notes.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "prof"]  # no temporary folder left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(capsys, "synth", str(empty), "--ranks", "1", "--steps", "1", "--layers", "2")[0] == 0
