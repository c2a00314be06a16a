"""CPU backend: there are no streams on a CPU, so every stream and event operation is a no-op.

The overlap on CPU comes from elsewhere: collectives launched with ``async_op=True`` (torch.distributed/gloo)
progress on gloo's own threads while the other micro-batch computes. The placeholders below only exist so that
the ping-pong runtime can run the same code on every device.
"""

from __future__ import annotations

from typing import ClassVar

from dbo_runtime.devices.base import DeviceBackend

__all__ = ["CPUBackend", "CPUStream", "CPUEvent"]


class CPUStream:
    """Placeholder for a stream on a device that has none."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return f"<CPUStream {self.label}>"


class CPUEvent:
    """Placeholder for an event; recording or waiting on it does nothing."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<CPUEvent>"


_DEFAULT_STREAM = CPUStream("default")


class CPUBackend(DeviceBackend):
    """No streams: the host thread that calls a torch op is the only place it runs."""

    name: ClassVar[str] = "cpu"
    has_streams: ClassVar[bool] = False

    def __init__(self) -> None:
        self._count = 0

    def new_stream(self) -> CPUStream:
        self._count += 1
        return CPUStream(f"stream{self._count}")

    def current_stream(self) -> CPUStream:
        return _DEFAULT_STREAM

    def set_stream(self, stream: CPUStream) -> None:
        return None

    def new_event(self) -> CPUEvent:
        return CPUEvent()

    def record_event(self, event: CPUEvent, stream: CPUStream) -> None:
        return None

    def wait_event(self, stream: CPUStream, event: CPUEvent) -> None:
        return None

    def synchronize(self) -> None:
        return None
