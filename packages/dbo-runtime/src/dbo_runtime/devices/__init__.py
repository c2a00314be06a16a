"""Device backends: ``npu`` (torch_npu), ``cuda`` (torch.cuda) and ``cpu`` (no streams).

Backend modules are imported only when asked for, so importing ``dbo_runtime`` never imports torch_npu.
"""

from __future__ import annotations

import importlib
import inspect

from dbo_runtime.devices.base import DeviceBackend, Event, Stream
from dbo_runtime.errors import DBOConfigError

__all__ = ["BACKEND_NAMES", "DeviceBackend", "Event", "Stream", "available_backends", "get_backend"]

# Order of preference for "auto": the first available wins; cpu is always available.
BACKEND_NAMES: tuple[str, ...] = ("npu", "cuda", "cpu")


def _backend_class(name: str) -> type[DeviceBackend]:
    """The concrete DeviceBackend subclass defined in ``dbo_runtime.devices.<name>`` whose ``name`` matches."""
    module = importlib.import_module(f"dbo_runtime.devices.{name}")
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if (
            issubclass(obj, DeviceBackend)
            and obj is not DeviceBackend
            and not inspect.isabstract(obj)
            and getattr(obj, "name", None) == name
            and obj.__module__ == module.__name__
        ):
            return obj
    raise ImportError(f"dbo_runtime.devices.{name} defines no concrete DeviceBackend with name {name!r}")


def available_backends() -> list[str]:
    """Names of the backends usable in this process, in ``auto`` preference order."""
    return [name for name in BACKEND_NAMES if _backend_class(name).is_available()]


def get_backend(name: str = "auto") -> DeviceBackend:
    """A backend instance by name (``"npu"``, ``"cuda"``, ``"cpu"``), or the first available one for ``"auto"``.

    Raises :class:`DBOConfigError` for an unknown name or a backend that cannot run here.
    """
    if name == "auto":
        for candidate in BACKEND_NAMES:
            cls = _backend_class(candidate)
            if cls.is_available():
                return cls()
        raise DBOConfigError(
            "no device backend is available (the cpu backend should always be)"
        )  # pragma: no cover
    if name not in BACKEND_NAMES:
        accepted = ", ".join(repr(n) for n in ("auto", *BACKEND_NAMES))
        raise DBOConfigError(f"unknown device backend {name!r}; accepted: {accepted}")
    cls = _backend_class(name)
    if not cls.is_available():
        raise DBOConfigError(
            f"device backend {name!r} is not available in this process"
            f"{_unavailable_reason(cls)}; available here: {', '.join(available_backends())}"
        )
    return cls()


def _unavailable_reason(cls: type[DeviceBackend]) -> str:
    reason = getattr(cls, "unavailable_reason", None)
    if callable(reason):
        text = reason()
        if text:
            return f" ({text})"
    return ""
