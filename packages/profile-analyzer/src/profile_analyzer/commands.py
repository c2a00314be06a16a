"""The subcommands of profile-analyzer: ``report``, ``compare``, ``whatif`` and ``synth`` (click commands).

Option names follow msprof-analyze where it has one: ``-d/--profiling_path`` for the profile,
``--output_path DIR`` for a report written into DIR under a default file name, and for ``compare``
``-d`` (the new profile) and ``--bp`` (the base). ``-o FILE`` writes one file; both are written atomically.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click
from toolkit_cli import (
    BoundedInt,
    NonNegativeInt,
    PositiveInt,
    check_output,
    format_option,
    output_option,
    write_output,
)

from profile_analyzer._params import FiniteFloat, LayerList
from profile_analyzer.errors import ProfileError
from profile_analyzer.report.compare import compare_dicts, render_compare
from profile_analyzer.report.render import render

FORMATS = ("text", "json", "md", "html")
# the file written into --output_path DIR, per format
DEFAULT_NAMES = {"text": "profile_analysis.txt", "json": "profile_analysis.json", "md": "profile_analysis.md",
                 "html": "profile_analysis.html"}
WHATIF_NAMES = {"text": "profile_whatif.txt", "json": "profile_whatif.json", "md": "profile_whatif.md"}
COMPARE_NAMES = {"text": "profile_compare.txt", "json": "profile_compare.json", "md": "profile_compare.md"}
MAX_JOBS = 1024
MAX_TOP = 100_000
JOBS = PositiveInt(MAX_JOBS, what="number of processes")


def _output_path_option(func):
    return click.option(
        "--output_path", "--output-path", "output_path", type=click.Path(file_okay=False, path_type=Path),
        default=None, metavar="DIR",
        help="write the report into DIR under a default file name (msprof-analyze's option); DIR is created if "
             "its parent exists")(func)


def _check_patterns(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    from profile_analyzer.loaders.comm_rules import compile_patterns

    try:
        compile_patterns(value)
    except ProfileError as exc:
        raise click.BadParameter(exc.problem) from None
    return value


def _comm_pattern_option(func):
    return click.option("--comm-pattern", "comm_patterns", multiple=True, metavar="REGEX", callback=_check_patterns,
                        help="also count kernels/operators whose name matches REGEX as communication (repeatable; "
                             "on top of the built-in vendor table: DeepEP, NVSHMEM, MC2, HCCL AI CPU, ...). REGEX "
                             "runs on RE2, an engine without backtracking: matching is linear in the name, so no "
                             "pattern can hang the report; Python regex syntax without backreferences or "
                             "lookaround, and \\d \\w \\s match ASCII only")(func)


def _strict_option(func):
    return click.option("--strict", is_flag=True,
                        help="fail on a rank of a directory of ranks that cannot be read (truncated, missing files) "
                             "instead of leaving it out of the figures with a warning")(func)


def _jobs_option(func):
    return click.option("--jobs", "-j", type=JOBS, default=None,
                        help="load and analyse the ranks of a multi-rank profile in this many processes (default: 2 "
                             "where 2 or more CPUs are available, else 1; each process holds about one rank at a "
                             "time, so memory grows with N; the report is the same for any N)")(func)


def _warn(messages: list[str]) -> None:
    for m in messages:
        print(f"profile-analyzer: warning: {m}", file=sys.stderr)


def _profile(positional: str | None, option: str | None, what: str, option_name: str) -> str:
    """The one profile path given either as the argument or as the msprof-analyze style option."""
    if positional and option and positional != option:
        raise click.UsageError(f"the {what} is given twice ({positional!r} and {option_name} {option!r}); "
                               "give it once")
    path = positional or option
    if not path:
        raise click.UsageError(f"missing the {what}: give it as the argument or with {option_name}")
    return path


def _destination(output: Path | None, output_path: Path | None, names: dict[str, str], fmt: str) -> Path | None:
    """Where the report goes (None: stdout), checked before any work so that a wrong place fails at once."""
    if output is not None and output_path is not None:
        raise click.UsageError("give either -o/--output FILE or --output_path DIR, not both")
    if output_path is None:
        return output
    if not output_path.is_dir():
        if output_path.exists() or not output_path.parent.is_dir():
            raise click.UsageError(f"--output_path {str(output_path)!r} is not a directory (nor one that can be "
                                   "created in an existing parent)")
        output_path.mkdir()
    target = output_path / names[fmt]
    check_output(target)
    return target


def default_jobs() -> int:
    """2 where the process may use 2 or more CPUs (the measured sweet spot: 23-26x msprof-analyze's speed at
    under twice the largest file's size in memory, docs/profile-analysis.md), else 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 2 else 1


@contextlib.contextmanager
def _progress(path: str):
    """A progress callback ``(done, total, label)``: a transient bar on a terminal, nothing otherwise."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import Progress

    with Progress(transient=True, console=None) as prog:
        task = prog.add_task(f"loading {Path(path).name}", total=None)

        def cb(done: int, total: int, label: str) -> None:
            prog.update(task, completed=done, total=total, description=f"loading {label}")

        yield cb


def _progress_loader(path: str, ranks: list[int] | None, jobs: int = 1, comm_patterns=(), strict: bool = False):
    from profile_analyzer.loaders import load

    with _progress(path) as cb:
        return load(path, ranks=ranks, progress=cb, workers=jobs, comm_patterns=comm_patterns, strict=strict)


@click.command("report", help="Analyse one profile: a *_ascend_pt or PROF_* directory, a trace_view.json, a "
               "msprof_*.json, a Kineto .json(.gz), or a directory of one profile per rank.",
               short_help="analyse one profile (a directory, a trace file, or a directory of ranks)")
@click.argument("path", required=False)
@click.option("-d", "--profiling_path", "--profiling-path", "profiling_path", metavar="PATH",
              help="the profile (msprof-analyze's name; the same as the argument)")
@format_option(*FORMATS)
@output_option()
@_output_path_option
@click.option("--rank", type=NonNegativeInt(1 << 31, what="rank"), help="only this rank")
@click.option("--step", type=NonNegativeInt(1 << 62, what="step"), help="only this step (ProfilerStep#N, or the N-th vLLM step annotation)")
@click.option("--top", type=PositiveInt(MAX_TOP, what="rows per ranked table"), default=20, show_default=True,
              help="rows per ranked table")
@_jobs_option
@_comm_pattern_option
@_strict_option
def report_command(path: str | None, profiling_path: str | None, format: str, output: Path | None,
                   output_path: Path | None, rank: int | None, step: int | None, top: int, jobs: int | None,
                   comm_patterns: tuple[str, ...], strict: bool = False) -> int:
    from profile_analyzer.api import load_and_analyze

    source = _profile(path, profiling_path, "profile", "-d/--profiling_path")
    target = _destination(output, output_path, DEFAULT_NAMES, format)
    # each rank is reduced to what the report needs before the next is held (in the worker that loaded it with
    # --jobs N), so memory does not grow with the rank count
    with _progress(source) as cb:
        _, rep = load_and_analyze(source, rank=rank, step=step, top=top, jobs=jobs or default_jobs(),
                                  comm_patterns=comm_patterns, progress=cb, strict=strict, keep_timeline=False)
    d = rep.to_dict()
    text = render(d, format)
    for w in d["warnings"]:
        print(f"profile-analyzer: warning: {w['message']}", file=sys.stderr)
    write_output(target, text)
    return 0


@click.command("compare", help="Delta of every breakdown item between two profiles (e.g. DBO off vs on): BASE then "
               "NEW as arguments, or msprof-analyze's --bp BASE -d NEW.",
               short_help="delta of every breakdown item between two profiles (e.g. DBO off vs on)")
@click.argument("base", required=False)
@click.argument("new", required=False)
@click.option("-d", "--profiling_path", "--profiling-path", "profiling_path", metavar="PATH",
              help="the new profile (msprof-analyze's name)")
@click.option("--bp", "--benchmark_path", "benchmark_path", metavar="PATH",
              help="the base profile to compare against (msprof-analyze's name)")
@format_option("text", "json", "md")
@output_option()
@_output_path_option
@click.option("--rank", type=NonNegativeInt(1 << 31, what="rank"), help="only this rank")
@click.option("--step", type=NonNegativeInt(1 << 62, what="step"), help="only this step (ProfilerStep#N, or the N-th vLLM step annotation)")
@_jobs_option
@_comm_pattern_option
@_strict_option
def compare_command(base: str | None, new: str | None, profiling_path: str | None, benchmark_path: str | None,
                    format: str, output: Path | None, output_path: Path | None, rank: int | None,
                    step: int | None, comm_patterns: tuple[str, ...], jobs: int | None = None,
                    strict: bool = False) -> int:
    from profile_analyzer.api import load_and_analyze

    if base and not new and profiling_path and not benchmark_path:  # `compare BASE -d NEW`
        base_path, new_path = base, profiling_path
    elif base and not new and benchmark_path and not profiling_path:  # `compare NEW --bp BASE`
        base_path, new_path = benchmark_path, base
    else:
        base_path = _profile(base, benchmark_path, "base profile", "--bp")
        new_path = _profile(new, profiling_path, "new profile", "-d/--profiling_path")
    target = _destination(output, output_path, COMPARE_NAMES, format)
    dicts = []
    for which in (base_path, new_path):
        with _progress(which) as cb:
            _, rep = load_and_analyze(which, rank=rank, step=step, jobs=jobs or default_jobs(),
                                      comm_patterns=comm_patterns, progress=cb, strict=strict, keep_timeline=False)
        dicts.append(rep.to_dict())
    base_d, new_d = dicts
    _warn([f"{side}: {u}" for side, d in (("base", base_d), ("new", new_d))
           for u in (f"rank {x['rank']} ({x['path']}) could not be read and is left out: {x['reason']}"
                     for x in d["unreadable"])])
    write_output(target, render_compare(compare_dicts(base_d, new_d), format))
    return 0


@click.command("whatif", help="What would dual batch overlap give? From a profile taken with DBO off, simulate the "
               "micro-batch ping-pong (each micro-batch's communication under the other's compute, one switch per "
               "collective) and predict the step with DBO on, per layer and in total, with the layers where it "
               "cannot pay.", short_help="predict the step with DBO on from a DBO-off profile")
@click.argument("path", required=False)
@click.option("-d", "--profiling_path", "--profiling-path", "profiling_path", metavar="PATH",
              help="the profile (msprof-analyze's name; the same as the argument)")
@click.option("--ubatches", type=BoundedInt(2, 8, what="micro-batches"), default=2, show_default=True,
              help="micro-batches (DBO: 2)")
@click.option("--switch-us", type=FiniteFloat(0, 1e6, what="µs"), default=30.0, show_default=True,
              help="cost of one switch between micro-batches, µs (the default: an OS-thread handoff as measured "
                   "by make bench on a CPU host; `dbo-runtime bench` measures yours)")
@click.option("--compute-scale", type=FiniteFloat(0, 1, min_open=True, what="a fraction"), default=None,
              help="a micro-batch's compute time as a fraction of the whole batch's (default 1/ubatches; closer to 1 "
                   "where small batches are bound by weight reads, e.g. decode)")
@click.option("--comm-scale", type=FiniteFloat(0, 1, min_open=True, what="a fraction"), default=None,
              help="a micro-batch's collective time above --comm-fixed-us, as a fraction of the whole batch's "
                   "(default 1/ubatches)")
@click.option("--comm-fixed-us", type=FiniteFloat(0, 1e9, what="µs"), default=0.0, show_default=True,
              help="the part of every collective that does not shrink with the tokens (link latency), µs")
@click.option("--measured-off-us", type=FiniteFloat(0, 1e12, min_open=True, what="µs"), default=None,
              help="the DBO-off step time measured without the profiler, µs: compute is scaled to it (a CPU "
                   "profiler's own cost lands on host compute)")
@click.option("--measured-on", "measured_on", metavar="PATH",
              help="a profile of the same work taken with DBO on: the prediction is compared with its steps, and the "
                   "communication operators of both profiles are put side by side")
@click.option("--no-host-work", "no_host_work", is_flag=True,
              help="leave out the collectives' host work: by default the time a CPU collective backend (gloo) spends "
                   "moving the bytes on the rank's cores is taken from the compute that runs beside it with DBO on")
@format_option("text", "json", "md")
@output_option()
@_output_path_option
@click.option("--rank", type=NonNegativeInt(1 << 31, what="rank"), help="only this rank")
@click.option("--step", type=NonNegativeInt(1 << 62, what="step"),
              help="the step to simulate (ProfilerStep#N, or the N-th vLLM step annotation; default: every step)")
@_comm_pattern_option
@_strict_option
def whatif_command(path: str | None, profiling_path: str | None, ubatches: int, switch_us: float,
                   compute_scale: float | None, comm_scale: float | None, comm_fixed_us: float,
                   measured_off_us: float | None, measured_on: str | None, format: str, output: Path | None,
                   output_path: Path | None, rank: int | None, step: int | None, comm_patterns: tuple[str, ...],
                   no_host_work: bool = False, strict: bool = False) -> int:
    from profile_analyzer.report.whatif import render_whatif
    from profile_analyzer.whatif import whatif

    source = _profile(path, profiling_path, "profile", "-d/--profiling_path")
    target = _destination(output, output_path, WHATIF_NAMES, format)
    tl = _progress_loader(source, [rank] if rank is not None else None, default_jobs(), comm_patterns=comm_patterns,
                          strict=strict)
    on_tl = (_progress_loader(measured_on, [rank] if rank is not None else None, default_jobs(),
                              comm_patterns=comm_patterns, strict=strict) if measured_on is not None else None)
    d = whatif(tl, ubatches=ubatches, switch_us=switch_us, rank=rank, step=step, compute_scale=compute_scale,
               comm_scale=comm_scale, comm_fixed_us=comm_fixed_us, measured_off_us=measured_off_us,
               measured_on=on_tl, host_work=not no_host_work)
    _warn([u.message() for t in (tl, on_tl) if t is not None for u in t.unreadable])
    write_output(target, render_whatif(d, format))
    return 0


@click.command("synth", help="Write a synthetic N-rank torch_npu profile (a stand-in for an NPU run) and "
               "ground_truth.json.", short_help="write a synthetic multi-rank torch_npu profile with a known ground truth")
@click.argument("out_dir", metavar="OUT_DIR")
@click.option("--ranks", type=PositiveInt(4096, what="ranks"), default=2, show_default=True)
@click.option("--steps", type=PositiveInt(100_000, what="steps"), default=2, show_default=True)
@click.option("--layers", type=PositiveInt(100_000, what="layers"), default=4, show_default=True)
@click.option("--pattern", type=click.Choice(["a2", "a3"]), default="a2", show_default=True,
              help="a2: allGather + reduceScatter around the experts; a3: alltoallv dispatch + combine")
@click.option("--dbo", is_flag=True, help="two micro-batches ping-pong (dual batch overlap)")
@click.option("--comm-fraction", type=FiniteFloat(0, 1000), default=0.3, show_default=True,
              help="collective transfer time of a layer relative to its compute time")
@click.option("--exposed-layers", type=LayerList(), default="", help="DBO: comma-separated layers whose collectives are too long to hide")
@click.option("--exposed-factor", type=FiniteFloat(0, 1000), default=6.0, show_default=True)
@click.option("--seed", type=NonNegativeInt(), default=0, show_default=True)
@click.option("--pp-receive-us", type=FiniteFloat(0, 1e9, what="µs"), default=0.0,
              help="start every step with an hcom_receive of this length (a pipeline-stage wait: Bubble)")
@click.option("--cann", type=click.Choice(["new", "old"]), default="new", show_default=True,
              help="CANN generation: new = Communication / Physic Stream Id / NPU <id>; old = HCCL / Stream Id")
@click.option("--comm-process-name", type=click.Choice(["Communication", "HCCL"]), default=None)
@click.option("--stream-id-key", type=click.Choice(["Physic Stream Id", "Stream Id"]), default=None)
@click.option("--numeric-ts", is_flag=True, help="write ts as JSON numbers instead of strings")
@click.option("--large-pids", is_flag=True, help="pids above 2**32")
@click.option("--no-host-tracks", is_flag=True, help="omit the Python and CANN host tracks")
@click.option("--workers", type=JOBS, default=None)
@click.option("--export", "export", type=click.Choice(["json", "db", "both"]), default="json", show_default=True,
              help="torch_npu's export_type: json = trace_view.json and the CSV/JSON summaries, db = "
                   "ascend_pytorch_profiler_{rank}.db and analysis.db, both = the two side by side")
@click.option("--overwrite", "--force", "overwrite", is_flag=True,
              help="write into an OUT_DIR that is not empty, replacing its rank folders and ground_truth.json of the "
                   "same names (without it such an OUT_DIR is refused)")
def synth_command(out_dir: str, ranks: int, steps: int, layers: int, pattern: str, dbo: bool, comm_fraction: float,
                  exposed_layers: tuple[int, ...], exposed_factor: float, seed: int, pp_receive_us: float, cann: str,
                  comm_process_name: str | None, stream_id_key: str | None, numeric_ts: bool, large_pids: bool,
                  no_host_tracks: bool, workers: int | None, export: str = "json", overwrite: bool = False) -> int:
    from profile_analyzer.synth import write_profile

    try:
        truth = write_profile(
            out_dir, ranks=ranks, steps=steps, layers=layers, pattern=pattern, dbo=dbo, comm_fraction=comm_fraction,
            seed=seed, workers=workers, exposed_layers=exposed_layers, exposed_factor=exposed_factor, cann=cann,
            comm_process_name=comm_process_name, stream_id_key=stream_id_key, ts_as_string=not numeric_ts,
            large_pids=large_pids, host_tracks=not no_host_tracks, pp_receive_us=pp_receive_us, export=export,
            overwrite=overwrite)
    except ValueError as exc:
        raise ProfileError(out_dir, str(exc)) from None
    except OSError as exc:
        raise ProfileError(out_dir, f"cannot write ({exc.strerror or exc})") from None
    mb = truth.total_bytes / 1e6
    print(f"wrote {len(truth.ranks)} rank(s), {truth.total_events} events, {mb:.1f} MB of trace_view.json "
          f"under {out_dir}; ground truth: {truth.path}")
    return 0


__all__ = ["compare_command", "report_command", "synth_command", "whatif_command"]
