"""The early check: fail as vLLM would at start-up when one request at max_model_len does not fit."""

from __future__ import annotations

from kv_capacity.errors import InsufficientKVCacheError
from kv_capacity.model_spec import ModelSpec
from kv_capacity.planner import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CapacityPlan,
    plan,
)
from kv_capacity.sizes import GiB, to_vllm_flag_value


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


def check(
    spec: ModelSpec,
    *,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_concurrent_batches: int = DEFAULT_MAX_CONCURRENT_BATCHES,
    disable_hybrid_kv_cache_manager: bool = False,
) -> CapacityPlan:
    """Return the plan when vLLM would start; raise InsufficientKVCacheError (vLLM's text + the fix) when not."""
    result = plan(
        spec,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=max_model_len,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_concurrent_batches=max_concurrent_batches,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
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
