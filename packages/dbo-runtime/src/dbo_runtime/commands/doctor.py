"""``dbo-runtime doctor``: check a vLLM-Ascend release (and vLLM) for every DBO hook site, from source only."""

from __future__ import annotations

import click
from toolkit_cli import format_option

__all__ = ["doctor"]


@click.command(
    "doctor",
    short_help="check a vLLM-Ascend release for every DBO hook site (source only, nothing imported)",
    help="Resolve every hook site and patched symbol of the DBO site table in a vLLM-Ascend (and vLLM) release by "
    "reading its source, and the structural facts the runtime relies on; exit 1 if any is missing or changed.",
)
@click.option("--vllm-ascend", metavar="PATH_OR_ARCHIVE", default=None,
              help="vllm-ascend source tree, sdist (.tar.gz) or wheel (.whl); default: the installed one")
@click.option("--vllm", metavar="PATH_OR_ARCHIVE", default=None,
              help="vLLM source tree, sdist or wheel; default: the installed one (skipped if none)")
@format_option("text", "json")
def doctor(vllm_ascend: str | None, vllm: str | None, format: str) -> int:
    from dbo_runtime.ascend.doctor import run_doctor

    return run_doctor(vllm_ascend, vllm, output_format="json" if format == "json" else "table")
