"""KV-cache capacity planner for vLLM --kv-cache-memory-bytes.

Public API:
    parse_size(text) -> int
    load_model(name_or_path) -> ModelSpec
    spec_from_config(config_dict, name=...) -> ModelSpec   (a config.json already in memory)
    load_compute_spec(name_or_path) -> ComputeSpec          (what a forward pass computes: hidden, MLP, experts)
    compute_spec_from_config(config_dict, name=...) -> ComputeSpec
    load_config(name_or_path) -> (config_dict, name, source)
    Settings(spec, *, max_model_len, kv_cache_memory_bytes=None, block_size=128, tensor_parallel_size=1,
             kv_cache_dtype="auto", max_num_batched_tokens=2048, max_concurrent_batches=2,
             disable_hybrid_kv_cache_manager=False, rule=None)   (frozen; what the functions below take)
    check_rule(vllm_version) -> CheckRule                   (the start-up check of that vLLM version)
    plan(settings) -> CapacityPlan
    required_bytes(settings, *, concurrency) -> int
    check(settings) -> CapacityPlan, or raises InsufficientKVCacheError

plan, required_bytes and check also take the model and the settings as keywords:
plan(spec, kv_cache_memory_bytes=..., max_model_len=...) is plan(Settings(spec, kv_cache_memory_bytes=..., ...)).
"""

from kv_capacity.check import check
from kv_capacity.errors import InsufficientKVCacheError, KVCapacityError, KVCapacityInputError
from kv_capacity.model_spec import (
    ComputeSpec,
    ModelSpec,
    compute_spec_from_config,
    load_compute_spec,
    load_config,
    load_model,
    preset_names,
    spec_from_config,
)
from kv_capacity.planner import CapacityPlan, KVCacheGroup, bytes_per_token, plan, required_bytes
from kv_capacity.settings import DEFAULT_BLOCK_SIZE, CheckRule, Settings, check_rule
from kv_capacity.sizes import format_gib, parse_size

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "CapacityPlan",
    "CheckRule",
    "ComputeSpec",
    "InsufficientKVCacheError",
    "KVCacheGroup",
    "KVCapacityError",
    "KVCapacityInputError",
    "ModelSpec",
    "Settings",
    "bytes_per_token",
    "check",
    "check_rule",
    "compute_spec_from_config",
    "format_gib",
    "load_compute_spec",
    "load_config",
    "load_model",
    "parse_size",
    "plan",
    "preset_names",
    "required_bytes",
    "spec_from_config",
]
