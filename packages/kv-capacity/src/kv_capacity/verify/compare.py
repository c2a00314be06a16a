"""Comparing: the planner's figures against what a real vLLM reported, and the seed's three verification cases.

For every vLLM start the planner is asked about exactly the settings vLLM resolved (the child reports
them), so a difference is a difference in the arithmetic, not in the inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kv_capacity.check import check
from kv_capacity.errors import InsufficientKVCacheError, KVCapacityInputError
from kv_capacity.model_spec import ModelSpec, load_model
from kv_capacity.planner import CapacityPlan, plan, required_bytes
from kv_capacity.settings import Settings
from kv_capacity.verify.run import VLLMRun, run_vllm

SEED_BLOCK_SIZE = 128  # the block size the seed's budgets are chosen for (vLLM-Ascend's)


@dataclass
class Comparison:
    """Planner vs vLLM for one vLLM start."""

    label: str
    run: VLLMRun
    rows: list[tuple[str, str, str, bool]]  # (quantity, planner, vLLM, equal)
    planner: dict[str, Any] | None

    @property
    def agrees(self) -> bool:
        return all(equal for *_, equal in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "agrees": self.agrees,
            "rows": [{"quantity": q, "planner": p, "vllm": v, "equal": e} for q, p, v, e in self.rows],
            "vllm": self.run.to_dict(),
            "planner": self.planner,
        }


def settings_of_run(model: str, run: VLLMRun) -> Settings:
    """The planner's Settings for what vLLM resolved in `run` (its budget, length, block size, TP, KV dtype,
    scheduler settings)."""
    r = run.resolved
    if not r.get("kv_cache_memory_bytes"):
        raise KVCapacityInputError(
            "vLLM ran without a KV cache budget; pass --kv-cache-memory-bytes SIZE to compare with the planner"
        )
    return Settings(
        load_model(model),
        kv_cache_memory_bytes=int(r["kv_cache_memory_bytes"]),
        max_model_len=int(r["max_model_len"]),
        block_size=int(r["block_size"]),
        tensor_parallel_size=int(r["tensor_parallel_size"]),
        kv_cache_dtype=str(r["kv_cache_dtype"]),
        max_num_batched_tokens=int(r["max_num_batched_tokens"]),
        max_concurrent_batches=int(r["max_concurrent_batches"]),
        disable_hybrid_kv_cache_manager=bool(r.get("disable_hybrid_kv_cache_manager")),
    )


def plan_for_run(model: str, run: VLLMRun) -> CapacityPlan:
    """The planner's answer for the settings vLLM resolved in `run`."""
    return plan(settings_of_run(model, run))


def compare(label: str, model: str, run: VLLMRun) -> Comparison:
    """Rows of planner vs vLLM: tokens and concurrency when vLLM started, the error when it did not."""
    result = plan_for_run(model, run)
    rows: list[tuple[str, str, str, bool]] = []
    if run.capacity is not None:
        cap = run.capacity
        conc = f"{result.max_concurrency:.2f}"
        rows += [
            ("starts", "yes" if result.fits else "no", "yes", result.fits),
            ("KV cache size (tokens)", f"{result.kv_cache_tokens:,}", f"{cap.kv_cache_tokens:,}",
             result.kv_cache_tokens == cap.kv_cache_tokens),
            ("max concurrency", f"{conc}x", f"{cap.max_concurrency_text}x", conc == cap.max_concurrency_text),
            ("max_model_len", f"{result.max_model_len:,}", f"{cap.max_model_len:,}", result.max_model_len == cap.max_model_len),
        ]
    else:
        vllm_error = run.error or ""
        rows += [
            ("starts", "yes" if result.fits else "no", "no", not result.fits),
            ("start-up error", result.vllm_error_message or "-", vllm_error, result.vllm_error_message == vllm_error),
        ]
    return Comparison(label, run, rows, result.to_dict())


# --------------------------------------------------------------------------------------------------
# The seed's three cases


@dataclass
class SeedCase:
    number: int
    title: str
    passed: bool
    details: list[str]
    comparisons: list[Comparison]

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.number,
            "title": self.title,
            "passed": self.passed,
            "details": self.details,
            "runs": [c.to_dict() for c in self.comparisons],
        }


def _mib_ceil(num_bytes: int) -> int:
    return int(math.ceil(num_bytes / (1 << 20))) << 20


def seed_budgets(spec: ModelSpec, budget: int | None, max_model_len: int | None) -> dict[str, int]:
    """Budgets and lengths for the three cases, chosen with the planner so each case means something."""
    max_pos = spec.max_position_embeddings or 8192
    length = max_model_len or min(2048, max_pos)
    at = Settings(spec, max_model_len=length, block_size=SEED_BLOCK_SIZE)
    small = budget or _mib_ceil(required_bytes(at, concurrency=4))
    long_len = min(max_pos, max(8 * length, 8192))
    one_long = required_bytes(replace(at, max_model_len=long_len), concurrency=1)
    tight = max(1 << 20, (one_long // 2) >> 20 << 20)
    return {"max_model_len": length, "budget": small, "large_budget": 2 * small, "long_max_model_len": long_len,
            "tight_budget": tight}


def run_seed_cases(
    model: str,
    *,
    budget: int | None,
    max_model_len: int | None,
    extra_args: list[str],
    python: str | None,
    timeout_s: float,
    progress: Any = None,
) -> list[SeedCase]:
    """Run the seed's three verification cases on a real vLLM (four starts)."""
    s = seed_budgets(load_model(model), budget, max_model_len)
    base = ["--model", model, "--max-model-len", str(s["max_model_len"])] + list(extra_args)

    def start(label: str, args: list[str]) -> Comparison:
        if progress:
            progress(label)
        run = run_vllm(args, python=python, timeout_s=timeout_s)
        return compare(label, model, run)

    gmu_low = start(
        f"budget {s['budget']:,} B, gpu_memory_utilization 0.5",
        base + ["--kv-cache-memory-bytes", str(s["budget"]), "--gpu-memory-utilization", "0.5"],
    )
    gmu_high = start(
        f"budget {s['budget']:,} B, gpu_memory_utilization 0.9",
        base + ["--kv-cache-memory-bytes", str(s["budget"]), "--gpu-memory-utilization", "0.9"],
    )
    large = start(f"budget {s['large_budget']:,} B", base + ["--kv-cache-memory-bytes", str(s["large_budget"])])
    long_args = ["--model", model, "--max-model-len", str(s["long_max_model_len"]),
                 "--kv-cache-memory-bytes", str(s["tight_budget"])] + list(extra_args)
    tight = start(f"budget {s['tight_budget']:,} B, max_model_len {s['long_max_model_len']:,}", long_args)

    cases: list[SeedCase] = []
    t1, t2 = (c.run.capacity.kv_cache_tokens if c.run.capacity else None for c in (gmu_low, gmu_high))
    ok1 = t1 is not None and t1 == t2 and gmu_low.agrees and gmu_high.agrees
    cases.append(SeedCase(1, "same budget, two gpu_memory_utilization values: identical token counts", ok1,
                          [f"tokens at 0.5: {t1}", f"tokens at 0.9: {t2}"], [gmu_low, gmu_high]))
    t3 = large.run.capacity.kv_cache_tokens if large.run.capacity else None
    ok2 = t1 is not None and t3 is not None and t3 > t1 and gmu_low.agrees and large.agrees
    cases.append(SeedCase(2, "larger budget: more tokens, each exactly the planner's figure", ok2,
                          [f"tokens at {s['budget']:,} B: {t1}", f"tokens at {s['large_budget']:,} B: {t3}"],
                          [gmu_low, large]))
    details = []
    predicted = None
    r = tight.run.resolved
    try:
        check(Settings(load_model(model), kv_cache_memory_bytes=int(r.get("kv_cache_memory_bytes") or s["tight_budget"]),
                       max_model_len=int(r.get("max_model_len") or s["long_max_model_len"]),
                       block_size=int(r.get("block_size") or SEED_BLOCK_SIZE),
                       tensor_parallel_size=int(r.get("tensor_parallel_size") or 1),
                       kv_cache_dtype=str(r.get("kv_cache_dtype") or "auto"),
                       max_num_batched_tokens=int(r.get("max_num_batched_tokens") or 2048),
                       max_concurrent_batches=int(r.get("max_concurrent_batches") or 2)))
        details.append("kv-capacity check predicted that vLLM starts")
    except InsufficientKVCacheError as exc:
        predicted = exc
        details.append(f"kv-capacity check: {exc}")
    failed_before_serving = tight.run.outcome == "startup_error" and tight.run.capacity is None
    details.append(f"vLLM: {tight.run.error_type}: {tight.run.error}" if tight.run.error else f"vLLM outcome: {tight.run.outcome}")
    ok3 = failed_before_serving and predicted is not None and predicted.vllm_message == tight.run.error and tight.agrees
    cases.append(SeedCase(3, "small budget, long max_model_len: fails at start-up, predicted by kv-capacity check",
                          ok3, details, [tight]))
    return cases


def run_plugin_timing(
    model: str,
    *,
    budget: int | None,
    max_model_len: int | None,
    extra_args: list[str],
    python: str | None,
    timeout_s: float,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Seed case 3 (a budget too small for max_model_len) started twice: without and with the plugin.

    Returns, per start, how long it took from launch until the start-up error, and the error.
    """
    s = seed_budgets(load_model(model), None, None)
    tight = budget or s["tight_budget"]
    length = max_model_len or s["long_max_model_len"]
    args = ["--model", model, "--kv-cache-memory-bytes", str(tight), "--max-model-len", str(length), *extra_args]
    rows = []
    for plugin in (False, True):
        label = f"{'with' if plugin else 'without'} the kv_capacity plugin"
        if progress:
            progress(label)
        run = run_vllm(args, python=python, timeout_s=timeout_s, plugin=plugin)
        rows.append({
            "plugin": plugin,
            "label": label,
            "kv_cache_memory_bytes": tight,
            "max_model_len": length,
            "outcome": run.outcome,
            "seconds_to_error": round(run.elapsed_s, 2) if run.outcome == "startup_error" else None,
            "error_type": run.error_type,
            "error": run.error,
            "weights_loaded_before_error": run.loaded_weights,
        })
    return rows



__all__ = ["Comparison", "SeedCase", "compare", "plan_for_run", "run_plugin_timing", "run_seed_cases", "seed_budgets",
           "settings_of_run"]
