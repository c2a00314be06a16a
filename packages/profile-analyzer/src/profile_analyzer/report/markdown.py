"""Markdown renderer (for pull requests): verdict, warnings, then the same tables as the text report."""

from __future__ import annotations

from typing import Any

from profile_analyzer.report.tables import tables


def _cell(c: object) -> str:
    return str(c).replace("|", "\\|").replace("\n", " ")


def render_markdown(report_dict: dict[str, Any]) -> str:
    src = report_dict["source"]
    lines = [f"## Profile analysis: `{src['path']}`", "",
             f"Format {src['format']}, ranks {src['ranks']}, {src['events']} events.", "", report_dict["verdict"], ""]
    for w in report_dict["warnings"]:
        lines.append(f"> **Warning:** {_cell(w['message'])}")
    if report_dict["warnings"]:
        lines.append("")
    for title, headers, rows in tables(report_dict):
        if not rows:
            continue
        lines += [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)
