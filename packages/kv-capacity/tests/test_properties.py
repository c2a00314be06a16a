"""Properties of the planner over every preset and a seeded random sample of settings."""

from __future__ import annotations

import random

import pytest
from kv_capacity import InsufficientKVCacheError, check, load_model, plan, preset_names, required_bytes

SEED = 20261130


def _settings(count: int):
    rng = random.Random(SEED)
    names = preset_names()
    for _ in range(count):
        name = rng.choice(names)
        spec = load_model(name)
        tp = rng.choice(
            [
                t
                for t in (1, 2, 4, 8)
                if spec.num_attention_heads % t == 0
                and (spec.is_mla or (spec.num_kv_heads % t == 0 or t % spec.num_kv_heads == 0))
            ]
        )
        yield (
            spec,
            dict(
                max_model_len=rng.choice([1, 100, 2048, 4096, 8192, 32768, 131072]) + rng.choice([0, 0, 7]),
                block_size=rng.choice([16, 32, 64, 128]),
                tensor_parallel_size=tp,
            ),
            int(2 ** rng.uniform(20, 36.5)),
        )  # 1 MiB .. ~90 GiB, log-uniform


@pytest.mark.parametrize("case", range(5))
def test_larger_budget_never_fewer_tokens(case):
    for spec, kw, budget in list(_settings(40))[case * 8 : case * 8 + 8]:
        budgets = sorted({budget, budget + 1, budget + 4096, budget * 2, budget // 2 + 1})
        tokens = [plan(spec, kv_cache_memory_bytes=b, **kw).kv_cache_tokens for b in budgets]
        assert tokens == sorted(tokens), (spec.name, kw, budgets, tokens)
        fits = [plan(spec, kv_cache_memory_bytes=b, **kw).fits for b in budgets]
        assert fits == sorted(fits)  # once it fits, more memory keeps fitting


def test_fp8_never_fewer_tokens_than_bf16():
    for spec, kw, budget in _settings(60):
        bf16 = plan(spec, kv_cache_memory_bytes=budget, kv_cache_dtype="bfloat16", **kw)
        for fp8_kind in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            fp8 = plan(spec, kv_cache_memory_bytes=budget, kv_cache_dtype=fp8_kind, **kw)
            assert fp8.kv_cache_tokens >= bf16.kv_cache_tokens
            assert fp8.bytes_per_token * 2 == bf16.bytes_per_token


def test_required_bytes_is_the_smallest_sufficient_budget():
    for spec, kw, _ in _settings(60):
        for concurrency in (1, 3):
            need = required_bytes(spec, concurrency=concurrency, **kw)
            enough = plan(spec, kv_cache_memory_bytes=need, **kw)
            short = plan(spec, kv_cache_memory_bytes=need - 1, **kw)
            # usable blocks = num_blocks - 1 (the null block)
            assert enough.fits and enough.num_blocks - 1 >= concurrency * enough.blocks_per_request
            assert enough.max_concurrency >= concurrency
            assert short.num_blocks - 1 < concurrency * short.blocks_per_request
            if concurrency == 1:
                assert need == enough.min_kv_cache_memory_bytes and not short.fits


def test_estimated_max_model_len_is_the_longest_that_fits():
    checked = 0
    for spec, kw, budget in _settings(80):
        result = plan(spec, kv_cache_memory_bytes=budget, **kw)
        if result.fits or result.estimated_max_model_len == 0:
            continue
        checked += 1
        estimate = result.estimated_max_model_len
        kw_at = dict(kw, max_model_len=estimate)
        assert plan(spec, kv_cache_memory_bytes=budget, **kw_at).fits
        kw_over = dict(kw, max_model_len=estimate + 1)
        assert not plan(spec, kv_cache_memory_bytes=budget, **kw_over).fits
    assert checked >= 5


def test_check_raises_exactly_when_plan_does_not_fit():
    for spec, kw, budget in _settings(40):
        result = plan(spec, kv_cache_memory_bytes=budget, **kw)
        if result.fits:
            assert check(spec, kv_cache_memory_bytes=budget, **kw) == result
            continue
        with pytest.raises(InsufficientKVCacheError) as info:
            check(spec, kv_cache_memory_bytes=budget, **kw)
        error = info.value
        assert error.vllm_message == result.vllm_error_message
        assert error.min_kv_cache_memory_bytes == result.min_kv_cache_memory_bytes
        assert str(error).startswith(error.vllm_message)
        assert f"{result.min_kv_cache_memory_bytes:,} bytes" in str(error)


def test_tensor_parallel_scaling():
    qwen = load_model("qwen3-8b")  # 8 KV heads: capacity per rank doubles up to TP 8
    tokens = [
        plan(
            qwen, kv_cache_memory_bytes=8 << 30, max_model_len=8192, block_size=16, tensor_parallel_size=t
        ).kv_cache_tokens
        for t in (1, 2, 4, 8)
    ]
    assert all(b >= 2 * a - 16 for a, b in zip(tokens, tokens[1:], strict=False))
    mla = load_model("deepseek-v2-lite")  # replicated latent: TP changes nothing per rank
    assert (
        len(
            {
                plan(
                    mla, kv_cache_memory_bytes=8 << 30, max_model_len=8192, tensor_parallel_size=t
                ).kv_cache_tokens
                for t in (1, 2, 4, 8)
            }
        )
        == 1
    )
