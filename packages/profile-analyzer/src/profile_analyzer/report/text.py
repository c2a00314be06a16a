"""Terminal renderer (rich): the verdict paragraph, then one table per analysis."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table

from profile_analyzer.report.tables import tables

_LEFT = {"item", "source", "worst item", "within 1 µs", "operator", "preceding compute", "stream", "kind", "after compute", "op", "method / reason"}


def render_text(report_dict: dict[str, Any], width: int = 120, color: bool = False) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, color_system="auto" if color else None,
                      highlight=False)
    console.print(f"[bold]profile-analyzer[/bold]: {report_dict['source']['path']} ({report_dict['source']['format']}, "
                  f"ranks {report_dict['source']['ranks']})")
    console.print()
    console.print(report_dict["verdict"])
    for w in report_dict["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w['message']}")
    for title, headers, rows in tables(report_dict, short=True):
        if not rows:
            continue
        t = Table(title=title, title_justify="left", show_lines=False)
        for h in headers:
            t.add_column(h, justify="left" if h in _LEFT else "right",
                         overflow="fold")
        for r in rows:
            t.add_row(*[str(c) for c in r])
        console.print()
        console.print(t)
    return buf.getvalue()
