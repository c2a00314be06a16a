"""Named ranges in a torch profiler trace, for the runtime's own work (zero cost when no profiler records).

``scope("dbo::wait_turn")`` is ``torch.autograd.profiler.record_function`` while a profiler is recording (on any
thread: torch's profiler records every thread), else a no-op context. The ranges the runtime emits, which
``python -m dbo_runtime.vllm.step_profile analyze`` reads back:

* ``dbo::split_forward``: a split step's whole forward (both micro-batches, ping-pong), on the runner's thread;
* ``dbo::ubatch<i>_forward``: micro-batch ``i``'s forward, on its own thread;
* ``dbo::wait_turn``: a micro-batch thread waiting for the baton (the other micro-batch runs meanwhile, and the
  thread wake-up of the handoff ends it);
* ``dbo::context_switch``: re-installing a resuming micro-batch's forward context;
* ``dbo::ubatch_metadata``: building the per-micro-batch attention metadata of a split step.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["scope"]

_NULL = contextlib.nullcontext()


def scope(name: str) -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - the runtime always has torch
        return _NULL
    if not torch.autograd._profiler_enabled():
        return _NULL
    return torch.autograd.profiler.record_function(name)
