"""``dbo-runtime policy-table``: print the table the ``auto`` split policy wrote (dbo_runtime.policy)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from toolkit_cli import format_option, output_option, write_output

__all__ = ["policy_table"]


@click.command(
    "policy-table",
    short_help="print the auto split policy's table (per shape class: verdict, split and unsplit step times)",
    help="Print the table of the auto split policy (--additional-config '{\"dbo_policy\": \"auto\"}' or "
    "DBO_POLICY=auto): per shape class (decode or mixed, a power-of-two token bucket) the agreed verdict, the median "
    "split and unsplit step times every rank agreed on, and this rank's step, split and exploration counts. PATH is "
    "a dbo-policy-rank<R>.json or the stats folder ($DBO_RUNTIME_STATS_DIR) holding one per rank; with several "
    "ranks the first is printed and the agreed part of every other is checked against it (exit 1 if they differ).",
)
@click.argument("path", type=click.Path(exists=True, readable=True), metavar="PATH")
@format_option("text", "json", "md")
@output_option()
def policy_table(path: str, format: str, output: Path | None) -> int:
    from dbo_runtime.policy import agreed_part, format_table, read_tables

    tables = read_tables(path)
    first = tables[0]
    differ = [t.get("rank") for t in tables[1:] if agreed_part(t) != agreed_part(first)]
    ranks = ", ".join(str(t.get("rank")) for t in tables)
    if format == "json":
        text = json.dumps({"tables": tables, "ranks": [t.get("rank") for t in tables], "agreed": not differ},
                          indent=2)
    else:
        text = format_table(first, format)
        if len(tables) > 1:
            text += (f"\nranks {ranks}: agreed tables identical" if not differ else
                     f"\nranks {ranks}: agreed tables DIFFER from rank {first.get('rank')} on rank(s) "
                     + ", ".join(map(str, differ)))
    write_output(output, text + "\n")
    return 1 if differ else 0
