"""``dbo-runtime policy-table``: print the table the ``auto`` split policy wrote (dbo_runtime.policy)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import click
from toolkit_cli import BoundedInt, format_option, output_option, write_output

from dbo_runtime.commands._params import WritableDir

__all__ = ["policy_table", "policy_sweep"]

TABLE_MAX_BYTES = 64 << 20  # a table has one row per shape class: kilobytes


def _refuse_what_cannot_be_a_table(path: str, accepted: str = "accepted: a policy table (dbo-policy-rank<R>.json) "
                                   "or the folder holding them") -> None:
    """Every file policy-table (or a replay) would open is a regular file of a sane size: a FIFO would block the
    reader for a writer that never comes, a device (/dev/zero) would never end."""
    from dbo_runtime.errors import DBOConfigError

    if os.path.isdir(path):
        files = [os.path.join(path, n) for n in sorted(os.listdir(path))
                 if n.startswith("dbo-policy-rank") and n.endswith(".json")]
    else:
        files = [path]
    for file in files:
        try:
            info = os.stat(file)
        except OSError as exc:
            raise DBOConfigError(f"{file[:200]!r} cannot be read ({exc.strerror}); {accepted}") from None
        if not stat.S_ISREG(info.st_mode):
            raise DBOConfigError(f"{file[:200]!r} is not a regular file; {accepted}")
        if info.st_size > TABLE_MAX_BYTES:
            raise DBOConfigError(f"{file[:200]!r} is larger than {TABLE_MAX_BYTES >> 20} MiB; {accepted}")


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

    _refuse_what_cannot_be_a_table(path)
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


@click.command(
    "policy-sweep",
    short_help="the auto split policy against every static token threshold on the reference MoE model",
    help="Benchmark of the auto split policy on the reference MoE model (2 gloo ranks, modelled link): a mixed "
    "prefill load of several batch sizes runs DBO off, DBO on and auto step by step; every static threshold is "
    "replayed from the same steps and auto's speed-up over DBO off is set against the best one's (target: 97%). "
    "Writes DIR/dbo_policy_sweep.json and DIR/dbo_policy_sweep.md (atomically) and prints the table. Exit 1 when "
    "auto misses the target.",
)
@click.option("--out", type=WritableDir(), default="bench-results", show_default=True,
              help="directory for dbo_policy_sweep.json and .md (created if missing; checked before the run)")
@click.option("--tokens", "tokens", type=BoundedInt(2, 8192, what="tokens per rank"), multiple=True, metavar="N",
              help="batch sizes of the load (repeat the option)  [default: 16 64 256 512]")
@click.option("--steps-per-size", type=BoundedInt(1, 10000, what="steps per batch size"), default=None,
              metavar="N", help="steps of each size in the load  [default: 100]")
@click.option("--layers", type=BoundedInt(1, 64, what="layers"), default=None, metavar="N",
              help="layers of the reference model  [default: 2]")
@click.option("--replay", "replay", type=click.Path(exists=True, dir_okay=False, readable=True), default=None,
              metavar="JSON", help="run nothing: replay auto on the steps a sweep recorded (its dbo_policy_sweep.json), "
              "each rank's policy fed the time that rank measured for the arm it chose, and print its share of the "
              "best threshold's speed-up for the recorded order and --orders shuffled ones")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="with --replay: a policy setting to replay (PolicyConfig's fields, e.g. explore_cost=0.02; "
              "repeat the option)")
@click.option("--orders", type=BoundedInt(0, 1000, what="orders"), default=40, show_default=True, metavar="N",
              help="with --replay: shuffled orders of the same steps to replay")
def policy_sweep(out: Path, tokens: tuple[int, ...], steps_per_size: int | None, layers: int | None,
                 replay: str | None, settings: tuple[str, ...], orders: int) -> int:
    from dataclasses import replace

    from dbo_runtime.reference.launcher import RanksFailed
    from dbo_runtime.reference.policy_sweep import PolicySweepPlan, format_sweep_markdown, run_policy_sweep

    if replay is not None:
        if tokens or steps_per_size is not None or layers is not None:
            raise click.UsageError("--replay replays a recorded sweep; --tokens, --steps-per-size and --layers "
                                   "are for a new one: accepted: --replay JSON [--set KEY=VALUE] [--orders N]")
        return _replay(replay, settings, orders)
    if settings:
        raise click.UsageError("--set applies to --replay only; accepted: --replay JSON --set KEY=VALUE")

    plan = PolicySweepPlan()
    if tokens:
        plan = replace(plan, token_counts=tuple(dict.fromkeys(tokens)))
    if steps_per_size is not None:
        plan = replace(plan, steps_per_size=steps_per_size)
    if layers is not None:
        plan = replace(plan, num_layers=layers)
    try:
        summary = run_policy_sweep(out, plan)
    except RanksFailed as exc:
        for err in exc.errors:
            click.echo(f"dbo-runtime policy-sweep: {err.line()}", err=True)
        return 1
    click.echo(format_sweep_markdown(summary), nl=False)
    click.echo(f"written: {Path(out) / 'dbo_policy_sweep.json'}")
    return 0 if summary["auto_meets_target"] else 1


def _replay(path: str, settings: tuple[str, ...], orders: int) -> int:
    from dbo_runtime.errors import DBOConfigError
    from dbo_runtime.reference.policy_sweep import format_replay, replay_orders

    _refuse_what_cannot_be_a_table(path, "accepted: the dbo_policy_sweep.json a policy sweep wrote")
    policy: dict[str, float | int] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or not key.strip() or not math.isfinite(number) and value.strip().lower() != "inf":
            raise DBOConfigError(f"--set {item!r} is invalid; accepted: KEY=NUMBER, e.g. explore_cost=0.02")
        policy[key.strip()] = int(number) if number.is_integer() and "." not in value and "e" not in value.lower() \
            else float(value)
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise DBOConfigError(f"{path[:200]!r} cannot be read as JSON ({type(exc).__name__}); accepted: the "
                             "dbo_policy_sweep.json a policy sweep wrote") from None
    if not isinstance(summary, dict):
        raise DBOConfigError(f"{path[:200]!r} is not a policy sweep; accepted: the dbo_policy_sweep.json a policy "
                             "sweep wrote")
    click.echo(format_replay(replay_orders(summary, policy, orders)), nl=False)
    return 0
