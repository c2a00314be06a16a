"""Loaded by every process of a capture run with ``--all-threads`` (the directory is put on PYTHONPATH, so vLLM's
engine core and worker processes import it too, however they are started).

vLLM's torch profiler (vllm/profiler/wrapper.py) builds ``torch.profiler.profile`` without an
``experimental_config``, and torch then records operators only on the thread that started it (plus threads that
inherit its thread-local state, such as gloo's run loops). DBO's micro-batch threads are plain Python threads:
their operators would be missing from the trace. ``_ExperimentalConfig(profile_all_threads=True)`` (torch >= 2.7)
records every thread; this sets it as the default when the caller gave none.
"""

import functools

try:
    import torch.profiler
    from torch._C._profiler import _ExperimentalConfig

    _init = torch.profiler.profile.__init__

    @functools.wraps(_init)
    def _init_all_threads(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("experimental_config") is None:
            kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
        _init(self, *args, **kwargs)

    torch.profiler.profile.__init__ = _init_all_threads
except Exception:  # noqa: BLE001 - a python without torch (or an older one) runs unchanged
    pass
