"""Faults 7-9 of the Ascend adapter: per-micro-batch state under the greenlet scheduler, the device of the
micro-batch threads, and what a split step passes to ``set_ascend_forward_context``.

Faults 7 and 8 run the real runtime (both schedulers, real greenlets and threads) with the CPU backend; fault 8's
backend is the CPU one with a current device per thread added, as CUDA and torch_npu keep it. Fault 9 uses a
STAND-IN ``set_ascend_forward_context`` (no vllm / vllm_ascend in this environment); what it cannot catch is said there.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import threading
import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dbo_runtime.ascend.custom_op import CompiledReentryGuard
from dbo_runtime.ascend.runner import AscendIntegration, ForwardContextSwitch
from dbo_runtime.context import dbo_yield, run_ubatches
from dbo_runtime.devices import get_backend
from dbo_runtime.devices.cpu import CPUBackend
from dbo_runtime.ubatch import UBatchSlice
from dbo_runtime.workers import SCHEDULERS


# -- fault 7: state keyed by the thread, which both greenlet micro-batches share -------------------------------
@pytest.mark.parametrize("mode", SCHEDULERS)
def test_each_micro_batch_gets_its_own_forward_context_back_after_a_yield(mode: str) -> None:
    """Each micro-batch registers its forward context, yields at a hook site, resumes and restores (what
    ``ascend_site_wrapper`` does after the yield): it must get its own back. Keyed by ``threading.get_ident()``,
    micro-batch 0 under the greenlet scheduler got micro-batch 1's context."""
    current: dict[str, Any] = {"ctx": None}
    switch = ForwardContextSwitch(lambda ctx: current.__setitem__("ctx", ctx))
    seen: list[tuple[str, Any]] = []

    def ub(name: str) -> Callable[[], None]:
        def run() -> None:
            switch.register(name)
            try:
                dbo_yield("a2.moe_prepare")
                current["ctx"] = None  # whatever the other micro-batch left installed
                switch.restore()
                seen.append((name, current["ctx"]))
            finally:
                switch.unregister()
        return run

    run_ubatches([ub("ctx-0"), ub("ctx-1")], backend=get_backend("cpu"), timeout_s=20, mode=mode)
    assert seen == [("ctx-0", "ctx-0"), ("ctx-1", "ctx-1")]


def test_forward_context_switch_outside_micro_batching_is_per_thread() -> None:
    current: dict[str, Any] = {"ctx": None}
    switch = ForwardContextSwitch(lambda ctx: current.__setitem__("ctx", ctx))
    switch.register("main")
    other: list[Any] = []

    def elsewhere() -> None:  # another thread, no micro-batching: nothing registered for it
        current["ctx"] = None
        switch.restore()
        other.append(current["ctx"])

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    switch.restore()
    assert (other, current["ctx"]) == ([None], "main")
    switch.unregister()
    switch.restore()
    assert current["ctx"] == "main"  # nothing registered any more: restore installs nothing


@pytest.mark.parametrize("mode", SCHEDULERS)
def test_reentry_guard_sends_the_second_micro_batch_eager_under_both_schedulers(mode: str) -> None:
    """Micro-batch 0 is parked at a yield inside the compiled callable when 1 arrives: 1 must go eager. With the
    owner keyed by the thread, the greenlet micro-batch 1 was taken for a nested call of 0 and let in. A nested
    entry of the same micro-batch stays allowed."""
    guard = CompiledReentryGuard("model")

    def ub() -> tuple[bool, bool]:
        with guard.enter() as compiled_ok, guard.enter() as nested_ok:
            dbo_yield("inside the compiled model")
            return compiled_ok, nested_ok

    assert run_ubatches([ub, ub], backend=get_backend("cpu"), timeout_s=20, mode=mode) == [(True, True),
                                                                                           (False, False)]
    assert (guard.compiled_entries, guard.eager_fallbacks) == (1, 2)


# -- fault 8: micro-batch threads start on device 0 ------------------------------------------------------------
class PerThreadDeviceBackend(CPUBackend):
    """The CPU backend with a current device per thread, as CUDA and torch_npu keep it: 0 in every new thread."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()
        self.set_calls: list[tuple[int, int]] = []

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, index: int) -> None:
        self._local.index = index
        self.set_calls.append((threading.get_ident(), index))


@pytest.mark.parametrize("mode", SCHEDULERS)
def test_each_micro_batch_runs_on_the_callers_device(mode: str) -> None:
    """The caller (rank 3 of a host, say) is on device 3: each micro-batch must run there, before and after a yield,
    and under the thread scheduler each micro-batch thread must have set it itself."""
    backend = PerThreadDeviceBackend()
    backend.set_device(3)
    seen: list[int] = []

    def probe() -> int:
        seen.append(backend.current_device())
        dbo_yield("x")
        seen.append(backend.current_device())
        return threading.get_ident()

    idents = run_ubatches([probe, probe], backend=backend, timeout_s=20, mode=mode)
    assert seen == [3, 3, 3, 3]
    if mode == "thread":
        assert {tid for tid, index in backend.set_calls if index == 3} >= set(idents)
    assert backend.current_device() == 3  # the caller's own device is untouched


def test_cpu_backend_has_no_device_to_set() -> None:
    backend = get_backend("cpu")
    assert backend.current_device() is None
    backend.set_device(0)  # nothing to do, nothing raised


# -- fault 9: what a split step passes to set_ascend_forward_context -------------------------------------------
class _CUDAGraphMode(enum.Enum):
    NONE = 0


def _standin_modules(calls: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, types.ModuleType]:
    """STAND-INS of the names ``ascend_context`` imports: ``vllm.config.CUDAGraphMode``,
    ``vllm.forward_context.BatchDescriptor`` and a ``set_ascend_forward_context`` that records its keyword arguments
    and installs a plain context object."""

    @contextlib.contextmanager
    def set_ascend_forward_context(attn_metadata: Any, vllm_config: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        previous = state["ctx"]
        state["ctx"] = SimpleNamespace(attn_metadata=attn_metadata, slot_mapping=None)
        try:
            yield
        finally:
            state["ctx"] = previous

    vllm, config, fc = (types.ModuleType(n) for n in ("vllm", "vllm.config", "vllm.forward_context"))
    vllm.__path__ = []  # type: ignore[attr-defined]
    config.CUDAGraphMode = _CUDAGraphMode  # type: ignore[attr-defined]
    fc.BatchDescriptor = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    ascend, afc = types.ModuleType("vllm_ascend"), types.ModuleType("vllm_ascend.ascend_forward_context")
    ascend.__path__ = []  # type: ignore[attr-defined]
    afc.set_ascend_forward_context = set_ascend_forward_context  # type: ignore[attr-defined]
    return {"vllm": vllm, "vllm.config": config, "vllm.forward_context": fc, "vllm_ascend": ascend,
            "vllm_ascend.ascend_forward_context": afc}


@pytest.mark.parametrize("flags", [True, False])
def test_split_step_passes_sinks_input_ids_and_eplb_flag_per_micro_batch(monkeypatch: pytest.MonkeyPatch,
                                                                          flags: bool) -> None:
    """NPUModelRunner.execute_model passes ``has_sinks=self._has_sinks``, ``input_ids`` and
    ``eplb_heat_collection_status`` to ``set_ascend_forward_context``, which stores them on the step's context as
    ``sinks``, ``input_ids`` and ``eplb_heat_collection_status``. Each micro-batch's context must get the step's
    flags and the ids of its own tokens (the last slice includes the padding tokens).

    What the stand-in cannot catch: what the real ``set_ascend_forward_context`` and its readers do with these values
    (the hash-routed gate's all-gather or pad-and-split of ``input_ids`` at the micro-batch's size, FIA with sinks,
    EPLB heat counted once per micro-batch), and a change of the real function's parameter names (the doctor's
    table is the check for that)."""
    calls: list[dict[str, Any]] = []
    state: dict[str, Any] = {"ctx": None}
    for name, module in _standin_modules(calls, state).items():
        monkeypatch.setitem(sys.modules, name, module)
    integration = SimpleNamespace(get_forward_context=lambda: state["ctx"],
                                  switch=ForwardContextSwitch(lambda ctx: None))
    runner = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1), vllm_config="vllm-config",
                             model="model")
    input_ids = torch.arange(100, 112)  # 10 tokens + 2 padding
    outer = SimpleNamespace(attn_metadata=["md0", "md1"], slot_mapping=None, input_ids=input_ids, sinks=flags,
                            eplb_heat_collection_status=flags)
    slices = [UBatchSlice(slice(0, 2), slice(0, 5)), UBatchSlice(slice(1, 3), slice(5, 12))]
    for i, ub in enumerate(slices):
        with AscendIntegration.ascend_context(integration, runner, outer, i, ub, False) as ctx:
            assert ctx.attn_metadata == f"md{i}"
    assert [c["num_tokens"] for c in calls] == [5, 7]
    assert [(c["has_sinks"], c["eplb_heat_collection_status"]) for c in calls] == [(flags, flags)] * 2
    assert [c["input_ids"].tolist() for c in calls] == [list(range(100, 105)), list(range(105, 112))]

    calls.clear()  # a step run from embeddings has no input ids; one without the attributes gets the defaults
    with AscendIntegration.ascend_context(integration, runner, SimpleNamespace(attn_metadata=["md0"],
                                                                               slot_mapping=None), 0, slices[0], False):
        pass
    assert (calls[0]["input_ids"], calls[0]["has_sinks"], calls[0]["eplb_heat_collection_status"]) == (None, False,
                                                                                                        False)
