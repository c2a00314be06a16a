"""Ascend NPU backend over torch_npu's stream and event API.

torch_npu is imported only when this backend is instantiated or asked whether it is available, never when
``dbo_runtime`` is imported. The calls are torch_npu's own (torch_npu/npu/streams.py and utils.py; after
``import torch_npu`` the same module is also reachable as ``torch.npu``):

- ``torch.npu.Stream(device=None, priority=0)``, ``torch.npu.Event(enable_timing=False, blocking=False)``
- ``torch.npu.current_stream(device)``, ``torch.npu.set_stream(stream)`` (the calling thread's current stream),
  ``torch.npu.stream(stream)`` (context manager)
- ``event.record(stream)``, ``stream.wait_event(event)`` (device-side wait, the host does not block)
- ``torch.npu.synchronize(device)``
- ``torch.npu.current_device()``, ``torch.npu.set_device(index)`` (the calling thread's current device)
- ``torch.npu.set_stream_limit(stream, cube_num, vector_num)``: AI Cube / AI Vector core limits of a stream, the
  Ascend counterpart of reserving SMs for communication kernels (vLLM-Ascend PR #4894 uses it the same way).

Only a fake torch_npu that records these calls exercises this module here (tests/test_devices.py); it has not run
on an NPU in this repository's CI.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import ClassVar

from dbo_runtime.devices.base import DeviceBackend, Event, Stream
from dbo_runtime.errors import DBOConfigError

__all__ = ["NPUBackend"]


def _torch_npu_installed() -> bool:
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"] is not None
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def _npu_module() -> ModuleType:
    """``torch_npu.npu`` (the module torch_npu registers as ``torch.npu``), importing torch_npu on first use."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as exc:
        raise DBOConfigError(
            f"device backend 'npu' needs torch_npu, which cannot be imported ({exc}); accepted: an environment with "
            "torch_npu installed, or backend 'cpu'/'cuda'"
        ) from exc
    return torch_npu.npu


class NPUBackend(DeviceBackend):
    """Streams and events of one Ascend NPU (the current one unless ``device`` is given)."""

    name: ClassVar[str] = "npu"
    has_streams: ClassVar[bool] = True

    def __init__(self, device: int | None = None) -> None:
        self._npu = _npu_module()
        self.device = device

    @classmethod
    def is_available(cls) -> bool:
        if not _torch_npu_installed():
            return False
        try:
            return bool(_npu_module().is_available())
        except Exception:  # a broken CANN install raises from inside torch_npu; treat it as "not here"
            return False

    @classmethod
    def unavailable_reason(cls) -> str:
        if not _torch_npu_installed():
            return "torch_npu is not installed"
        try:
            npu = _npu_module()
        except DBOConfigError as exc:
            return str(exc.__cause__ or exc)
        except Exception as exc:
            return f"importing torch_npu failed: {type(exc).__name__}: {exc}"
        try:
            if not npu.is_available():
                return "torch_npu is installed but torch.npu.is_available() is False (no visible NPU or CANN not set up)"
        except Exception as exc:
            return f"torch.npu.is_available() raised {type(exc).__name__}: {exc}"
        return ""

    def new_stream(self) -> Stream:
        return self._npu.Stream(device=self.device)

    def current_stream(self) -> Stream:
        return self._npu.current_stream(self.device)

    def set_stream(self, stream: Stream) -> None:
        self._npu.set_stream(stream)

    def new_event(self) -> Event:
        return self._npu.Event(enable_timing=False, blocking=False)

    def record_event(self, event: Event, stream: Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def synchronize(self) -> None:
        self._npu.synchronize(self.device)

    def current_device(self) -> int:
        return int(self._npu.current_device())

    def set_device(self, index: int) -> None:
        self._npu.set_device(index)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        with self._npu.stream(stream):
            yield stream

    def set_stream_limit(self, stream: Stream, *, cube_num: int = -1, vector_num: int = -1) -> None:
        """Limit the AI Cube / AI Vector cores kernels on ``stream`` may use (-1 leaves a limit unchanged).

        vLLM-Ascend's note for HCCL on the communication stream: give it at least 16 vector cores.
        """
        self._npu.set_stream_limit(stream, cube_num=cube_num, vector_num=vector_num)
