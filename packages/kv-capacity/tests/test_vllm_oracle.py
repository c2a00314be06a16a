"""The planner against vLLM's own capacity code, for every bundled preset.

vLLM's `get_kv_cache_configs` runs in the vllm virtualenv (kv_capacity.testing.vllm_oracle) on the KV cache specs
vLLM would build for each preset; the planner must give the same blocks, tokens, concurrency and, when
the budget is too small, the same start-up error text. One subprocess evaluates every combination.
"""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest
from kv_capacity import KVCapacityInputError, load_model, plan, preset_names
from kv_capacity.model_spec import load_preset_config
from kv_capacity.verify import require_vllm_python

pytestmark = pytest.mark.vllm

TP_SIZES = (1, 2, 8)
BLOCK_SIZES = (16, 128)
KV_DTYPES = ("auto", "fp8")
BUDGETS = (256 << 20, 1 << 30, 3_000_000_007, 8 << 30, 8 * 10**9)
# (max_num_batched_tokens, async scheduling): vLLM's GPU default, and a synchronous large-batch one.
SCHEDULING = ((2048, True), (8192, False))


def _max_lengths(name: str) -> tuple[int, ...]:
    max_pos = load_model(name).max_position_embeddings or 32768
    return (4096, min(max_pos, 131072))


def _cases() -> list[dict]:
    cases = []
    for name in preset_names():
        config = {k: v for k, v in load_preset_config(name).items() if not k.startswith("_")}
        combos = itertools.product(TP_SIZES, KV_DTYPES, BLOCK_SIZES, _max_lengths(name))
        for index, (tp, dtype, block, length) in enumerate(combos):
            batched, async_sched = SCHEDULING[index % len(SCHEDULING)]
            cases.append(
                {
                    "id": f"{name}/tp{tp}/{dtype}/bs{block}/len{length}/mnbt{batched}{'a' if async_sched else 's'}",
                    "preset": name,
                    "config": config,
                    "tensor_parallel_size": tp,
                    "kv_cache_dtype": dtype,
                    "block_size": block,
                    "max_model_len": length,
                    "budgets": list(BUDGETS),
                    "max_num_batched_tokens": batched,
                    "async_scheduling": async_sched,
                }
            )
    return cases


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> tuple[list[dict], dict]:
    python = require_vllm_python()
    cases = _cases()
    folder = tmp_path_factory.mktemp("oracle")
    (folder / "cases.json").write_text(json.dumps({"cases": cases}))
    proc = subprocess.run(
        [python, "-m", "kv_capacity.testing.vllm_oracle", str(folder / "cases.json"), str(folder / "results.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"vllm_oracle failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return cases, json.loads((folder / "results.json").read_text())


def test_oracle_ran_on_vllm_0_32(oracle):
    cases, out = oracle
    assert out["vllm_version"].startswith("0.32")
    assert len(out["results"]) + len(out["failures"]) * len(BUDGETS) == len(cases) * len(BUDGETS)
    # Both outcomes must be exercised: budgets that fit and budgets vLLM refuses at start-up.
    assert any(r["error"] is None for r in out["results"])
    assert any(r["error"] and "max seq len" in r["error"] for r in out["results"])


def test_planner_matches_vllm_for_every_preset_and_setting(oracle):
    cases, out = oracle
    by_id = {c["id"]: c for c in cases}
    vllm_refused = {f["id"]: f["error"] for f in out["failures"]}
    mismatches: list[str] = []
    compared = 0
    for case in cases:
        spec = load_model(case["preset"])
        if case["id"] in vllm_refused:
            # vLLM refused the configuration itself (e.g. TP 8 with 28 attention heads): so must the planner.
            with pytest.raises(KVCapacityInputError, match="tensor parallel"):
                print(case["id"], vllm_refused[case["id"]])
                plan(spec, kv_cache_memory_bytes=1 << 30, max_model_len=case["max_model_len"],
                     tensor_parallel_size=case["tensor_parallel_size"])
    for row in out["results"]:
        case = by_id[row["id"]]
        result = plan(
            load_model(case["preset"]),
            kv_cache_memory_bytes=row["budget"],
            max_model_len=case["max_model_len"],
            block_size=case["block_size"],
            tensor_parallel_size=case["tensor_parallel_size"],
            kv_cache_dtype=case["kv_cache_dtype"],
            max_num_batched_tokens=case["max_num_batched_tokens"],
            max_concurrent_batches=2 if case["async_scheduling"] else 1,
        )
        compared += 1
        where = f"{row['id']} budget={row['budget']}"
        if row["error"] is not None:
            if result.fits:
                mismatches.append(f"{where}: vLLM refuses ({row['error'][:80]}...), planner says it fits")
            elif result.vllm_error_message != row["error"]:
                mismatches.append(f"{where}: error text differs\n  vLLM:    {row['error']}\n  planner: {result.vllm_error_message}")
            continue
        if not result.fits:
            mismatches.append(f"{where}: vLLM starts, planner says it does not fit")
        got = (result.num_blocks, result.kv_cache_tokens, result.max_concurrency, result.num_groups)
        want = (row["num_blocks"], row["kv_cache_tokens"], row["max_concurrency"], row["num_groups"])
        if got != want:
            mismatches.append(f"{where}: planner (blocks, tokens, concurrency, groups) {got} != vLLM {want}")
    assert compared >= 1000
    assert not mismatches, f"{len(mismatches)} of {compared} differ:\n" + "\n".join(mismatches[:30])
