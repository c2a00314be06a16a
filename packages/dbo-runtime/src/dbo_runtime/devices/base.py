"""The interface every device backend implements.

A backend hides which device API creates streams and events: torch_npu on Ascend, torch.cuda on NVIDIA GPUs,
and nothing at all on CPU, where there are no streams and the overlap comes from collectives launched with
``async_op=True`` while the other micro-batch computes. The ping-pong runtime (``dbo_runtime.context``) talks
only to this interface.

Conventions for implementers:

- Subclass :class:`DeviceBackend` and set the class attributes ``name`` and ``has_streams``.
- Stream and event objects are whatever the device API returns (``torch.npu.Stream``, ``torch.cuda.Event``, ...);
  the runtime never inspects them, it only passes them back to the backend that created them.
- ``record_event(event, stream)`` records ``event`` on ``stream``; ``wait_event(stream, event)`` makes ``stream``
  wait (on the device, not on the host) until ``event`` has completed. Argument order follows the device APIs:
  ``event.record(stream)`` and ``stream.wait_event(event)``.
- A backend without streams (``has_streams = False``) returns placeholder objects and makes every stream or event
  operation a no-op; ``synchronize`` is then also a no-op.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

__all__ = ["DeviceBackend", "Stream", "Event"]

# The device API's own types; kept opaque so that this module imports no device library.
Stream = Any
Event = Any


class DeviceBackend(ABC):
    """Streams and events of one device kind, behind one small interface."""

    name: ClassVar[str]
    """Backend name as accepted by :func:`dbo_runtime.devices.get_backend`: ``"npu"``, ``"cuda"`` or ``"cpu"``."""

    has_streams: ClassVar[bool]
    """False where streams and events do not exist (CPU): every stream/event call is then a no-op."""

    @classmethod
    def is_available(cls) -> bool:
        """Whether this backend can run in this process (device library importable and a device present)."""
        return True

    @abstractmethod
    def new_stream(self) -> Stream:
        """A new stream on the current device."""

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream the calling thread currently enqueues work on."""

    @abstractmethod
    def set_stream(self, stream: Stream) -> None:
        """Make ``stream`` the calling thread's current stream."""

    @abstractmethod
    def new_event(self) -> Event:
        """A new event (timing disabled) usable for stream-to-stream ordering."""

    @abstractmethod
    def record_event(self, event: Event, stream: Stream) -> None:
        """Record ``event`` on ``stream`` (the device equivalent of ``event.record(stream)``)."""

    @abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make ``stream`` wait for ``event`` on the device (``stream.wait_event(event)``); the host does not block."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work on the current device has finished."""

    def current_device(self) -> int | None:
        """The calling thread's current device index; None where there is no device to pick (CPU).

        The current device is per thread in CUDA and torch_npu, and a new thread starts on device 0: the runtime
        reads it in the caller and sets it in each micro-batch thread (:meth:`set_device`)."""
        return None

    def set_device(self, index: int) -> None:
        """Make device ``index`` the calling thread's current device (nothing where :meth:`current_device` is None)."""
        return None

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        """Run a block with ``stream`` current, restoring the previous stream afterwards (even on error)."""
        previous = self.current_stream()
        self.set_stream(stream)
        try:
            yield stream
        finally:
            self.set_stream(previous)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} has_streams={self.has_streams}>"
