"""Fault 2 (issue 27): a fresh prefill cut in the middle of a request, through the REAL vllm-ascend metadata builder
and attention backend.

vllm-ascend's runner marks a batch ``PrefillNoCache`` when no request has computed tokens
(``NPUModelRunner._build_attn_state``); in that state ``AscendAttentionBackendImpl._get_fia_params`` hands the
kernel the current forward's key/value with KV lengths = query lengths and no block table. In micro-batch 1 the
request cut at the split point must also see micro-batch 0's part of it (written to the cache in the same layer
before), so micro-batch 1 needs a state that reads the cache, with KV length = the whole sequence.

Real here: ``AscendCommonAttentionMetadata``, ``AscendAttentionMetadataBuilder.build``,
``AscendAttentionBackendImpl._get_fia_params``, a ``VllmConfig`` under ``NPUPlatform``. The emulation only supplies
the "npu" device.
"""

from __future__ import annotations

import _emu  # noqa: F401  (import order)
import pytest
import torch
from dbo_runtime.ubatch import UBatchSlice
from dbo_runtime.vllm.split import split_common_attn_metadata
from vllm.config import set_current_vllm_config
from vllm_ascend.attention.attention_v1 import (
    AscendAttentionBackendImpl,
    AscendAttentionMetadataBuilder,
    AscendAttentionState,
)


@pytest.fixture(scope="module")
def config():
    cfg = _emu.vllm_config()
    with set_current_vllm_config(cfg):
        yield cfg


def _builder(config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=_emu.BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return AscendAttentionMetadataBuilder(spec, ["layers.0.attn"], config, torch.device("npu:0"))


def _impl(num_blocks: int):
    impl = AscendAttentionBackendImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
                                      sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                                      attn_type="decoder", kv_sharing_target_layer_name=None)
    cache = torch.zeros(2, num_blocks, _emu.BLOCK_SIZE, 2, 64)
    impl.key_cache, impl.value_cache = cache[0], cache[1]
    return impl


@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_the_second_half_of_a_cut_fresh_prefill_reads_the_cache(config, chunked_prefill: bool) -> None:
    # two fresh requests of 5 and 6 tokens, cut at token 8: request 1 has 3 tokens in each micro-batch
    cm = _emu.common_metadata([5, 6], [0, 0], attn_state=AscendAttentionState.PrefillNoCache)
    halves = [split_common_attn_metadata(ub, cm, chunked_prefill=chunked_prefill)
              for ub in (UBatchSlice(slice(0, 2), slice(0, 8)), UBatchSlice(slice(1, 2), slice(8, 11)))]
    builder, impl = _builder(config), _impl(num_blocks=8)
    md0, md1 = (builder.build(common_prefix_len=0, common_attn_metadata=h) for h in halves)

    # micro-batch 0 holds only fresh tokens: the runner's own state for it, attending to this forward's K/V
    assert md0.attn_state == AscendAttentionState.PrefillNoCache
    key = value = torch.zeros(8, 2, 64)
    _, _, _, block_table, kv_lens = impl._get_fia_params(key, value, md0)
    assert block_table is None and kv_lens == [5, 8]

    # micro-batch 1: request 1's last 3 tokens attend to all 6 of its tokens, through the cache
    want = AscendAttentionState.ChunkedPrefill if chunked_prefill else AscendAttentionState.PrefillCacheHit
    assert md1.attn_state == want
    _, _, _, block_table, kv_lens = impl._get_fia_params(key[:3], value[:3], md1)
    assert block_table is not None and block_table[0].tolist() == cm.block_table_tensor[1].tolist()
    assert list(kv_lens) == [6], f"micro-batch 1 attends to {kv_lens} tokens of request 1, not its 6"


def test_halves_of_a_batch_with_cache_keep_its_state(config) -> None:
    for state in (AscendAttentionState.ChunkedPrefill, AscendAttentionState.DecodeOnly,
                  AscendAttentionState.PrefillCacheHit):
        cm = _emu.common_metadata([3, 4, 5], [7, 1, 2], attn_state=state)
        for ub in (UBatchSlice(slice(0, 2), slice(0, 6)), UBatchSlice(slice(1, 3), slice(6, 12))):
            assert split_common_attn_metadata(ub, cm).attn_state == state


def test_a_fresh_batch_cut_between_requests_stays_prefill_no_cache(config) -> None:
    cm = _emu.common_metadata([4, 4], [0, 0], attn_state=AscendAttentionState.PrefillNoCache)
    second = split_common_attn_metadata(UBatchSlice(slice(1, 2), slice(4, 8)), cm)
    assert second.attn_state == AscendAttentionState.PrefillNoCache
    assert second.num_computed_tokens_cpu.tolist() == [0]
