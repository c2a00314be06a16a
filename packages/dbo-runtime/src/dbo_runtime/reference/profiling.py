"""Naming of trace spans and writing of PyTorch profiler (Kineto) traces in which compute and communication differ.

Span names (``torch.profiler.record_function``), relied on by profile-analyzer:

    dbo.<who>.compute.layer<L>           compute of layer L (several spans per layer: before and after the MoE)
    dbo.<who>.comm.<op>.layer<L>         a collective of layer L, from launch to completion

``<who>`` is ``ubatch0`` / ``ubatch1`` inside a micro-batch and ``full`` for a batch that was not split.
``<op>`` is ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``all_to_all_counts``. With micro-batching
on, compute spans are on the micro-batch threads and communication spans on the rank's communication thread
(``dbo-comm-rank<R>``), so that overlap shows as spans on different threads at the same time; the launch of a
collective (gloo's own ``c10d::`` op) sits on the micro-batch thread inside a short
``dbo.ubatch<i>.launch.<op>.layer<L>`` span, so that it carries the micro-batch marker too. With DBO off the
same holds with ``full``: compute and launches (``dbo.full.launch.<op>.layer<L>``) on the main thread, the
collectives in flight on the communication thread.
Regular expression: ``^dbo\\.(ubatch\\d+|full)\\.(compute|comm\\.[a-z_]+)\\.layer(\\d+)$``.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dbo_runtime.context import dbo_current_ubatch_id, dbo_enabled

__all__ = ["SPAN_PATTERN", "span_owner", "compute_span_name", "comm_span_name", "launch_span_name", "kineto_trace", "trace_file_name"]

SPAN_PATTERN = re.compile(r"^dbo\.(ubatch\d+|full)\.(compute|comm\.[a-z_]+)\.layer(\d+)$")


def span_owner() -> str:
    """``ubatch<i>`` inside micro-batch ``i``, ``full`` outside micro-batching."""
    return f"ubatch{dbo_current_ubatch_id()}" if dbo_enabled() else "full"


def compute_span_name(tag: str) -> str:
    """Name of a compute span of the calling micro-batch, e.g. ``dbo.ubatch0.compute.layer3``."""
    return f"dbo.{span_owner()}.compute.{tag}"


def comm_span_name(op: str, tag: str) -> str:
    """Name of a communication span of the calling micro-batch, e.g. ``dbo.ubatch1.comm.all_gather.layer3``."""
    return f"dbo.{span_owner()}.comm.{op}.{tag}"


def launch_span_name(op: str, tag: str) -> str:
    """Name of the span around a collective's launch on the micro-batch thread (DBO on only)."""
    return f"dbo.{span_owner()}.launch.{op}.{tag}"


def trace_file_name(rank: int) -> str:
    """Kineto's own naming: ``<worker>.<timestamp>.pt.trace.json``, one file per rank."""
    return f"rank{rank}.{int(time.time() * 1000)}.pt.trace.json"


@contextlib.contextmanager
def kineto_trace(
    out_dir: str | os.PathLike[str] | None, rank: int, step: int = 0, sync: Callable[[], None] | None = None
) -> Iterator[list[Path]]:
    """Profile the block on every thread (micro-batch and communication threads too) and write one Kineto trace.

    The block is one ``ProfilerStep#<step>`` range, as ``torch.profiler``'s own ``step()`` would mark it; ``sync``
    (e.g. a barrier, so that every rank's step starts together) runs after the profiler started and before that
    range. With ``out_dir`` None nothing is profiled. The list yielded receives the written path after the block. The
    file is written to a temporary name and renamed, so a reader never sees half a trace.
    """
    written: list[Path] = []
    if out_dir is None:
        yield written
        return
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # profile_all_threads: without it only the thread that started the profiler is recorded.
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        if sync is not None:
            sync()
        with record_function(f"ProfilerStep#{step}"):
            yield written
    final = out / trace_file_name(rank)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=out)
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    written.append(final)
