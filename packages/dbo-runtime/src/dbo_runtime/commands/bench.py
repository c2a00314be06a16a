"""``dbo-runtime bench``: the benchmark of the DBO runtime on the reference MoE model (``make bench``)."""

from __future__ import annotations

from pathlib import Path

import click
from toolkit_cli import BoundedInt

from dbo_runtime.commands._params import WritableDir

__all__ = ["bench", "bench_plan"]


@click.command(
    "bench",
    short_help="benchmark DBO on the reference MoE model (overlap efficiency, handoff cost)",
    help="Benchmark of the DBO runtime on the reference MoE model: step time with DBO off and on, overlap "
    "efficiency per pattern, token count and link, the handoff cost and the cost below the thresholds. Writes "
    "DIR/dbo_runtime.json and DIR/dbo_runtime.md (atomically) and prints a table.",
)
@click.option("--out", type=WritableDir(), default="bench-results", show_default=True,
              help="directory for dbo_runtime.json and dbo_runtime.md (created if missing; checked before the run)")
@click.option("--quick", is_flag=True, help="tiny model, few steps: a smoke run, not the figures")
@click.option("--dbo-scheduler", type=click.Choice(("thread", "greenlet")), default="thread", show_default=True,
              envvar="DBO_RUNTIME_SCHEDULER", show_envvar=True,
              help="scheduler of the sweep's DBO-on steps (the handoff and the decode rows are measured under both)")
@click.option("--tokens", "tokens", type=BoundedInt(8, 16384, what="tokens per rank"), multiple=True, metavar="N",
              help="token counts of the sweep rows at the default link, in this order; repeat the option for more "
                   "(a count may come again, to see how one setting varies within a run)  [default: 512 1024 2048]")
@click.option("--pattern", "patterns", type=click.Choice(("a2", "a3")), multiple=True,
              help="communication pattern(s) to sweep; repeat for both  [default: a2 and a3]")
@click.option("--steps", type=BoundedInt(2, 200, what="timed steps per sweep row"), default=None, metavar="N",
              help="timed steps per sweep row, each DBO off, DBO on and half the tokens; the what-if and estimate "
                   "checks read their medians (fewer: a quicker, noisier sweep; make bench runs 7)  [default: 15]")
@click.option("--links", type=click.Choice(("all", "default")), default="all", show_default=True,
              help="link settings of the sweep: `all` adds rows at the default token count with the link's bandwidth "
                   "halved and doubled and its latency at 200 us; `default` sweeps the calibrated default link only "
                   "(make bench's default run: the rows the 80%% target is judged on)")
def bench(out: Path, quick: bool, dbo_scheduler: str, tokens: tuple[int, ...], patterns: tuple[str, ...],
          steps: int | None, links: str) -> int:
    from dbo_runtime.estimate_check import bench_check
    from dbo_runtime.reference.bench import format_table, run_bench
    from dbo_runtime.reference.launcher import RanksFailed

    plan = bench_plan(quick=quick, scheduler=dbo_scheduler, tokens=tokens, patterns=patterns, steps=steps, links=links)
    try:
        summary = run_bench(out, plan, checks=(bench_check,))
    except RanksFailed as exc:
        for err in exc.errors:
            click.echo(f"dbo-runtime bench: {err.line()}", err=True)
        return 1
    click.echo(format_table(summary))
    click.echo(f"written: {out / 'dbo_runtime.json'}")
    return 0


def bench_plan(*, quick: bool = False, scheduler: str = "thread", tokens: tuple[int, ...] = (),
               patterns: tuple[str, ...] = (), steps: int | None = None, links: str = "all"):
    """The reference benchmark's plan from the command's options."""
    from dataclasses import replace

    from dbo_runtime.reference.bench import BenchPlan, quick_plan

    plan = replace(quick_plan() if quick else BenchPlan(), scheduler=scheduler)
    if tokens:
        plan = replace(plan, token_counts=tokens)
    if patterns:
        plan = replace(plan, patterns=tuple(dict.fromkeys(patterns)))
    if steps is not None:
        plan = replace(plan, steps=steps)
    if links == "default":
        plan = replace(plan, links=plan.links[:1])
    return plan
