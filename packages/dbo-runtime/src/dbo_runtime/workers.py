"""Running the micro-batches: long-lived worker threads and the loop of :func:`run_ubatches`.

:mod:`dbo_runtime.context` holds one micro-batch's context and the hook functions model code calls; this module
starts the micro-batches on worker threads, hands the baton to micro-batch 0, watches for a run that makes no
handoff within its timeout, and turns the first failure into the caller's exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dbo_runtime.context import (
    _EXIT_SITE,
    _START_SITE,
    _THREAD_CONTEXTS,
    NUM_UBATCHES,
    ThreadState,
    UBatchContext,
    _Aborted,
    _current,
    _Run,
)
from dbo_runtime.devices.base import DeviceBackend
from dbo_runtime.errors import DBOConfigError, DBOTimeoutError, DBOWorkerError

__all__ = ["run_ubatches", "busy_workers", "SCHEDULERS", "SCHEDULER_ENV", "resolve_scheduler", "TIMEOUT_ENV",
           "resolve_timeout"]

SCHEDULERS = ("thread", "greenlet")
"""``thread``: one OS thread per micro-batch, handing off through events (upstream vLLM's design; the default).
``greenlet``: both micro-batches on the caller's thread as greenlets (:mod:`dbo_runtime.greenlets`)."""

SCHEDULER_ENV = "DBO_RUNTIME_SCHEDULER"
"""Environment variable that picks the scheduler when a caller does not (the vLLM plugin, ``dbo-runtime``)."""


def resolve_scheduler(mode: str | None = None) -> str:
    """``mode`` if given, else ``$DBO_RUNTIME_SCHEDULER``, else ``thread``; anything else is a DBOConfigError."""
    source = "mode"
    if mode is None:
        mode = os.environ.get(SCHEDULER_ENV, "").strip() or "thread"
        source = SCHEDULER_ENV
    if mode not in SCHEDULERS:
        raise DBOConfigError(f"{source}={mode!r} is not a DBO scheduler; accepted: {', '.join(SCHEDULERS)}")
    return mode


TIMEOUT_ENV = "DBO_RUNTIME_TIMEOUT_S"


def resolve_timeout(default: float) -> float:
    """``$DBO_RUNTIME_TIMEOUT_S`` (seconds, a number > 0) if set, else ``default``: the bound of every wait the
    engine integration makes (a handoff, a micro-batch's collective, the DP vote, the policy's agreement). A first
    step that compiles graphs for minutes wants more; a test that waits for a rank's failure wants less."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise DBOConfigError(f"{TIMEOUT_ENV}={text!r} is invalid; accepted: seconds, a number > 0 (default {default:g})")
    return value


T = TypeVar("T")

# How often the caller's watchdog looks at the run; short enough to report a stuck micro-batch promptly.
_WATCHDOG_PERIOD_S = 0.05


class _Worker:
    """A long-lived micro-batch thread. Reused across runs: a fresh thread's first torch ops can cost milliseconds
    (new malloc arena, per-thread library state), which would land inside every step's first compute block."""

    def __init__(self, index: int) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], None], Callable[[], None]]] = queue.Queue()
        self.busy = True
        self.thread = threading.Thread(target=self._loop, name=f"dbo-ubatch-worker{index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job, done = self.jobs.get()
            try:
                job()
            finally:
                self.busy = False  # idle before the caller hears of the end: the next run can reuse this thread
                done()


_POOL: list[_Worker] = []
_POOL_LOCK = threading.Lock()


def _acquire_workers(n: int) -> list[_Worker]:
    """``n`` idle workers, marked busy; new ones are started when too few are idle (a stuck one stays busy)."""
    with _POOL_LOCK:
        chosen = []
        for worker in _POOL:
            if len(chosen) == n:
                break
            if not worker.busy:
                worker.busy = True
                chosen.append(worker)
        while len(chosen) < n:
            worker = _Worker(len(_POOL))
            _POOL.append(worker)
            chosen.append(worker)
        return chosen


def busy_workers() -> int:
    """How many micro-batch threads are still running a micro-batch (0 once every run has ended)."""
    with _POOL_LOCK:
        return sum(1 for w in _POOL if w.busy)


def _ubatch_main(ctx: UBatchContext, fn: Callable[[], Any], state: ThreadState | None) -> None:
    run = ctx._run
    _THREAD_CONTEXTS[threading.get_ident()] = ctx
    try:
        with state.applied() if state is not None else contextlib.nullcontext():
            ctx._take_baton(_START_SITE)
            ctx._update_stream(ctx.compute_stream)
            result = fn()
        ctx.site = _EXIT_SITE
        ctx.maybe_run_recv_hook()
        run.results[ctx.id] = result
        run.finished[ctx.id] = True
        ctx._give_baton()
    except _Aborted:
        pass
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        run.fail(ctx.id, exc)
    finally:
        _THREAD_CONTEXTS.pop(threading.get_ident(), None)


def _ubatch_exited(run: _Run) -> None:
    with run.cond:
        run.exited += 1
        run.cond.notify_all()


def _raise_failure(run: _Run) -> None:
    assert run.error is not None
    ubatch_id, exc = run.error
    if isinstance(exc, DBOTimeoutError):
        raise exc
    site = run.contexts[ubatch_id].site
    raise DBOWorkerError(
        f"micro-batch {ubatch_id} raised {type(exc).__name__} at or after hook site {site!r}: {exc}",
        ubatch_id=ubatch_id,
    ) from exc


def run_ubatches(
    fns: Sequence[Callable[[], T]],
    *,
    backend: DeviceBackend | None = None,
    timeout_s: float = 60.0,
    thread_state: ThreadState | None = None,
    on_resume: Sequence[Callable[[], None] | None] | None = None,
    mode: str | None = None,
) -> list[T]:
    """Run ``fns[i]`` as micro-batch ``i`` in its own thread, ping-ponging at the hook calls; return their results.

    Each micro-batch thread runs under ``thread_state`` (default: :meth:`ThreadState.capture` of the caller, so
    a caller under ``torch.inference_mode()`` gets micro-batches under it too) and on the caller's current device
    (the backend's :meth:`~dbo_runtime.devices.base.DeviceBackend.current_device`). ``on_resume[i]``, when given, runs
    in micro-batch ``i``'s thread each time it takes the baton (at its start and after every yield): the place to
    re-install process-global state that belongs to one micro-batch, such as vLLM's forward context.

    Exactly two micro-batches. Micro-batch 0 starts; each hands over at its yields. Raises
    :class:`DBOWorkerError` for an exception inside a micro-batch (``__cause__`` is the original) and
    :class:`DBOTimeoutError` when no handoff happens within ``timeout_s`` (naming the micro-batch and hook site).
    A micro-batch stuck outside the hooks cannot be killed; its thread is a daemon and stops at its next hook.
    The micro-batch threads are long-lived workers, reused by the next call.

    ``mode`` picks the scheduler (:data:`SCHEDULERS`; default ``$DBO_RUNTIME_SCHEDULER``, else ``thread``). With
    ``greenlet`` both micro-batches run on the calling thread as greenlets (:mod:`dbo_runtime.greenlets`): the
    same hooks, results and errors, a switch of well under a microsecond instead of a thread wake-up, and no
    compute watchdog (a micro-batch that does not yield just runs; receives are bounded waits instead).
    """
    if len(fns) != NUM_UBATCHES:
        raise DBOConfigError(f"run_ubatches got {len(fns)} micro-batches; accepted: exactly {NUM_UBATCHES}")
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise DBOConfigError(f"timeout_s={timeout_s!r} is invalid; accepted: a number of seconds > 0")
    if _current() is not None:
        raise DBOConfigError("run_ubatches was called from inside a micro-batch; accepted: a call from outside")
    if backend is None:
        from dbo_runtime.devices import get_backend

        backend = get_backend("auto")

    if on_resume is not None and len(on_resume) != len(fns):
        raise DBOConfigError(f"on_resume has {len(on_resume)} entries for {len(fns)} micro-batches; accepted: one each")
    if thread_state is None:
        thread_state = ThreadState.capture()
    if resolve_scheduler(mode) == "greenlet":
        from dbo_runtime.greenlets import run_ubatches_greenlet

        return run_ubatches_greenlet(fns, backend=backend, timeout_s=float(timeout_s), thread_state=thread_state,
                                     on_resume=on_resume)

    if thread_state.device is None:
        # The current device is per thread in CUDA and torch_npu and a new thread starts on device 0: on rank 1 of
        # an 8-NPU host a micro-batch thread would allocate on NPU 0. Each thread enters the caller's device, as
        # upstream's micro-batch threads do (torch.accelerator.set_device_index). Greenlets need nothing: they run
        # on the caller's thread.
        index = backend.current_device()
        if index is not None:
            thread_state = dataclasses.replace(thread_state, device=(backend, index))
    run = _Run(len(fns), float(timeout_s))
    compute_stream = backend.current_stream()
    comm_stream = backend.new_stream()
    run.contexts = [UBatchContext(i, run, backend, compute_stream, comm_stream) for i in range(len(fns))]
    for i, ctx in enumerate(run.contexts):
        ctx.on_resume = None if on_resume is None else on_resume[i]
    # Micro-batch 0 holds the baton before either thread runs: its worker takes it as soon as it picks up the job,
    # with no start barrier (that was two more thread wake-ups per split step: the caller waking after both workers
    # arrived, then micro-batch 0 waking again for the baton). A worker that never starts is the watchdog's below:
    # no handoff within timeout_s.
    run.last_progress = time.monotonic()
    run.contexts[0].cpu_wait_event.set()
    workers = _acquire_workers(len(fns))
    for worker, ctx, fn in zip(workers, run.contexts, fns, strict=True):
        worker.jobs.put((lambda ctx=ctx, fn=fn: _ubatch_main(ctx, fn, thread_state), lambda: _ubatch_exited(run)))

    with run.cond:
        while run.exited < len(fns) and run.error is None:
            run.cond.wait(_WATCHDOG_PERIOD_S)
            if run.error is None and time.monotonic() - run.last_progress > timeout_s:
                holder = run.holder
                site = run.contexts[holder].site if holder is not None else "?"
                run.cond.release()
                try:
                    run.fail(
                        holder if holder is not None else -1,
                        DBOTimeoutError(
                            f"micro-batch {holder} made no handoff for {timeout_s:g} s after hook site {site!r} "
                            "(stuck in compute or in a collective)",
                            ubatch_id=holder,
                            site=site,
                        ) if holder is not None or any(c.site != _START_SITE for c in run.contexts) else
                        DBOTimeoutError(f"the micro-batch threads did not start within {timeout_s:g} s"),
                    )
                finally:
                    run.cond.acquire()
    if run.error is not None:
        # Give the other threads a moment to stop at their hooks; one stuck outside them stays behind (daemon,
        # never reused).
        with run.cond:
            run.cond.wait_for(lambda: run.exited == len(fns), timeout=min(1.0, timeout_s))
        _raise_failure(run)
    return list(run.results)
