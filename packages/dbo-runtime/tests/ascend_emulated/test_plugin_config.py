"""The plugin on a real ``VllmConfig`` under vllm-ascend's ``NPUPlatform`` (whose ``check_and_update_config`` resets
``enable_dbo``): DBO is turned back on where it can run and refused with one line where it cannot (fault 5: a dense
model without FlashComm1). Real: vLLM's ``EngineArgs.create_engine_config``, vllm-ascend's platform and ascend config,
this project's plugin entry point as vLLM loaded it."""

from __future__ import annotations

import _emu
import pytest


def test_dense_model_with_flashcomm1_keeps_dbo() -> None:
    cfg = _emu.vllm_config(enable_dbo=True, tensor_parallel_size=2, additional_config={"enable_flashcomm1": True})
    assert cfg.parallel_config.enable_dbo is True


def test_dense_model_without_flashcomm1_is_refused_in_one_line() -> None:
    with pytest.raises(Exception) as info:
        _emu.vllm_config(enable_dbo=True, tensor_parallel_size=2)
    text = str(info.value)
    assert "Qwen3ForCausalLM without FlashComm1" in text and '"enable_flashcomm1": true' in text


def test_moe_model_keeps_dbo_without_flashcomm1() -> None:
    cfg = _emu.vllm_config("qwen3_moe", enable_dbo=True, tensor_parallel_size=2, enable_expert_parallel=True)
    assert cfg.parallel_config.enable_dbo is True


def test_greenlet_scheduler_is_refused_before_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found here: with DBO_RUNTIME_SCHEDULER=greenlet the emulated engine aborted at its first split step
    (pybind11 'loader_life_support: internal error': the MoE site yields inside vllm::moe_forward's kernel). Now the
    configuration is refused in one line instead."""
    monkeypatch.setenv("DBO_RUNTIME_SCHEDULER", "greenlet")
    with pytest.raises(Exception) as info:
        _emu.vllm_config("qwen3_moe", enable_dbo=True, tensor_parallel_size=2)
    assert "the greenlet scheduler" in str(info.value) and "unset DBO_RUNTIME_SCHEDULER" in str(info.value)
