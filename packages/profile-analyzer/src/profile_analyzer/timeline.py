"""The data model every loader produces and every analysis reads.

``Timeline`` -> ``RankTimeline`` (one per rank/device) -> columnar task arrays. A task is one interval on
one stream (an Ascend Hardware stream, a communication group or plane track, a CUDA stream, a host
thread). Tasks are held as parallel numpy arrays, never as one Python object per event:

==============  =======  =====================================================================
array           dtype    meaning
==============  =======  =====================================================================
``start_ns``    int64    start, integer nanoseconds on the profiler's clock
``end_ns``      int64    end (``start_ns + dur``)
``stream``      int32    index into ``RankTimeline.streams``
``kind``        int8     a :class:`Kind` value
``name_id``     int32    index into ``RankTimeline.names``
==============  =======  =====================================================================

Tasks are sorted by ``start_ns``. ``RankTimeline.launch_ns`` (optional, same length) is when the host
launched each device task, -1 when unknown. ``Kind`` says what a task means for the overlap analyses:

* ``COMPUTE``: a device compute kernel (AI Core / AI Vector / AI CPU / MIX op, a CUDA compute kernel).
* ``COMMUNICATION``: a whole collective or point-to-point operator span (HCCL ``hcom_*`` big op on a
  ``Group ... Communication`` track, an NCCL/gloo kernel, a communication ``record_function`` range).
  msprof's Communication figure is the union of these.
* ``COMM_TASK``: a small task inside a communication op (HCCL ``Plane N`` tasks: Memcpy, Reduce_Inline,
  RDMASend, Notify_Record ...). It never counts twice: the op span already covers it.
* ``IDLE_WAIT``: a device task that waits (``Notify_Wait`` on a plane, ``EVENT_WAIT`` on a stream).
* ``HOST``: a CPU-side event (torch op, CANN API, enqueue/dequeue).
* ``OTHER``: device tasks that are neither (MEMCPY_ASYNC, EVENT_RECORD, ...): they count towards the
  device span but not towards Computing, as in msprof.
* ``FUSED``: one kernel that computes and communicates (an MC2 GEMM+collective on Ascend): it counts in
  Computing and in Communication (so it is Overlapped, never exposed); see ``loaders/comm_rules.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
# vLLM's per-step annotation (vllm/v1/worker/gpu_worker.py, annotate_profile): execute_context_<requests>(<tokens>)
# _generation_<requests>(<tokens>), or with detailed_trace_annotation execute_context_<n>(sq<tokens>sk...)
VLLM_STEP_NAME = re.compile(r"^execute_context_\d+\((?:sq)?\d+.*\)_generation_\d+\(")


def is_step_name(name: str) -> bool:
    """A framework step range: ``ProfilerStep#N`` or vLLM's per-step annotation."""
    return bool(STEP_NAME.match(name) or VLLM_STEP_NAME.match(name))


class Kind(IntEnum):
    COMPUTE = 0
    COMMUNICATION = 1
    COMM_TASK = 2
    IDLE_WAIT = 3
    HOST = 4
    OTHER = 5
    FUSED = 6


COMPUTE_KINDS = (Kind.COMPUTE, Kind.FUSED)
COMM_KINDS = (Kind.COMMUNICATION, Kind.FUSED)


KIND_NAMES = {k: k.name.lower().replace("_", "-") for k in Kind}


@dataclass(frozen=True)
class Stream:
    """One track of tasks. ``kind`` is ``compute``, ``communication``, ``host`` or ``other``."""

    index: int
    label: str
    kind: str
    stream_id: int | None = None


@dataclass
class Steps:
    """Step ranges on the device clock (ns). ``host_start_ns`` is the framework ``ProfilerStep#N`` start."""

    ids: np.ndarray  # int64
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    host_start_ns: np.ndarray  # int64

    @classmethod
    def empty(cls) -> Steps:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy(), z.copy())

    def __len__(self) -> int:
        return int(self.ids.size)


@dataclass
class Warning_:
    """A partial-profile warning: what is missing, and which figures it affects."""

    file: str
    missing: str
    affects: list[str]
    # a warning that is not about a missing input says what it is in its own words
    text: str | None = None

    def message(self) -> str:
        if self.text is not None:
            return f"{self.file}: {self.text}"
        return f"{self.file}: {self.missing} is missing; affected: {', '.join(self.affects)}"


@dataclass
class RankTimeline:
    rank: int
    source: str
    format: str
    streams: list[Stream]
    names: list[str]
    start_ns: np.ndarray
    end_ns: np.ndarray
    stream: np.ndarray
    kind: np.ndarray
    name_id: np.ndarray
    steps: Steps = field(default_factory=Steps.empty)
    # operator type per name id (kernel_details.csv ``Type``), "" when unknown
    op_types: dict[int, str] = field(default_factory=dict)
    # the profiler's own ``Overlap Analysis`` track: track name -> (starts_ns, ends_ns), None if absent
    profiler_overlap: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    # the profiler's own step_trace_time.csv rows for this rank (column name -> value in µs)
    profiler_step_trace: list[dict[str, float | str]] | None = None
    # where profiler_step_trace and profiler_comm were read (the profiler_agreement rows' source): the text export's
    # files, or their tables in a DB export's analysis.db
    profiler_step_trace_source: str = "step_trace_time.csv"
    profiler_comm_source: str = "communication.json"
    warnings: list[Warning_] = field(default_factory=list)
    device_id: int | None = None
    # the profiler's communication.json totals per step (None key: no steps): elapse/transit/wait/sync in µs
    profiler_comm: dict[int | None, dict[str, float]] | None = None
    # per task: when the host launched it (ns, same clock), -1 when unknown (from async_npu flows / correlation)
    launch_ns: np.ndarray | None = None
    # a CPU-only trace: the host ranges are the work (the vendor rules also match them)
    host_is_work: bool = False
    # tasks the vendor communication rules (or --comm-pattern) reclassified: rule name -> (kind, tasks)
    comm_rules_applied: dict[str, tuple[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.start_ns.size and np.any(np.diff(self.start_ns) < 0):
            order = np.argsort(self.start_ns, kind="stable")
            self.start_ns = self.start_ns[order]
            self.end_ns = self.end_ns[order]
            self.stream = self.stream[order]
            self.kind = self.kind[order]
            self.name_id = self.name_id[order]
            if self.launch_ns is not None:
                self.launch_ns = self.launch_ns[order]

    def __len__(self) -> int:
        return int(self.start_ns.size)

    def select(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.start_ns[mask], self.end_ns[mask]

    def of_kind(self, *kinds: Kind) -> np.ndarray:
        m = np.zeros(self.kind.size, dtype=bool)
        for k in kinds:
            m |= self.kind == int(k)
        return m

    @property
    def device_mask(self) -> np.ndarray:
        return self.kind != int(Kind.HOST)

    def t0_ns(self) -> int:
        dev = self.device_mask
        if dev.any():
            return int(self.start_ns[dev].min())
        return int(self.start_ns.min()) if self.start_ns.size else 0


@dataclass(frozen=True)
class UnreadableRank:
    """A rank of a directory of ranks that could not be read (truncated while still being written, missing files,
    no permission ...): it is left out of every figure, and the report says so."""

    rank: int
    path: str
    reason: str

    def message(self) -> str:
        return f"rank {self.rank} ({self.path}) could not be read and is left out of every figure: {self.reason}"


@dataclass
class Timeline:
    """Everything loaded from one path: one ``RankTimeline`` per rank, ordered by rank, and the ranks of a
    directory of ranks that could not be read (``unreadable``)."""

    source: str
    format: str
    ranks: dict[int, RankTimeline]
    warnings: list[Warning_] = field(default_factory=list)
    unreadable: list[UnreadableRank] = field(default_factory=list)

    def rank(self, r: int) -> RankTimeline:
        return self.ranks[r]

    def all_warnings(self) -> list[Warning_]:
        out = list(self.warnings)
        for rt in self.ranks.values():
            out.extend(rt.warnings)
        return out

    @property
    def n_events(self) -> int:
        return sum(len(r) for r in self.ranks.values())


class TimelineBuilder:
    """Accumulates columnar chunks for one rank, then freezes them into a :class:`RankTimeline`."""

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self._stream_key: dict[tuple[object, ...], int] = {}
        self.names: list[str] = []
        self._name_idx: dict[str, int] = {}
        self._chunks: list[tuple[np.ndarray, ...]] = []

    def stream_index(self, key: tuple[object, ...], label: str, kind: str, stream_id: int | None = None) -> int:
        idx = self._stream_key.get(key)
        if idx is None:
            idx = len(self.streams)
            self._stream_key[key] = idx
            self.streams.append(Stream(idx, label, kind, stream_id))
        return idx

    def intern(self, names: list[str]) -> np.ndarray:
        d = self._name_idx
        lst = self.names

        def get(n: str) -> int:
            i = d.get(n)
            if i is None:
                i = d[n] = len(lst)
                lst.append(n)
            return i

        return np.fromiter((get(n) for n in names), dtype=np.int32, count=len(names))

    def add(self, start_ns: np.ndarray, end_ns: np.ndarray, stream: np.ndarray | int, kind: np.ndarray | int,
            name_id: np.ndarray) -> None:
        n = start_ns.size
        if n == 0:
            return
        stream_a = np.full(n, stream, dtype=np.int32) if np.isscalar(stream) else np.asarray(stream, np.int32)
        kind_a = np.full(n, kind, dtype=np.int8) if np.isscalar(kind) else np.asarray(kind, np.int8)
        self._chunks.append((np.asarray(start_ns, np.int64), np.asarray(end_ns, np.int64), stream_a, kind_a,
                             np.asarray(name_id, np.int32)))

    def build(self, rank: int, source: str, fmt: str, **kw: object) -> RankTimeline:
        if self._chunks:
            cols = [np.concatenate([c[i] for c in self._chunks]) for i in range(5)]
        else:
            cols = [np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int8),
                    np.zeros(0, np.int32)]
        self._chunks = []
        return RankTimeline(rank=rank, source=source, format=fmt, streams=self.streams, names=self.names,
                            start_ns=cols[0], end_ns=cols[1], stream=cols[2], kind=cols[3], name_id=cols[4],
                            **kw)  # type: ignore[arg-type]
