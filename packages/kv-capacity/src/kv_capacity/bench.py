"""Benchmark of kv_capacity, run by `make bench`: the planner's table over every bundled preset, and its speed.

`python -m kv_capacity.bench --out DIR` prints the table and writes DIR/kv_capacity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kv_capacity.model_spec import load_model, preset_names
from kv_capacity.planner import plan
from kv_capacity.settings import DEFAULT_BLOCK_SIZE, Settings
from kv_capacity.sizes import GiB

BUDGETS_GIB = (8, 32)
LENGTHS = (8192, 32768)


def capacity_rows(block_size: int = DEFAULT_BLOCK_SIZE) -> list[dict[str, Any]]:
    """One row per (preset, budget, max_model_len) at TP 1, model dtype."""
    rows = []
    for name in preset_names():
        spec = load_model(name)
        for budget in BUDGETS_GIB:
            for length in LENGTHS:
                result = plan(
                    Settings(spec, kv_cache_memory_bytes=budget * GiB, max_model_len=length, block_size=block_size)
                )
                rows.append(
                    {
                        "model": name,
                        "attention": spec.attention_summary,
                        "kv_cache_memory_gib": budget,
                        "max_model_len": length,
                        "block_size": block_size,
                        "bytes_per_token": result.bytes_per_token,
                        "num_kv_cache_groups": result.num_groups,
                        "num_blocks": result.num_blocks,
                        "kv_cache_tokens": result.kv_cache_tokens,
                        "max_concurrency": round(result.max_concurrency, 4),
                        "fits": result.fits,
                        "estimated_max_model_len": result.estimated_max_model_len,
                    }
                )
    return rows


def planner_speed(seconds: float = 1.0) -> dict[str, float]:
    """Plans per second for a uniform model (Qwen3-8B) and a 6-group hybrid (Gemma-3-12B, not fitting,
    which adds the binary search for the estimated maximum length). The Settings are built once: this
    times the planner, not the construction of its input (about 3 us for a frozen dataclass)."""
    cases = {
        "qwen3-8b_fits": Settings(load_model("qwen3-8b"), kv_cache_memory_bytes=8 * GiB, max_model_len=32768,
                                  block_size=16),
        "gemma-3-12b_not_fitting": Settings(load_model("gemma-3-12b"), kv_cache_memory_bytes=8 * GiB,
                                            max_model_len=131072, block_size=16),
    }
    out = {}
    for label, settings in cases.items():
        count = 0
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            plan(settings)
            count += 1
        out[label] = count / (time.perf_counter() - start)
    return out


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_capacity.bench")
    parser.add_argument("--out", default="bench-results", help="folder for kv_capacity.json")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per speed case")
    args = parser.parse_args(argv)

    rows = capacity_rows()
    speed = planner_speed(args.seconds)

    console = Console(highlight=False, width=None if os.isatty(1) else 150)
    table = Table(
        title=f"kv-capacity: KV cache tokens (max concurrency) per device, TP 1, model dtype, block {DEFAULT_BLOCK_SIZE}, "
        "vLLM 0.32 arithmetic",
        title_justify="left",
    )
    table.add_column("model")
    table.add_column("attention")
    table.add_column("KV B/token", justify="right")
    table.add_column("groups", justify="right")
    settings = [(b, n) for b in BUDGETS_GIB for n in LENGTHS]
    for budget, length in settings:
        table.add_column(f"{budget} GiB @ {length:,}", justify="right")
    by_model: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(row["model"], {})[(row["kv_cache_memory_gib"], row["max_model_len"])] = row
    for model, cells in by_model.items():
        first = next(iter(cells.values()))
        values = []
        for key in settings:
            row = cells[key]
            if row["fits"]:
                values.append(f"{row['kv_cache_tokens']:,} ({row['max_concurrency']:.2f}x)")
            else:
                values.append(f"does not fit (max {row['estimated_max_model_len']:,})")
        table.add_row(
            model,
            first["attention"],
            f"{first['bytes_per_token']:,}",
            str(first["num_kv_cache_groups"]),
            *values,
        )
    console.print(table)
    for label, rate in speed.items():
        console.print(f"planner speed, {label}: {rate:,.0f} plans/s")

    out = Path(args.out) / "kv_capacity.json"
    _write_json_atomically(
        out,
        {
            "benchmark": "kv_capacity",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "capacity": rows,
            "plans_per_second": {k: round(v, 1) for k, v in speed.items()},
        },
    )
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
