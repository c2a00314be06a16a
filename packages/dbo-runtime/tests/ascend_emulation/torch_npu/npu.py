"""STAND-IN ``torch.npu`` (tests only): torch_npu's device, stream, event and graph API on the CPU.

Streams and events keep torch_npu's per-thread bookkeeping (the current device and the current stream are
per thread, as in torch_npu) but order nothing: every operator runs synchronously on the CPU, so a recorded event
is always complete. Graph capture is refused (:class:`torch_npu.NotEmulatedError`): ACL graphs cannot be
emulated, and the DBO tests run eager. Memory queries report a fixed emulated 64 GiB device.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

_DEVICE_COUNT = 8
_TOTAL_MEMORY = 64 << 30
_local = threading.local()
# SoC version numbers as torch_npu reports them (vllm_ascend.utils.check_ascend_device_type's ranges):
# 220-225 A2 (Atlas 800I/T A2, 910B), 250-255 A3 (910C).
SOC_VERSIONS = {"A2": 223, "A3": 253}
_soc = {"version": SOC_VERSIONS["A2"]}


def set_emulated_soc(kind: str) -> None:
    """Emulate an A2 or an A3 host (what ``get_soc_version`` answers); tests also set vllm_ascend's own
    ``utils._ascend_device_type``, which the real package reads from its build info."""
    if kind not in SOC_VERSIONS:
        raise ValueError(f"emulated SoC {kind!r}; accepted: {sorted(SOC_VERSIONS)}")
    _soc["version"] = SOC_VERSIONS[kind]


def get_soc_version() -> int:
    return _soc["version"]


def _not_emulated(what: str) -> Any:
    from torch_npu import NotEmulatedError

    raise NotEmulatedError(f"torch.npu.{what} is not emulated (no ACL graphs on the CPU stand-in)")


# -- devices ------------------------------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    return None


def device_count() -> int:
    return _DEVICE_COUNT


def _index(device: Any) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return current_device() if device.index is None else int(device.index)
    raise TypeError(f"not a device: {device!r}")


def current_device() -> int:
    return getattr(_local, "device", 0)


def set_device(device: Any) -> None:
    index = _index(device)
    if not 0 <= index < _DEVICE_COUNT:
        raise RuntimeError(f"emulated NPU: invalid device index {index} (device_count {_DEVICE_COUNT})")
    _local.device = index


@contextlib.contextmanager
def device(dev: Any):  # noqa: D401 - torch.npu.device context manager
    prev = current_device()
    set_device(dev)
    try:
        yield
    finally:
        set_device(prev)


def get_device_name(device: Any = None) -> str:
    return "Ascend910B3 (emulated on CPU)" if _soc["version"] < 250 else "Ascend910_9391 (emulated on CPU)"


def get_device_properties(device: Any = None) -> Any:
    return SimpleNamespace(name=get_device_name(device), total_memory=_TOTAL_MEMORY, major=0, minor=0,
                           multi_processor_count=24, cube_core_num=24, vector_core_num=48)


def synchronize(device: Any = None) -> None:
    return None


def empty_cache() -> None:
    return None


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return _TOTAL_MEMORY, _TOTAL_MEMORY


def memory_allocated(device: Any = None) -> int:
    return 0


def max_memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def memory_stats(device: Any = None) -> dict[str, int]:
    return {"allocated_bytes.all.peak": 0, "allocated_bytes.all.current": 0}


def reset_peak_memory_stats(device: Any = None) -> None:
    return None


def set_compile_mode(jit_compile: bool = False) -> None:
    return None


# "npu" tensors are CPU tensors drawn from the CPU generator, which torch.manual_seed already seeds (it calls these).
def manual_seed(seed: int) -> None:
    return None


def manual_seed_all(seed: int) -> None:
    return None


config = SimpleNamespace(allow_internal_format=False)


# -- streams and events -------------------------------------------------------------------------------------------
_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1, the device type torch_npu's streams carry


class Stream(torch.Stream):
    """A named queue on one device (a ``torch.Stream`` of the npu device type, as torch_npu's ``NPUStream``); operators
    run when called, so ``query`` is always True."""

    _next_id = 0
    _lock = threading.Lock()

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        with Stream._lock:
            Stream._next_id += 1
            stream_id = Stream._next_id
        return super().__new__(cls, stream_id=stream_id, device_index=_index(device), device_type=_PRIVATEUSE1)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority
        self.limits: tuple[int, int] | None = None

    def wait_event(self, event: Event) -> None:
        return None

    def wait_stream(self, stream: Stream) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("emulated-npu-stream", self.stream_id))

    def __repr__(self) -> str:
        return f"<emulated torch.npu.Stream {self.stream_id} on npu:{self.device_index}>"


def _record_stream_on_cpu_memory() -> None:
    """``Tensor.record_stream``: torch_npu's caching allocator keeps a block until the recorded stream used it. The
    emulated npu memory is the CPU allocator's, which reuses nothing across streams: nothing to record."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TID251
    lib.impl("record_stream", lambda tensor, stream: None, "CPU")
    _LIBS.append(lib)


_LIBS: list[Any] = []
_record_stream_on_cpu_memory()


_default_streams: dict[int, Stream] = {}
_default_lock = threading.Lock()


def default_stream(device: Any = None) -> Stream:
    index = _index(device)
    with _default_lock:
        if index not in _default_streams:
            _default_streams[index] = Stream(index)
        return _default_streams[index]


def current_stream(device: Any = None) -> Stream:
    streams = getattr(_local, "streams", None)
    index = _index(device)
    if streams and index in streams:
        return streams[index]
    return default_stream(index)


def set_stream(stream: Stream) -> None:
    if stream is None:
        return
    if not hasattr(_local, "streams"):
        _local.streams = {}
    _local.streams[stream.device_index] = stream


@contextlib.contextmanager
def stream(s: Stream | None):
    if s is None:
        yield
        return
    prev = current_stream(s.device_index)
    set_stream(s)
    try:
        yield s
    finally:
        set_stream(prev)


def set_stream_limit(stream: Stream, cube_num: int = -1, vector_num: int = -1) -> None:
    stream.limits = (cube_num, vector_num)


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs: Any) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Event) -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("emulated NPU event: elapsed_time before both events were recorded")
        return (end._time - self._time) * 1000.0


class ExternalEvent(Event):
    def reset(self, stream: Stream | None = None) -> None:
        return None


# -- graphs: refused -----------------------------------------------------------------------------------------------
def is_current_stream_capturing() -> bool:
    return False


class NPUGraph:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _not_emulated("NPUGraph")


def graph(*args: Any, **kwargs: Any) -> Any:
    return _not_emulated("graph")


def graph_pool_handle() -> Any:
    return _not_emulated("graph_pool_handle")


for _name in ("graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end"):
    globals()[_name] = (lambda n: (lambda *a, **k: _not_emulated(n)))(_name)

memory = SimpleNamespace(
    NPUPluggableAllocator=lambda *a, **k: _not_emulated("memory.NPUPluggableAllocator"),
    MemPool=lambda *a, **k: _not_emulated("memory.MemPool"),
    use_mem_pool=lambda *a, **k: _not_emulated("memory.use_mem_pool"),
    memory_snapshot=lambda *a, **k: [],
)
