"""The result object of :func:`profile_analyzer.analyze` and its JSON form (see ``json_schema``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from profile_analyzer.report.json_schema import SCHEMA_NAME, SCHEMA_VERSION


@dataclass
class Report:
    source: dict[str, Any]
    selection: dict[str, Any]
    warnings: list[dict[str, Any]]
    verdict: str
    summary: dict[str, Any]
    breakdown: list[dict[str, Any]]
    profiler_agreement: list[dict[str, Any]]
    exposed_communication: list[dict[str, Any]]
    streams: list[dict[str, Any]]
    idle_gaps: list[dict[str, Any]]
    dual_batch: list[dict[str, Any]]
    ranks: dict[str, Any]
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from profile_analyzer._version import __version__
        from profile_analyzer.analyses.breakdown import BREAKDOWN_ITEMS

        return {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "profile-analyzer", "version": __version__},
            "source": self.source,
            "selection": self.selection,
            "warnings": self.warnings,
            "verdict": self.verdict,
            "summary": self.summary,
            "breakdown": self.breakdown,
            "breakdown_items": [list(x) for x in BREAKDOWN_ITEMS],
            "profiler_agreement": self.profiler_agreement,
            "exposed_communication": self.exposed_communication,
            "streams": self.streams,
            "idle_gaps": self.idle_gaps,
            "dual_batch": self.dual_batch,
            "ranks": self.ranks,
            "timeline": self.timeline,
        }
