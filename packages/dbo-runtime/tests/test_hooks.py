"""The communication-site wrappers: the schedule they produce with micro-batching on, a plain call with it off."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
from dbo_runtime.context import dbo_current_ubatch_id, run_ubatches
from dbo_runtime.devices.base import DeviceBackend
from dbo_runtime.devices.cpu import CPUBackend
from dbo_runtime.hooks import dbo_async_site, wrap_stream_site
from dbo_runtime.workers import SCHEDULER_ENV, SCHEDULERS


@pytest.fixture(params=SCHEDULERS, autouse=True)
def scheduler(request, monkeypatch):
    """Each test under both schedulers (thread and greenlet), picked as a user would: the environment variable."""
    monkeypatch.setenv(SCHEDULER_ENV, request.param)
    return request.param


class RecordingBackend(DeviceBackend):
    """A backend with named streams and events that logs every call, to check the stream choreography."""

    name: ClassVar[str] = "recording"
    has_streams: ClassVar[bool] = True

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._local = threading.local()
        self._n_streams = 0
        self._n_events = 0

    def new_stream(self):
        self._n_streams += 1
        return f"s{self._n_streams}"

    def current_stream(self):
        return getattr(self._local, "stream", "main")

    def set_stream(self, stream) -> None:
        self._local.stream = stream
        self.log.append(("set", dbo_current_ubatch_id(), stream))

    def new_event(self):
        self._n_events += 1
        return f"e{self._n_events}"

    def record_event(self, event, stream) -> None:
        self.log.append(("record", dbo_current_ubatch_id(), event, stream))

    def wait_event(self, stream, event) -> None:
        self.log.append(("wait", dbo_current_ubatch_id(), stream, event))

    def synchronize(self) -> None:
        pass


def test_async_site_off_runs_hook_inline_then_receiver():
    calls = []

    def launch():
        calls.append("launch")
        return (lambda: calls.append("hook")), (lambda: calls.append("receiver") or 42)

    assert dbo_async_site("moe.dispatch", launch) == 42
    assert calls == ["launch", "hook", "receiver"]


def test_async_site_on_follows_the_upstream_schedule():
    """ub0 launches and yields; ub1 finishes ub0's receive before launching its own; one yield per site."""
    log = []

    def model():
        u = dbo_current_ubatch_id()
        for layer in range(2):
            log.append(f"compute{u}.{layer}")

            def launch(layer=layer, u=u):
                log.append(f"launch{u}.{layer}")
                return (lambda: log.append(f"wait{u}.{layer}")), (lambda: log.append(f"recv{u}.{layer}"))

            dbo_async_site(f"layer{layer}.moe", launch)
        return u

    assert run_ubatches([model, model], backend=CPUBackend(), timeout_s=5) == [0, 1]
    assert log == [
        "compute0.0", "launch0.0",
        "compute1.0", "wait0.0", "launch1.0",
        "recv0.0", "compute0.1", "wait1.0", "launch0.1",
        "recv1.0", "compute1.1", "wait0.1", "launch1.1",
        "recv0.1", "wait1.1",  # micro-batch 0 runs 1's pending receive as it exits
        "recv1.1",
    ]  # fmt: skip


def test_async_site_without_hook_does_not_yield():
    order = []

    def model():
        u = dbo_current_ubatch_id()
        dbo_async_site("noop", lambda: (None, lambda: order.append(u)))
        order.append(u)

    run_ubatches([model, model], backend=CPUBackend(), timeout_s=5)
    assert order == [0, 0, 1, 1]


def test_wrap_stream_site_off_is_a_plain_call():
    backend = RecordingBackend()

    def collective(x, *, scale):
        return x * scale

    wrapped = wrap_stream_site("linear.all_gather", collective)
    assert wrapped(3, scale=2) == 6
    assert wrapped.__name__ == "collective" and wrapped.__dbo_site__ == "linear.all_gather"
    assert backend.log == []


def test_wrap_stream_site_on_moves_to_comm_stream_and_back_with_events():
    backend = RecordingBackend()
    streams_seen = []

    def collective():
        streams_seen.append((dbo_current_ubatch_id(), backend.current_stream()))
        return dbo_current_ubatch_id()

    wrapped = wrap_stream_site("moe.finalize", collective)
    assert run_ubatches([wrapped, wrapped], backend=backend, timeout_s=5) == [0, 1]
    comm = "s1"
    assert streams_seen == [(0, comm), (1, comm)]
    ops0 = [entry for entry in backend.log if entry[1] == 0]
    # enter: compute stream; yield_and_switch_from_compute_to_comm: record compute-done, (yield), set comm, comm
    # waits compute-done; after fn: record comm-done on comm, set compute, compute waits comm-done.
    assert ops0 == [
        ("set", 0, "main"),
        ("record", 0, "e1", "main"),
        ("set", 0, comm),
        ("wait", 0, comm, "e1"),
        ("record", 0, "e2", comm),
        ("set", 0, "main"),
        ("wait", 0, "main", "e2"),
    ]


def test_wrap_stream_site_propagates_errors():
    def broken():
        raise ValueError("hccl failed")

    with pytest.raises(ValueError, match="hccl failed"):
        wrap_stream_site("x", broken)()


def test_callers_stream_is_back_after_the_run(scheduler):
    """Thread scheduler: the micro-batch threads' streams are their own. Greenlet scheduler: the micro-batches move
    the caller's thread between the compute and the communication stream; the caller gets its stream back."""
    backend = RecordingBackend()

    def fn():
        from dbo_runtime.context import dbo_yield_and_switch_from_compute_to_comm

        dbo_yield_and_switch_from_compute_to_comm("left on the comm stream")

    run_ubatches([fn, fn], backend=backend, timeout_s=5)
    assert backend.current_stream() == "main"
