"""Collectives for the reference model: torch.distributed (gloo on CPU) with ``async_op=True``, plus a link model.

The link model is a STAND-IN for the NPU interconnect (HCCS on Ascend): loopback between two processes on one
machine is neither as fast nor as slow as a real link, and it competes for the same CPU cores as the compute. So
every collective is made to last at least ``latency + wire_bytes / bandwidth``: after gloo's ``work.wait()`` the
completion waits until that deadline. ``wire_bytes`` is what one rank moves over its link:

- all-gather: input bytes x (world - 1)          (receives every other rank's shard)
- reduce-scatter: output bytes x (world - 1)     (ring: sends/receives world-1 partial shards)
- all-to-all: max(bytes sent to, bytes received from) the other ranks

The link serves one collective at a time: a collective's modelled time starts when the previous one's ends.

A collective's completion is observed in one of two ways:

- by whoever runs its receive hook: inline right after the launch on the plain path, and inside micro-batching
  by the *other* micro-batch at its next communication site, after its compute (gloo progressed meanwhile on its
  own threads). This costs no extra thread wake-up, so it is what timed steps use;
- while a profiler is recording (or with ``comm_thread=True``), by a per-rank communication thread (the CPU
  analogue of a communication stream) that waits for each collective in launch order, so that the collective's
  span in the trace covers the time it was really in flight while the other micro-batch computed. This holds
  with DBO off too: the plain path's compute thread then carries only launches and waits, not the transfers,
  and a trace reader that tells threads apart by what they mostly do sees a compute thread and a
  communication thread in both modes.

Every wait is bounded by ``timeout_s``; a collective that fails or does not complete raises an error naming the
collective, the rank and the micro-batch.
"""

from __future__ import annotations

import datetime
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dbo_runtime.context import dbo_current_ubatch_id, dbo_enabled
from dbo_runtime.errors import DBOConfigError, DBOError, DBOTimeoutError
from dbo_runtime.reference.profiling import comm_span_name, launch_span_name

__all__ = ["LinkModel", "CollectiveRecord", "PendingCollective", "Collectives", "LINK_STAND_IN_NOTE"]

LINK_STAND_IN_NOTE = "modelled link: latency + bytes/bandwidth, a stand-in for HCCS (loopback here is not an NPU link)"


# What a modelled link may be (`--link`): an interconnect's latency is microseconds (HCCS, NVLink, RoCE: 1-50 us;
# 10 ms is far past any link one step crosses), its bandwidth from a slow Ethernet (1 MB/s) to far past any
# NPU/GPU link (10 TB/s).
LINK_LATENCY_US_MAX = 10_000.0
LINK_GBPS_RANGE = (1e-3, 1e4)


@dataclass(frozen=True)
class LinkModel:
    """Stand-in for an NPU link: each collective lasts at least ``latency_us`` + wire bytes / ``bandwidth_gbps``.

    ``bandwidth_gbps`` is in GB/s (1e9 bytes per second); ``math.inf`` means no bandwidth term, and
    ``LinkModel(0, inf)`` leaves the collectives as fast as loopback makes them.
    """

    latency_us: float = 20.0
    bandwidth_gbps: float = math.inf

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise DBOConfigError(f"link latency {self.latency_us!r} us is invalid; accepted: a number >= 0")
        if not (self.bandwidth_gbps > 0):
            raise DBOConfigError(f"link bandwidth {self.bandwidth_gbps!r} GB/s is invalid; accepted: a number > 0")

    def duration_s(self, wire_bytes: int) -> float:
        """The least time a collective moving ``wire_bytes`` over this link takes, in seconds."""
        return self.latency_us * 1e-6 + wire_bytes / (self.bandwidth_gbps * 1e9)

    def describe(self) -> str:
        bw = "unlimited" if math.isinf(self.bandwidth_gbps) else f"{self.bandwidth_gbps:.4g} GB/s"
        return f"modelled link: {self.latency_us:g} us + bytes / {bw} (stand-in for HCCS)"

    def spec(self) -> str:
        """The ``LAT_US,GBPS`` text that :meth:`parse` reads back."""
        return f"{self.latency_us:g},{'inf' if math.isinf(self.bandwidth_gbps) else f'{self.bandwidth_gbps:.6g}'}"

    @classmethod
    def parse(cls, text: str) -> LinkModel:
        """``"LAT_US,GBPS"`` (e.g. ``"20,0.5"``; ``GBPS`` may be ``inf``) or ``"none"`` (no modelled cost), within
        :data:`LINK_LATENCY_US_MAX` and :data:`LINK_GBPS_RANGE`: a link that slow would only make the ranks sleep
        past their timeouts (or past what ``time.sleep`` takes: OverflowError)."""
        accepted = (f"accepted: LAT_US,GBPS with 0 <= LAT_US <= {LINK_LATENCY_US_MAX:g} and "
                    f"{LINK_GBPS_RANGE[0]:g} <= GBPS <= {LINK_GBPS_RANGE[1]:g} or inf (e.g. 20,0.5 for 20 us and "
                    "0.5 GB/s), 'none' or 'auto'")
        if text.strip().lower() == "none":
            return cls(0.0, math.inf)
        parts = text.split(",")
        if len(parts) != 2:
            raise DBOConfigError(f"--link {text[:80]!r} is invalid; {accepted}")
        try:
            latency, bandwidth = float(parts[0]), float(parts[1])
        except ValueError:
            raise DBOConfigError(f"--link {text[:80]!r} is invalid; {accepted}") from None
        in_range = (0 <= latency <= LINK_LATENCY_US_MAX
                    and (bandwidth == math.inf or LINK_GBPS_RANGE[0] <= bandwidth <= LINK_GBPS_RANGE[1]))
        if not in_range:  # NaN compares false: refused here too
            raise DBOConfigError(f"--link {text[:80]!r} is out of range; {accepted}")
        return cls(latency, bandwidth)


@dataclass(frozen=True)
class CollectiveRecord:
    """One completed collective: what, who, how many wire bytes, and when (``time.perf_counter`` seconds)."""

    op: str
    name: str
    ubatch: int | None
    wire_bytes: int
    launch_s: float
    done_s: float
    modelled_s: float

    @property
    def duration_s(self) -> float:
        return self.done_s - self.launch_s


def _profiler_running() -> bool:
    """Whether a torch profiler is recording (process-wide flag, visible from every thread)."""
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


class PendingCollective:
    """A launched collective. :meth:`wait` blocks (bounded) until it is done; :attr:`output` is its result."""

    def __init__(
        self,
        owner: Collectives,
        op: str,
        name: str,
        work: dist.Work | None,
        output: torch.Tensor,
        wire_bytes: int,
        launch_s: float,
        ubatch: int | None,
        span: record_function | None,
    ) -> None:
        self._owner = owner
        self.op = op
        self.name = name
        self._work = work
        self.output = output
        self.wire_bytes = wire_bytes
        self.launch_s = launch_s
        self.ubatch = ubatch
        self._span = span
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._on_thread = False
        # The link is busy with one collective at a time: this one starts when the previous one's modelled time
        # is over.
        self.modelled_s = owner.link.duration_s(wire_bytes)
        self.deadline_s = max(launch_s, owner._link_free_at) + self.modelled_s
        owner._link_free_at = self.deadline_s

    def _complete(self, signal: bool = True) -> None:
        """Wait for gloo, then for the link model's deadline; record; with ``signal``, wake the waiters (else the
        caller does). Runs on the comm thread or inline."""
        owner = self._owner
        finished_before = False
        try:
            if self._work is not None:
                finished_before = self._work.is_completed()
                self._work.wait(datetime.timedelta(seconds=owner.timeout_s))
        except Exception as exc:  # noqa: BLE001 - reported to whoever waits
            who = "" if self.ubatch is None else f" (micro-batch {self.ubatch})"
            self._error = DBOError(
                f"collective {self.name} ({self.op}) failed on rank {owner.rank}{who}: {str(exc).splitlines()[0]}"
            )
            self._error.__cause__ = exc
        now = time.perf_counter()
        if self._error is None and now < self.deadline_s:
            time.sleep(self.deadline_s - now)
        # Done when both gloo and the modelled link are; if gloo had finished before anybody looked, its own end is
        # unknown but earlier than the check, and the modelled deadline (far longer than loopback) stands.
        done = self.deadline_s if finished_before or now <= self.deadline_s else now
        owner.records.append(
            CollectiveRecord(self.op, self.name, self.ubatch, self.wire_bytes, self.launch_s, done, self.modelled_s)
        )
        if signal:
            self._done.set()

    def wait(self) -> None:
        """Block until done (bounded by the owner's ``timeout_s``); raise if the collective failed."""
        if not self._done.is_set():
            if self._on_thread:
                bound = self._owner.timeout_s + self._owner.link.duration_s(self.wire_bytes) + 1.0
                if not self._done.wait(bound):
                    raise DBOTimeoutError(
                        f"collective {self.name} ({self.op}) on rank {self._owner.rank} did not complete within "
                        f"{bound:.1f} s",
                        ubatch_id=self.ubatch,
                        site=self.name,
                    )
            else:
                try:
                    self._complete()  # only one micro-batch runs at a time: no concurrent completion
                finally:
                    if self._span is not None:
                        self._span.__exit__(None, None, None)
                        self._span = None
        if self._error is not None:
            raise self._error

    def result(self) -> torch.Tensor:
        self.wait()
        return self.output


class Collectives:
    """The collectives of one rank over ``group``, each lasting at least what ``link`` says."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        link: LinkModel | None = None,
        timeout_s: float = 60.0,
        comm_thread: bool | None = None,
    ):
        if not dist.is_initialized():
            raise DBOConfigError("torch.distributed is not initialized; accepted: call init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.link = link if link is not None else LinkModel()
        self.timeout_s = float(timeout_s)
        self.records: list[CollectiveRecord] = []
        self._link_free_at = 0.0
        # None: a communication thread only while the profiler runs (its in-flight spans are what a trace needs);
        # otherwise whoever runs the receive hook waits, which costs no thread wake-ups.
        self.comm_thread = comm_thread
        self._queue: queue.Queue[PendingCollective | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- the communication thread (while profiling, or with comm_thread=True) ------------------------------
    def _comm_thread_main(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            # the span ends before the waiter is woken: a waiter that resumed its compute first (and held the GIL
            # while the span waited to close) would show compute beside a collective that had already completed
            with record_function(pending.name):
                pending._complete(signal=False)
            pending._done.set()

    def _submit(self, pending: PendingCollective) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._comm_thread_main, name=f"dbo-comm-rank{self.rank}", daemon=True)
            self._thread.start()
        pending._on_thread = True
        self._queue.put(pending)

    def close(self) -> None:
        """Stop the communication thread (bounded)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.timeout_s)
        self._thread = None

    # -- launching --------------------------------------------------------------------------------------------
    def _launch(
        self, op: str, tag: str, output: torch.Tensor, wire_bytes: int, start: Callable[[], dist.Work | None]
    ) -> PendingCollective:
        in_ubatch = dbo_enabled()
        ubatch = dbo_current_ubatch_id() if in_ubatch else None
        name = comm_span_name(op, tag)
        on_thread = bool(self.comm_thread or (self.comm_thread is None and _profiler_running()))
        # On the communication thread, that thread holds the in-flight span and this thread only a short launch
        # span (DBO on or off alike, so that a trace has compute on the compute thread and communication on the
        # communication thread, as a device trace has streams). Otherwise the span runs from launch to completion
        # on this thread.
        span = record_function(launch_span_name(op, tag) if on_thread else name)
        span.__enter__()
        launch_s = time.perf_counter()
        try:
            work = start()
        except Exception as exc:
            span.__exit__(None, None, None)
            raise DBOError(f"collective {name} ({op}) failed to launch on rank {self.rank}: {exc}") from exc
        if on_thread:
            span.__exit__(None, None, None)
            span = None
        pending = PendingCollective(self, op, name, work, output, wire_bytes, launch_s, ubatch, span)
        if on_thread:
            self._submit(pending)
        return pending

    def all_gather(self, x: torch.Tensor, *, tag: str) -> PendingCollective:
        """Concatenate every rank's ``x`` along dim 0 (same shape on every rank)."""
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        wire = x.numel() * x.element_size() * (self.world_size - 1)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._launch("all_gather", tag, out, wire, lambda: gather(out, x, group=self.group, async_op=True))

    def reduce_scatter(self, x: torch.Tensor, *, tag: str) -> PendingCollective:
        """Sum ``x`` over ranks and give each rank its dim-0 shard (dim 0 divisible by the world size)."""
        if x.shape[0] % self.world_size:
            raise DBOConfigError(
                f"reduce_scatter of {x.shape[0]} rows over {self.world_size} ranks; accepted: a multiple of the world size"
            )
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        wire = out.numel() * out.element_size() * (self.world_size - 1)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._launch("reduce_scatter", tag, out, wire, lambda: scatter(out, x, group=self.group, async_op=True))

    def all_to_all(
        self, x: torch.Tensor, *, out_splits: Sequence[int], in_splits: Sequence[int], tag: str
    ) -> PendingCollective:
        """Send ``in_splits[j]`` rows of ``x`` to rank ``j`` and receive ``out_splits[j]`` rows from it."""
        if len(in_splits) != self.world_size or len(out_splits) != self.world_size or sum(in_splits) != x.shape[0]:
            raise DBOConfigError(
                f"all_to_all splits {list(in_splits)} / {list(out_splits)} do not fit {x.shape[0]} rows on "
                f"{self.world_size} ranks; accepted: one split per rank, input splits summing to the rows"
            )
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        row = x[0].numel() * x.element_size() if x.shape[0] else out[0].numel() * out.element_size() if out.shape[0] else 0
        sent = sum(n for j, n in enumerate(in_splits) if j != self.rank) * row
        received = sum(n for j, n in enumerate(out_splits) if j != self.rank) * row
        outs, ins = list(out_splits), list(in_splits)
        return self._launch(
            "all_to_all",
            tag,
            out,
            max(sent, received),
            lambda: dist.all_to_all_single(out, x, outs, ins, group=self.group, async_op=True),
        )

    def exchange_counts_async(self, counts: Sequence[int], *, tag: str) -> PendingCollective:
        """Start the all-to-all of one integer per rank (the sizes an all-to-all-v needs before it can start).

        Launched as early as the counts are known (right after routing), so that the other rank's arrival is
        waited for only if it is later than the compute in between; ``.result()`` gives the received counts.
        """
        send = torch.tensor(list(counts), dtype=torch.int64)
        recv = torch.empty_like(send)
        ones = [1] * self.world_size
        wire = 8 * (self.world_size - 1)
        return self._launch(
            "all_to_all_counts",
            tag,
            recv,
            wire,
            lambda: dist.all_to_all_single(recv, send, ones, ones, group=self.group, async_op=True),
        )

    def exchange_counts(self, counts: Sequence[int], *, tag: str) -> list[int]:
        """Blocking all-to-all of one integer per rank (see :meth:`exchange_counts_async`)."""
        return [int(v) for v in self.exchange_counts_async(counts, tag=tag).result().tolist()]

    def reset_records(self) -> list[CollectiveRecord]:
        """Return the records so far and start afresh."""
        out, self.records = self.records, []
        return out
