"""The renderer choice: one report dict -> text (rich), json, markdown or html."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from profile_analyzer.errors import ProfileError


def render(report_dict: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        from profile_analyzer.report.json_report import render_json

        return render_json(report_dict)
    if fmt == "md":
        from profile_analyzer.report.markdown import render_markdown

        return render_markdown(report_dict)
    if fmt == "html":
        try:
            from profile_analyzer.report.html import render_html
        except ModuleNotFoundError as exc:
            raise ProfileError("--format html", f"the HTML renderer is not installed ({exc.name}); use text, json or md") from None
        return render_html(report_dict)
    from profile_analyzer.report.text import render_text

    tty = sys.stdout.isatty()
    # a terminal's own width (at least 100); files and pipes get room for the widest table (breakdown)
    width = max(100, shutil.get_terminal_size((150, 24)).columns) if tty else 150
    return render_text(report_dict, width=width, color=tty and not os.environ.get("NO_COLOR"))
