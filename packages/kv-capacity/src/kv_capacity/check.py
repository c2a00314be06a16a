"""The early check: fail as vLLM would at start-up when one request at max_model_len does not fit."""

from __future__ import annotations

import os
from typing import Any

from kv_capacity.errors import InsufficientKVCacheError
from kv_capacity.model_spec import ModelSpec
from kv_capacity.planner import CapacityPlan, plan
from kv_capacity.settings import Settings
from kv_capacity.sizes import GiB, to_vllm_flag_value


def max_model_len_error(spec: ModelSpec, max_model_len: int) -> str | None:
    """vLLM's start-up error for a max_model_len above what the model's config allows, or None.

    vLLM derives the limit from max_position_embeddings (times a RoPE scaling factor) and refuses a longer
    max_model_len unless config.json's model_max_length allows it or VLLM_ALLOW_LONG_MAX_MODEL_LEN is set
    (vllm/config/model.py, _get_and_verify_max_len).
    """
    if spec.max_position_embeddings is None:
        return None
    factor = spec.rope_scaling_factor
    derived: float | int = spec.max_position_embeddings * factor if factor != 1.0 else spec.max_position_embeddings
    if max_model_len <= derived:
        return None
    if spec.model_max_length is not None and max_model_len <= spec.model_max_length:
        return None
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return None
    return (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"(max_position_embeddings={derived} or model_max_length={spec.model_max_length} in model's "
        "config.json). To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
    )


def max_model_len_hint(spec: ModelSpec) -> str:
    """What to change when max_model_len is above the model's limit."""
    limit = int(spec.max_position_embeddings * spec.rope_scaling_factor) if spec.max_position_embeddings else 0
    return (
        f"Use --max-model-len {limit} or less (the model's limit), or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
        "if the model really handles longer sequences."
    )


def fix_hint(result: CapacityPlan) -> str:
    """What to change so the engine starts: the smallest budget, or the longest max_model_len."""
    smallest = result.min_kv_cache_memory_bytes
    hint = (
        f"The smallest sufficient budget is {smallest:,} bytes ({smallest / GiB:.3f} GiB): "
        f"--kv-cache-memory-bytes {to_vllm_flag_value(smallest)}"
    )
    if smallest % (1 << 20):
        rounded = -(-smallest // (1 << 20)) * (1 << 20)
        hint += f" (or {to_vllm_flag_value(rounded)})"
    if result.estimated_max_model_len > 0:
        hint += f"; or keep the budget and use --max-model-len {result.estimated_max_model_len}"
    return hint + "."


def check(settings: Settings | ModelSpec, /, **fields: Any) -> CapacityPlan:
    """Return the plan when vLLM would start; raise InsufficientKVCacheError (vLLM's text + the fix) when not.
    ``settings.rule``: the start-up check of the vLLM version that will run (default the newest).
    ``check(spec, kv_cache_memory_bytes=..., max_model_len=..., ...)`` is short for ``check(Settings(spec, ...))``."""
    result = plan(Settings.of(settings, fields))
    if result.fits:
        return result
    vllm_message = result.vllm_error_message
    assert vllm_message is not None
    raise InsufficientKVCacheError(
        f"{vllm_message} {fix_hint(result)}",
        vllm_message=vllm_message,
        needed_bytes=result.needed_bytes,
        available_bytes=result.kv_cache_memory_bytes,
        max_model_len=result.max_model_len,
        estimated_max_model_len=result.estimated_max_model_len,
        min_kv_cache_memory_bytes=result.min_kv_cache_memory_bytes,
    )
