"""Command line of profile-analyzer: a click group whose subcommands (in ``profile_analyzer.commands``) load
lazily. Bad input is one line on stderr and exit status 2 (toolkit_cli's error path)."""

from __future__ import annotations

from toolkit_cli import ToolGroup, argparse_mirror

from profile_analyzer.errors import ProfileError

cli = ToolGroup(
    "profile-analyzer",
    lazy_subcommands={name: f"profile_analyzer.commands:{name}_command" for name in ("report", "compare", "whatif", "synth")},
    domain_errors=(ProfileError,),
    help="Where communication is not overlapped: msprof, torch_npu and Kineto profile analysis",
)


def main(argv: list[str] | None = None) -> int:
    return cli.run(argv)


def build_parser():  # -> argparse.ArgumentParser
    """An argparse parser with the same subcommands and option names (for tools that read argparse parsers)."""
    return argparse_mirror(cli)
