"""Core limits of the communication stream (Ascend): how many AI Cube / AI Vector cores the kernels on the stream
that carries a micro-batch's collectives may use, so HCCL keeps cores while the other micro-batch computes.

Read from ``DBO_RUNTIME_ASCEND_COMM_AIC_NUM`` / ``DBO_RUNTIME_ASCEND_COMM_AIV_NUM``; applied by wrapping a device
backend (``CommLimitedBackend``) whose ``new_stream`` sets them (``torch.npu.set_stream_limit``, see
:mod:`dbo_runtime.devices.npu`). Used by the vLLM-Ascend adapter (``dbo_runtime.ascend.runner``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dbo_runtime.devices.base import DeviceBackend
from dbo_runtime.errors import DBOConfigError

__all__ = ["COMM_AIC_ENV", "COMM_AIV_ENV", "comm_core_limits", "CommLimitedBackend"]

COMM_AIC_ENV = "DBO_RUNTIME_ASCEND_COMM_AIC_NUM"
COMM_AIV_ENV = "DBO_RUNTIME_ASCEND_COMM_AIV_NUM"


def comm_core_limits(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(AI Cube, AI Vector) core limits for the communication stream from the environment; -1 means no limit.

    HCCL kernels that run on AI cores need at least 16 vector cores (PR #4894's note); a smaller AIV limit is
    refused rather than left to hang in HCCL."""
    env = os.environ if env is None else env
    values = []
    for name in (COMM_AIC_ENV, COMM_AIV_ENV):
        raw = env.get(name, "-1").strip()
        try:
            value = int(raw)
        except ValueError:
            raise DBOConfigError(f"{name}={raw!r}: expected an integer number of cores, or -1 for no limit") from None
        if value < -1 or value == 0:
            raise DBOConfigError(f"{name}={raw!r}: expected a positive number of cores, or -1 for no limit")
        values.append(value)
    if 0 < values[1] < 16:
        raise DBOConfigError(f"{COMM_AIV_ENV}={values[1]}: HCCL needs at least 16 AI Vector cores; use >= 16 or -1")
    return values[0], values[1]


class CommLimitedBackend(DeviceBackend):
    """A device backend whose new streams (run_ubatches creates the communication stream with ``new_stream``)
    carry AI Cube / AI Vector core limits, so HCCL keeps cores while the other micro-batch computes."""

    has_streams = True

    def __init__(self, inner: DeviceBackend, *, cube_num: int, vector_num: int) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.has_streams = inner.has_streams  # type: ignore[misc]
        self.cube_num, self.vector_num = cube_num, vector_num

    def new_stream(self) -> Any:
        stream = self.inner.new_stream()
        if self.cube_num != -1 or self.vector_num != -1:
            self.inner.set_stream_limit(stream, cube_num=self.cube_num, vector_num=self.vector_num)  # type: ignore[attr-defined]
        return stream

    def current_stream(self) -> Any:
        return self.inner.current_stream()

    def set_stream(self, stream: Any) -> None:
        self.inner.set_stream(stream)

    def new_event(self) -> Any:
        return self.inner.new_event()

    def record_event(self, event: Any, stream: Any) -> None:
        self.inner.record_event(event, stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.inner.wait_event(stream, event)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def current_device(self) -> int | None:
        return self.inner.current_device()

    def set_device(self, index: int) -> None:
        self.inner.set_device(index)


