"""``vllm.general_plugins`` entry point ``dbo_runtime``: DBO (``--enable-dbo``) on vLLM-Ascend.

Off Ascend it logs one line saying it is inactive and changes nothing.

On Ascend (``current_platform`` is vllm_ascend's ``NPUPlatform``):

1. In every process: ``NPUPlatform.check_and_update_config`` is wrapped. vLLM-Ascend 0.23.0.post1 resets
   ``enable_dbo`` to False there (``_fix_incompatible_config``); when the user asked for DBO the wrapper validates
   the combination (:mod:`dbo_runtime.ascend.validate`: one error naming the conflict and the flag), turns it back
   on, turns cascade attention off (as upstream does for DBO) and marks the environment so that the engine-core
   and worker processes spawned afterwards install the runtime. Upstream ``VllmConfig.__post_init__`` asserts a
   DeepEP all2all backend whenever ubatching is on; vLLM-Ascend's MoE never uses vLLM's all2all manager, so the
   wrapper shows that assert ``deepep_low_latency`` and a wrapped ``__post_init__`` puts the platform's own
   backend back right after it (PR #11273 and the micropuma fork leave the DeepEP label in place instead).
2. In processes started with DBO on: the hook sites of :data:`dbo_runtime.ascend.sites.SITES` are wrapped with
   dbo_runtime's ``wrap_stream_site`` and the NPU model runner is patched (:mod:`dbo_runtime.ascend.runner`).

Everything in (1) and (2) is written against the vllm-ascend 0.23.0.post1 / vLLM 0.23.0 source and cannot run on
this CPU-only project machine; what is tested here is named in docs/dbo-vllm-ascend.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from dbo_runtime.errors import DBOConfigError

__all__ = ["register", "ACTIVE_ENV", "keep_dbo", "patch_platform_class", "patch_vllm_config_class",
           "platform_is_ascend", "INACTIVE_MESSAGE"]

ACTIVE_ENV = "DBO_RUNTIME_ASCEND_ACTIVE"
INACTIVE_MESSAGE = "dbo_runtime: inactive: platform is %s, not Ascend NPU; nothing patched"
# The backend label shown to upstream's DBO assert in VllmConfig.__post_init__, undone right after it.
_ASSERT_BACKEND = "deepep_low_latency"

_state: dict[str, Any] = {"registered": False, "undo": []}
# id(parallel_config) -> the all2all backend vLLM-Ascend chose, restored after VllmConfig.__post_init__.
_saved_backend: dict[int, str] = {}


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.dbo_runtime")  # under vLLM's handler and format
    except Exception:  # noqa: BLE001 - vLLM absent or broken: plain logging
        return logging.getLogger("dbo_runtime")


def platform_is_ascend() -> tuple[bool, str]:
    """(is the current vLLM platform vLLM-Ascend's NPU platform, a description of the platform)."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - no vLLM here: nothing to do
        return False, f"unknown (vLLM not importable: {type(exc).__name__})"
    cls = type(current_platform)
    device_type = getattr(current_platform, "device_type", "?")
    is_npu = cls.__module__.startswith("vllm_ascend") or device_type == "npu"
    return is_npu, f"{cls.__name__} (device_type={device_type})"


def keep_dbo(vllm_config: Any, *, env: MutableMapping[str, str] | None = None,
             log: logging.Logger | None = None) -> None:
    """After vLLM-Ascend's config check reset ``enable_dbo``: validate, turn DBO back on, mark the environment.

    Raises :class:`DBOConfigError` (one message, conflict and flag) when the combination cannot work.
    """
    from dbo_runtime.ascend.validate import validate_dbo_config

    env = os.environ if env is None else env
    log = log or _logger()
    pc = vllm_config.parallel_config
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and getattr(mc, "disable_cascade_attn", True) is False:
        mc.disable_cascade_attn = True  # upstream VllmConfig does the same whenever DBO is on
        log.info("dbo_runtime: cascade attention disabled because DBO is on")
    validate_dbo_config(vllm_config, env)
    pc.enable_dbo = True
    backend = getattr(pc, "all2all_backend", None)
    if backend is not None and backend not in ("deepep_low_latency", "deepep_high_throughput"):
        _saved_backend[id(pc)] = backend
        pc.all2all_backend = _ASSERT_BACKEND
    env[ACTIVE_ENV] = "1"
    log.info("dbo_runtime: --enable-dbo kept on vLLM-Ascend (two micro-batches, thresholds decode=%s "
             "prefill=%s tokens)", getattr(pc, "dbo_decode_token_threshold", "?"),
             getattr(pc, "dbo_prefill_token_threshold", "?"))


def patch_platform_class(platform_cls: type, *, env: MutableMapping[str, str] | None = None) -> Callable[[], None]:
    """Wrap ``platform_cls.check_and_update_config`` (a classmethod) so that a requested DBO survives it."""
    from dbo_runtime.ascend.validate import dbo_requested

    raw = platform_cls.__dict__["check_and_update_config"]
    func = raw.__func__ if isinstance(raw, classmethod) else raw

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        requested = dbo_requested(vllm_config)
        func(cls, vllm_config)
        if requested:
            keep_dbo(vllm_config, env=env)

    check_and_update_config.__wrapped__ = func  # type: ignore[attr-defined]
    check_and_update_config.__dbo_patch__ = True  # type: ignore[attr-defined]
    platform_cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]

    def undo() -> None:
        platform_cls.check_and_update_config = raw  # type: ignore[assignment]

    return undo


def patch_vllm_config_class(config_cls: type) -> Callable[[], None]:
    """Wrap ``VllmConfig.__post_init__`` to put back the all2all backend shown to upstream's DBO assert."""
    original = config_cls.__dict__["__post_init__"]

    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, *args, **kwargs)
        finally:
            saved = _saved_backend.pop(id(self.parallel_config), None)
            if saved is not None:
                self.parallel_config.all2all_backend = saved

    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    config_cls.__post_init__ = __post_init__  # type: ignore[attr-defined]

    def undo() -> None:
        config_cls.__post_init__ = original  # type: ignore[attr-defined]

    return undo


def _install_worker_runtime() -> list[Callable[[], None]]:  # pragma: no cover - Ascend host only
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner  # type: ignore[import-not-found]

    from dbo_runtime.ascend.patching import install_sites
    from dbo_runtime.ascend.runner import (
        ForwardContextSwitch,
        PerUBatchState,
        ascend_site_wrapper,
        install_runner_patches,
        set_vllm_forward_context,
    )

    switch = ForwardContextSwitch(set_vllm_forward_context)
    installation = install_sites(wrap=ascend_site_wrapper(switch, PerUBatchState()), dispatch_key="PrivateUse1")
    undo_runner = install_runner_patches(NPUModelRunner, switch)
    return [installation.uninstall, undo_runner]


def _activate_on_ascend(log: logging.Logger) -> None:  # pragma: no cover - Ascend host only
    from vllm.config import VllmConfig
    from vllm_ascend.platform import NPUPlatform  # type: ignore[import-not-found]

    _state["undo"].append(patch_platform_class(NPUPlatform))
    _state["undo"].append(patch_vllm_config_class(VllmConfig))
    if os.environ.get(ACTIVE_ENV) == "1":
        _state["undo"].extend(_install_worker_runtime())
        log.info("dbo_runtime: DBO runtime installed in this process (pid %d)", os.getpid())
    else:
        log.info("dbo_runtime: watching NPUPlatform.check_and_update_config for --enable-dbo")


def register() -> None:
    """The entry point vLLM calls (possibly several times per process: only the first call acts)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    log = _logger()
    is_ascend, description = platform_is_ascend()
    if not is_ascend:
        log.info(INACTIVE_MESSAGE, description)
        return
    try:
        _activate_on_ascend(log)
    except DBOConfigError as exc:
        log.error("dbo_runtime: %s", exc)
        raise


def unregister() -> None:
    """Undo every patch (tests and embedding applications)."""
    while _state["undo"]:
        _state["undo"].pop()()
    _state["registered"] = False
