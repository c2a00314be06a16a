"""Where a rank's DBO state goes when one of its collectives fails, so that a dying peer is reported in order.

When a tensor-parallel worker dies during a split step, two processes learn of it at once: the surviving worker
from its collective (gloo: "Connection reset by peer"; HCCL: its own timeout) and vLLM's executor, in the engine
core, from the dead process's sentinel. The executor's line ("Worker proc ... died unexpectedly") then wins the race
to the log by milliseconds, and the engine shuts down, so the one line that says where DBO stood (which micro-batch
waited at which hook site) came after the death notice, or never, when the survivor was killed in the shutdown.

The board orders the two. The engine core (:func:`dbo_runtime.vllm.plugin.patch_worker_monitor`, vLLM's
``MultiprocExecutor``) opens a folder named after its own pid before it watches its workers; a worker whose
collective fails (:func:`report`) logs its DBO state, then drops a file named after its pid in its parent's
folder; on a death, the executor's monitor waits, at most ``hold_s``, for a file from every surviving worker before
vLLM's own monitor reports the death. Nothing travels in environment variables: a worker finds the folder from its
parent's pid. Without a folder (no engine core watching: the reference model, Ray, tests) :func:`report` does
nothing and returns False.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["board_dir", "open_board", "close_board", "report", "wait_for_reports"]

_PREFIX = "dbo-failures-"
# a child of vLLM's own logger: under a vLLM process its handler and format (the worker's "(Worker_TP0 pid=...)"
# prefix), the only place report() logs (a board exists only under a watching vLLM engine core)
_LOGGER = "vllm.dbo_runtime"


def board_dir(owner_pid: int) -> Path:
    """The board folder of the process ``owner_pid`` (the engine core whose workers report to it)."""
    return Path(tempfile.gettempdir()) / f"{_PREFIX}{owner_pid}"


def open_board() -> Path:
    """Create this process's board (empty, private to this user) and return it. A folder left by an earlier
    process of the same pid is emptied; one of another user is not used (OSError)."""
    path = board_dir(os.getpid())
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if path.is_symlink() or path.stat().st_uid != os.getuid():
        raise OSError(f"{path} is not this user's folder; DBO failure board not opened")
    for old in path.iterdir():
        old.unlink(missing_ok=True)
    return path


def close_board(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def report(message: str) -> bool:
    """In a worker whose parent opened a board: log ``message`` (this rank's DBO state at a failed collective) at
    ERROR, flushed, then leave it on the board under this process's pid. False, and nothing logged, without one."""
    board = board_dir(os.getppid())
    if not board.is_dir():
        return False
    logger = logging.getLogger(_LOGGER)
    logger.error("dbo_runtime: DBO state at a failed collective: %s", message)
    current: logging.Logger | None = logger
    while current is not None:  # the line must be in the log before the file is on the board
        for handler in current.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        current = current.parent if current.propagate else None
    tmp = board / f".{os.getpid()}.tmp"
    try:
        tmp.write_text(message, encoding="utf-8")
        os.replace(tmp, board / str(os.getpid()))
    except OSError:  # the board went away (the engine core is shutting down): the log line is what counts
        return False
    return True


def wait_for_reports(board: Path, pids: Iterable[int], hold_s: float,
                     alive: Callable[[int], bool] = lambda pid: True, poll_s: float = 0.01) -> dict[int, str]:
    """Wait until every process of ``pids`` that is still ``alive`` has reported on ``board``, at most ``hold_s``
    seconds; return the reports that came ({pid: message}). A survivor that is not in a collective never reports:
    the wait is bounded so that a death is still reported ``hold_s`` after it at the latest."""
    waiting = set(pids)
    deadline = time.monotonic() + hold_s
    found: dict[int, str] = {}
    while True:
        for pid in list(waiting):
            file = board / str(pid)
            if file.is_file():
                with contextlib.suppress(OSError):
                    found[pid] = file.read_text(encoding="utf-8", errors="replace")
                waiting.discard(pid)
            elif not alive(pid):
                waiting.discard(pid)
        if not waiting or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)
