"""The communication-site wrappers: the one place where model code meets the ping-pong.

Two kinds of site, after how the collective is issued:

- :func:`dbo_async_site` for collectives launched asynchronously that complete through a receive hook
  (torch.distributed with ``async_op=True`` on CPU/gloo, DeepEP-style ``return_recv_hook``). This is upstream
  vLLM's ``FusedMoEModularKernel._prepare``/``_finalize`` pattern: finish the other micro-batch's pending
  receive, launch ours, park our receive hook on the other micro-batch and yield exactly once.
- :func:`wrap_stream_site` for an existing function whose collectives are enqueued on the current stream (HCCL on
  NPU, NCCL on CUDA): yield and move to the communication stream, run it there, and come back to the compute
  stream, which waits for the communication to finish.

Both are plain calls when no micro-batching is running, so the non-split path costs nothing extra.

A receive hook that is a ``torch.distributed`` ``Work.wait`` (the vLLM CPU all-reduce site) is waited on with the
run's ``timeout_s``: under the greenlet scheduler no other thread watches a micro-batch, so a collective that never
completes must end its own wait, as a :class:`DBOTimeoutError` naming the micro-batch and the hook site.
"""

from __future__ import annotations

import datetime
import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from dbo_runtime import failure_board
from dbo_runtime.context import (
    _current,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_compute_to_comm,
    note_site,
)
from dbo_runtime.errors import DBOTimeoutError

__all__ = ["dbo_async_site", "wrap_stream_site"]

P = ParamSpec("P")
T = TypeVar("T")


def dbo_async_site(site: str, launch: Callable[[], tuple[Callable[[], None] | None, Callable[[], T]]]) -> T:
    """Run one asynchronous communication boundary and return what its receiver returns.

    ``launch()`` starts the communication and returns ``(hook, receiver)``: ``hook`` blocks until the data has
    arrived (``None`` when there is nothing to wait for), ``receiver`` returns the result. With micro-batching on,
    ``hook`` runs in the *other* micro-batch at its next site (after its compute), and this micro-batch yields
    exactly once; with it off, ``hook`` runs at once.
    """
    note_site(site)
    dbo_maybe_run_recv_hook()
    hook, receiver = launch()
    if hook is not None:
        if dbo_enabled():
            dbo_register_recv_hook(_bounded(site, hook))
            dbo_yield(site)
        else:
            hook()
    return receiver()


def _rank() -> str:
    """This process's rank in the default group, for a report ("?" where there is none)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return str(dist.get_rank()) if dist is not None and dist.is_initialized() else "?"
    except Exception:  # noqa: BLE001 - a report must never fail the failure it reports
        return "?"


def _bounded(site: str, hook: Callable[[], None]) -> Callable[[], None]:
    """``hook`` itself, unless it is a ``torch.distributed`` ``Work.wait``: then that wait with the run's timeout."""
    work = getattr(hook, "__self__", None)
    dist = sys.modules.get("torch.distributed")
    if work is None or dist is None or getattr(hook, "__name__", "") != "wait" or not isinstance(work, dist.Work):
        return hook
    ctx = _current()
    timeout_s = ctx._run.timeout_s if ctx is not None else 60.0
    owner = dbo_current_ubatch_id()

    def wait() -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            first = (str(exc).splitlines() or [""])[0]
            error = DBOTimeoutError(
                f"the collective micro-batch {owner} launched at hook site {site!r} failed or did not complete "
                f"within {timeout_s:g} s ({first}); micro-batch {dbo_current_ubatch_id()} waited for it",
                ubatch_id=owner,
                site=site,
            )
            # a peer may have died: say where DBO stood before the engine reports the death (failure_board)
            failure_board.report(f"rank {_rank()}: {error}")
            raise error from exc

    return wait


def wrap_stream_site(site: str, fn: Callable[P, T]) -> Callable[P, T]:
    """Wrap ``fn`` (whose collectives go on the current stream) so that it runs as a DBO communication site.

    Micro-batching on: yield, switching from the compute to the communication stream (which waits for the
    compute done so far), call ``fn`` there, then switch back to the compute stream, which waits for the
    communication. Off: a plain call.
    """

    @functools.wraps(fn)
    def at_site(*args: P.args, **kwargs: P.kwargs) -> T:
        if not dbo_enabled():
            return fn(*args, **kwargs)
        note_site(site)
        dbo_yield_and_switch_from_compute_to_comm(site)
        try:
            return fn(*args, **kwargs)
        finally:
            dbo_switch_to_compute_sync()

    at_site.__dbo_site__ = site  # type: ignore[attr-defined]
    return at_site
