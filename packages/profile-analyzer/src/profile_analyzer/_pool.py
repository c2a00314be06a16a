"""Run one function over many jobs in worker processes, results in job order: the process pool of the loader
(``load(workers=N)``) and of the api (``load_and_analyze(jobs=N)``: each worker loads a rank and analyses it).

Workers are forked where the platform can (they inherit the imported modules), die with their parent (Linux:
``PR_SET_PDEATHSIG``), ignore Ctrl-C (the parent decides), and are stopped at once on an error, Ctrl-C or
SIGTERM in the parent instead of finishing the ranks they hold.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["map_in_processes"]

R = TypeVar("R")


def map_in_processes(fn: Callable[..., R], jobs: Sequence[tuple[Any, ...]], workers: int,
                     on_result: Callable[[int, R], None]) -> None:
    """``on_result(i, fn(*jobs[i]))`` for every job, in job order, with ``fn`` run in ``min(workers, len(jobs))``
    processes. An exception in a job is raised here (the other workers are stopped first)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs))), mp_context=ctx,
                               initializer=_worker_init, initargs=(os.getpid(),))
    try:
        # A forked worker inherits the parent's SIGTERM handler until its initializer resets it: SIGTERM stays
        # blocked while the workers are forked (all at the first submit under fork) and the worker unblocks it
        # after the reset, so a SIGTERM in that window neither raises in a half-started worker nor is lost.
        with _sigterm_blocked():
            futures = [pool.submit(fn, *job) for job in jobs]
        for i, fut in enumerate(futures):
            on_result(i, fut.result())
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


def _worker_init(parent: int) -> None:
    """In each worker: die with the parent. Linux delivers SIGTERM to the worker when the process that started it
    ends (even by SIGKILL), so no worker outlives a killed `report`."""
    import signal

    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a worker forked from a handler-installing parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent while it forked (see _sigterm_blocked)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if os.getppid() != parent:  # the parent is already gone
        os._exit(1)


@contextlib.contextmanager
def _sigterm_blocked() -> Iterator[None]:
    """Hold SIGTERM pending in this thread (and in processes forked meanwhile) until the block ends."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop_workers(pool: Any) -> None:
    """Terminate a ProcessPoolExecutor's processes, wait for them and for the executor's manager thread (the
    executor has no public way)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    # shutdown() forgets the manager thread, so take it first
    manager = getattr(pool, "_executor_manager_thread", None)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    pool.shutdown(wait=False, cancel_futures=True)
    # Let the manager thread see its dead workers and close its wake-up pipe now. Left running, it can close that
    # pipe while the interpreter's exit hook (concurrent.futures.process._python_exit) writes to it, which puts
    # "Exception ignored ... OSError: [Errno 9] Bad file descriptor" on stderr after the one-line error (seen in
    # CI twice; the first attempt at this join read the thread after shutdown() had set it to None).
    if manager is not None:
        try:
            manager.join(timeout=10)
        except RuntimeError:  # created but never started (an error inside submit() before its start())
            return
        if manager.is_alive():  # never seen; keep the exit hook off a pipe the thread may still close
            from concurrent.futures import process as _cf_process

            getattr(_cf_process, "_threads_wakeups", {}).pop(manager, None)
