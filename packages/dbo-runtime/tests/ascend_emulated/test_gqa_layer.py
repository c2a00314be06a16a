"""DBO on == DBO off, bit for bit, for a dense GQA attention + MLP stack through vllm-ascend's REAL attention path
(issue 27): two decoder layers, float32, a batch with a request cut in the middle and odd counts, in PrefillNoCache,
ChunkedPrefill and DecodeOnly, run whole and as two micro-batches by ``run_ubatches`` that hand over after each
layer's attention (where the o_proj all-reduce or FlashComm1's reduce-scatter would be).

Real: ``AscendAttentionMetadataBuilder`` (one per micro-batch, both built before either runs, as the runner does),
``AscendAttentionBackendImpl.forward`` (``_npu_reshape_and_cache`` into the paged cache, then
``npu_fused_infer_attention_score`` with the arguments ``_get_fia_params`` derives from the state),
``rope_forward_oot`` (vllm-ascend's rotary), this project's ``split_ubatches`` and ``split_common_attn_metadata``
(with the fault-2 state rule) and ``wrap_stream_site``. Emulated operators: RMSNorm, SwiGLU, rotary, KV write,
attention. STAND-IN: the linear layers (q/k/v, o, gate/up, down) are products computed one row at a time: torch's
CPU sgemm is not batch-invariant in the last bits of a row, which would compare GEMM blocking, not DBO (the
engine test and test_mla_layer.py take the real linears, against a measured bound). Weights, hidden states and
cached context are seeded random.

Existing tests do not cover this: test_attn_state_split.py checks the metadata only, test_emulated_ops.py the
backend without DBO, test_engine_dbo.py whole engines (Qwen3-MoE: GQA + MoE, within a logprob bound).
"""

from __future__ import annotations

import dataclasses

import _emu
import pytest
import torch
import torch_npu
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context

HIDDEN, HEADS, KV_HEADS, HEAD, INTER, LAYERS = 64, 4, 2, 16, 96, 2
PER_REQ = 3  # blocks per request


@pytest.fixture(scope="module")
def config():
    cfg = _emu.vllm_config()
    with set_current_vllm_config(cfg):
        yield cfg


def rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w one row at a time (the same computation for a row whatever the rows beside it)."""
    return torch.bmm(x.unsqueeze(1), w.expand(x.shape[0], *w.shape)).squeeze(1)


class Stack:
    """Two decoder layers: RMSNorm, q/k/v, rotary, vllm-ascend's attention, o; add+RMSNorm, SwiGLU MLP."""

    def __init__(self, num_blocks: int) -> None:
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl

        g = torch.Generator().manual_seed(3)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        self.layers = [dict(norm1=1 + 0.1 * torch.randn(HIDDEN, generator=g), wq=w(HIDDEN, HEADS * HEAD),
                            wk=w(HIDDEN, KV_HEADS * HEAD), wv=w(HIDDEN, KV_HEADS * HEAD), wo=w(HEADS * HEAD, HIDDEN),
                            norm2=1 + 0.1 * torch.randn(HIDDEN, generator=g), w13=w(HIDDEN, 2 * INTER),
                            w2=w(INTER, HIDDEN), kv=torch.zeros(2, num_blocks, _emu.BLOCK_SIZE, KV_HEADS, HEAD))
                       for _ in range(LAYERS)]
        self.impl = AscendAttentionBackendImpl(
            num_heads=HEADS, head_size=HEAD, scale=HEAD ** -0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None)
        base = 10000 ** (-torch.arange(0, HEAD, 2).float() / HEAD)
        freqs = torch.arange(512).float().unsqueeze(1) * base
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def fill_context(self, reqs: list[tuple[int, int, int]], seed: int) -> None:
        """Every layer's cache holds each request's computed tokens (as a previous step wrote them)."""
        g = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            layer["kv"].zero_()
            for rid, _, computed in reqs:
                for p in range(computed):
                    block, off = rid * PER_REQ + p // _emu.BLOCK_SIZE, p % _emu.BLOCK_SIZE
                    layer["kv"][:, block, off] = torch.randn(2, KV_HEADS, HEAD, generator=g)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, md, after_attention=lambda h: h) -> torch.Tensor:
        from vllm_ascend.ops.rotary_embedding import rope_forward_oot

        n = x.shape[0]
        attn_layer = type("Layer", (), {"_k_scale_float": 1.0, "_v_scale_float": 1.0,
                                        "layer_name": "model.layers.0.self_attn.attn"})
        for layer in self.layers:
            h, _ = torch_npu.npu_rms_norm(x, layer["norm1"], 1e-6)
            q, k, v = rowwise(h, layer["wq"]), rowwise(h, layer["wk"]), rowwise(h, layer["wv"])
            q, k = rope_forward_oot(positions, q, k, self.cos_sin, HEAD, HEAD, True)
            out = torch.zeros(n, HEADS, HEAD)
            self.impl.forward(attn_layer, q.view(n, HEADS, HEAD), k.view(n, KV_HEADS, HEAD),
                              v.view(n, KV_HEADS, HEAD), layer["kv"], md, out)
            attn = after_attention(rowwise(out.view(n, -1), layer["wo"]))
            h, _, x = torch_npu.npu_add_rms_norm(attn, x, layer["norm2"], 1e-6)
            x = x + rowwise(torch_npu.npu_swiglu(rowwise(h, layer["w13"])), layer["w2"])
        return x


# (request id, new tokens, computed tokens); request id picks its blocks (id * PER_REQ ...)
CASES = {
    # 5 + 6 + 3 fresh tokens: the cut at 7 leaves 2 of request 1's tokens in micro-batch 0, 4 in micro-batch 1
    "PrefillNoCache": [(0, 5, 0), (1, 6, 0), (2, 3, 0)],
    # decodes first, then prefills over cached context; 15 tokens, the cut at 7 falls inside request 2 (5 over 2)
    "ChunkedPrefill": [(0, 1, 7), (1, 1, 200), (2, 5, 2), (3, 1, 0), (4, 7, 130)],
    # 7 decodes (odd): 3 + 4, positions across block boundaries
    "DecodeOnly": [(0, 1, 5), (1, 1, 127), (2, 1, 128), (3, 1, 300), (4, 1, 1), (5, 1, 64), (6, 1, 33)],
}


def _metadata(reqs, state):
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    cm = _emu.common_metadata([q for _, q, _ in reqs], [c for _, _, c in reqs],
                              attn_state=AscendAttentionState[state], num_blocks_per_req=PER_REQ)
    assert [r for r, _, _ in reqs] == list(range(len(reqs)))  # _emu's block layout: request i owns i*PER_REQ...
    return cm


def _run(config, state: str, *, state_fix: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    from dbo_runtime.devices import get_backend
    from dbo_runtime.hooks import wrap_stream_site
    from dbo_runtime.ubatch import split_ubatches
    from dbo_runtime.vllm.split import split_common_attn_metadata
    from dbo_runtime.workers import run_ubatches
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder, AscendAttentionState

    reqs = CASES[state]
    stack = Stack(num_blocks=len(reqs) * PER_REQ)
    spec = FullAttentionSpec(block_size=_emu.BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    builders = [AscendAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], config,
                                               torch.device("npu:0")) for _ in range(2)]
    cm = _metadata(reqs, state)
    x = torch.randn(cm.num_actual_tokens, HIDDEN, generator=torch.Generator().manual_seed(11))

    with set_forward_context(None, config), torch.inference_mode():
        stack.fill_context(reqs, seed=5)
        whole = stack.forward(x, cm.positions, builders[0].build(common_prefix_len=0, common_attn_metadata=cm))

        stack.fill_context(reqs, seed=5)
        slices = split_ubatches([q for _, q, _ in reqs])
        halves = [split_common_attn_metadata(ub, cm) for ub in slices]
        if not state_fix:  # fault 2 as it was: every half keeps the batch's state
            halves = [dataclasses.replace(h, attn_state=cm.attn_state) for h in halves]
        mds = [b.build(common_prefix_len=0, common_attn_metadata=h) for b, h in zip(builders, halves, strict=True)]
        hand_over = wrap_stream_site("test.after_attention", lambda h: h)
        outs = run_ubatches([lambda i=i, ub=ub: stack.forward(x[ub.token_slice], halves[i].positions, mds[i],
                                                              hand_over)
                             for i, ub in enumerate(slices)], backend=get_backend("cpu"), timeout_s=60)
    states = [AscendAttentionState(md.attn_state).name for md in mds]
    return whole, torch.cat(outs), states


@pytest.mark.parametrize("state", list(CASES))
def test_dense_gqa_stack_split_by_dbo_equals_the_whole_batch_bit_for_bit(config, state: str) -> None:
    whole, split, states = _run(config, state)
    want = {"PrefillNoCache": ["PrefillNoCache", "ChunkedPrefill"]}.get(state, [state, state])
    assert states == want
    assert torch.equal(split, whole), float((split - whole).abs().max())


def test_without_the_state_fix_the_cut_fresh_prefill_differs(config) -> None:
    """The control: micro-batch 1 kept PrefillNoCache, so the cut request attends only to its own 4 tokens."""
    whole, split, states = _run(config, "PrefillNoCache", state_fix=False)
    assert states == ["PrefillNoCache", "PrefillNoCache"]
    assert float((split - whole).abs().max()) > 1e-2
