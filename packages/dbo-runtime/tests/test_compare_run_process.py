"""`compare run` stops the whole process group of an engine run it gives up on (timeout, Ctrl-C, SIGTERM): vLLM's
engine core and workers run below the `generate` child, so killing the child alone would leave them running.
The stand-in for the vLLM interpreter is a shell script that starts a long-lived grandchild and waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAKE_PYTHON = """#!/bin/sh
sleep 300 &
echo $! > "{pidfile}"
wait
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _fake(tmp_path: Path) -> tuple[Path, Path]:
    pidfile = tmp_path / "grandchild.pid"
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON.format(pidfile=pidfile))
    fake.chmod(0o755)
    return fake, pidfile


def _grandchild(pidfile: Path) -> int:
    for _ in range(100):
        if pidfile.is_file() and pidfile.read_text().strip():
            return int(pidfile.read_text())
        time.sleep(0.1)
    raise AssertionError("the stand-in engine did not start")


def _command(tmp_path: Path, fake: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dbo_runtime.cli", "compare", "run", "--model", str(tmp_path),
            "--vllm-python", str(fake), "--workdir", str(tmp_path / "work"), *extra]


def test_a_timeout_stops_the_engine_group(tmp_path: Path) -> None:
    fake, pidfile = _fake(tmp_path)
    proc = subprocess.run(_command(tmp_path, fake, "--timeout", "3"), capture_output=True, text=True, timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "did not finish within 3 s" in lines[0], proc.stderr
    grandchild = _grandchild(pidfile)
    deadline = time.monotonic() + 20
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(grandchild)


def test_sigterm_stops_the_engine_group(tmp_path: Path) -> None:
    fake, pidfile = _fake(tmp_path)
    proc = subprocess.Popen(_command(tmp_path, fake), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        grandchild = _grandchild(pidfile)
        assert _alive(grandchild)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.monotonic() + 20
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(grandchild)


def test_a_missing_local_model_directory_is_refused_before_any_engine(tmp_path: Path) -> None:
    fake, pidfile = _fake(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "dbo_runtime.cli", "compare", "run", "--model", str(tmp_path / "nope"),
                           "--vllm-python", str(fake)], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "no such directory" in lines[0], proc.stderr
    assert not pidfile.exists()
