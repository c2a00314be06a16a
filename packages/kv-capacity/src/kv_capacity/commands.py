"""The subcommands of kv-capacity: plan, check, required, presets, verify (click commands).

Exit status: 0 success, 1 the budget does not fit (vLLM would refuse to start), 2 bad input (one line on
stderr naming the input and what is accepted; printed by the tool group in `kv_capacity.cli`).
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from toolkit_cli import ByteSize, NumberType, PositiveInt, format_option, output_option, write_output

from kv_capacity.check import fix_hint, max_model_len_error, max_model_len_hint
from kv_capacity.errors import KVCapacityInputError
from kv_capacity.model_spec import ModelSpec, load_model, load_preset_config, preset_names
from kv_capacity.planner import (
    ACCEPTED_KV_CACHE_DTYPES,
    KV_CACHE_DTYPE_BYTES,
    CapacityPlan,
    bytes_per_token,
    plan,
    required_bytes,
)
from kv_capacity.settings import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CheckRule,
    Settings,
    check_rule,
    installed_vllm_version,
)
from kv_capacity.sizes import ACCEPTED_SIZES, format_size, parse_size, to_vllm_flag_value

# Bounds of the integer options: far above any real setting, low enough that every figure stays exact.
MAX_MODEL_LEN = 1 << 40
MAX_BLOCK_SIZE = 1 << 20
MAX_TP = 1 << 16
MAX_CONCURRENCY = 1 << 32
MAX_BATCHED_TOKENS = 1 << 40
MAX_CONCURRENT_BATCHES = 1 << 10

SIZE = ByteSize(parse_size, (KVCapacityInputError,))


class KVCacheDtype(click.ParamType):
    name = "dtype"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "D"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if value in KV_CACHE_DTYPE_BYTES:
            return str(value)
        self.fail(f"kv cache dtype {str(value)[:40]!r} is not supported; expected one of {ACCEPTED_KV_CACHE_DTYPES}",
                  param, ctx)


class Seconds(NumberType):
    name = "seconds"

    @property
    def expected(self) -> str:
        return "a positive number of seconds (below 10,000,000)"

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if not 0 < number < 1e7:
            self.fail(f"timeout {str(value)[:40]!r} is not a positive number of seconds (below 10,000,000)", param, ctx)
        return number


def sizing_options(*, budget: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options plan, check and required share (vLLM's names)."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        options = [
            click.option("--model", required=True, help="bundled preset name, config.json path, or model directory"),
        ]
        if budget:
            options.append(click.option(
                "--kv-cache-memory-bytes", "--kv-cache-memory", "kv_cache_memory_bytes", type=SIZE, required=True,
                help=f"per-device KV cache budget: {ACCEPTED_SIZES}"))
        options += [
            click.option("--max-model-len", type=PositiveInt(MAX_MODEL_LEN, what="max model len"), required=True,
                         metavar="N"),
            click.option("--block-size", type=PositiveInt(MAX_BLOCK_SIZE, what="block size"),
                         default=DEFAULT_BLOCK_SIZE, show_default=True, metavar="N",
                         help="tokens per KV block (vLLM-Ascend forces 128; CUDA backends use 16/64/128)"),
            click.option("--tensor-parallel-size", "-tp", type=PositiveInt(MAX_TP, what="tensor parallel size"),
                         default=1, show_default=True, metavar="N"),
            click.option("--kv-cache-dtype", type=KVCacheDtype(), default="auto", show_default=True,
                         help=f"one of {ACCEPTED_KV_CACHE_DTYPES}"),
            click.option("--max-num-batched-tokens", type=PositiveInt(MAX_BATCHED_TOKENS, what="max num batched tokens"),
                         default=DEFAULT_MAX_NUM_BATCHED_TOKENS, show_default=True, metavar="N",
                         help="scheduler token budget per step; only sizes sliding-window layers"),
            click.option("--max-concurrent-batches",
                         type=PositiveInt(MAX_CONCURRENT_BATCHES, what="max concurrent batches"),
                         default=DEFAULT_MAX_CONCURRENT_BATCHES, show_default=True, metavar="N",
                         help="batches in flight: 2 with async scheduling (vLLM default), 1 without; only sizes "
                              "sliding-window layers"),
            click.option("--disable-hybrid-kv-cache-manager", is_flag=True,
                         help="as vLLM's flag: cache sliding-window layers of hybrid models like full attention"),
            click.option("--vllm-version", metavar="X.Y",
                         help="apply that vLLM's start-up check (0.23 counts every block, 0.32 holds one back); "
                              "default: the vLLM installed here, else the newest rule"),
            format_option("text", "json"),
            output_option(),
        ]
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def _console(file: io.StringIO | None = None) -> Console:
    tty = sys.stdout.isatty()
    return Console(file=file, force_terminal=tty if file is not None else None, highlight=False, soft_wrap=False,
                   width=None if tty else 110)


def _emit(output: Any, render: Callable[[Console], None]) -> None:
    """Render with a rich console into a string, then write it to stdout or atomically to `output`."""
    buffer = io.StringIO()
    console = _console(buffer) if output is None else Console(file=buffer, highlight=False, soft_wrap=False,
                                                               width=110, color_system=None)
    render(console)
    write_output(output, buffer.getvalue())


def _settings(options: dict[str, Any]) -> Settings:
    """The sizing options as Settings (the budget is None for `required`; the check rule is set by the caller)."""
    return Settings(
        load_model(options["model"]),
        max_model_len=options["max_model_len"],
        kv_cache_memory_bytes=options.get("kv_cache_memory_bytes"),
        block_size=options["block_size"],
        tensor_parallel_size=options["tensor_parallel_size"],
        kv_cache_dtype=options["kv_cache_dtype"],
        max_num_batched_tokens=options["max_num_batched_tokens"],
        max_concurrent_batches=options["max_concurrent_batches"],
        disable_hybrid_kv_cache_manager=options["disable_hybrid_kv_cache_manager"],
    )


def _rule(options: dict[str, Any]) -> CheckRule:
    """The start-up check of --vllm-version, else of the vLLM installed here, else the newest."""
    return check_rule(options["vllm_version"] or installed_vllm_version())


def _plan(options: dict[str, Any]) -> tuple[ModelSpec, CapacityPlan]:
    settings = _settings(options)
    return settings.model, plan(replace(settings, rule=_rule(options)))


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


def _plan_text(spec: ModelSpec, result: CapacityPlan, fmt: str, output: Any, device: str = "GPU") -> None:
    if fmt == "json":
        data = result.to_dict()
        data["vllm_log"] = result.log_line(device)
        write_output(output, json.dumps(data, indent=2) + "\n")
        return

    def render(console: Console) -> None:
        console.print(_plan_table(spec, result))
        if result.fits:
            console.print(f"vLLM logs: {result.log_line(device)}")
        console.print(f"start-up check: {result.check_rule}", style="dim")
        for note in result.notes:
            console.print(f"note: {note}", style="dim")

    _emit(output, render)


def _print_failure(message: str, hint: str) -> None:
    print(f"ValueError: {message}", file=sys.stderr)
    print(hint, file=sys.stderr)


@click.command("plan", help="KV cache blocks, tokens and concurrency for a budget")
@sizing_options(budget=True)
@click.option("--log-device", type=click.Choice(["GPU", "NPU", "CPU"], case_sensitive=False), default="GPU",
              show_default=True, help="how the quoted vLLM log line names the device: GPU on CUDA, NPU on vLLM-Ascend, "
              "CPU on the CPU backend")
def plan_command(**options: Any) -> int:
    device = str(options.pop("log_device")).upper()
    spec, result = _plan(options)
    _plan_text(spec, result, options["format"], options["output"], device)
    if not result.fits:
        _print_failure(result.vllm_error_message or "", fix_hint(result))
        return 1
    return 0


@click.command("check", help="exit 1 with vLLM's start-up error when vLLM would not start")
@sizing_options(budget=True)
def check_command(**options: Any) -> int:
    spec, result = _plan(options)
    length_error = max_model_len_error(spec, result.max_model_len)
    error = length_error or result.vllm_error_message
    if options["format"] == "json":
        data: dict[str, Any] = result.to_dict()
        data["vllm_error"] = error
        data["starts"] = error is None
        write_output(options["output"], json.dumps(data, indent=2) + "\n")
    elif error is None:
        write_output(options["output"],
                     f"OK: {spec.name} at max_model_len {result.max_model_len:,} fits in "
                     f"{format_size(result.kv_cache_memory_bytes)} ({result.kv_cache_tokens:,} tokens, "
                     f"{result.max_concurrency:.2f}x).\n")
    if length_error is not None:
        _print_failure(length_error, max_model_len_hint(spec))
        return 1
    if not result.fits:
        _print_failure(result.vllm_error_message or "", fix_hint(result))
        return 1
    return 0


@click.command("required", help="smallest budget for N concurrent requests of L tokens")
@sizing_options(budget=False)
@click.option("--max-num-seqs", "--concurrency", "concurrency", type=PositiveInt(MAX_CONCURRENCY, what="concurrency"),
              default=1, show_default=True, metavar="N",
              help="concurrent requests of --max-model-len tokens (vLLM's --max-num-seqs)")
def required_command(**options: Any) -> int:
    settings = _settings(options)
    spec, concurrency = settings.model, options["concurrency"]
    needed = required_bytes(settings, concurrency=concurrency)
    result = plan(replace(settings, kv_cache_memory_bytes=needed, rule=_rule(options)))
    if options["format"] == "json":
        data = {
            "model": spec.name,
            "max_model_len": settings.max_model_len,
            "concurrency": concurrency,
            "block_size": settings.block_size,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "kv_cache_dtype": settings.kv_cache_dtype,
            "required_bytes": needed,
            "kv_cache_memory_bytes_flag": to_vllm_flag_value(needed),
            "plan": result.to_dict(),
        }
        write_output(options["output"], json.dumps(data, indent=2) + "\n")
        return 0
    table = Table(
        title=f"KV cache needed: {spec.name}, {concurrency} x {settings.max_model_len:,} tokens",
        title_justify="left",
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("required_bytes", f"{needed:,}")
    table.add_row("readable", format_size(needed))
    table.add_row("flag", f"--kv-cache-memory-bytes {to_vllm_flag_value(needed)}")
    table.add_row("num_blocks at that budget", f"{result.num_blocks:,}")
    table.add_row("vLLM would report", f"{result.kv_cache_tokens:,} tokens, {result.max_concurrency:.2f}x")
    _emit(options["output"], lambda console: console.print(table))
    return 0


@click.command("presets", help="list the bundled model presets")
@format_option("text", "json")
@output_option()
def presets_command(format: str, output: Any) -> int:
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
    if format == "json":
        write_output(output, json.dumps(rows, indent=2) + "\n")
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
    _emit(output, lambda console: console.print(table))
    return 0


@click.command(
    "verify",
    help="Start a real vLLM offline with these settings, read the KV cache capacity it logs (or its start-up "
    "error), stop it, and compare with the planner. Arguments after `--` go to vLLM unchanged.",
    short_help="start a real vLLM and compare the KV capacity it reports with the planner",
)
@click.option("--model", required=True, metavar="DIR", help="local model directory (config.json, weights, tokenizer)")
@click.option("--kv-cache-memory-bytes", "--kv-cache-memory", "kv_cache_memory_bytes", type=SIZE,
              help="per-device KV cache budget (e.g. 64M, 1G, 8GiB)")
@click.option("--max-model-len", type=PositiveInt(MAX_MODEL_LEN, what="max model len"), metavar="N")
@click.option("--cases", type=click.Choice(["seed", "plugin-timing"]),
              help="seed: the seed's three verification cases; plugin-timing: seed case 3 without and with the "
                   "kv_capacity plugin, timed from launch to the start-up error")
@format_option("text", "json")
@click.option("--timeout", type=Seconds(), default=600.0, show_default=True, metavar="SECONDS",
              help="longest wait for each vLLM start")
@click.option("--vllm-python", metavar="PATH", help="python with vLLM (default $DBO_TOOLKIT_VLLM_PYTHON, else .venv-vllm)")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def verify_command(model: str, kv_cache_memory_bytes: int | None, max_model_len: int | None, cases: str | None,
                   format: str, timeout: float, vllm_python: str | None, vllm_args: tuple[str, ...]) -> int:
    from kv_capacity.verify import (
        VerifyError,
        VLLMUnavailableError,
        compare,
        probe_vllm_python,
        require_vllm_python,
        run_plugin_timing,
        run_seed_cases,
        run_vllm,
    )

    extra = list(vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if vllm_python:
        if not os.access(vllm_python, os.X_OK):
            return _verify_fail(f"--vllm-python {vllm_python!r} is not an executable; expected a python with vLLM")
        python = vllm_python
    else:
        try:
            python = require_vllm_python()
        except VLLMUnavailableError as exc:
            return _verify_fail(str(exc))
    if not Path(model).is_dir():
        return _verify_fail(f"--model {model!r} is not a directory; expected a local model directory with config.json")
    try:
        load_model(model)
    except KVCapacityInputError as exc:
        return _verify_fail(str(exc))
    problem = probe_vllm_python(python)
    if problem:
        return _verify_fail(problem)

    console = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)
    show = console.print if format == "text" else (lambda *a, **k: None)
    try:
        if cases == "seed":
            seed = run_seed_cases(
                model, budget=kv_cache_memory_bytes, max_model_len=max_model_len, extra_args=extra,
                python=python, timeout_s=timeout,
                progress=lambda label: show(f"[dim]starting vLLM: {label}[/]") if sys.stdout.isatty() else None,
            )
            if format == "json":
                print(json.dumps({"model": model, "cases": [c.to_dict() for c in seed],
                                  "passed": all(c.passed for c in seed)}, indent=2))
            else:
                for case in seed:
                    mark = "[green]PASS[/]" if case.passed else "[bold red]FAIL[/]"
                    show(f"\n{mark} case {case.number}: {case.title}")
                    for detail in case.details:
                        show(f"  {detail}")
                    for comparison in case.comparisons:
                        show(_comparison_table(comparison))
            return 0 if all(c.passed for c in seed) else 1

        if cases == "plugin-timing":
            rows = run_plugin_timing(
                model, budget=kv_cache_memory_bytes, max_model_len=max_model_len, extra_args=extra,
                python=python, timeout_s=timeout,
                progress=lambda label: show(f"[dim]starting vLLM {label}[/]") if sys.stdout.isatty() else None,
            )
            if format == "json":
                print(json.dumps({"model": model, "runs": rows}, indent=2))
            else:
                table = Table(title=f"Launch to start-up error: {Path(model).name}, "
                              f"budget {rows[0]['kv_cache_memory_bytes']:,} B, max_model_len {rows[0]['max_model_len']:,}",
                              title_justify="left")
                for column in ("run", "seconds to error", "error", "weights loaded first"):
                    table.add_column(column, overflow="fold")
                for row in rows:
                    table.add_row(row["label"], f"{row['seconds_to_error']}", f"{row['error_type']}: {row['error']}",
                                  "yes" if row["weights_loaded_before_error"] else "no")
                show(table)
            ok = all(r["outcome"] == "startup_error" for r in rows)
            return 0 if ok else 1

        if kv_cache_memory_bytes is None:
            return _verify_fail("--kv-cache-memory-bytes is required without --cases; expected a size such as 64M or 1G")
        engine_args = ["--model", model, "--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
        if max_model_len:
            engine_args += ["--max-model-len", str(max_model_len)]
        run = run_vllm(engine_args + extra, python=python, timeout_s=timeout)
        comparison = compare(f"{Path(model).name}: planner vs vLLM", model, run)
    except VerifyError as exc:
        return _verify_fail(str(exc), exc.log_tail)
    except KVCapacityInputError as exc:
        return _verify_fail(str(exc))
    if run.outcome == "startup_error" and run.error and "KV cache" not in run.error and "cache blocks" not in run.error:
        return _verify_fail(f"vLLM failed to start for a reason other than the KV cache: {run.error_type}: {run.error}",
                            run.log_tail)
    if format == "json":
        print(json.dumps(comparison.to_dict(), indent=2))
    else:
        show(_comparison_table(comparison))
        show(f"vLLM {run.outcome.replace('_', ' ')} after {run.elapsed_s:.1f} s; "
             + ("planner and vLLM agree." if comparison.agrees else "[bold red]planner and vLLM differ.[/]"))
    return 0 if comparison.agrees else 1


def _comparison_table(comparison: Any) -> Table:  # comparison: kv_capacity.verify.Comparison
    table = Table(title=comparison.label, title_justify="left")
    table.add_column("quantity")
    table.add_column("planner", overflow="fold")
    table.add_column("vLLM", overflow="fold")
    table.add_column("", justify="center")
    for quantity, planner_value, vllm_value, equal in comparison.rows:
        table.add_row(quantity, planner_value, vllm_value, "[green]=[/]" if equal else "[bold red]DIFFERS[/]")
    return table


def _verify_fail(message: str, log_tail: list[str] | None = None) -> int:
    """One line on stderr, exit status 2; vLLM's log, when there is one, goes to a file that the line names."""
    if log_tail:
        fd, log_path = tempfile.mkstemp(prefix="kv-capacity-verify-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write("\n".join(log_tail) + "\n")
        message = f"{message} (last {len(log_tail)} lines of vLLM's log: {log_path})"
    print(f"kv-capacity verify: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


__all__ = ["check_command", "plan_command", "presets_command", "required_command", "verify_command"]
