"""vLLM general plugin `kv_capacity`: the KV-cache budget check, before any weight is loaded.

vLLM checks that one request of `max_model_len` tokens fits the KV cache only after it has started its
workers, loaded the weights and run a profiling forward pass (`get_kv_cache_configs`, called from
`EngineCore._initialize_kv_caches`). With `--kv-cache-memory-bytes` the budget is known from the start, so
the same verdict can be given as soon as the engine config exists.

How it hooks in (vLLM 0.32): vLLM calls `load_general_plugins()` from `EngineArgs.__post_init__` (and from
the CLI parser, the engine core and every worker), which calls `register()`. `register()` wraps
`EngineArgs.create_engine_config`: after vLLM has built and validated the `VllmConfig` (platform defaults
applied, e.g. the CPU backend's block size), the wrapper runs `kv_capacity.check` with the resolved settings.
`vllm serve`, the OpenAI API server and `vllm.LLM` all build their config there, in the front-end process,
before the engine core process or any worker starts.

* Budget unset (or `num_gpu_blocks_override`, `--max-model-len auto`, pipeline/context parallelism,
  speculative decoding, where vLLM's sizing has terms the planner does not model): nothing happens.
* Budget too small: `EarlyKVCacheCheckError` (a `ValueError`, as vLLM's own error, and an
  `InsufficientKVCacheError`) with vLLM's message plus the fix (smallest budget, longest max_model_len).
* The plugin's own imports fail, or the config lacks what it reads: one warning, vLLM continues unchecked.
* `KV_CAPACITY_PLUGIN=off` disables it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Any

# A child of vLLM's "vllm" logger, so the lines carry vLLM's format and level settings.
logger = logging.getLogger("vllm.kv_capacity_plugin")

ENV_SWITCH = "KV_CAPACITY_PLUGIN"
_WRAPPED_MARK = "_kv_capacity_early_check"
_warned: set[str] = set()

# Resolved torch dtype of the model -> the planner's name for it (kv_cache_dtype "auto").
_TORCH_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def enabled() -> bool:
    """False when KV_CAPACITY_PLUGIN is off/0/false/no."""
    return os.environ.get(ENV_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


@functools.lru_cache(maxsize=1)
def _error_class() -> type:
    from kv_capacity.errors import InsufficientKVCacheError

    class EarlyKVCacheCheckError(InsufficientKVCacheError, ValueError):
        """vLLM would refuse this KV cache budget after loading the model; refused before instead."""

    EarlyKVCacheCheckError.__module__ = __name__
    EarlyKVCacheCheckError.__qualname__ = "EarlyKVCacheCheckError"
    return EarlyKVCacheCheckError


def settings_from_config(vllm_config: Any):  # -> kv_capacity.Settings | None
    """The planner's Settings read off a VllmConfig (without the check rule); None when the check does not apply.

    Raises AttributeError/KeyError/TypeError/ValueError when the config is not shaped as expected, and
    KVCapacityInputError when the model is not one the planner sizes.
    """
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    scheduler = vllm_config.scheduler_config
    budget = cache.kv_cache_memory_bytes
    if not budget:  # unset, or 0 (vLLM then profiles as if unset)
        return None
    if cache.num_gpu_blocks_override is not None:
        return None
    if getattr(model, "original_max_model_len", None) == -1:  # --max-model-len auto: vLLM fits it itself
        return None
    if parallel.pipeline_parallel_size != 1 or getattr(parallel, "decode_context_parallel_size", 1) != 1:
        return None
    if vllm_config.speculative_config is not None:
        return None
    block_size = cache.block_size
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"cache_config.block_size is {block_size!r}, not resolved to a positive integer")
    kv_cache_dtype = cache.cache_dtype
    if kv_cache_dtype == "auto":
        dtype_name = str(model.dtype)
        if dtype_name not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"model dtype {dtype_name} is not one the planner sizes")
        kv_cache_dtype = _TORCH_DTYPE_NAMES[dtype_name]
    from kv_capacity.settings import Settings

    fields = {
        "kv_cache_memory_bytes": int(budget),
        "max_model_len": int(model.max_model_len),
        "block_size": block_size,
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "kv_cache_dtype": str(kv_cache_dtype),
        "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
        "max_concurrent_batches": int(vllm_config.max_concurrent_batches),
        "disable_hybrid_kv_cache_manager": bool(scheduler.disable_hybrid_kv_cache_manager),
    }
    return Settings(model_spec_from_config(vllm_config), **fields)


def model_spec_from_config(vllm_config: Any):  # -> kv_capacity.ModelSpec
    """The model's KV shape: its local config.json when there is one, else the config vLLM loaded."""
    from kv_capacity.model_spec import load_model, spec_from_config

    model = vllm_config.model_config
    local = Path(str(model.model)) / "config.json"
    if local.is_file():
        return load_model(str(local.parent))
    return spec_from_config(model.hf_config.to_dict(), name=str(model.model), source="vLLM's loaded config")


def early_check(vllm_config: Any) -> None:
    """Raise EarlyKVCacheCheckError when vLLM would refuse this budget at start-up; otherwise return."""
    try:
        settings = settings_from_config(vllm_config)
        if settings is None:
            return
        from kv_capacity.check import check
        from kv_capacity.errors import InsufficientKVCacheError, KVCapacityInputError
    except Exception as exc:  # the config is not what this plugin understands: vLLM decides alone
        _warn_once("config", "kv_capacity plugin: early KV cache check skipped, vLLM's config looks unexpected "
                   "(%s: %s); vLLM continues and checks the budget itself after loading the model",
                   type(exc).__name__, exc)
        return
    try:
        from kv_capacity.settings import check_rule, installed_vllm_version

        # the start-up check of the vLLM that is running (0.23 counts every block, 0.32 holds the null block back)
        check(dataclasses.replace(settings, rule=check_rule(installed_vllm_version())))
    except InsufficientKVCacheError as exc:
        error = _error_class()(
            f"{exc} [kv_capacity plugin: refused before loading model weights; "
            f"set {ENV_SWITCH}=off to let vLLM find this out itself]",
            vllm_message=exc.vllm_message,
            needed_bytes=exc.needed_bytes,
            available_bytes=exc.available_bytes,
            max_model_len=exc.max_model_len,
            estimated_max_model_len=exc.estimated_max_model_len,
            min_kv_cache_memory_bytes=exc.min_kv_cache_memory_bytes,
        )
        raise error from None
    except KVCapacityInputError as exc:
        _warn_once("model", "kv_capacity plugin: early KV cache check skipped (%s); vLLM continues", exc)


def _wrap_create_engine_config(engine_args_cls: type) -> bool:
    original = engine_args_cls.create_engine_config
    if getattr(original, _WRAPPED_MARK, False):
        return False

    @functools.wraps(original)
    def create_engine_config(self, *args: Any, **kwargs: Any):
        config = original(self, *args, **kwargs)
        if enabled():
            early_check(config)
        return config

    setattr(create_engine_config, _WRAPPED_MARK, True)
    create_engine_config.__wrapped_original__ = original  # type: ignore[attr-defined]
    engine_args_cls.create_engine_config = create_engine_config
    return True


def register() -> None:
    """vLLM general plugin entry point: install the early check (idempotent; inactive when switched off)."""
    if not enabled():
        return
    try:
        from vllm.engine.arg_utils import EngineArgs

        import kv_capacity.check  # noqa: F401  (fail here, not at check time, when the planner is broken)
        import kv_capacity.model_spec  # noqa: F401
    except Exception as exc:
        _warn_once("import", "kv_capacity plugin: not installed, import failed (%s: %s); vLLM continues "
                   "without the early KV cache check", type(exc).__name__, exc)
        return
    _wrap_create_engine_config(EngineArgs)


def unregister() -> None:
    """Undo register() (for tests and tools that construct configs on purpose)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:
        return
    current = EngineArgs.create_engine_config
    original = getattr(current, "__wrapped_original__", None)
    if getattr(current, _WRAPPED_MARK, False) and original is not None:
        EngineArgs.create_engine_config = original
