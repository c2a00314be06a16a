"""The planner's subcommands: plan, required, check, presets.

Exit status: 0 success, 1 the budget does not fit (vLLM would refuse to start), 2 bad input (one line on
stderr naming the input and what is accepted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from kv_capacity.check import fix_hint
from kv_capacity.errors import KVCapacityInputError
from kv_capacity.model_spec import ModelSpec, load_model, load_preset_config, preset_names
from kv_capacity.planner import (
    ACCEPTED_KV_CACHE_DTYPES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_DTYPE_BYTES,
    CapacityPlan,
    bytes_per_token,
    plan,
    required_bytes,
)
from kv_capacity.sizes import ACCEPTED_SIZES, format_size, parse_size, to_vllm_flag_value

PROG = "kv-capacity"


class _InputError(Exception):
    """Raised by argument types so the message stays one line and the exit status 2."""


def _positive_int(name: str) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} {text!r} is not an integer; expected a positive integer"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} {text!r} must be positive; expected a positive integer")
        return value

    convert.__name__ = name
    return convert


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except KVCapacityInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPE_BYTES:
        raise argparse.ArgumentTypeError(
            f"kv cache dtype {text!r} is not supported; expected one of {ACCEPTED_KV_CACHE_DTYPES}"
        )
    return text


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse prints usage plus the message on errors; the project's CLIs print one line and exit 2."""

    def error(message: str) -> None:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _add_sizing_args(parser: argparse.ArgumentParser, *, budget: bool) -> None:
    parser.add_argument(
        "--model", required=True, help="bundled preset name, config.json path, or model directory"
    )
    if budget:
        parser.add_argument(
            "--kv-cache-memory-bytes",
            "--kv-cache-memory",
            dest="kv_cache_memory_bytes",
            type=_size,
            required=True,
            metavar="SIZE",
            help=f"per-device KV cache budget: {ACCEPTED_SIZES}",
        )
    parser.add_argument("--max-model-len", type=_positive_int("max model len"), required=True, metavar="N")
    parser.add_argument(
        "--block-size",
        type=_positive_int("block size"),
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}, as vLLM-Ascend forces; CUDA backends use 16/64/128)",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=_positive_int("tensor parallel size"), default=1, metavar="N"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        type=_kv_dtype,
        default="auto",
        metavar="D",
        help=f"one of {ACCEPTED_KV_CACHE_DTYPES}",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int("max num batched tokens"),
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metavar="N",
        help=f"scheduler token budget per step; only sizes sliding-window layers (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument(
        "--max-concurrent-batches",
        type=_positive_int("max concurrent batches"),
        default=DEFAULT_MAX_CONCURRENT_BATCHES,
        metavar="N",
        help="batches in flight: 2 with async scheduling (vLLM default), 1 without; only sizes sliding-window layers",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="as vLLM's flag: cache sliding-window layers of hybrid models like full attention",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register plan / required / check / presets on the kv-capacity command line."""
    p = _one_line_errors(
        subparsers.add_parser("plan", help="KV cache blocks, tokens and concurrency for a budget")
    )
    _add_sizing_args(p, budget=True)
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=_run_plan)

    c = _one_line_errors(
        subparsers.add_parser("check", help="exit 1 with vLLM's start-up error when the budget does not fit")
    )
    _add_sizing_args(c, budget=True)
    c.add_argument("--format", choices=("text", "json"), default="text")
    c.set_defaults(func=_run_check)

    r = _one_line_errors(
        subparsers.add_parser("required", help="smallest budget for C concurrent requests of L tokens")
    )
    _add_sizing_args(r, budget=False)
    r.add_argument("--concurrency", type=_positive_int("concurrency"), default=1, metavar="C")
    r.add_argument("--format", choices=("text", "json"), default="text")
    r.set_defaults(func=_run_required)

    s = _one_line_errors(subparsers.add_parser("presets", help="list the bundled model presets"))
    s.add_argument("--format", choices=("text", "json"), default="text")
    s.set_defaults(func=_run_presets)


def _guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KVCapacityInputError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # e.g. `kv-capacity plan ... | head`: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return run


def _plan_from_args(args: argparse.Namespace) -> tuple[ModelSpec, CapacityPlan]:
    spec = load_model(args.model)
    result = plan(
        spec,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_concurrent_batches=args.max_concurrent_batches,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
    )
    return spec, result


def _console(stderr: bool = False) -> Console:
    return Console(
        stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 110
    )


def _plan_table(spec: ModelSpec, result: CapacityPlan) -> Table:
    table = Table(
        title=f"KV cache plan: {spec.name} ({spec.attention_summary})", show_header=True, title_justify="left"
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("how", style="dim")
    rows: list[tuple[str, str, str]] = [
        (
            "kv_cache_memory_bytes",
            f"{result.kv_cache_memory_bytes:,}",
            format_size(result.kv_cache_memory_bytes) + " per device",
        ),
        ("max_model_len", f"{result.max_model_len:,}", ""),
        (
            "block_size",
            str(result.block_size),
            f"TP {result.tensor_parallel_size}, {result.num_kv_heads_per_rank} KV head(s)/rank",
        ),
        ("kv dtype", f"{result.kv_cache_dtype} ({result.kv_dtype_bytes} B)", ""),
        ("bytes_per_token", f"{result.bytes_per_token:,}", f"all {spec.num_hidden_layers} layers, one rank"),
    ]
    for i, group in enumerate(result.groups):
        rows.append(
            (
                f"group {i} page_size_bytes",
                f"{group.page_size_bytes:,}",
                f"{group.kind}, {len(group.layers)} layers, "
                f"{group.blocks_per_request(result.max_model_len, result.max_in_flight_tokens):,} blocks/request",
            )
        )
    rows += [
        ("bytes_per_block", f"{result.bytes_per_block:,}", f"{result.num_groups} KV cache group(s)"),
        ("num_blocks", f"{result.num_blocks:,}", "budget // bytes_per_block"),
        ("blocks_per_request", f"{result.blocks_per_request:,}", "one request at max_model_len"),
        ("max_concurrency", f"{result.max_concurrency:.2f}x", "num_blocks / blocks_per_request"),
        ("kv_cache_tokens", f"{result.kv_cache_tokens:,}", "int(max_concurrency * max_model_len)"),
        ("needed_bytes", f"{result.needed_bytes:,}", format_size(result.needed_bytes) + " for one request"),
        ("fits", "yes" if result.fits else "NO", "vLLM starts" if result.fits else "vLLM refuses to start"),
    ]
    if not result.fits:
        rows.append(
            (
                "estimated_max_model_len",
                f"{result.estimated_max_model_len:,}",
                "longest that fits this budget",
            )
        )
    rows.append(
        (
            "min_kv_cache_memory_bytes",
            f"{result.min_kv_cache_memory_bytes:,}",
            f"{format_size(result.min_kv_cache_memory_bytes)}, smallest budget that starts",
        )
    )
    for name, value, how in rows:
        table.add_row(name, value, how)
    return table


def _print_plan(spec: ModelSpec, result: CapacityPlan, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(result.to_dict(), indent=2))
        return
    console = _console()
    console.print(_plan_table(spec, result))
    if result.fits:
        console.print(f"vLLM logs: {result.vllm_log_line}")
    for note in result.notes:
        console.print(f"note: {note}", style="dim")


def _print_failure(result: CapacityPlan) -> None:
    print(f"ValueError: {result.vllm_error_message}", file=sys.stderr)
    print(fix_hint(result), file=sys.stderr)


@_guard
def _run_plan(args: argparse.Namespace) -> int:
    spec, result = _plan_from_args(args)
    _print_plan(spec, result, args.format)
    if not result.fits:
        _print_failure(result)
        return 1
    return 0


@_guard
def _run_check(args: argparse.Namespace) -> int:
    spec, result = _plan_from_args(args)
    if args.format == "json":
        data: dict[str, Any] = result.to_dict()
        data["vllm_error"] = result.vllm_error_message
        print(json.dumps(data, indent=2))
    elif result.fits:
        print(
            f"OK: {spec.name} at max_model_len {result.max_model_len:,} fits in {format_size(result.kv_cache_memory_bytes)} "
            f"({result.kv_cache_tokens:,} tokens, {result.max_concurrency:.2f}x)."
        )
    if not result.fits:
        _print_failure(result)
        return 1
    return 0


@_guard
def _run_required(args: argparse.Namespace) -> int:
    spec = load_model(args.model)
    kwargs = dict(
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_concurrent_batches=args.max_concurrent_batches,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
    )
    needed = required_bytes(spec, concurrency=args.concurrency, **kwargs)
    result = plan(spec, kv_cache_memory_bytes=needed, **kwargs)
    if args.format == "json":
        data = {
            "model": spec.name,
            "max_model_len": args.max_model_len,
            "concurrency": args.concurrency,
            "block_size": args.block_size,
            "tensor_parallel_size": args.tensor_parallel_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            "required_bytes": needed,
            "kv_cache_memory_bytes_flag": to_vllm_flag_value(needed),
            "plan": result.to_dict(),
        }
        print(json.dumps(data, indent=2))
        return 0
    table = Table(
        title=f"KV cache needed: {spec.name}, {args.concurrency} x {args.max_model_len:,} tokens",
        title_justify="left",
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("required_bytes", f"{needed:,}")
    table.add_row("readable", format_size(needed))
    table.add_row("flag", f"--kv-cache-memory-bytes {to_vllm_flag_value(needed)}")
    table.add_row("num_blocks at that budget", f"{result.num_blocks:,}")
    table.add_row("vLLM would report", f"{result.kv_cache_tokens:,} tokens, {result.max_concurrency:.2f}x")
    _console().print(table)
    return 0


@_guard
def _run_presets(args: argparse.Namespace) -> int:
    rows = []
    for name in preset_names():
        spec = load_model(name)
        rows.append(
            {
                "name": name,
                "architecture": spec.architecture,
                "layers": spec.num_hidden_layers,
                "attention": spec.attention_summary,
                "dtype": spec.dtype,
                "max_position_embeddings": spec.max_position_embeddings,
                "bytes_per_token": bytes_per_token(spec),
                "source": load_preset_config(name).get("_source", ""),
            }
        )
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="Bundled model presets (KV bytes/token at TP 1, model dtype)", title_justify="left")
    for column, justify in (
        ("name", "left"),
        ("architecture", "left"),
        ("layers", "right"),
        ("attention", "left"),
        ("dtype", "left"),
        ("max pos", "right"),
        ("KV B/token", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(
            row["name"],
            row["architecture"],
            str(row["layers"]),
            row["attention"],
            row["dtype"],
            f"{row['max_position_embeddings']:,}",
            f"{row['bytes_per_token']:,}",
        )
    _console().print(table)
    return 0
