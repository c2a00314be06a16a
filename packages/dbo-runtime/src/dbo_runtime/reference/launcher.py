"""Local gloo ranks: spawn N processes on a free loopback port, run a task in each, collect results or errors.

Nothing here waits without a bound: the process group has a timeout, the parent joins the ranks until a
deadline and then kills what is left, and each rank reports its own error, so a failure on one rank is a clear
error for every rank rather than a hang. No rank outlives the parent: an exception in the parent (Ctrl-C, SIGTERM)
kills them before it propagates, and a parent that dies without running any code (SIGKILL, OOM killer) takes them
with it (Linux: the kernel's parent-death signal; elsewhere: a thread in each rank that watches the parent).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.errors import DBOConfigError, DBOError, DBOTimeoutError

__all__ = ["RankError", "RanksFailed", "free_port", "run_ranks"]


@dataclass(frozen=True)
class RankError:
    """What went wrong on one rank: the exception type, its message and the last line of its traceback."""

    rank: int
    type: str
    message: str
    where: str

    def line(self) -> str:
        return f"rank {self.rank}: {self.type}: {self.message}"


class RanksFailed(DBOError):
    """One or more ranks failed; ``errors`` has one entry per failed rank (a rank that was killed says so)."""

    def __init__(self, errors: list[RankError], results: dict[int, Any]) -> None:
        self.errors = errors
        self.results = results
        super().__init__("; ".join(e.line() for e in errors))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _atomic_pickle(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Make this process end when ``parent`` does, however the parent ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # it died before the signal was asked for
                    os._exit(1)
                return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="dbo-parent-watch", daemon=True).start()


def _rank_entry(
    rank: int, task: str, world_size: int, port: int, payload: Any, out_dir: str, pg_timeout_s: float, threads: int,
    parent: int | None = None,
) -> None:
    """Child process: one gloo rank. Never raises: the outcome goes to ``out_dir/rank<R>.pkl``."""
    if parent is not None:
        _die_with_parent(parent)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            result = _resolve(task)(rank, world_size, payload)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        _atomic_pickle({"ok": result}, out)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _atomic_pickle({"error": RankError(rank, type(exc).__name__, message, where)}, out)


def run_ranks(
    task: str,
    payload: Any,
    *,
    world_size: int = 2,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 30.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``task`` (``"module:function"``, called as ``f(rank, world_size, payload)``) on ``world_size`` ranks.

    Returns the per-rank results in rank order. Raises :class:`RanksFailed` listing every rank's error (a rank
    that did not finish within ``timeout_s`` is killed and reported as such).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DBOConfigError(f"world_size={world_size!r} is invalid; accepted: an integer >= 1")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dbo-ranks-") as out_dir:
        port = free_port()
        context = mp.start_processes(
            _rank_entry,
            args=(task, world_size, port, payload, out_dir, pg_timeout_s, threads, os.getpid()),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        procs = context.processes
        try:
            while time.monotonic() < deadline and any(p.is_alive() for p in procs):
                for p in procs:
                    p.join(0.05)
        except BaseException:  # Ctrl-C or SIGTERM in the parent: the ranks stop with it, now
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(5)
            raise
        killed = set()
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                killed.add(rank)
                proc.kill()
        for proc in procs:
            proc.join(5)

        results: dict[int, Any] = {}
        errors: list[RankError] = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if path.exists():
                with open(path, "rb") as f:
                    outcome = pickle.load(f)
                if "ok" in outcome:
                    results[rank] = outcome["ok"]
                else:
                    errors.append(outcome["error"])
            elif rank in killed:
                errors.append(RankError(rank, DBOTimeoutError.__name__, f"did not finish within {timeout_s:g} s; killed", "?"))
            else:
                code = context.processes[rank].exitcode
                errors.append(RankError(rank, "ProcessDied", f"exited with code {code} without a result", "?"))
        if errors:
            raise RanksFailed(errors, results)
        return [results[r] for r in range(world_size)]
