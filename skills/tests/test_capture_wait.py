"""dbo-debug/capture_profile waits for the profiler to finish writing before it reads anything.

vLLM's torch profiler writes its trace in place, and on a busy machine (or an NPU flushing a large capture)
that takes longer than any fixed pause. A small local HTTP server stands in for the vLLM server's
/health, /start_profile and /stop_profile endpoints (only those: nothing here is about vLLM itself, which
test_debug_e2e covers); on /stop_profile it writes a real gzip Kineto trace in two parts with a pause between,
as a slow writer would. The rendered script must wait for the second part, then the real profile-analyzer
reads the complete trace.
"""

from __future__ import annotations

import gzip
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SKILLS = Path(__file__).resolve().parents[1]

WRITE_PAUSE_S = 8.0  # longer than the fixed 5 s pause the script used to make


def _kineto_trace() -> bytes:
    ev = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000}]
    for i in range(400):  # enough events that half the gzip stream is not a whole JSON document
        t = i * 2
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t, "dur": 1})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": 1, "tid": 2, "ts": t + 1, "dur": 2})
    return gzip.compress(json.dumps({"traceEvents": ev}).encode())


class _FakeServer(http.server.ThreadingHTTPServer):
    profile_dir: Path
    writer: threading.Thread | None = None


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _FakeServer

    def log_message(self, *args: object) -> None:
        pass

    def _ok(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # /health
        self._ok()

    def do_POST(self) -> None:
        if self.path == "/stop_profile":
            data = _kineto_trace()
            target = self.server.profile_dir / "host_1.pt.trace.json.gz"

            def write() -> None:
                with open(target, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    time.sleep(WRITE_PAUSE_S)
                    f.write(data[len(data) // 2:])

            self.server.writer = threading.Thread(target=write, daemon=True)
            self.server.writer.start()
        self._ok()


def _capture(tmp_path: Path, render_mod, flush_timeout_s: int) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """Render capture_profile.sh against the stand-in endpoints and run it: (result, seconds, report path)."""
    prof = tmp_path / "prof"
    prof.mkdir()
    report_json = tmp_path / "reports" / "r.json"
    server = _FakeServer(("127.0.0.1", 0), _Handler)
    server.profile_dir = prof
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        script = tmp_path / "capture.sh"
        render_mod.write_atomically(script, render_mod.render(SKILLS / "dbo-debug", "capture_profile.sh", {
            "label": "writer", "base_url": f"http://127.0.0.1:{server.server_address[1]}", "model": "m",
            "profile_dir": str(prof), "report_json": str(report_json), "bench_cmd": f"{sys.executable} -c pass",
            "analyzer": f"{sys.executable} -m profile_analyzer", "num_prompts": 1, "input_len": 8, "output_len": 2,
            "concurrency": 1, "health_timeout_s": 10, "bench_timeout_s": 30, "stop_timeout_s": 10,
            "flush_timeout_s": flush_timeout_s, "analyse_timeout_s": 30,
        }))
        started = time.monotonic()
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        return done, time.monotonic() - started, report_json
    finally:
        server.shutdown()
        server.server_close()


def test_capture_waits_for_a_slow_trace_writer(tmp_path: Path, render_mod) -> None:
    done, took, report_json = _capture(tmp_path, render_mod, flush_timeout_s=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert took >= WRITE_PAUSE_S  # it waited for the writer
    report = json.loads(report_json.read_text())
    assert report["source"]["format"] == "kineto"
    (row,) = report["breakdown"]
    assert row["computing"] == pytest.approx(400.0) and row["communication"] > 0


def test_capture_gives_up_on_a_writer_that_never_finishes(tmp_path: Path, render_mod) -> None:
    """A trace still incomplete when the flush timeout ends is reported: exit 1, no report."""
    done, _, report_json = _capture(tmp_path, render_mod, flush_timeout_s=4)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "still being written" in done.stderr
    assert not report_json.exists()
