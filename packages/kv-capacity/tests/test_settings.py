"""The Settings object: the one input of plan, required_bytes, check, the plugin and verify."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from kv_capacity import (
    InsufficientKVCacheError,
    KVCapacityInputError,
    Settings,
    check,
    check_rule,
    load_model,
    plan,
    preset_names,
    required_bytes,
)
from kv_capacity.model_spec import load_preset_config
from kv_capacity.plugin import settings_from_config
from kv_capacity.verify import VLLMRun, settings_of_run

GiB = 1 << 30


@pytest.mark.parametrize("name", preset_names())
def test_settings_and_keyword_forms_give_the_same_answers(name):
    spec = load_model(name)
    fields = dict(max_model_len=32768, block_size=16, kv_cache_dtype="fp8", max_num_batched_tokens=512,
                  max_concurrent_batches=1, rule=check_rule("0.23.0"))
    for budget in (1 << 20, 8 * GiB):
        settings = Settings(spec, kv_cache_memory_bytes=budget, **fields)
        assert plan(settings) == plan(spec, kv_cache_memory_bytes=budget, **fields)
        try:
            by_keywords = check(spec, kv_cache_memory_bytes=budget, **fields)
        except InsufficientKVCacheError as exc:
            with pytest.raises(InsufficientKVCacheError) as raised:
                check(settings)
            assert str(raised.value) == str(exc)
        else:
            assert check(settings) == by_keywords
    settings = Settings(spec, **fields)
    assert required_bytes(settings, concurrency=3) == required_bytes(spec, concurrency=3, **fields)
    # required_bytes ignores the budget, and its answer is a budget plan() accepts for three requests
    needed = required_bytes(dataclasses.replace(settings, kv_cache_memory_bytes=1), concurrency=3)
    assert needed == required_bytes(settings, concurrency=3)
    assert plan(dataclasses.replace(settings, kv_cache_memory_bytes=needed)).max_concurrency >= 3


def test_settings_is_frozen_hashable_and_not_mixed_with_keywords():
    settings = Settings(load_model("qwen3-8b"), max_model_len=4096, kv_cache_memory_bytes=GiB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.block_size = 16  # type: ignore[misc]
    assert hash(settings) == hash(dataclasses.replace(settings))
    with pytest.raises(TypeError, match="max_model_len"):
        plan(settings, max_model_len=8192)
    with pytest.raises(TypeError):
        Settings(load_model("qwen3-8b"), 4096)  # everything but the model is a keyword


def test_a_bad_value_in_settings_is_the_planners_one_line_error():
    spec = load_model("qwen3-8b")
    with pytest.raises(KVCapacityInputError, match="^block size 0 is not allowed; expected a positive integer$"):
        plan(Settings(spec, max_model_len=4096, kv_cache_memory_bytes=GiB, block_size=0))
    with pytest.raises(KVCapacityInputError, match="^kv cache memory bytes None is not allowed"):
        plan(Settings(spec, max_model_len=4096))  # a plan needs a budget


def _vllm_config(model_dir: str, **cache: object) -> SimpleNamespace:
    """The attributes of a vLLM 0.32 VllmConfig that the plugin reads."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(**{"kv_cache_memory_bytes": 3 * GiB, "num_gpu_blocks_override": None,
                                        "block_size": 16, "cache_dtype": "auto", **cache}),
        model_config=SimpleNamespace(model=model_dir, max_model_len=8192, dtype="torch.bfloat16",
                                     original_max_model_len=8192),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=4096, disable_hybrid_kv_cache_manager=True),
        speculative_config=None,
        max_concurrent_batches=1,
    )


def test_plugin_reads_settings_off_vllms_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_preset_config("qwen3-8b")))
    settings = settings_from_config(_vllm_config(str(tmp_path)))
    assert settings == Settings(load_model(str(tmp_path)), kv_cache_memory_bytes=3 * GiB, max_model_len=8192,
                                block_size=16, tensor_parallel_size=2, kv_cache_dtype="bfloat16",
                                max_num_batched_tokens=4096, max_concurrent_batches=1,
                                disable_hybrid_kv_cache_manager=True)
    assert settings_from_config(_vllm_config(str(tmp_path), kv_cache_memory_bytes=None)) is None
    assert settings_from_config(_vllm_config(str(tmp_path), num_gpu_blocks_override=20)) is None


def test_verify_plans_for_the_settings_vllm_resolved(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_preset_config("gemma-3-12b")))
    resolved = {"kv_cache_memory_bytes": 2 * GiB, "max_model_len": 16384, "block_size": 32, "tensor_parallel_size": 1,
                "kv_cache_dtype": "fp8", "max_num_batched_tokens": 1024, "max_concurrent_batches": 2,
                "disable_hybrid_kv_cache_manager": False, "gpu_memory_utilization": 0.9}
    run = VLLMRun(args=[], outcome="capacity", elapsed_s=1.0, resolved=resolved)
    settings = settings_of_run(str(tmp_path), run)
    assert (settings.kv_cache_memory_bytes, settings.block_size, settings.kv_cache_dtype,
            settings.max_num_batched_tokens) == (2 * GiB, 32, "fp8", 1024)
    with pytest.raises(KVCapacityInputError, match="without a KV cache budget"):
        settings_of_run(str(tmp_path), VLLMRun(args=[], outcome="capacity", elapsed_s=1.0,
                                               resolved={**resolved, "kv_cache_memory_bytes": None}))
