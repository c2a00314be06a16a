"""The greenlet scheduler: both micro-batches on the caller's OS thread, switching as greenlets.

The thread scheduler (:mod:`dbo_runtime.workers`, upstream vLLM's design) parks one OS thread and wakes another
at every yield: a futex round trip through the kernel, about 30 us median on this 2-core machine. Here the two
micro-batches are greenlets (PyPI ``greenlet``) on the thread that called :func:`run_ubatches`; a yield is a
stack switch inside the process, well under a microsecond, and only one micro-batch can run at a time by
construction, not by a ring of events.

Same hook API (:mod:`dbo_runtime.context`), same contexts and the same fault behaviour where one thread can
give it:

- an exception in a micro-batch stops the other one at its next hook and reaches the caller as
  :class:`DBOWorkerError` (a ``KeyboardInterrupt`` / ``SystemExit`` as itself);
- a micro-batch that does not yield for a long time just runs: nobody else is waiting on an OS thread, exactly
  as in the plain forward. It cannot be preempted, so there is no compute watchdog here;
- what can wait forever is a receive: a collective that never completes. Those waits are bounded: the reference
  model's :class:`~dbo_runtime.reference.comm.PendingCollective` waits at most its timeout, and
  :func:`dbo_runtime.hooks.dbo_async_site` bounds a receive hook that is a ``torch.distributed`` ``Work.wait``
  by the run's ``timeout_s``; a timeout is a :class:`DBOTimeoutError` naming the micro-batch and hook site.

Communication still proceeds while the other micro-batch computes, because it never needed the micro-batch's
thread: collectives are launched asynchronously (gloo's own threads move the bytes; on a device, the
communication stream) and waited on at the next switch, by the receive hook the other micro-batch runs after its
compute (upstream's schedule). The reference model's communication thread, which waits for each collective in
launch order while a profiler records, stays as it is.

What a micro-batch thread carried per OS thread in the thread scheduler is carried per greenlet here, saved when
a micro-batch switches away and restored when it resumes: torch grad mode, inference mode, autocast and the
device (:class:`~dbo_runtime.context.ThreadState`), the current stream (the context's ``_update_stream`` after
every yield, as in thread mode) and whatever ``on_resume`` re-installs (vLLM's forward context). Checking costs
three flag reads per switch; the state is only rebuilt when a micro-batch changed it between two hook sites.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dbo_runtime import context as _ctxmod
from dbo_runtime.context import (
    _EXIT_SITE,
    _START_SITE,
    _THREAD_CONTEXTS,
    ThreadState,
    UBatchContext,
    _Aborted,
    _Run,
)
from dbo_runtime.devices.base import DeviceBackend
from dbo_runtime.errors import DBOConfigError, DBOError, DBOTimeoutError, DBOWorkerError

__all__ = ["run_ubatches_greenlet", "greenlet_available"]


def greenlet_available() -> bool:
    try:
        import greenlet  # noqa: F401
    except ImportError:
        return False
    return True


def _import_greenlet() -> Any:
    try:
        import greenlet
    except ImportError:
        raise DBOConfigError(
            "the greenlet scheduler needs the 'greenlet' package, which is not installed; accepted: "
            "pip install greenlet, or the thread scheduler (DBO_RUNTIME_SCHEDULER=thread)"
        ) from None
    return greenlet


class _TLS:
    """Fast check and exact save/restore of torch's thread-local modes across greenlet switches.

    ``key()`` is three C calls; when both micro-batches are in the state the run started with (the usual case)
    nothing else happens at a switch. A micro-batch that entered ``torch.no_grad()``, ``inference_mode`` or
    ``autocast`` between two hook sites gets its state saved in full and put back when it resumes; meanwhile the
    thread is reset to the run's base state for the other micro-batch. Inference mode has no setter in torch,
    only the ``c10::InferenceMode`` guard, whose destructor restores the complete state it found (autograd flags
    and dispatch keys): a guard created when a micro-batch leaves in a non-base inference mode is dropped when it
    resumes, which puts its exact state back.
    """

    def __init__(self, torch: Any, device_module: Any) -> None:
        self.torch = torch
        self.grad = torch._C.is_grad_enabled
        self.inference = torch.is_inference_mode_enabled
        self.any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
        self.device_module = device_module

    def set_base(self, key: tuple[Any, ...]) -> None:
        self.base_grad, self.base_inference, self.base_autocast, self.base_device = key

    def key(self) -> tuple[Any, ...]:
        autocast = self.any_autocast() if self.any_autocast is not None else None
        device = None if self.device_module is None else self.device_module.current_device()
        return (self.grad(), self.inference(), autocast, device)

    def full(self) -> ThreadState:
        return ThreadState.capture(self.device_module)

    def set_plain(self, state: ThreadState) -> None:
        """Grad mode, autocast and device of ``state`` on this thread (inference mode is the guard's business)."""
        torch = self.torch
        torch._C._set_grad_enabled(state.grad_enabled)
        for device_type in _autocast_types(torch):
            enabled, dtype = state.autocast.get(device_type, (False, None))
            torch.set_autocast_enabled(device_type, enabled)
            if dtype is not None:
                torch.set_autocast_dtype(device_type, dtype)
        if state.device is not None:
            module, index = state.device
            module.set_device(index)


_AUTOCAST_TYPES: list[str] | None = None


def _autocast_types(torch: Any) -> list[str]:
    global _AUTOCAST_TYPES
    if _AUTOCAST_TYPES is None:
        types = []
        for device_type in ("cpu", "cuda", "npu", "xpu"):
            try:
                torch.is_autocast_enabled(device_type)
            except RuntimeError:
                continue
            types.append(device_type)
        _AUTOCAST_TYPES = types
    return _AUTOCAST_TYPES


class _GreenletRun(_Run):
    def __init__(self, num_ubatches: int, timeout_s: float, tls: _TLS, base: ThreadState) -> None:
        super().__init__(num_ubatches, timeout_s)
        self.tls = tls
        self.base = base
        self.base_key = tls.key()
        tls.set_base(self.base_key)
        self.tid = threading.get_ident()
        self.handoffs = 0


class GreenletUBatchContext(UBatchContext):
    """A micro-batch as a greenlet: a yield switches straight to the other micro-batch's greenlet."""

    _run: _GreenletRun

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.glet: Any = None
        self.saved: ThreadState | None = None  # this micro-batch's modes while switched away, if not the base
        self.saved_key: tuple[Any, ...] | None = None
        self.inference_guard: Any = None
        self.other: GreenletUBatchContext = self  # the other micro-batch, set by the run

    # -- thread-local state ------------------------------------------------------------------------------------
    def _leave(self) -> None:
        """Save this micro-batch's modes (they differ from the base) and put the base back for the other one."""
        run = self._run
        key = run.tls.key()
        self.saved, self.saved_key = run.tls.full(), key
        if key[1] != run.base_key[1]:
            self.inference_guard = run.tls.torch._C._InferenceMode(run.base.inference_mode)
        run.tls.set_plain(run.base)

    def _restore(self) -> None:
        if self.saved is None:
            return
        run = self._run
        if self.inference_guard is not None:
            self.inference_guard = None  # its destructor puts this micro-batch's inference state back, exactly
        run.tls.set_plain(self.saved)
        self.saved = None

    # -- baton -------------------------------------------------------------------------------------------------
    def _resumed(self, site: str) -> None:
        run = self._run
        if run.aborted:
            raise _Aborted
        if run.holder != self.id:
            raise self._baton_broken(site)
        self._restore()
        run.last_progress = time.monotonic()
        self.site = site
        if self.on_resume is not None:
            self.on_resume()

    def _baton_broken(self, site: str) -> DBOError:
        return DBOError(f"micro-batch {self.id} resumed at hook site {site!r} while micro-batch {self._run.holder} "
                        "holds the baton: the one-at-a-time invariant is broken")

    def cpu_yield(self, site: str = "") -> None:
        # The hot path of the scheduler (every handoff): kept flat (each Python call level costs about as much as
        # the greenlet switch itself), no time stamps (no watchdog reads them here).
        run = self._run
        site = site or "<yield>"
        if run.aborted:
            raise _Aborted
        if run.holder != self.id:
            self._check_running(site)  # raises with the message
        self.site = site
        other = self.other
        if run.finished[other.id]:
            return
        run.handoffs += 1
        tls = run.tls  # does the thread's state differ from the run's base (_TLS.key() != base, inline)?
        if (
            tls.grad() is not tls.base_grad
            or tls.inference() is not tls.base_inference
            or (tls.any_autocast is not None and tls.any_autocast() is not tls.base_autocast)
            or (tls.device_module is not None and tls.device_module.current_device() != tls.base_device)
        ):
            self._leave()
        run.holder = other.id
        _THREAD_CONTEXTS[run.tid] = other
        other.glet.switch()  # returns when another greenlet (or the run loop) switches back to this one
        if self.saved is not None:
            self._restore()  # first, so that an abort unwinds this micro-batch's ``with`` blocks from its own state
        if run.aborted:
            raise _Aborted
        if run.holder != self.id:
            raise self._baton_broken(site)
        if self.on_resume is not None:
            self.on_resume()

    def yield_(self, site: str = "") -> None:
        # UBatchContext.yield_ with _update_stream inline (the hot path of dbo_yield).
        stream = self.current_stream
        self.cpu_yield(site)
        self.current_stream = stream
        self.backend.set_stream(stream)

    def _take_baton(self, site: str) -> None:  # pragma: no cover - the thread scheduler's entry, not used here
        raise DBOError("a greenlet micro-batch takes the baton by being switched to, not by waiting")


def _ubatch_main(ctx: GreenletUBatchContext, fn: Callable[[], Any]) -> None:
    run = ctx._run
    try:
        ctx._resumed(_START_SITE)
        ctx._update_stream(ctx.compute_stream)
        result = fn()
        ctx.site = _EXIT_SITE
        ctx.maybe_run_recv_hook()
        run.results[ctx.id] = result
    except _Aborted:
        pass
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        run.fail(ctx.id, exc)
    finally:
        run.finished[ctx.id] = True
        run.holder = None
        ctx.inference_guard = None
        _THREAD_CONTEXTS.pop(run.tid, None)
        # Back to the run loop in the base state: model code's own ``with`` blocks have unwound by now, but a
        # micro-batch that set a mode without one must not hand it to the other micro-batch or to the caller.
        if run.tls.key() != run.base_key:
            run.tls.set_plain(run.base)


def run_ubatches_greenlet(
    fns: Sequence[Callable[[], Any]],
    *,
    backend: DeviceBackend,
    timeout_s: float,
    thread_state: ThreadState | None,
    on_resume: Sequence[Callable[[], None] | None] | None,
) -> list[Any]:
    """The greenlet scheduler's :func:`dbo_runtime.workers.run_ubatches` (arguments already validated there)."""
    greenlet = _import_greenlet()
    import torch

    device_module = thread_state.device[0] if thread_state is not None and thread_state.device is not None else None
    tls = _TLS(torch, device_module)
    # The micro-batches share the caller's thread, so its thread state is entered once around the whole run (and
    # left exactly as it was afterwards); it is the base every switch compares against.
    with thread_state.applied() if thread_state is not None else contextlib.nullcontext():
        base = tls.full()
        run = _GreenletRun(len(fns), float(timeout_s), tls, base)
        compute_stream = backend.current_stream()
        comm_stream = backend.new_stream()
        run.contexts = [GreenletUBatchContext(i, run, backend, compute_stream, comm_stream) for i in range(len(fns))]
        contexts: list[GreenletUBatchContext] = run.contexts  # type: ignore[assignment]
        contexts[0].other, contexts[1].other = contexts[1], contexts[0]
        for i, ctx in enumerate(contexts):
            ctx.on_resume = None if on_resume is None else on_resume[i]
            ctx.glet = greenlet.greenlet(lambda ctx=ctx, fn=fns[i]: _ubatch_main(ctx, fn))
            # As a thread would see them after a copy: the caller's context variables, not another run's.
            ctx.glet.gr_context = contextvars.copy_context()
        try:
            _loop(run, contexts)
        finally:
            # A thread's current stream is thread-local state of the caller's here: the micro-batches moved it
            # between the compute and the communication stream; the caller gets its own back.
            if backend.current_stream() != compute_stream:
                backend.set_stream(compute_stream)
    if run.error is not None:
        ubatch_id, exc = run.error
        if isinstance(exc, KeyboardInterrupt | SystemExit | DBOTimeoutError):
            raise exc
        site = run.contexts[ubatch_id].site
        raise DBOWorkerError(
            f"micro-batch {ubatch_id} raised {type(exc).__name__} at or after hook site {site!r}: {exc}",
            ubatch_id=ubatch_id,
        ) from exc
    return list(run.results)


def _loop(run: _GreenletRun, contexts: list[GreenletUBatchContext]) -> None:
    """Start micro-batch 0; when a micro-batch ends its greenlet returns here, and the loop resumes (or starts)
    whichever is left. After a failure it resumes each started one once, so that it stops at its hook
    (``_Aborted``) and unwinds; one never started is dropped."""
    started = False
    try:
        while True:
            pending = [c for c in contexts if not run.finished[c.id]]
            if not pending:
                break
            ctx = pending[0]
            if run.aborted and not ctx.glet:  # never started: nothing to unwind
                run.finished[ctx.id] = True
                continue
            if started:
                run.handoffs += 1
            started = True
            run.holder = ctx.id
            _THREAD_CONTEXTS[run.tid] = ctx
            ctx.glet.switch()
    finally:
        _ctxmod._HANDOFFS += run.handoffs  # counted per run on the hot path, added to the process's count here
        _THREAD_CONTEXTS.pop(run.tid, None)
        run.holder = None
        if run.tls.key() != run.base_key:
            run.tls.set_plain(run.base)
