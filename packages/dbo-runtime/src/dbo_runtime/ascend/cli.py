"""`dbo-runtime ascend-sites`: print the DBO hook-site table (per model family) and the patched symbols."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from dbo_runtime.ascend.sites import MODEL_FAMILY_SITES, PATCHED_SYMBOLS, SITES, VLLM_SYMBOLS

__all__ = ["add_parser", "render_markdown"]


def render_markdown() -> str:
    """The site table and the per-family map as Markdown (what docs/dbo-vllm-ascend.md shows)."""
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


def _cmd(args: argparse.Namespace) -> int:
    if args.format == "json":
        payload = {
            "sites": [asdict(s) for s in SITES],
            "families": MODEL_FAMILY_SITES,
            "symbols": [asdict(p) for p in (*PATCHED_SYMBOLS, *VLLM_SYMBOLS)],
        }
        print(json.dumps(payload, indent=2))
        return 0
    if args.format == "md":
        sys.stdout.write(render_markdown())
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="DBO hook sites on vLLM-Ascend (vllm-ascend 0.23.0.post1)")
    for col in ("site", "target", "hook", "family"):
        table.add_column(col, overflow="fold")
    for s in SITES:
        table.add_row(s.name, s.target, s.hook if s.hook != "via" else f"via {s.via}", s.family)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("ascend-sites", help="print the DBO hook-site table for vLLM-Ascend",
                                   description="Print the declarative table of DBO hook sites and patched symbols.")
    parser.add_argument("--format", choices=("table", "md", "json"), default="table")
    parser.set_defaults(func=_cmd)
    return parser
