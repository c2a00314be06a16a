"""NVIDIA GPU backend over ``torch.cuda`` (the API upstream vLLM's ubatching uses).

``torch.cuda.set_stream`` sets the calling thread's current stream, which is what lets two micro-batch threads
each run on the stream they chose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import torch

from dbo_runtime.devices.base import DeviceBackend, Event, Stream
from dbo_runtime.errors import DBOConfigError

__all__ = ["CUDABackend"]


class CUDABackend(DeviceBackend):
    """Streams and events of one CUDA device (the current one unless ``device`` is given)."""

    name: ClassVar[str] = "cuda"
    has_streams: ClassVar[bool] = True

    def __init__(self, device: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise DBOConfigError(f"device backend 'cuda' cannot run here: {self.unavailable_reason()}")
        self.device = device

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} was built without CUDA"
        return "torch.cuda.is_available() is False (no visible GPU)"

    def new_stream(self) -> Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def set_stream(self, stream: Stream) -> None:
        torch.cuda.set_stream(stream)

    def new_event(self) -> Event:
        return torch.cuda.Event(enable_timing=False, blocking=False)

    def record_event(self, event: Event, stream: Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        with torch.cuda.stream(stream):
            yield stream
