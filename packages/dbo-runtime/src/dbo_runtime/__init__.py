"""Dual batch overlap (DBO) runtime for vLLM-Ascend.

The public API is re-exported here lazily, so that `import dbo_runtime` stays cheap (no torch, no
torch_npu) for the vLLM plugin entry point and for `dbo-runtime doctor`:

- split decision: `should_ubatch`, `split_ubatches`, `UBatchSlice`, `slice_request_metadata`,
  `maybe_create_ubatch_slices` (dbo_runtime.ubatch)
- DP agreement: `coordinate_ubatching`, `UBatchDecision` (dbo_runtime.dp_sync)
- the ping-pong: `run_ubatches` (dbo_runtime.workers, the worker threads and the run loop; with
  `mode="greenlet"` or DBO_RUNTIME_SCHEDULER=greenlet both micro-batches run on the caller's thread as greenlets,
  dbo_runtime.greenlets) and the hook API
  `dbo_enabled`, `dbo_current_ubatch_id`, `dbo_yield`, `dbo_switch_to_comm`, `dbo_switch_to_compute`,
  `dbo_register_recv_hook`, `dbo_maybe_run_recv_hook` (dbo_runtime.context)
- communication-site wrappers shared by the reference model and the vLLM-Ascend adapter:
  `dbo_async_site`, `wrap_stream_site` (dbo_runtime.hooks)
- device backends: `get_backend`, `DeviceBackend` (dbo_runtime.devices)
- errors: `DBOError`, `DBOConfigError`, `DBOTimeoutError`, `DBOWorkerError` (dbo_runtime.errors)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ["should_ubatch", "split_ubatches", "UBatchSlice", "slice_request_metadata",
         "maybe_create_ubatch_slices", "validate_thresholds", "DEFAULT_DECODE_TOKEN_THRESHOLD",
         "DEFAULT_PREFILL_TOKEN_THRESHOLD"], "dbo_runtime.ubatch"),
    **dict.fromkeys(["coordinate_ubatching", "UBatchDecision"], "dbo_runtime.dp_sync"),
    **dict.fromkeys(
        ["dbo_enabled", "dbo_current_ubatch_id", "dbo_yield", "dbo_switch_to_comm",
         "dbo_switch_to_compute", "dbo_switch_to_comm_sync", "dbo_switch_to_compute_sync",
         "dbo_yield_and_switch_from_compute_to_comm", "dbo_yield_and_switch_from_comm_to_compute",
         "dbo_register_recv_hook", "dbo_maybe_run_recv_hook"], "dbo_runtime.context"),
    "run_ubatches": "dbo_runtime.workers",
    **dict.fromkeys(["dbo_async_site", "wrap_stream_site"], "dbo_runtime.hooks"),
    **dict.fromkeys(["get_backend", "DeviceBackend"], "dbo_runtime.devices"),
    **dict.fromkeys(["DBOError", "DBOConfigError", "DBOTimeoutError", "DBOWorkerError"], "dbo_runtime.errors"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dbo_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
