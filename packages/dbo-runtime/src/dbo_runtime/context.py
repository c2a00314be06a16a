"""The ping-pong runtime: two micro-batches, one thread each, exactly one running at a time.

Modelled on vLLM's ``vllm/v1/worker/ubatching.py``: every micro-batch runs the whole model in its own thread, and
the threads hand a baton to each other through a ring of ``threading.Event`` objects at the communication
boundaries the model code marks with the hook functions below. While one micro-batch waits for its collective,
the other computes. Each micro-batch has a compute stream and a communication stream (shared by all micro-batches,
as upstream); events recorded on one and waited on by the other order the device work. On CPU there are no
streams (see :mod:`dbo_runtime.devices.cpu`) and those calls do nothing.

What this module adds to the upstream mechanism:

- every wait is bounded: a handoff that does not arrive within ``timeout_s`` raises :class:`DBOTimeoutError`
  naming the micro-batch that waits, the hook site it waits at, and the micro-batch that holds the baton;
- an exception in any micro-batch stops the others at their next hook and reaches the caller of
  :func:`run_ubatches` as :class:`DBOWorkerError` (the original exception is its ``__cause__``);
- the "exactly one runs" invariant is checked at every handoff, not just assumed;
- a micro-batch that finished no longer takes part: a yield with nobody left to hand to returns at once, and a
  receive hook registered on a finished micro-batch runs in place.

The same contexts and hooks serve the greenlet scheduler (:mod:`dbo_runtime.greenlets`), where both micro-batches run
on the caller's thread and a yield is a greenlet switch; the scheduler is picked per call or by
``DBO_RUNTIME_SCHEDULER`` (:func:`dbo_runtime.workers.resolve_scheduler`).

The module-level hook functions are no-ops outside a micro-batch thread, so model code calls them unconditionally.
The worker threads and the run loop (:func:`run_ubatches`) are in :mod:`dbo_runtime.workers`; ``run_ubatches`` and
``busy_workers`` are also reachable here, as before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dbo_runtime.devices.base import DeviceBackend
from dbo_runtime.errors import DBOError, DBOTimeoutError
from dbo_runtime.scopes import scope

__all__ = [
    "NUM_UBATCHES",
    "UBatchContext",
    "dbo_enabled",
    "dbo_current_ubatch_id",
    "dbo_current_ubatch_key",
    "dbo_num_ubatches",
    "dbo_current_site",
    "dbo_yield",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute_sync",
    "dbo_yield_and_switch_from_compute_to_comm",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_register_recv_hook",
    "dbo_maybe_run_recv_hook",
    "dbo_record_current_stream",
    "dbo_wait_current_stream_and_yield",
    "handoff_count",
    "note_site",
    "ThreadState",
]

T = TypeVar("T")

NUM_UBATCHES = 2
"""The runtime supports exactly two micro-batches (dual batch overlap), as vLLM's ``--enable-dbo``."""

_START_SITE = "<start>"
_EXIT_SITE = "<exit>"

_THREAD_CONTEXTS: dict[int, UBatchContext] = {}
_HANDOFFS = 0  # process-wide count of baton handoffs, for benchmarks and tests


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu")


@dataclass
class ThreadState:
    """The caller's thread-local execution state, re-created in each micro-batch thread.

    A micro-batch runs the caller's model code on another OS thread, so everything torch or the engine keeps per
    thread must be carried over, or the two halves run under different rules than the whole batch would. The
    list is complete for what torch keeps per thread and vLLM's forward pass reads:

    * ``inference_mode`` / ``grad_enabled``: torch's autograd TLS (``c10::AutogradState``); vLLM's
      ``execute_model`` runs under ``torch.inference_mode()``: without it an in-place write to an inference
      tensor (the KV cache, persistent buffers) raises in the micro-batch thread;
    * ``autocast``: the per-device-type autocast enable flag and dtype (also TLS in torch);
    * ``device``: the current device index of the accelerator (TLS in CUDA/NPU runtimes), with what sets it (a
      device module such as ``torch.npu``, or the run's device backend, which :func:`run_ubatches` adds for its
      threads when ``capture`` was not given a module); ``None`` on CPU;
    * the current stream: not captured here: :func:`run_ubatches` sets each micro-batch's compute stream through
      the device backend before the micro-batch starts and after every resume;
    * the forward context: vLLM keeps it in a module global, not in TLS, so it is re-installed on every resume by
      the ``on_resume`` callbacks of :func:`run_ubatches`, not once per thread.

    Everything else a model reads (weights, configs, distributed groups) is process-global.

    Under the greenlet scheduler both micro-batches share the caller's thread: this state is entered once around
    the run, and a micro-batch that changes it between two hook sites has it saved and restored at each switch
    (:mod:`dbo_runtime.greenlets`).
    """

    inference_mode: bool = False
    grad_enabled: bool = True
    autocast: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    device: tuple[Any, int] | None = None

    @classmethod
    def capture(cls, device_module: Any = None) -> ThreadState:
        """The calling thread's state; ``device_module`` (``torch.cuda``, ``torch.npu``) adds its current device."""
        import torch

        autocast = {}
        for device_type in _AUTOCAST_DEVICE_TYPES:
            try:
                enabled = torch.is_autocast_enabled(device_type)
            except RuntimeError:  # a device type this torch build does not know
                continue
            if enabled:
                autocast[device_type] = (True, torch.get_autocast_dtype(device_type))
        device = None
        if device_module is not None:
            device = (device_module, int(device_module.current_device()))
        return cls(inference_mode=torch.is_inference_mode_enabled(), grad_enabled=torch.is_grad_enabled(),
                   autocast=autocast, device=device)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Enter this state on the current thread for the duration of the block."""
        import torch

        with contextlib.ExitStack() as stack:
            if self.device is not None:
                module, index = self.device
                module.set_device(index)
            stack.enter_context(torch.inference_mode(self.inference_mode))
            if not self.inference_mode:
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


class _Aborted(BaseException):
    """Raised inside a micro-batch whose run was aborted because another micro-batch failed.

    A BaseException so that model code's ``except Exception`` does not swallow it.
    """


class _Run:
    """State shared by the micro-batches of one :func:`run_ubatches` call."""

    def __init__(self, num_ubatches: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.contexts: list[UBatchContext] = []
        self.holder: int | None = None
        self.finished = [False] * num_ubatches
        self.results: list[Any] = [None] * num_ubatches
        self.error: tuple[int, BaseException] | None = None
        self.aborted = False
        self.last_progress = time.monotonic()
        self.cond = threading.Condition()
        self.exited = 0

    def fail(self, ubatch_id: int, exc: BaseException) -> None:
        """Record the first failure and wake every waiting micro-batch so that it stops."""
        with self.cond:
            if self.error is None:
                self.error = (ubatch_id, exc)
            self.aborted = True
            self.cond.notify_all()
        for ctx in self.contexts:
            ctx.cpu_wait_event.set()


class UBatchContext:
    """One micro-batch's view of the run: its baton event, its streams and events, its pending receive hook."""

    def __init__(
        self,
        ubatch_id: int,
        run: _Run,
        backend: DeviceBackend,
        compute_stream: Any,
        comm_stream: Any,
    ) -> None:
        self.id = ubatch_id
        self._run = run
        self.backend = backend
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.current_stream = compute_stream
        self.cpu_wait_event = threading.Event()
        self.gpu_compute_done_event = backend.new_event()
        self.gpu_comm_done_event = backend.new_event()
        self._keyed_events: dict[str, Any] = {}
        self.recv_hook: Callable[[], None] | None = None
        self.site = _START_SITE
        self.on_resume: Callable[[], None] | None = None

    # -- baton -----------------------------------------------------------------------------------------------
    def _others_alive(self) -> bool:
        return any(not done for i, done in enumerate(self._run.finished) if i != self.id)

    def _next_alive(self) -> UBatchContext | None:
        n = len(self._run.contexts)
        for step in range(1, n):
            ctx = self._run.contexts[(self.id + step) % n]
            if not self._run.finished[ctx.id]:
                return ctx
        return None

    def _give_baton(self) -> None:
        global _HANDOFFS
        run = self._run
        if run.holder != self.id:
            raise DBOError(
                f"micro-batch {self.id} hands over at hook site {self.site!r} but micro-batch {run.holder} holds the "
                "baton: the one-thread-at-a-time invariant is broken"
            )
        run.holder = None
        run.last_progress = time.monotonic()
        nxt = self._next_alive()
        if nxt is not None:
            _HANDOFFS += 1
            nxt.cpu_wait_event.set()

    def _take_baton(self, site: str) -> None:
        run = self._run
        with scope("dbo::wait_turn"):
            arrived = self.cpu_wait_event.wait(run.timeout_s)
        if not arrived and not run.aborted:
            holder = run.holder
            holder_site = run.contexts[holder].site if holder is not None else "?"
            who = f"micro-batch {holder}" if holder is not None else "no micro-batch"
            raise DBOTimeoutError(
                f"micro-batch {self.id} waited {run.timeout_s:g} s at hook site {site!r} for its turn, but {who} did "
                f"not hand control back (last seen at hook site {holder_site!r})",
                ubatch_id=self.id,
                site=site,
            )
        if run.aborted:
            raise _Aborted
        self.cpu_wait_event.clear()
        if run.holder is not None:
            raise DBOError(
                f"micro-batch {self.id} resumed at hook site {site!r} while micro-batch {run.holder} still runs: the "
                "one-thread-at-a-time invariant is broken"
            )
        run.holder = self.id
        run.last_progress = time.monotonic()
        self.site = site
        if self.on_resume is not None:
            with scope("dbo::context_switch"):
                self.on_resume()

    def _check_running(self, site: str) -> None:
        if self._run.aborted:
            raise _Aborted
        if self._run.holder != self.id:
            raise DBOError(
                f"micro-batch {self.id} called a hook at site {site!r} without holding the baton (holder: "
                f"{self._run.holder}); hooks must be called from the micro-batch's own thread"
            )

    def cpu_yield(self, site: str = "") -> None:
        """Hand the baton to the next micro-batch and wait until it comes back."""
        site = site or "<yield>"
        self._check_running(site)
        self.site = site
        self._run.last_progress = time.monotonic()
        if not self._others_alive():
            return
        self._give_baton()
        self._take_baton(site)

    # -- streams ---------------------------------------------------------------------------------------------
    def _update_stream(self, stream: Any) -> None:
        self.current_stream = stream
        self.backend.set_stream(stream)

    def yield_(self, site: str = "") -> None:
        stream = self.current_stream
        self.cpu_yield(site)
        self._update_stream(stream)

    def switch_to_comm(self) -> None:
        self._update_stream(self.comm_stream)

    def switch_to_compute(self) -> None:
        self._update_stream(self.compute_stream)

    def _signal_compute_done(self) -> None:
        self.backend.record_event(self.gpu_compute_done_event, self.compute_stream)

    def _wait_compute_done(self) -> None:
        self.backend.wait_event(self.comm_stream, self.gpu_compute_done_event)

    def _signal_comm_done(self) -> None:
        self.backend.record_event(self.gpu_comm_done_event, self.comm_stream)

    def _wait_comm_done(self) -> None:
        self.backend.wait_event(self.compute_stream, self.gpu_comm_done_event)

    def switch_to_comm_sync(self) -> None:
        self._signal_compute_done()
        self._update_stream(self.comm_stream)
        self._wait_compute_done()

    def switch_to_compute_sync(self) -> None:
        self._signal_comm_done()
        self._update_stream(self.compute_stream)
        self._wait_comm_done()

    def yield_and_switch_from_compute_to_comm(self, site: str = "") -> None:
        self._signal_compute_done()
        self.cpu_yield(site)
        self._update_stream(self.comm_stream)
        self._wait_compute_done()

    def yield_and_switch_from_comm_to_compute(self, site: str = "") -> None:
        self._signal_comm_done()
        self.cpu_yield(site)
        self._update_stream(self.compute_stream)
        self._wait_comm_done()

    def record_current_stream(self, key: str = "default") -> None:
        """Record this micro-batch's keyed event on its current stream (vLLM-Ascend's ``record_current_stream``)."""
        event = self._keyed_events.get(key)
        if event is None:
            event = self._keyed_events[key] = self.backend.new_event()
        self.backend.record_event(event, self.current_stream)

    def wait_current_stream_and_yield(self, key: str = "default", *, wait: bool = True, site: str = "") -> None:
        """Make the other micro-batch's stream wait for the keyed event, then yield (vLLM-Ascend's primitive)."""
        if wait:
            event = self._keyed_events.get(key)
            nxt = self._next_alive()
            if event is not None and nxt is not None:
                self.backend.wait_event(nxt.current_stream, event)
        self.yield_(site or key)

    # -- deferred receive --------------------------------------------------------------------------------------
    def maybe_run_recv_hook(self) -> None:
        if self._run.aborted:
            raise _Aborted
        hook, self.recv_hook = self.recv_hook, None
        if hook is not None:
            with scope("dbo::recv_wait"):
                hook()

    def register_recv_hook_on_next(self, hook: Callable[[], None]) -> None:
        nxt = self._next_alive()
        if nxt is None:
            hook()  # nobody left to run it later
            return
        previous = nxt.recv_hook
        if previous is None:
            nxt.recv_hook = hook
        else:

            def both() -> None:
                previous()
                hook()

            nxt.recv_hook = both


_get_ident = threading.get_ident


def _current() -> UBatchContext | None:
    return _THREAD_CONTEXTS.get(_get_ident())


# -- module-level hook API (no-ops outside a micro-batch thread) -------------------------------------------------
def dbo_enabled() -> bool:
    """True inside a micro-batch thread of a running :func:`run_ubatches`."""
    return _current() is not None


def dbo_current_ubatch_id() -> int:
    """The calling micro-batch's index (0 outside micro-batching, as upstream)."""
    ctx = _current()
    return 0 if ctx is None else ctx.id


def dbo_current_ubatch_key() -> Hashable:
    """Who is running, for state kept per micro-batch outside the runtime (a forward context, a lock's owner): the
    calling micro-batch (its context object, unique to one micro-batch of one run) or, outside micro-batching, the
    calling thread's id. A thread id alone cannot tell the micro-batches apart: under the greenlet scheduler both
    run on the caller's thread."""
    ctx = _current()
    return _get_ident() if ctx is None else ctx


def dbo_num_ubatches() -> int:
    """Number of micro-batches in the current run (1 outside micro-batching)."""
    ctx = _current()
    return 1 if ctx is None else len(ctx._run.contexts)


def dbo_current_site() -> str | None:
    """The hook site the calling micro-batch passed last (None outside micro-batching)."""
    ctx = _current()
    return None if ctx is None else ctx.site


def dbo_yield(site: str = "") -> None:
    """Let the other micro-batch run until it yields back; keeps the current stream."""
    ctx = _THREAD_CONTEXTS.get(_get_ident())  # _current() inline: the hook every layer calls
    if ctx is not None:
        ctx.yield_(site)


def dbo_switch_to_comm() -> None:
    ctx = _current()
    if ctx is not None:
        ctx.switch_to_comm()


def dbo_switch_to_compute() -> None:
    ctx = _current()
    if ctx is not None:
        ctx.switch_to_compute()


def dbo_switch_to_comm_sync() -> None:
    """Switch to the comm stream, which first waits for the compute enqueued so far."""
    ctx = _current()
    if ctx is not None:
        ctx.switch_to_comm_sync()


def dbo_switch_to_compute_sync() -> None:
    """Switch to the compute stream, which first waits for the communication enqueued so far."""
    ctx = _current()
    if ctx is not None:
        ctx.switch_to_compute_sync()


def dbo_yield_and_switch_from_compute_to_comm(site: str = "") -> None:
    ctx = _current()
    if ctx is not None:
        ctx.yield_and_switch_from_compute_to_comm(site)


def dbo_yield_and_switch_from_comm_to_compute(site: str = "") -> None:
    ctx = _current()
    if ctx is not None:
        ctx.yield_and_switch_from_comm_to_compute(site)


def dbo_register_recv_hook(hook: Callable[[], None]) -> None:
    """Park ``hook`` on the NEXT micro-batch, which runs it at its next :func:`dbo_maybe_run_recv_hook`.

    Outside micro-batching the hook runs at once.
    """
    ctx = _current()
    if ctx is None:
        hook()
    else:
        ctx.register_recv_hook_on_next(hook)


def dbo_maybe_run_recv_hook() -> None:
    """Run the receive hook another micro-batch parked on this one, if any."""
    ctx = _current()
    if ctx is not None:
        ctx.maybe_run_recv_hook()


def dbo_record_current_stream(key: str = "default") -> None:
    ctx = _current()
    if ctx is not None:
        ctx.record_current_stream(key)


def dbo_wait_current_stream_and_yield(key: str = "default", *, wait: bool = True, site: str = "") -> None:
    ctx = _current()
    if ctx is not None:
        ctx.wait_current_stream_and_yield(key, wait=wait, site=site)


def note_site(site: str) -> None:
    """Record that the calling micro-batch entered hook site ``site`` (for error messages); no-op outside."""
    ctx = _current()
    if ctx is not None and site:
        ctx.site = site


def handoff_count() -> int:
    """How many baton handoffs this process has made so far (all runs together)."""
    return _HANDOFFS


def __getattr__(name: str) -> Any:
    # The run loop lives in dbo_runtime.workers, which imports this module; resolved on first use, no import cycle.
    if name in ("run_ubatches", "busy_workers"):
        from dbo_runtime import workers

        return getattr(workers, name)
    raise AttributeError(f"module 'dbo_runtime.context' has no attribute {name!r}")
