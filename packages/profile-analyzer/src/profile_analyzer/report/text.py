"""Terminal renderer (rich): the verdict paragraph, then one table per analysis."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table

from profile_analyzer.report.tables import tables

_LEFT = {"item", "source", "worst item", "within 1 µs", "operator", "preceding compute", "stream", "kind", "after compute", "op", "method / reason"}


_FOLD_AT = 40


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
        cells = [[str(c) for c in r] for r in rows]
        # a column is as wide as its longest word: headers wrap between words, never inside one; numbers never
        # fold; only names longer than _FOLD_AT characters (kernel names) fold
        widths = [max(max(map(len, h.split() or [""])),
                      min(_FOLD_AT, max((len(w) for r in cells for w in r[i].split()), default=0)))
                  for i, h in enumerate(headers)]
        for h, w in zip(headers, widths, strict=True):
            t.add_column(h, justify="left" if h in _LEFT else "right", overflow="fold", min_width=w)
        for r in cells:
            t.add_row(*r)
        console.print()
        need = sum(widths) + 3 * len(widths) + 1  # one space of padding each side, one border between columns
        if need <= width:
            console.print(t)
        else:  # too narrow for the table without cropping columns: print it at the width it needs
            Console(file=buf, width=need, force_terminal=color, color_system="auto" if color else None,
                    highlight=False).print(t)
    return buf.getvalue()
