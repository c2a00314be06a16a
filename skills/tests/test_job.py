"""job.py: long steps in the background with a PID file, a log and an exit-code file, polled by an agent.

Real processes, no mocks: a command that ends well, one that fails, one that is still running when
`wait` gives up (exit 3), and one stopped with its child (the whole process group goes). Bad input is
one line on stderr and exit 2, and nothing is overwritten.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[1] / "job.py"


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for a parent that never reaps counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def job(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_done_and_failed_jobs_report_their_exit_code(tmp_path: Path) -> None:
    assert job(tmp_path, "start", "good", "--", sys.executable, "-c", "print('all fine')").returncode == 0
    assert job(tmp_path, "start", "bad", "--", sys.executable, "-c", "import sys; sys.exit(4)").returncode == 0
    good = job(tmp_path, "wait", "good", "--timeout", "30")
    assert good.returncode == 0 and "good: done, exit code 0" in good.stdout and "all fine" in good.stdout
    bad = job(tmp_path, "wait", "bad", "--timeout", "30")
    assert bad.returncode == 1 and "bad: done, exit code 4" in bad.stdout
    files = sorted(p.name for p in (tmp_path / "jobs").iterdir())
    assert files == [f"{n}.{k}" for n in ("bad", "good") for k in ("json", "log", "pid", "rc")]
    meta = json.loads((tmp_path / "jobs" / "bad.json").read_text())
    assert meta["returncode"] == 4 and meta["cwd"] == str(tmp_path) and meta["ended"] >= meta["started"]
    listing = job(tmp_path, "status")
    assert listing.returncode == 1 and listing.stdout.count("done, exit code") == 2


def test_wait_returns_while_running_and_stop_ends_the_whole_group(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    # The grandchild ignores SIGTERM, as a server busy shutting down may: stop must still end it.
    grandchild_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild_code!r}]);"
              f" open({str(child_pid)!r}, 'w').write(str(p.pid)); print('progress 1/9', flush=True); time.sleep(300)")
    assert job(tmp_path, "start", "long", "--", sys.executable, "-c", script).returncode == 0
    started = time.monotonic()
    waited = job(tmp_path, "wait", "long", "--timeout", "3")
    assert waited.returncode == 3 and "long: running" in waited.stdout
    assert 2.5 <= time.monotonic() - started < 30
    deadline = time.monotonic() + 30
    while not child_pid.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    grandchild = int(child_pid.read_text())
    assert "progress 1/9" in job(tmp_path, "status", "long").stdout
    stopped = job(tmp_path, "stop", "long", "--grace", "5")
    assert stopped.returncode == 1 and "long: done, exit code 143" in stopped.stdout  # SIGTERM = 128 + 15
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(grandchild)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["start", "x"], "start: no command given"),
        (["start", "../evil", "--", "true"], "job name '../evil': letters, digits"),
        (["wait", "nope"], "no job 'nope' in jobs; known: (none)"),
        (["status", "nope", "--", "extra"], "unexpected arguments after --"),
        (["wait", "nope", "--timeout", "soon"], "invalid float value: 'soon'"),
        (["launch"], "invalid choice: 'launch'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = job(tmp_path, *args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


def test_a_name_is_used_once(tmp_path: Path) -> None:
    assert job(tmp_path, "start", "once", "--", sys.executable, "-c", "pass").returncode == 0
    assert job(tmp_path, "wait", "once", "--timeout", "30").returncode == 0
    log_before = (tmp_path / "jobs" / "once.log").read_bytes()
    again = job(tmp_path, "start", "once", "--", sys.executable, "-c", "print('second')")
    assert again.returncode == 2 and "job 'once' already exists" in again.stderr
    assert (tmp_path / "jobs" / "once.log").read_bytes() == log_before
