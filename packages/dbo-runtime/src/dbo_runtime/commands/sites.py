"""``dbo-runtime ascend-sites``: the declarative table of DBO hook sites on vLLM-Ascend."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import asdict
from pathlib import Path

import click
from toolkit_cli import format_option, output_option, write_output

__all__ = ["ascend_sites", "render_markdown"]


def render_markdown() -> str:
    """The site table and the per-family map as Markdown (what docs/dbo-vllm-ascend.md shows)."""
    from dbo_runtime.ascend.sites import MODEL_FAMILY_SITES, PATCHED_SYMBOLS, SITES, VLLM_SYMBOLS

    out = ["| site | module : qualified name | hook | what |", "|---|---|---|---|"]
    for s in SITES:
        hook = f"via `{s.via}`" if s.hook == "via" else f"`{s.hook}`"
        out.append(f"| `{s.name}` | `{s.module}:{s.qualname}` | {hook} | {s.what} |")
    out += ["", "| model family | sites that fire |", "|---|---|"]
    for family, names in MODEL_FAMILY_SITES.items():
        out.append(f"| {family} | " + ", ".join(f"`{n}`" for n in names) + " |")
    out += ["", "| symbol | module : qualified name | patched | why |", "|---|---|---|---|"]
    for p in (*PATCHED_SYMBOLS, *VLLM_SYMBOLS):
        out.append(f"| `{p.name}` | `{p.module}:{p.qualname}` | {'yes' if p.patched else 'relied on'} | {p.why.removeprefix('relied on: ')} |")
    return "\n".join(out) + "\n"


def _render_table(to_terminal: bool) -> str:
    from rich.console import Console
    from rich.table import Table

    from dbo_runtime.ascend.sites import SITES

    table = Table(title="DBO hook sites on vLLM-Ascend (vllm-ascend 0.23.0.post1)")
    for col in ("site", "target", "hook", "family"):
        table.add_column(col, overflow="fold")
    for s in SITES:
        table.add_row(s.name, s.target, s.hook if s.hook != "via" else f"via {s.via}", s.family)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=to_terminal, width=None if to_terminal else 160,
                      color_system="auto" if to_terminal else None)
    console.print(table)
    return buffer.getvalue()


@click.command("ascend-sites", short_help="print the DBO hook-site table for vLLM-Ascend",
               help="Print the declarative table of DBO hook sites and patched symbols.")
@format_option("text", "md", "json")
@output_option()
def ascend_sites(format: str, output: Path | None) -> int:
    from dbo_runtime.ascend.sites import MODEL_FAMILY_SITES, PATCHED_SYMBOLS, SITES, VLLM_SYMBOLS

    if format == "json":
        payload = {"sites": [asdict(s) for s in SITES], "families": MODEL_FAMILY_SITES,
                   "symbols": [asdict(p) for p in (*PATCHED_SYMBOLS, *VLLM_SYMBOLS)]}
        text = json.dumps(payload, indent=2) + "\n"
    elif format == "md":
        text = render_markdown()
    else:
        text = _render_table(output is None and sys.stdout.isatty())
    write_output(output, text)
    return 0
