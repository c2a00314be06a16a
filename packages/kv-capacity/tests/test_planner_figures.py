"""The worked figures of reference/kv_cache.md §5, recomputed here from the page-size formulas.

Each expected value is derived in the test from the model's shape (layers, KV heads, head size, dtype),
not copied, and then compared with the planner; the §5 figures are quoted in comments.
vLLM 0.32 plans the start-up check against the budget minus one block (the null block), which moves
the estimated maximum length a little below the v0.27.1 figures quoted in §5.
"""

from __future__ import annotations

import pytest
from kv_capacity import load_model, parse_size, plan

GiB = 1 << 30
BUDGET = 8 * GiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def full_attention_expectation(
    layers: int, kv_heads: int, head: int, dtype: int, block: int, budget: int, max_len: int
):
    page = block * kv_heads * 2 * head * dtype
    num_blocks = budget // (page * layers)
    per_request = cdiv(max_len, block)
    concurrency = num_blocks / per_request
    return num_blocks, int(concurrency * max_len), concurrency


@pytest.mark.parametrize(
    "model,layers,kv_heads,head,block,tp,max_len,blocks,tokens",
    [
        ("qwen3-8b", 36, 8, 128, 16, 1, 40960, 3640, 58240),  # §5: 3,640 blocks, 58,240 tokens, 1.42x
        ("qwen3-8b", 36, 8, 128, 128, 1, 40960, 455, 58240),  # §5: bs128 455 blocks
        ("qwen3-8b", 36, 8, 128, 16, 2, 40960, 7281, 116496),  # §5: TP2 7281 blocks, 116,496 tokens
        ("qwen3-8b", 36, 8, 128, 128, 2, 40960, 910, 116480),
        ("llama-3.1-8b", 32, 8, 128, 16, 1, 32768, 4096, 65536),  # §5: 4096 blocks, 65,536 tokens, 2.00x
        ("llama-3.1-8b", 32, 8, 128, 128, 1, 32768, 512, 65536),
        ("qwen2.5-7b", 28, 4, 128, 16, 1, 32768, 9362, 149792),  # §5: 9362 blocks, 149,792 tokens, 4.57x
        ("qwen2.5-7b", 28, 4, 128, 128, 1, 32768, 1170, 149760),
        ("qwen2.5-7b", 28, 4, 128, 16, 2, 32768, 18724, 299584),
        (
            "qwen2.5-7b",
            28,
            4,
            128,
            16,
            4,
            32768,
            37449,
            599184,
        ),  # §5 quotes these for TP8; vLLM needs TP | 28 heads
        (
            "qwen3-30b-a3b",
            48,
            4,
            128,
            16,
            8,
            32768,
            21845,
            349520,
        ),  # TP8 > 4 KV heads: one replicated head per rank
    ],
)
def test_full_attention_figures(model, layers, kv_heads, head, block, tp, max_len, blocks, tokens):
    spec = load_model(model)
    heads_per_rank = max(1, kv_heads // tp)
    exp_blocks, exp_tokens, exp_conc = full_attention_expectation(
        layers, heads_per_rank, head, 2, block, BUDGET, max_len
    )
    result = plan(
        spec, kv_cache_memory_bytes=BUDGET, max_model_len=max_len, block_size=block, tensor_parallel_size=tp
    )
    assert (result.num_blocks, result.kv_cache_tokens) == (exp_blocks, exp_tokens) == (blocks, tokens)
    assert result.max_concurrency == pytest.approx(exp_conc)
    assert result.page_size_bytes == [block * heads_per_rank * 2 * head * 2]
    assert result.bytes_per_token == layers * heads_per_rank * 2 * head * 2
    assert result.fits


def test_qwen3_8b_parse_size_and_concurrency():
    result = plan(
        load_model("qwen3-8b"), kv_cache_memory_bytes=parse_size("8G"), max_model_len=40960, block_size=16
    )
    assert f"{result.max_concurrency:.2f}" == "1.42"
    assert result.bytes_per_token == 36 * 2 * 8 * 128 * 2 == 147456


def test_fp8_halves_the_page():
    bf16 = plan(load_model("qwen3-8b"), kv_cache_memory_bytes=BUDGET, max_model_len=40960, block_size=16)
    fp8 = plan(
        load_model("qwen3-8b"),
        kv_cache_memory_bytes=BUDGET,
        max_model_len=40960,
        block_size=16,
        kv_cache_dtype="fp8",
    )
    assert fp8.page_size_bytes == [bf16.page_size_bytes[0] // 2] == [32768]
    assert (fp8.num_blocks, fp8.kv_cache_tokens) == (BUDGET // (32768 * 36), 7281 * 16) == (7281, 116496)


def test_deepseek_v2_lite_mla():
    spec = load_model("deepseek-v2-lite")
    latent = 512 + 64  # kv_lora_rank + qk_rope_head_dim, one replicated "head", no separate V
    for block, blocks, tokens in ((16, 17260, 276160), (64, 4315, 276160), (128, 2157, 276096)):
        page = block * latent * 2
        result = plan(spec, kv_cache_memory_bytes=BUDGET, max_model_len=163840, block_size=block)
        assert result.page_size_bytes == [page]
        assert result.num_blocks == BUDGET // (page * 27) == blocks
        assert result.kv_cache_tokens == int(blocks / cdiv(163840, block) * 163840) == tokens
        assert f"{result.max_concurrency:.2f}" == "1.69"
    # TP does not add MLA capacity: the latent cache is replicated on every rank.
    tp2 = plan(
        spec, kv_cache_memory_bytes=BUDGET, max_model_len=163840, block_size=16, tensor_parallel_size=2
    )
    assert tp2.kv_cache_tokens == 276160
    fp8 = plan(spec, kv_cache_memory_bytes=BUDGET, max_model_len=163840, block_size=64, kv_cache_dtype="fp8")
    assert (fp8.num_blocks, fp8.kv_cache_tokens) == (8630, 552320)  # §5: fp8 MLA bs64


def test_llama_at_128k_does_not_fit():
    spec = load_model("llama-3.1-8b")
    result = plan(spec, kv_cache_memory_bytes=BUDGET, max_model_len=131072, block_size=16)
    page_all_layers = 32 * 16 * 8 * 256 * 2  # bytes one block id takes over the 32 layers
    assert result.needed_bytes == page_all_layers * cdiv(131072, 16) == 16 * GiB
    assert not result.fits
    # The check plans against the budget minus the null block; the longest length that then fits:
    usable_blocks = (BUDGET - page_all_layers) // page_all_layers
    assert (
        result.estimated_max_model_len == usable_blocks * 16 == 65520
    )  # §5 (v0.27.1, no null block): 65,536
    message = result.vllm_error_message
    assert message is not None
    assert "max seq len (131072), (16.0 GiB KV cache is needed" in message
    assert "available KV cache memory (8.0 GiB)" in message
    assert "estimated maximum model length is 65520." in message
    assert result.min_kv_cache_memory_bytes == page_all_layers * (cdiv(131072, 16) + 1)


def test_hybrid_sliding_window_figures():
    # Mistral-7B-v0.1: all 32 layers SW 4096, in-flight 2 x 2048 -> cdiv(min(4095+4096, 32768), 16) + 1 = 513.
    mistral = plan(
        load_model("mistral-7b-v0.1"), kv_cache_memory_bytes=BUDGET, max_model_len=32768, block_size=16
    )
    assert mistral.num_blocks == 4096 and mistral.blocks_per_request == cdiv(4095 + 4096, 16) + 1 == 513
    assert mistral.kv_cache_tokens == int(4096 / 513 * 32768) == 261632
    h100 = plan(
        load_model("mistral-7b-v0.1"),
        kv_cache_memory_bytes=BUDGET,
        max_model_len=32768,
        block_size=16,
        max_num_batched_tokens=8192,
    )
    assert h100.kv_cache_tokens == int(4096 / (cdiv(4095 + 16384, 16) + 1) * 32768) == 104775
    # Gemma-2-9B: 21 SW + 21 full -> 2 groups of 21, page 16*8*512*2.
    gemma2 = plan(load_model("gemma-2-9b"), kv_cache_memory_bytes=BUDGET, max_model_len=8192, block_size=16)
    assert gemma2.num_groups == 2
    assert gemma2.num_blocks == BUDGET // (131072 * 21) == 3120
    assert gemma2.blocks_per_request == 512 + cdiv(min(4095 + 4096, 8192), 16) + 1 == 1025
    assert gemma2.kv_cache_tokens == int(3120 / 1025 * 8192) == 24935
    # Gemma-3-12B: 40 SW(1024) + 8 full -> group size 8, 6 groups.
    gemma3 = plan(load_model("gemma-3-12b"), kv_cache_memory_bytes=BUDGET, max_model_len=32768, block_size=16)
    assert gemma3.num_groups == 6 and gemma3.num_blocks == BUDGET // (131072 * 8) == 8192
    assert gemma3.blocks_per_request == 2048 + 5 * (cdiv(1023 + 4096, 16) + 1) == 3653
    assert gemma3.kv_cache_tokens == int(8192 / 3653 * 32768) == 73483
    at_128k = plan(
        load_model("gemma-3-12b"), kv_cache_memory_bytes=BUDGET, max_model_len=131072, block_size=16
    )
    assert not at_128k.fits


def test_hybrid_manager_disabled_caches_sliding_layers_in_full():
    # §5: Gemma-3-12B with --disable-hybrid-kv-cache-manager: one group of 48 full-size layers.
    spec = load_model("gemma-3-12b")
    result = plan(
        spec,
        kv_cache_memory_bytes=BUDGET,
        max_model_len=32768,
        block_size=16,
        disable_hybrid_kv_cache_manager=True,
    )
    page = 16 * 8 * 2 * 256 * 2
    assert result.num_groups == 1 and result.num_blocks == BUDGET // (page * 48) == 1365
    assert result.kv_cache_tokens == 1365 * 16 == 21840
    assert result.needed_bytes == 48 * page * cdiv(32768, 16) == 12 * GiB and not result.fits
    # An all-sliding model has nothing to unify: unchanged.
    mistral = load_model("mistral-7b-v0.1")
    kw = dict(kv_cache_memory_bytes=BUDGET, max_model_len=32768, block_size=16)
    assert plan(mistral, disable_hybrid_kv_cache_manager=True, **kw) == plan(mistral, **kw)


def test_log_line_spelling():
    result = plan(load_model("qwen3-8b"), kv_cache_memory_bytes=BUDGET, max_model_len=40960, block_size=16)
    assert (
        result.vllm_log_line
        == "GPU KV cache size: 58,240 tokens, Maximum concurrency for 40,960 tokens per request: 1.42x"
    )
    assert result.log_line("NPU").startswith("NPU KV cache size: 58,240 tokens")
