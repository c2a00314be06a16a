"""Device backends (dbo_runtime.devices): cpu for real, npu against a recording stand-in for torch_npu, cuda where
a GPU is present.

No NPU can exist on this machine, so the npu backend is driven through ``FakeTorchNPU``, a STAND-IN module
injected as ``sys.modules["torch_npu"]``. It implements only the torch_npu calls the backend makes, with
torch_npu's signatures (torch_npu/npu/streams.py, torch_npu/npu/utils.py), and records every call so that the
tests can check the exact sequence, including when DBO-core's ping-pong runtime drives it.
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dbo_runtime.devices import BACKEND_NAMES, DeviceBackend, available_backends, get_backend
from dbo_runtime.errors import DBOConfigError

# --- cpu ---------------------------------------------------------------------------------------------------


def test_cpu_backend_has_no_streams_and_every_operation_is_a_no_op() -> None:
    backend = get_backend("cpu")
    assert isinstance(backend, DeviceBackend)
    assert (backend.name, backend.has_streams) == ("cpu", False)
    stream, event = backend.new_stream(), backend.new_event()
    assert backend.record_event(event, stream) is None
    assert backend.wait_event(stream, event) is None
    assert backend.set_stream(stream) is None
    assert backend.synchronize() is None
    with backend.use_stream(stream) as used:
        assert used is stream


def test_auto_falls_back_to_cpu_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: auto picks cuda (tested below)")
    assert get_backend("auto").name == "cpu"
    assert available_backends() == ["cpu"]


def test_unknown_backend_lists_the_accepted_names() -> None:
    with pytest.raises(
        DBOConfigError, match="unknown device backend 'tpu'; accepted: 'auto', 'npu', 'cuda', 'cpu'"
    ):
        get_backend("tpu")


def test_unavailable_backend_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(DBOConfigError, match=r"'cuda' is not available .*without CUDA|no visible GPU"):
        get_backend("cuda")
    with pytest.raises(DBOConfigError, match=r"'npu' is not available .*torch_npu is not installed"):
        get_backend("npu")


def test_importing_dbo_runtime_never_imports_torch_npu(tmp_path: Path) -> None:
    # A torch_npu that explodes on import, first on the path: only an explicit npu request may touch it.
    trap = tmp_path / "torch_npu"
    trap.mkdir()
    (trap / "__init__.py").write_text("raise RuntimeError('torch_npu was imported')\n")
    script = textwrap.dedent(
        """
        import sys
        import dbo_runtime, dbo_runtime.errors, dbo_runtime.ubatch, dbo_runtime.dp_sync
        import dbo_runtime.devices, dbo_runtime.devices.base, dbo_runtime.devices.npu, dbo_runtime.devices.cuda
        from dbo_runtime.devices import get_backend
        assert get_backend("cpu").name == "cpu"
        assert "torch_npu" not in sys.modules, "imported"
        try:
            get_backend("npu")
        except Exception as exc:
            print("npu:", type(exc).__name__, exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # asking for npu does import it, and its failure comes back as a clear DBOConfigError
    assert "npu: DBOConfigError" in out.stdout
    assert "torch_npu was imported" in out.stdout


# --- npu, through a recording stand-in ---------------------------------------------------------------------


class FakeTorchNPU:
    """STAND-IN for torch_npu (no NPU here): records each call the npu backend makes, in order.

    ``module`` is what goes into ``sys.modules["torch_npu"]``; ``module.npu`` mimics ``torch_npu.npu`` (which
    torch_npu registers as ``torch.npu``). Current streams are per thread, as on the device.
    """

    def __init__(self, *, available: bool = True) -> None:
        self.calls: list[tuple] = []
        self.lock = threading.Lock()
        self.local = threading.local()
        self.available = available
        self.ids = itertools.count()
        fake = self

        class Stream:
            def __init__(self, device: int | None = None, priority: int = 0) -> None:
                self.name = f"stream{next(fake.ids)}"
                fake.log("Stream", device, priority)

            def wait_event(self, event: Event) -> None:
                fake.log("Stream.wait_event", self.name, event.name)

            def __repr__(self) -> str:
                return self.name

        class Event:
            def __init__(
                self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
            ) -> None:
                self.name = f"event{next(fake.ids)}"
                fake.log("Event", enable_timing, blocking)

            def record(self, stream: Stream | None = None) -> None:
                stream = stream if stream is not None else npu.current_stream()
                fake.log("Event.record", self.name, stream.name)

        self.default_stream = object.__new__(Stream)
        self.default_stream.name = "default"

        npu = types.ModuleType("torch_npu.npu")
        npu.Stream = Stream
        npu.Event = Event

        def current_stream(device: int | None = None) -> Stream:
            fake.log("current_stream", device)
            return getattr(fake.local, "stream", fake.default_stream)

        def set_stream(stream: Stream) -> None:
            fake.log("set_stream", stream.name)
            fake.local.stream = stream

        @contextlib.contextmanager
        def stream(s: Stream) -> Iterator[None]:
            fake.log("stream.enter", s.name)
            previous = getattr(fake.local, "stream", fake.default_stream)
            fake.local.stream = s
            try:
                yield
            finally:
                fake.local.stream = previous
                fake.log("stream.exit", s.name)

        def current_device() -> int:
            fake.log("current_device")
            return getattr(fake.local, "device", 0)  # per thread, 0 in a new thread, as on the device

        def set_device(index: int) -> None:
            fake.log("set_device", index)
            fake.local.device = index

        npu.current_device = current_device
        npu.set_device = set_device
        npu.current_stream = current_stream
        npu.set_stream = set_stream
        npu.stream = stream
        npu.synchronize = lambda device=None: fake.log("synchronize", device)
        npu.is_available = lambda: fake.available
        npu.set_stream_limit = lambda s, cube_num=-1, vector_num=-1: fake.log(
            "set_stream_limit", s.name, cube_num, vector_num
        )
        self.module = types.ModuleType("torch_npu")
        self.module.npu = npu
        self.module.__stand_in__ = "dbo_runtime tests: recording fake of torch_npu"

    def log(self, *call: object) -> None:
        with self.lock:
            self.calls.append((threading.current_thread().name, *call))

    def names(self) -> list[tuple]:
        """Calls without the thread name."""
        return [c[1:] for c in self.calls]


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNPU:
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
    return fake


def test_npu_backend_makes_torch_npus_calls(fake_npu: FakeTorchNPU) -> None:
    backend = get_backend("npu")
    assert (backend.name, backend.has_streams) == ("npu", True)
    compute = backend.current_stream()
    comm = backend.new_stream()
    done = backend.new_event()
    backend.record_event(done, compute)
    backend.set_stream(comm)
    backend.wait_event(comm, done)
    with backend.use_stream(compute):
        pass
    backend.set_stream_limit(comm, vector_num=16)
    backend.synchronize()
    assert fake_npu.names() == [
        ("current_stream", None),
        ("Stream", None, 0),
        ("Event", False, False),
        ("Event.record", done.name, "default"),
        ("set_stream", comm.name),
        ("Stream.wait_event", comm.name, done.name),
        ("stream.enter", "default"),
        ("stream.exit", "default"),
        ("set_stream_limit", comm.name, -1, 16),
        ("synchronize", None),
    ]


def test_auto_prefers_an_available_npu(fake_npu: FakeTorchNPU) -> None:
    assert get_backend("auto").name == "npu"
    assert available_backends()[0] == "npu"
    fake_npu.available = False
    assert get_backend("auto").name in ("cuda", "cpu")
    with pytest.raises(DBOConfigError, match="torch.npu.is_available\\(\\) is False"):
        get_backend("npu")


def test_ping_pong_runtime_drives_npu_streams_in_a_consistent_order(fake_npu: FakeTorchNPU) -> None:
    from dbo_runtime.context import (
        dbo_current_ubatch_id,
        dbo_yield_and_switch_from_comm_to_compute,
        dbo_yield_and_switch_from_compute_to_comm,
        run_ubatches,
    )

    backend = get_backend("npu")
    seen: list[tuple[int, str, str]] = []

    def micro_batch() -> int:
        ub = dbo_current_ubatch_id()
        seen.append((ub, "attention", backend.current_stream().name))
        dbo_yield_and_switch_from_compute_to_comm("moe_dispatch")
        seen.append((ub, "dispatch", backend.current_stream().name))
        dbo_yield_and_switch_from_comm_to_compute("moe_dispatch_done")
        seen.append((ub, "experts", backend.current_stream().name))
        return ub

    assert run_ubatches([micro_batch, micro_batch], backend=backend, timeout_s=10) == [0, 1]

    created = [c for c in fake_npu.names() if c[0] == "Stream"]
    assert len(created) == 1  # one communication stream; compute is the caller's current stream
    comm = next(name for ub, where, name in seen if where == "dispatch")
    # each micro-batch computes on the caller's stream, communicates on the comm stream, then returns
    for ub in (0, 1):
        assert [name for u, _, name in seen if u == ub] == ["default", comm, "default"]
    # the two micro-batches alternate: ub0 attention, ub1 attention, ub0 dispatch, ...
    assert [(u, w) for u, w, _ in seen] == [
        (0, "attention"), (1, "attention"), (0, "dispatch"), (1, "dispatch"), (0, "experts"), (1, "experts")
    ]  # fmt: skip
    # every device-side wait is on an event already recorded on the OTHER stream
    recorded: dict[str, str] = {}
    waits = 0
    for call in fake_npu.names():
        if call[0] == "Event.record":
            recorded[call[1]] = call[2]
        elif call[0] == "Stream.wait_event":
            waiter, event = call[1], call[2]
            assert event in recorded, f"{waiter} waits for {event}, never recorded"
            assert recorded[event] != waiter
            waits += 1
    assert waits == 4  # compute->comm and comm->compute, for each micro-batch
    # stream switches happen in the micro-batch threads, never in the caller's
    switching_threads = {c[0] for c in fake_npu.calls if c[1] == "set_stream"}
    assert switching_threads and threading.current_thread().name not in switching_threads


def test_npu_micro_batch_threads_set_the_callers_device(fake_npu: FakeTorchNPU) -> None:
    """torch_npu's current device is per thread: a micro-batch thread would start on NPU 0 while the caller (rank 3
    of an 8-NPU host) is on NPU 3. Each micro-batch thread sets the caller's device before the micro-batch runs."""
    from dbo_runtime.context import dbo_yield, run_ubatches

    backend = get_backend("npu")
    fake_npu.module.npu.set_device(3)
    seen: list[int] = []

    def micro_batch() -> None:
        seen.append(fake_npu.module.npu.current_device())
        dbo_yield("x")
        seen.append(fake_npu.module.npu.current_device())

    run_ubatches([micro_batch, micro_batch], backend=backend, timeout_s=10, mode="thread")
    assert seen == [3, 3, 3, 3]
    me = threading.current_thread().name
    assert {c[0] for c in fake_npu.calls if c[1:] == ("set_device", 3) and c[0] != me} == {
        c[0] for c in fake_npu.calls if c[1] == "set_stream"}  # the two micro-batch threads


def test_npu_import_error_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    from dbo_runtime.devices.npu import NPUBackend

    assert not NPUBackend.is_available()
    with pytest.raises(DBOConfigError, match="needs torch_npu"):
        NPUBackend()


def test_every_named_backend_is_registered() -> None:
    from dbo_runtime.devices import _backend_class

    assert BACKEND_NAMES == ("npu", "cuda", "cpu")
    for name in BACKEND_NAMES:
        assert _backend_class(name).name == name


# --- cuda, where a GPU is present --------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch.cuda.is_available() is False here (the cuda backend is tested where one is)",
)


@needs_cuda
def test_cuda_is_auto_without_torch_npu() -> None:
    assert get_backend("auto").name == "cuda"


@needs_cuda
def test_cuda_events_order_work_across_streams() -> None:
    backend = get_backend("cuda")
    side, done = backend.new_stream(), backend.new_event()
    main = backend.current_stream()
    x = torch.ones(1024, 1024, device="cuda")
    side.wait_stream(main)  # x was filled on the main stream
    with backend.use_stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy so an unordered read would see stale data
        y = x @ x
        backend.record_event(done, side)
    backend.wait_event(main, done)
    total = y.sum()  # enqueued on main, after the event
    backend.synchronize()
    assert total.item() == 1024.0**3


@needs_cuda
def test_cuda_set_stream_is_per_thread() -> None:
    backend = get_backend("cuda")
    mine = backend.current_stream()
    other = backend.new_stream()
    seen = []

    def worker() -> None:
        backend.set_stream(other)
        seen.append(backend.current_stream() == other)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert seen == [True]
    assert backend.current_stream() == mine


@needs_cuda
def test_cuda_ping_pong_gives_the_serial_result() -> None:
    from dbo_runtime.context import (
        dbo_current_ubatch_id,
        dbo_yield_and_switch_from_comm_to_compute,
        dbo_yield_and_switch_from_compute_to_comm,
        run_ubatches,
    )

    backend = get_backend("cuda")
    torch.manual_seed(0)
    halves = [torch.randn(512, 256, device="cuda"), torch.randn(512, 256, device="cuda")]
    weight = torch.randn(256, 256, device="cuda")

    def micro_batch() -> torch.Tensor:
        h = halves[dbo_current_ubatch_id()] @ weight
        dbo_yield_and_switch_from_compute_to_comm("comm")
        h = h * 2.0  # stands for a collective on the comm stream
        dbo_yield_and_switch_from_comm_to_compute("comm_done")
        return torch.relu(h @ weight)

    out = run_ubatches([micro_batch, micro_batch], backend=backend, timeout_s=30)
    backend.synchronize()
    expected = [torch.relu((x @ weight * 2.0) @ weight) for x in halves]
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want)
