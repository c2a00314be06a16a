"""Test helpers shared by the packages' tests (imported by tests only)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

__all__ = ["run_module_measured"]

# The child reads its own high-water mark at exit. ``os.wait4``'s ``ru_maxrss`` cannot be used: Linux carries the
# parent's peak into a forked child across exec, so a child of a 650 MiB pytest process "peaks" at 650 MiB however
# little it uses itself (a fresh-clone CI run failed a 512 MiB bound that way).
_WRAPPER = """\
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        kib = next(line for line in f if line.startswith("VmHWM:")).split()[1]
    with open(os.environ["TOOLKIT_PEAK_RSS_FILE"], "w") as out:
        out.write(kib)
atexit.register(_peak)
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_module_measured(module: str, *args: str) -> tuple[int, str, float, int]:
    """``python -m MODULE ARGS``: (exit code, stderr, seconds, the child's own peak RSS in bytes). Linux only
    (``/proc/self/status``); the peak is 0 when the child died before its exit handlers ran."""
    fd, peak_file = tempfile.mkstemp(prefix="peak-rss-")
    os.close(fd)
    try:
        begin = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _WRAPPER, module, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                              env={**os.environ, "TOOLKIT_PEAK_RSS_FILE": peak_file}, check=False)
        seconds = time.monotonic() - begin
        with open(peak_file) as f:
            text = f.read().strip()
        return proc.returncode, proc.stderr, seconds, int(text) * 1024 if text else 0
    finally:
        os.unlink(peak_file)
