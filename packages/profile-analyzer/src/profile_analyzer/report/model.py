"""The result object of :func:`profile_analyzer.analyze`, typed, and its JSON form (``json_schema``).

Every record of the report is a dataclass below; :meth:`Report.to_dict` turns them into exactly the JSON of
schema version 1. The analyses hand their rows over as dicts and :func:`record` converts each one strictly: a
key that the record does not declare, or a declared key that is missing, raises, so the schema in
``json_schema`` and what the analyses produce cannot drift apart silently.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from profile_analyzer.report.json_schema import SCHEMA_NAME, SCHEMA_VERSION

__all__ = ["Report", "record", "Source", "Selection", "WarningRow", "Summary", "CommRuleRow", "WholeTraceRow",
           "BreakdownRow", "AgreementRow", "ExposedOperator", "ExposedAfterCompute", "ExposedGap", "ExposedRank",
           "StreamRow", "IdleStream", "IdleGap", "IdleRank", "UBatchRow", "DualBatchLayer", "DualBatchRank",
           "RankRow", "RanksSummary", "UnreadableRow", "TimelineTask", "TimelineLane", "TimelineSpan", "TimelineWindow"]

T = TypeVar("T")
Num = float | int


@dataclass
class Source:
    path: str
    format: str
    ranks: list[int]
    events: int


@dataclass
class Selection:
    rank: int | None
    step: int | None


@dataclass
class WarningRow:
    file: str
    missing: str
    affects: list[str]
    message: str


@dataclass
class UnreadableRow:
    rank: int
    path: str
    reason: str


@dataclass
class CommRuleRow:
    rank: int
    rule: str
    kind: str
    tasks: int


@dataclass
class WholeTraceRow:
    rank: int
    communication_us: Num
    overlapped_us: Num
    overlap_pct: Num | None


@dataclass
class Summary:
    ranks: int
    steps: int
    wall_us: Num
    computing_us: Num
    communication_us: Num
    communication_not_overlapped_us: Num
    overlapped_us: Num
    free_us: Num
    overlap_pct: Num | None
    exposed_comm_pct_of_wall: Num | None
    fused_us: Num
    comm_rules: list[CommRuleRow]
    whole_trace_overlap: list[WholeTraceRow]
    whole_trace_overlap_pct: Num | None


@dataclass
class BreakdownRow:
    """One step of one rank, in µs: msprof's step_trace_time columns."""

    rank: int
    step: int | None
    t0_ns: int
    start_us: Num
    end_us: Num
    computing: Num
    communication_not_overlapped: Num
    overlapped: Num
    communication: Num
    free: Num
    stage: Num
    bubble: Num
    communication_not_overlapped_exclude_receive: Num
    preparing: Num
    overlap_pct: Num | None


@dataclass
class AgreementRow:
    rank: int
    step: int | None
    item: str
    source: str
    ours_us: Num
    profiler_us: Num
    delta_us: Num


@dataclass
class ExposedOperator:
    operator: str
    count: int
    exposed_us: Num
    total_us: Num
    exposed_pct: Num | None


@dataclass
class ExposedAfterCompute:
    preceding_compute: str
    count: int
    exposed_us: Num
    total_us: Num
    exposed_pct: Num | None


@dataclass
class ExposedGap:
    rank: int
    start_us: Num
    end_us: Num
    dur_us: Num
    comm_op: str | None
    comm_kind: str | None
    occurrence: int | None
    stream: str | None
    preceding_compute: str | None


@dataclass
class ExposedRank:
    exposed_us: Num
    by_operator: list[ExposedOperator]
    by_preceding_compute: list[ExposedAfterCompute]
    worst_gaps: list[ExposedGap]
    rank: int


@dataclass
class StreamRow:
    rank: int
    stream: str
    kind: str
    tasks: int
    busy_us: Num
    wait_us: Num
    compute_us: Num
    window_us: Num
    utilisation: Num


@dataclass
class IdleStream:
    rank: int
    stream: str
    gaps: int
    idle_us: Num
    host_bound_us: Num
    launch_known_pct: Num | None
    max_gap_us: Num
    median_gap_us: Num


@dataclass
class IdleGap:
    rank: int
    stream: str
    start_us: Num
    end_us: Num
    dur_us: Num
    host_bound_us: Num | None
    before: str | None
    after: str | None


@dataclass
class IdleRank:
    per_stream: list[IdleStream]
    largest: list[IdleGap]
    rank: int


@dataclass
class UBatchRow:
    ubatch: int
    comm_ops: int
    comm_us: Num
    covered_us: Num
    covered_pct: Num | None
    op_kinds: dict[str, int]


@dataclass
class DualBatchLayer:
    rank: int
    ubatch: int
    layer: int | None
    index: int
    op: str
    start_us: Num
    comm_us: Num
    covered_us: Num
    covered_pct: Num | None


@dataclass
class DualBatchRank:
    rank: int
    detected: bool
    method: str | None
    reason: str
    ubatches: list[UBatchRow]
    layers: list[DualBatchLayer]


@dataclass
class RankRow:
    rank: int
    computing_us: Num
    communication_us: Num
    exposed_communication_us: Num
    free_us: Num
    comm_wait_us: Num
    caused_wait_us: Num
    arrived_last: int
    sync_wait_us: Num


@dataclass
class RanksSummary:
    per_rank: list[RankRow]
    matched_collectives: int
    slowest_rank: int | None
    waited_for_rank: int | None
    explanation: str


@dataclass
class TimelineTask:
    start_us: Num
    end_us: Num
    name: str
    kind: str


@dataclass
class TimelineLane:
    stream: str
    kind: str
    tasks: list[TimelineTask]


@dataclass
class TimelineSpan:
    start_us: Num
    end_us: Num


@dataclass
class TimelineWindow:
    rank: int
    t0_ns: int
    start_us: Num
    end_us: Num
    title: str
    lanes: list[TimelineLane]
    exposed: list[TimelineSpan]


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return record(tp, value, where)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return [_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return record(args[0], value, where)
    return value


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], list[str]]:
    """The field types and names of a record class, worked out once per class (``get_type_hints`` evaluates the
    annotations each time it is called, and a report has thousands of records)."""
    return typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


def record(cls: type[T], data: Any, where: str = "") -> T:
    """``cls`` from a dict with exactly its fields (nested records and lists of records converted too)."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise TypeError(f"report record {where or cls.__name__}: expected a dict for {cls.__name__}, got "
                        f"{type(data).__name__}")
    hints, names = _fields(cls)
    extra = sorted(set(data) - set(names))
    missing = [n for n in names if n not in data]
    if extra or missing:
        raise TypeError(f"report record {where or cls.__name__} ({cls.__name__}): unexpected keys {extra}, "
                        f"missing keys {missing}")
    return cls(**{n: _convert(hints[n], data[n], f"{where}.{n}" if where else n) for n in names})  # type: ignore[call-arg]


@dataclass
class Report:
    source: Source
    selection: Selection
    warnings: list[WarningRow]
    verdict: str
    summary: Summary
    breakdown: list[BreakdownRow]
    profiler_agreement: list[AgreementRow]
    exposed_communication: list[ExposedRank]
    streams: list[StreamRow]
    idle_gaps: list[IdleRank]
    dual_batch: list[DualBatchRank]
    ranks: RanksSummary
    timeline: list[TimelineWindow] = field(default_factory=list)
    unreadable: list[UnreadableRow] = field(default_factory=list)

    @classmethod
    def from_parts(cls, **parts: Any) -> Report:
        """A report from the analyses' dicts, each converted strictly (:func:`record`)."""
        return record(cls, {"timeline": [], "unreadable": [], **parts})

    def to_dict(self) -> dict[str, Any]:
        from profile_analyzer._version import __version__
        from profile_analyzer.analyses.breakdown import BREAKDOWN_ITEMS

        body = dataclasses.asdict(self)
        return {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "profile-analyzer", "version": __version__},
            "source": body["source"],
            "selection": body["selection"],
            "warnings": body["warnings"],
            "verdict": self.verdict,
            "summary": body["summary"],
            "breakdown": body["breakdown"],
            "breakdown_items": [list(x) for x in BREAKDOWN_ITEMS],
            "profiler_agreement": body["profiler_agreement"],
            "exposed_communication": body["exposed_communication"],
            "streams": body["streams"],
            "idle_gaps": body["idle_gaps"],
            "dual_batch": body["dual_batch"],
            "ranks": body["ranks"],
            "timeline": body["timeline"],
            "unreadable": body["unreadable"],
        }
