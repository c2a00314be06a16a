"""Fault 3 (issue 27): an MLA decode batch split in two keeps each micro-batch's rotary tables.

The real ``AscendMLAMetadataBuilder`` takes a decode batch's cos/sin from ``get_cos_and_sin_mla(positions,
use_cache=True)``: views of the process-global ``_cos_mla`` / ``_sin_mla``, written from row 0 for every build.
Building micro-batch 1 overwrote the rows micro-batch 0's views show.

Real: the MLA builder (vLLM's ``MLACommonMetadataBuilder`` under vllm-ascend's), ``set_cos_and_sin`` /
``_record_cos_and_sin_cache`` (the globals as the runner and the rope layer set them), a DeepSeek-V2 ``VllmConfig``
under ``NPUPlatform``, this project's ``split_common_attn_metadata`` and ``RunnerIntegration.own_metadata`` as
``AscendIntegration`` has it. STAND-IN: the attention layer in ``static_forward_context`` is an object with only
``prefill_backend`` (the one attribute the builder reads from it); the rope tables are random.
"""

from __future__ import annotations

from types import SimpleNamespace

import _emu  # noqa: F401  (import order)
import pytest
import torch
import vllm_ascend.ops.rotary_embedding as rope
from dbo_runtime.ascend.runner import own_rotary_tables
from dbo_runtime.ubatch import UBatchSlice
from dbo_runtime.vllm.split import split_common_attn_metadata
from vllm.config import set_current_vllm_config
from vllm_ascend.attention.attention_v1 import AscendAttentionState
from vllm_ascend.attention.mla_v1 import AscendMLAMetadataBuilder
from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec

LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def builder():
    cfg = _emu.vllm_config("deepseek_v2_moe")
    cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None)
    with set_current_vllm_config(cfg), _emu.distributed():
        rope_dim = cfg.model_config.hf_text_config.qk_rope_head_dim
        rope.set_cos_and_sin(cfg, 8, 1, torch.float32, torch.device("npu:0"))
        rope._record_cos_and_sin_cache(torch.randn(512, rope_dim), torch.randn(512, rope_dim))
        spec = AscendMLAAttentionSpec(block_size=_emu.BLOCK_SIZE, num_kv_heads=1, head_size=576,
                                      dtype=torch.float32)
        yield [AscendMLAMetadataBuilder(spec, [LAYER], cfg, torch.device("npu:0")) for _ in range(2)]


def _halves(builders, own):
    computed = [5, 9, 20, 33, 41]  # five decode requests: positions 5, 9, 20, 33, 41
    cm = _emu.common_metadata([1] * 5, computed, attn_state=AscendAttentionState.DecodeOnly)
    slices = (UBatchSlice(slice(0, 3), slice(0, 3)), UBatchSlice(slice(3, 5), slice(3, 5)))
    mds = []
    for builder, ub in zip(builders, slices, strict=True):
        md = builder.build(0, split_common_attn_metadata(ub, cm))
        mds.append(own(md))
    return mds, [computed[:3], computed[3:]]


def test_each_micro_batch_keeps_its_own_rotary_rows(builder) -> None:
    mds, positions = _halves(builder, own_rotary_tables)
    for md, pos in zip(mds, positions, strict=True):
        want = rope._cos_cache[torch.tensor(pos)].unsqueeze(1).unsqueeze(2)
        assert torch.equal(md.decode.cos, want), "a micro-batch's cos rows are another micro-batch's"
        assert torch.equal(md.decode.sin, rope._sin_cache[torch.tensor(pos)].unsqueeze(1).unsqueeze(2))


def test_without_own_tables_micro_batch_0_reads_micro_batch_1s_rows(builder) -> None:
    """The fault on the real builder: what own_rotary_tables prevents."""
    mds, positions = _halves(builder, lambda md: md)
    first = rope._cos_cache[torch.tensor(positions[0])].unsqueeze(1).unsqueeze(2)
    assert not torch.equal(mds[0].decode.cos, first)
    assert torch.equal(mds[0].decode.cos[:2], mds[1].decode.cos)
