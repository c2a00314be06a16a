"""`dbo-runtime ascend-sites` (the DBO hook-site table) and `dbo-runtime ascend-compare collect|diff` (the DBO
on/off precision comparison against two running vLLM servers)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from dbo_runtime.ascend.sites import MODEL_FAMILY_SITES, PATCHED_SYMBOLS, SITES, VLLM_SYMBOLS
from dbo_runtime.errors import DBOConfigError

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


def _read_json(path: str) -> dict:
    from dbo_runtime.errors import DBOConfigError

    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise DBOConfigError(f"{path}: cannot read a collect result ({type(exc).__name__}); accepted: the JSON "
                             "written by `dbo-runtime ascend-compare collect`") from None
    if not isinstance(data, dict):
        raise DBOConfigError(f"{path}: not a collect result; accepted: the JSON written by ascend-compare collect")
    return data


def _compare_run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from dbo_runtime.ascend.compare import write_json_atomic
    from dbo_runtime.vllm.compare import render_text, run_compare

    python = args.vllm_python or os.environ.get("DBO_TOOLKIT_VLLM_PYTHON") or sys.executable
    if not Path(python).is_file():
        raise DBOConfigError(f"--vllm-python {python}: no such interpreter; accepted: the python of the "
                             "environment where vLLM (and dbo-runtime) are installed")
    for name in ("tensor_parallel_size", "num_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            raise DBOConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    report = run_compare(args.model, python=python, tensor_parallel_size=args.tensor_parallel_size,
                         num_prompts=args.num_prompts, max_tokens=args.max_tokens, engine_argv=args.vllm_args,
                         workdir=Path(args.workdir) if args.workdir else None, timeout_s=args.timeout,
                         control=args.control)
    if args.output:
        write_json_atomic(Path(args.output), report)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(render_text(report))
    ok = (report["split_steps"] > 0 and report["identical_pct"] >= args.min_identical_pct
          and report["max_logprob_diff"] <= args.max_logprob_diff
          and report.get("control_identical_pct", 100.0) >= args.min_identical_pct)
    return 0 if ok else 1


def _compare_cmd(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dbo_runtime.ascend.compare import DEFAULT_PROMPTS, collect, diff_report, diff_runs, write_json_atomic
    from dbo_runtime.errors import DBOConfigError

    try:
        if args.compare_command == "run":
            return _compare_run(args)
        if args.compare_command == "collect":
            prompts = list(DEFAULT_PROMPTS)
            if args.prompts:
                try:
                    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
                except OSError as exc:
                    raise DBOConfigError(f"{args.prompts}: cannot read ({exc.strerror}); accepted: a text file "
                                         "with one prompt per line") from None
            run = collect(args.url, args.model, prompts[: args.num_prompts], max_tokens=args.max_tokens,
                          label=args.label, concurrency=args.concurrency)
            write_json_atomic(Path(args.out), run)
            print(f"wrote {len(run['results'])} greedy completions to {args.out}")
            return 0
        d = diff_runs(_read_json(args.a), _read_json(args.b))
    except DBOConfigError as exc:
        print(f"dbo-runtime compare: {exc}", file=sys.stderr)
        return 2
    report = diff_report(d)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"identical text: {d.identical}/{d.prompts} ({100 * d.identical_fraction:.1f}%)")
        print(f"logprob |diff| over {d.compared_tokens} common tokens: max {d.max_abs_logprob_diff:.4g}, "
              f"mean {d.mean_abs_logprob_diff:.4g}")
    ok = d.identical_fraction >= args.min_identical and d.max_abs_logprob_diff <= args.max_logprob_diff
    return 0 if ok else 1


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    compare = subparsers.add_parser("compare", aliases=["ascend-compare"], help="DBO on/off precision comparison",
                                    description="run: vLLM with DBO off then on (offline engine, greedy prompts), "
                                    "compared; collect: greedy completions with logprobs from one server; "
                                    "diff: text identity and logprob difference of two collect results.")
    sub = compare.add_subparsers(dest="compare_command", metavar="{run,collect,diff}", required=True)
    run = sub.add_parser("run", help="run vLLM with DBO off and on and compare (exit 1 when they differ)",
                         description="Greedy completions of built-in prompts with DBO off, then on, each in a fresh "
                         "offline vLLM engine of --vllm-python; prints identical_pct, max_logprob_diff and "
                         "split_steps. Exit 0: outputs agree and DBO split steps; 1: they differ or DBO never split; "
                         "2: bad input or a run failed. Arguments after `--` go to vLLM (its serve flags).")
    run.add_argument("--model", required=True, help="model directory (or hub name)")
    run.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    run.add_argument("--num-prompts", "--prompts", type=int, default=50, help="greedy prompts (default 50)")
    run.add_argument("--control", action="store_true", help="also run DBO off twice: off vs off must be identical")
    run.add_argument("--max-tokens", type=int, default=16)
    run.add_argument("--vllm-python", help="interpreter with vLLM and dbo-runtime (default: $DBO_TOOLKIT_VLLM_PYTHON "
                     "or this python)")
    run.add_argument("--min-identical-pct", type=float, default=100.0)
    run.add_argument("--max-logprob-diff", type=float, default=float("inf"))
    run.add_argument("--timeout", type=float, default=900.0, help="seconds per vLLM run (default 900)")
    run.add_argument("--workdir", help="keep the two runs' outputs, logs and per-rank split counts here")
    run.add_argument("--format", choices=("text", "json"), default="text")
    run.add_argument("-o", "--output", help="also write the JSON report here (atomically)")
    run.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vLLM engine flags")
    col = sub.add_parser("collect", help="greedy completions with logprobs from a running server")
    col.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    col.add_argument("--model", required=True, help="the served model name (as given to --model)")
    col.add_argument("--prompts", help="text file, one prompt per line (default: 16 built-in prompts)")
    col.add_argument("--num-prompts", type=int, default=1000)
    col.add_argument("--max-tokens", type=int, default=64)
    col.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    col.add_argument("--label", default="")
    col.add_argument("--out", required=True)
    dif = sub.add_parser("diff", help="compare two collect results")
    dif.add_argument("a")
    dif.add_argument("b")
    dif.add_argument("--min-identical", type=float, default=0.0, help="exit 1 below this identical-text fraction")
    dif.add_argument("--max-logprob-diff", type=float, default=float("inf"),
                     help="exit 1 above this max |logprob difference| on common tokens")
    dif.add_argument("--json", action="store_true")
    compare.set_defaults(func=_compare_cmd)

    parser = subparsers.add_parser("ascend-sites", help="print the DBO hook-site table for vLLM-Ascend",
                                   description="Print the declarative table of DBO hook sites and patched symbols.")
    parser.add_argument("--format", choices=("table", "md", "json"), default="table")
    parser.set_defaults(func=_cmd)
    return parser
