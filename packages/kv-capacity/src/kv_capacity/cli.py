"""Command line of kv-capacity: a click group whose subcommands (in `kv_capacity.commands`) load lazily.

Bad input is one line on stderr and exit status 2 (toolkit_cli's error path); a budget that does not fit
is exit status 1 with vLLM's own error text.
"""

from __future__ import annotations

from toolkit_cli import ToolGroup, argparse_mirror

from kv_capacity.errors import KVCapacityError

cli = ToolGroup(
    "kv-capacity",
    lazy_subcommands={
        name: f"kv_capacity.commands:{name}_command" for name in ("plan", "check", "required", "presets", "verify")
    },
    domain_errors=(KVCapacityError,),
    help="KV-cache capacity planner for vLLM --kv-cache-memory-bytes",
)


def main(argv: list[str] | None = None) -> int:
    return cli.run(argv)


def build_parser():  # -> argparse.ArgumentParser
    """An argparse parser with the same subcommands and option names (for tools that read argparse parsers)."""
    return argparse_mirror(cli)
