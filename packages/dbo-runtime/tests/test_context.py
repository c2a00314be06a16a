"""The ping-pong runtime: ordering, the one-at-a-time invariant, and that no fault ever hangs it.

Every test runs under both schedulers (``thread``: one OS thread per micro-batch; ``greenlet``: both on the
caller's thread), chosen through ``DBO_RUNTIME_SCHEDULER`` as a user would. The few that are about OS threads
(a thread the watchdog gives up on, thread reuse) have a greenlet counterpart that says what happens there.
"""

from __future__ import annotations

import threading
import time

import pytest
from dbo_runtime import context as ctxmod
from dbo_runtime.context import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from dbo_runtime.devices.cpu import CPUBackend
from dbo_runtime.errors import DBOConfigError, DBOTimeoutError, DBOWorkerError
from dbo_runtime.hooks import dbo_async_site
from dbo_runtime.workers import SCHEDULER_ENV, SCHEDULERS

CPU = CPUBackend()


@pytest.fixture(params=SCHEDULERS, autouse=True)
def scheduler(request, monkeypatch):
    monkeypatch.setenv(SCHEDULER_ENV, request.param)
    return request.param


def _thread_only(scheduler: str, counterpart: str) -> None:
    if scheduler != "thread":
        pytest.skip(f"about OS threads; the greenlet scheduler's behaviour: {counterpart}")


def _no_ubatch_threads_left(wait_s: float = 2.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ctxmod.busy_workers() == 0:
            return True
        time.sleep(0.01)
    return False


def test_hooks_are_noops_outside_a_micro_batch():
    assert not dbo_enabled()
    assert dbo_current_ubatch_id() == 0
    dbo_yield("x")
    dbo_switch_to_comm()
    dbo_switch_to_compute_sync()
    dbo_maybe_run_recv_hook()
    ran = []
    dbo_register_recv_hook(lambda: ran.append(1))
    assert ran == [1]


def test_ping_pong_alternates_and_returns_results_in_order():
    trace: list[tuple[int, int]] = []

    def body(tag: str):
        def fn():
            assert dbo_enabled()
            for step in range(4):
                trace.append((dbo_current_ubatch_id(), step))
                dbo_yield(f"step{step}")
            return tag

        return fn

    assert run_ubatches([body("a"), body("b")], backend=CPU, timeout_s=5) == ["a", "b"]
    assert trace == [(u, s) for s in range(4) for u in (0, 1)]


def test_exactly_one_micro_batch_runs_at_a_time():
    running = []
    overlaps = []
    lock = threading.Lock()

    def fn():
        for _ in range(20):
            with lock:
                running.append(dbo_current_ubatch_id())
                if len(running) > 1:
                    overlaps.append(tuple(running))
            time.sleep(0.001)  # give a misbehaving runtime the chance to run the other thread now
            with lock:
                running.remove(dbo_current_ubatch_id())
            dbo_yield("loop")

    run_ubatches([fn, fn], backend=CPU, timeout_s=5)
    assert overlaps == []


def test_recv_hook_runs_in_the_next_micro_batch():
    seen = []

    def ub0():
        dbo_register_recv_hook(lambda: seen.append(("hook of 0 ran in", dbo_current_ubatch_id())))
        dbo_yield("dispatch")
        seen.append(("0 resumed",))

    def ub1():
        dbo_maybe_run_recv_hook()
        seen.append(("1 ran",))

    run_ubatches([ub0, ub1], backend=CPU, timeout_s=5)
    assert seen == [("hook of 0 ran in", 1), ("1 ran",), ("0 resumed",)]


def test_uneven_number_of_yields_finishes():
    def short():
        dbo_yield("a")

    def long():
        for i in range(5):
            dbo_yield(f"b{i}")
        ran = []
        dbo_register_recv_hook(lambda: ran.append(1))  # micro-batch 0 is gone: runs in place
        return ran

    assert run_ubatches([short, long], backend=CPU, timeout_s=5) == [None, [1]]


@pytest.mark.parametrize("n", [0, 1, 3])
def test_number_of_micro_batches_other_than_two_is_refused(n):
    with pytest.raises(DBOConfigError, match="exactly 2"):
        run_ubatches([lambda: None] * n, backend=CPU)


def test_bad_timeout_is_refused():
    with pytest.raises(DBOConfigError, match="timeout_s"):
        run_ubatches([lambda: None] * 2, backend=CPU, timeout_s=0)


class InjectedFault(RuntimeError):
    pass


# Every hook the model code can call, and the async site's three callables: a fault right after each.
FAULT_SITES = [
    "start",
    "yield",
    "switch_to_comm",
    "switch_to_compute",
    "switch_to_comm_sync",
    "switch_to_compute_sync",
    "yield_and_switch_from_compute_to_comm",
    "yield_and_switch_from_comm_to_compute",
    "register_recv_hook",
    "maybe_run_recv_hook",
    "launch",
    "recv_hook",
    "receiver",
    "end",
]


def _model(fault_ubatch: int, fault_site: str, layers: int = 3):
    def check(site: str) -> None:
        if dbo_current_ubatch_id() == fault_ubatch and site == fault_site:
            raise InjectedFault(f"injected at {site} in micro-batch {fault_ubatch}")

    def fn():
        check("start")
        for layer in range(layers):
            dbo_switch_to_comm()
            check("switch_to_comm")
            dbo_switch_to_compute()
            check("switch_to_compute")
            dbo_switch_to_comm_sync()
            check("switch_to_comm_sync")
            dbo_switch_to_compute_sync()
            check("switch_to_compute_sync")
            dbo_yield(f"layer{layer}.yield")
            check("yield")
            dbo_yield_and_switch_from_compute_to_comm(f"layer{layer}.to_comm")
            check("yield_and_switch_from_compute_to_comm")
            dbo_yield_and_switch_from_comm_to_compute(f"layer{layer}.to_compute")
            check("yield_and_switch_from_comm_to_compute")

            def launch(layer=layer):
                check("launch")
                return (lambda: check("recv_hook")), (lambda: check("receiver") or layer)

            assert dbo_async_site(f"layer{layer}.moe", launch) == layer
            dbo_register_recv_hook(lambda: None)
            check("register_recv_hook")
            dbo_maybe_run_recv_hook()
            check("maybe_run_recv_hook")
        check("end")
        return "done"

    return fn


def test_fault_free_model_runs():
    assert run_ubatches([_model(-1, ""), _model(-1, "")], backend=CPU, timeout_s=5) == ["done", "done"]


@pytest.mark.parametrize("site", FAULT_SITES)
@pytest.mark.parametrize("ubatch", [0, 1])
def test_fault_at_every_hook_reaches_the_caller(ubatch, site):
    fns = [_model(ubatch, site), _model(ubatch, site)]
    t0 = time.monotonic()
    with pytest.raises(DBOWorkerError) as info:
        run_ubatches(fns, backend=CPU, timeout_s=60)
    # the fault arrives at once, not when the timeout runs out (a bound far below the timeout, far above the
    # milliseconds it takes)
    assert time.monotonic() - t0 < 20.0
    err = info.value
    # The fault fires in the thread of micro-batch `ubatch` (for "recv_hook": a hook the other one parked on it).
    expected = ubatch
    assert err.ubatch_id == expected
    assert f"micro-batch {expected}" in str(err)
    assert isinstance(err.__cause__, InjectedFault)
    assert _no_ubatch_threads_left()


def test_micro_batch_that_never_yields_back_is_a_timeout_naming_it(scheduler):
    _thread_only(scheduler, "test_greenlet_micro_batch_that_does_not_yield_runs_to_its_end")
    release = threading.Event()

    def stuck():
        dbo_yield("layer0.moe.prepare")
        release.wait(30)  # never yields again until the test lets it go

    def fine():
        for i in range(3):
            dbo_yield(f"layer{i}.moe.prepare")

    t0 = time.monotonic()
    try:
        with pytest.raises(DBOTimeoutError) as info:
            run_ubatches([stuck, fine], backend=CPU, timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
        msg = str(info.value)
        assert "micro-batch 0" in msg and "layer0.moe.prepare" in msg
        assert info.value.site is not None
    finally:
        release.set()
    assert _no_ubatch_threads_left()


def test_stuck_collective_is_a_timeout_naming_the_site(scheduler):
    _thread_only(scheduler, "test_stuck_torch_distributed_receive_is_a_timeout_naming_the_site")
    release = threading.Event()

    def fn():
        for layer in range(2):

            def launch():
                return (lambda: release.wait(30)), (lambda: None)  # a receive that never completes

            dbo_async_site(f"layer{layer}.moe.dispatch", launch)

    t0 = time.monotonic()
    try:
        with pytest.raises(DBOTimeoutError) as info:
            run_ubatches([fn, fn], backend=CPU, timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
        assert "layer0.moe.dispatch" in str(info.value)
    finally:
        release.set()
    assert _no_ubatch_threads_left()


def test_lone_micro_batch_stuck_after_the_other_finished_is_caught_by_the_watchdog(scheduler):
    _thread_only(scheduler, "test_greenlet_micro_batch_that_does_not_yield_runs_to_its_end")
    release = threading.Event()

    def quick():
        return 1

    def stuck():
        dbo_yield("layer0.attn")
        release.wait(30)

    try:
        with pytest.raises(DBOTimeoutError, match="micro-batch 1"):
            run_ubatches([quick, stuck], backend=CPU, timeout_s=0.5)
    finally:
        release.set()
    assert _no_ubatch_threads_left()


def test_micro_batch_threads_are_reused(scheduler):
    _thread_only(scheduler, "test_greenlet_micro_batches_run_on_the_callers_thread")
    seen = []

    def fn():
        seen.append(threading.get_ident())
        dbo_yield("x")

    for _ in range(3):
        run_ubatches([fn, fn], backend=CPU, timeout_s=5)
        assert ctxmod.busy_workers() == 0  # idle as soon as the run returns
    assert len(set(seen)) == 2


def _raises_after_one_yield():
    dbo_yield("before the failure")
    raise ValueError("boom")


def test_handoff_counter_counts_handoffs(scheduler):
    """The greenlet scheduler counts per run on its hot path and adds the run's count when the run ends."""
    before = ctxmod.handoff_count()

    def fn():
        for i in range(3):
            dbo_yield(str(i))

    run_ubatches([fn, fn], backend=CPU, timeout_s=5)
    # 3 yields each, plus the final handovers at exit (the last one has nobody left to hand to).
    assert ctxmod.handoff_count() - before == 7
    with pytest.raises(DBOWorkerError):
        run_ubatches([fn, _raises_after_one_yield], backend=CPU, timeout_s=5)
    assert ctxmod.handoff_count() - before > 7  # a failed run's handoffs are counted too


def test_greenlet_micro_batch_that_does_not_yield_runs_to_its_end(scheduler):
    """One thread: nobody waits on a micro-batch that computes without yielding, so it just runs (as the plain
    forward would), however long; the other one goes on when it yields or ends."""
    if scheduler != "greenlet":
        pytest.skip("the thread scheduler's watchdog makes this a timeout (test above)")
    order = []

    def long_compute():
        dbo_yield("layer0.moe.prepare")
        order.append("0 computes")
        time.sleep(0.6)  # longer than timeout_s without a yield
        order.append("0 done")
        return 0

    def other():
        for i in range(3):
            order.append(f"1 step {i}")
            dbo_yield(f"layer{i}.moe.prepare")
        return 1

    assert run_ubatches([long_compute, other], backend=CPU, timeout_s=0.2) == [0, 1]
    assert order == ["1 step 0", "0 computes", "0 done", "1 step 1", "1 step 2"]


def _gloo_pair(timeout_s: float):
    """Two real gloo process groups of one 2-rank world in this process (rank 1 never joins a collective)."""
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    groups = {}

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups


def test_stuck_torch_distributed_receive_is_a_timeout_naming_the_site(scheduler):
    """A receive hook that is a real gloo ``Work.wait`` whose peer never joins: bounded by the run's timeout in
    both schedulers (in greenlet mode nothing else could end it), and the error names the site."""
    import torch

    group = _gloo_pair(30.0)[0]

    def fn():
        def launch():
            work = group.allreduce([torch.ones(4)])
            return work.wait, (lambda: None)

        dbo_async_site("layer0.tp.all_reduce", launch)
        dbo_yield("layer0.after")

    t0 = time.monotonic()
    with pytest.raises(DBOTimeoutError) as info:
        run_ubatches([fn, fn], backend=CPU, timeout_s=0.5)
    assert time.monotonic() - t0 < 5.0
    assert "layer0.tp.all_reduce" in str(info.value)
    assert _no_ubatch_threads_left()


def test_greenlet_micro_batches_run_on_the_callers_thread(scheduler):
    if scheduler != "greenlet":
        pytest.skip("thread scheduler: its own worker threads (test_micro_batch_threads_are_reused)")
    seen = []

    def fn():
        seen.append((dbo_current_ubatch_id(), threading.get_ident()))
        dbo_yield("x")
        seen.append((dbo_current_ubatch_id(), threading.get_ident()))

    run_ubatches([fn, fn], backend=CPU, timeout_s=5)
    assert sorted(seen) == [(0, threading.get_ident())] * 2 + [(1, threading.get_ident())] * 2
    assert ctxmod.busy_workers() == 0
    assert not dbo_enabled()  # the caller is outside micro-batching again


def test_unknown_scheduler_is_refused(monkeypatch):
    monkeypatch.setenv(SCHEDULER_ENV, "fibers")
    with pytest.raises(DBOConfigError, match="DBO_RUNTIME_SCHEDULER='fibers'.*thread, greenlet"):
        run_ubatches([lambda: None] * 2, backend=CPU)
    with pytest.raises(DBOConfigError, match="mode='x'"):
        run_ubatches([lambda: None] * 2, backend=CPU, mode="x")


@pytest.mark.parametrize("value", ["thread", "greenlet", "fibers"])
def test_vllm_runner_integration_reads_the_scheduler_from_the_environment(value, monkeypatch):
    """The vLLM plugin's runner integration (built in each worker process) takes DBO_RUNTIME_SCHEDULER; a bad value
    fails there, at installation, before the model loads."""
    from dbo_runtime.vllm.runner import RunnerIntegration

    monkeypatch.setenv(SCHEDULER_ENV, value)

    def make():
        return RunnerIntegration(platform="test", install_forward_context=lambda ctx: None,
                                 get_forward_context=lambda: None, backend=lambda: CPU,
                                 may_split=lambda *a: True, eager_descriptor=lambda d, n: d, eager_mode=None)

    if value == "fibers":
        with pytest.raises(DBOConfigError, match="DBO_RUNTIME_SCHEDULER='fibers'"):
            make()
    else:
        assert make().scheduler == value
