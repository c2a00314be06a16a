"""Command line of dbo-runtime: a click group whose subcommands (in `dbo_runtime.commands`) load lazily.

Bad input is one line on stderr and exit status 2 (toolkit_cli's error path: a bad value is a usage error, a
`DBOError` found while working is `dbo-runtime: error: ...`); exit 1 is a verdict (outputs differ, a hook site
is missing) or a run that failed on its ranks.
"""

from __future__ import annotations

import sys

from toolkit_cli import ToolGroup, argparse_mirror

from dbo_runtime.errors import DBOError

COMMANDS = {
    "reference": "dbo_runtime.commands.reference:reference",
    "bench": "dbo_runtime.commands.bench:bench",
    "compare": "dbo_runtime.commands.compare:compare",
    "ascend-compare": "dbo_runtime.commands.compare:ascend_compare",
    "doctor": "dbo_runtime.commands.doctor:doctor",
    "ascend-sites": "dbo_runtime.commands.sites:ascend_sites",
    "estimate": "dbo_runtime.commands.estimate:estimate",
    "policy-table": "dbo_runtime.commands.policy:policy_table",
    "policy-sweep": "dbo_runtime.commands.policy:policy_sweep",
    "step-profile": "dbo_runtime.commands.step_profile:step_profile",
}

cli = ToolGroup("dbo-runtime", lazy_subcommands=COMMANDS, domain_errors=(DBOError,),
                help="Dual batch overlap (DBO) runtime for vLLM-Ascend: the reference model, its benchmark, the DBO "
                "on/off precision comparison in a real vLLM, and the vLLM-Ascend hook-site checks.")


def main(argv: list[str] | None = None) -> int:
    return cli.run(argv)


def build_parser():  # -> argparse.ArgumentParser
    """An argparse parser with the same subcommands and option names (for tools that read argparse parsers)."""
    return argparse_mirror(cli)


if __name__ == "__main__":  # python -m dbo_runtime.cli
    sys.exit(main())
