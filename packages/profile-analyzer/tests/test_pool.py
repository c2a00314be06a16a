"""The loader's process pool on an error: the error reaches the caller, and the pool leaves nothing running that
the interpreter's exit could trip over (CI twice printed "Exception ignored ... Bad file descriptor" after the
one-line error, from concurrent.futures' exit hook writing to a wake-up pipe its manager thread was closing)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from profile_analyzer._pool import map_in_processes


def _job(i: int, fail_at: int) -> int:
    if i == fail_at:
        raise ValueError(f"job {i} failed")
    time.sleep(0.05 * i)
    return i * i


def test_results_in_job_order():
    got: list[tuple[int, int]] = []
    map_in_processes(_job, [(i, -1) for i in range(5)], 2, lambda i, r: got.append((i, r)))
    assert got == [(i, i * i) for i in range(5)]


def test_error_stops_pool_and_its_manager_thread():
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="job 0 failed"):
        map_in_processes(_job, [(i, 0) for i in range(4)], 2, lambda i, r: None)
    # the executor's manager thread has finished (it closed its wake-up pipe), so the exit hook has nothing to race
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], left


def test_error_exit_prints_only_the_error():
    """A process that catches the pool's error and exits prints that error and nothing else (five tries: a race)."""
    code = "\n".join([
        "import sys",
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "from profile_analyzer._pool import map_in_processes",
        "from test_pool import _job",
        "try:",
        "    map_in_processes(_job, [(i, 0) for i in range(4)], 2, lambda i, r: None)",
        "except ValueError as e:",
        "    sys.exit(f'error: {e}')",
    ])
    for _ in range(5):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert res.returncode == 1 and res.stderr.strip() == "error: job 0 failed", res.stderr
