"""The emulated torch_npu / ``torch.ops._C_ascend`` operators (tests/ascend_emulation/torch_npu/ops.py,
_c_ascend_ops.py) against plain-torch references written here, independently: loops over requests, tokens, heads
and experts with ``torch.softmax`` and explicit masks, paged KV gathered through the block table one position at a
time. float32 unless a test says otherwise. Then the real vllm-ascend call sites over them: the attention backend's
``forward`` in each attention state, ``rope_forward_oot``, and the all-gather MoE path (``select_experts`` ->
``TokenDispatcherWithAllGather`` -> ``unified_apply_mlp`` -> ``token_combine``).
"""

from __future__ import annotations

import _emu  # noqa: F401  (import order)
import pytest
import torch
import torch_npu
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context

CAUSAL_TEMPLATE = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)  # vllm-ascend's splitfuse mask


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- references ---------------------------------------------------------------------------------------------------
def ref_gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens 0..length-1 of a request, one position at a time: block table_row[p // bs], offset p % bs."""
    bs = cache.shape[1]
    return torch.stack([cache[int(table_row[p // bs]), p % bs] for p in range(length)])


def ref_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [q_len, N, D], k/v [L, N_kv, D]; row i sees keys 0..L-q_len+i (bottom-right causal). Returns (out, lse)."""
    q_len, n = q.shape[0], q.shape[1]
    length, n_kv = k.shape[0], k.shape[1]
    group = n // n_kv
    out = torch.zeros(q_len, n, v.shape[-1])
    lse = torch.zeros(q_len, n)
    for h in range(n):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(q_len):
            last = length - q_len + i if causal else length - 1
            scores = (kh[:last + 1] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ vh[:last + 1]
            lse[i, h] = torch.logsumexp(scores, dim=0)
    return out, lse


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def ref_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a / (1 + torch.exp(-a)) * b


def ref_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
            ) -> torch.Tensor:
    """Per token, per chosen expert: w * (silu(x Wg) * (x Wu)) W2; w13 [E, H, 2I] (gate | up), w2 [E, I, H]."""
    inter = w2.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t] @ w13[e]
            out[t] += weights[t, j] * (ref_silu_mul(h[:inter], h[inter:]) @ w2[e])
    return out


def ref_topk_softmax(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = [], []
    for row in logits:
        p = torch.exp(row - row.max())
        p = p / p.sum()
        order = sorted(range(len(p)), key=lambda e: (-float(p[e]), e))[:k]
        sel = torch.stack([p[e] for e in order])
        w.append(sel / sel.sum() if renorm else sel)
        ids.append(order)
    return torch.stack(w), torch.tensor(ids, dtype=torch.int32)


def paged_case(spans: list[tuple[int, int]], block_size: int, n_kv: int = 2, d: int = 16, dv: int = 16):
    """Requests (computed, q_len) with KV already cached: a shuffled block table, random caches."""
    blocks_per = [-(-(c + q) // block_size) for c, q in spans]
    perm = torch.randperm(sum(blocks_per) + 3)
    table = torch.zeros(len(spans), max(blocks_per), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per):
        table[b, :nb] = perm[used:used + nb]
        used += nb
    num_blocks = int(perm.max()) + 1
    k_cache = torch.randn(num_blocks, block_size, n_kv, d)
    v_cache = torch.randn(num_blocks, block_size, n_kv, dv)
    return table, k_cache, v_cache


# -- KV cache write -----------------------------------------------------------------------------------------------
def test_reshape_and_cache_writes_each_slot_and_skips_negative_ones() -> None:
    kc, vc = torch.zeros(6, 16, 2, 8), torch.zeros(6, 16, 2, 8)
    slots = torch.tensor([0, 15, 16, 47, -1, 90, 33], dtype=torch.int32)  # crosses blocks; -1 is padding
    key, value = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    torch_npu._npu_reshape_and_cache(key=key, value=value, key_cache=kc, value_cache=vc, slot_indices=slots)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // 16, s % 16], want_v[s // 16, s % 16] = key[t], value[t]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


# -- fused infer attention ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spans,block_size,heads", [
    ([(0, 5), (37, 1), (20, 13), (3, 1)], 16, (4, 2)),          # chunked prefill: mixed decodes and prefills
    ([(250, 7), (0, 1), (129, 2)], 128, (4, 2)),                # a request spanning 3 blocks of 128
    ([(4, 1), (60, 1), (17, 1)], 16, (6, 3)),                   # decode only, odd counts
    ([(0, 9), (5, 4)], 16, (2, 2)),                             # no GQA
])
def test_fia_paged_tnd_causal_matches_reference(spans, block_size, heads) -> None:
    n, n_kv = heads
    table, kc, vc = paged_case(spans, block_size, n_kv=n_kv)
    q_lens = [q for _, q in spans]
    q = torch.randn(sum(q_lens), n, 16)
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    kv_lens = [c + q for c, q in spans]
    out, lse = torch_npu.npu_fused_infer_attention_score(
        query=q, key=kc.view(kc.shape[0], block_size, -1), value=vc.view(vc.shape[0], block_size, -1),
        atten_mask=CAUSAL_TEMPLATE, block_table=table, input_layout="TND", block_size=block_size,
        actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens, num_key_value_heads=n_kv, num_heads=n,
        scale=0.25, sparse_mode=3, softmax_lse_flag=True)
    start = 0
    for b, (end, kv_len) in enumerate(zip(ends, kv_lens, strict=True)):
        k, v = ref_gather(kc, table[b], kv_len), ref_gather(vc, table[b], kv_len)
        want, want_lse = ref_causal_attention(q[start:end], k, v, 0.25)
        torch.testing.assert_close(out[start:end], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[start:end, :, 0], want_lse, rtol=1e-5, atol=1e-5)
        start = end
    assert out.shape == q.shape and lse.shape == (q.shape[0], n, 1)


@pytest.mark.parametrize("q_lens,kv_lens", [([5, 1, 8], [5, 1, 8]), ([2, 3], [4, 6])])
def test_fia_tnd_without_block_table_takes_cumulative_kv_lengths(q_lens, kv_lens) -> None:
    q = torch.randn(sum(q_lens), 4, 8)
    k, v = torch.randn(sum(kv_lens), 2, 8), torch.randn(sum(kv_lens), 2, 8)
    q_ends, kv_ends = torch.tensor(q_lens).cumsum(0).tolist(), torch.tensor(kv_lens).cumsum(0).tolist()
    out, lse = torch_npu.npu_fused_infer_attention_score(
        query=q, key=k, value=v, atten_mask=CAUSAL_TEMPLATE, block_table=None, input_layout="TND",
        block_size=128, actual_seq_lengths=q_ends, actual_seq_lengths_kv=kv_ends, num_key_value_heads=2,
        num_heads=4, scale=0.3, sparse_mode=3)
    assert lse.shape == (1,) and float(lse[0]) == 0.0  # softmax_lse_flag False
    qs = ks = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        want, _ = ref_causal_attention(q[qs:qs + ql], k[ks:ks + kl], v[ks:ks + kl], 0.3)
        torch.testing.assert_close(out[qs:qs + ql], want, rtol=1e-5, atol=1e-5)
        qs, ks = qs + ql, ks + kl


def test_fia_bf16_is_close_to_the_float32_reference() -> None:
    spans = [(30, 3), (0, 5)]
    table, kc, vc = paged_case(spans, 16)
    q = torch.randn(8, 4, 16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query=q.bfloat16(), key=kc.bfloat16().view(kc.shape[0], 16, -1), value=vc.bfloat16().view(vc.shape[0], 16, -1),
        atten_mask=CAUSAL_TEMPLATE, block_table=table, input_layout="TND", block_size=16,
        actual_seq_lengths=[3, 8], actual_seq_lengths_kv=[33, 5], num_key_value_heads=2, num_heads=4,
        scale=0.25, sparse_mode=3)
    assert out.dtype == torch.bfloat16
    want = torch.cat([ref_causal_attention(q[:3], ref_gather(kc, table[0], 33), ref_gather(vc, table[0], 33), 0.25)[0],
                      ref_causal_attention(q[3:], ref_gather(kc, table[1], 5), ref_gather(vc, table[1], 5), 0.25)[0]])
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)


def test_paged_attention_decode_matches_reference() -> None:
    spans = [(40, 1), (0, 1), (16, 1), (129, 1)]
    table, kc, vc = paged_case(spans, 16, n_kv=2, d=8, dv=8)
    q = torch.randn(4, 6, 8)
    out = torch.empty(4, 6, 8)
    lens = torch.tensor([c + 1 for c, _ in spans], dtype=torch.int32)
    torch_npu._npu_paged_attention(query=q, key_cache=kc, value_cache=vc, num_kv_heads=2, num_heads=6,
                                   scale_value=0.5, block_table=table, context_lens=lens, out=out)
    for b, kv_len in enumerate(lens.tolist()):
        want, _ = ref_causal_attention(q[b:b + 1], ref_gather(kc, table[b], kv_len), ref_gather(vc, table[b], kv_len),
                                       0.5)
        torch.testing.assert_close(out[b:b + 1], want, rtol=1e-5, atol=1e-5)


# -- rotary ---------------------------------------------------------------------------------------------------------
def ref_rope(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, head_size: int, neox: bool
             ) -> torch.Tensor:
    rot = cache.shape[1]
    half = rot // 2
    out = x.clone().view(x.shape[0], -1, head_size)
    src = x.view(x.shape[0], -1, head_size)
    for t in range(x.shape[0]):
        c, s = cache[positions[t], :half], cache[positions[t], half:]
        for i in range(half):
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            out[t, :, a] = src[t, :, a] * c[i] - src[t, :, b] * s[i]
            out[t, :, b] = src[t, :, b] * c[i] + src[t, :, a] * s[i]
    return out.view_as(x)


def rope_cache(max_pos: int, rot: int) -> torch.Tensor:
    theta = torch.rand(max_pos, rot // 2) * 6.28
    return torch.cat([torch.cos(theta), torch.sin(theta)], dim=-1)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_rotates_query_and_key_in_place(neox: bool) -> None:
    cache, pos = rope_cache(64, 16), torch.tensor([0, 5, 63, 7, 7])
    q, k = torch.randn(5, 3 * 16), torch.randn(5, 1 * 16)
    want_q, want_k = ref_rope(q, pos, cache, 16, neox), ref_rope(k, pos, cache, 16, neox)
    assert torch_npu._npu_rotary_embedding(pos, q, k, 16, cache, neox) is None
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_vllm_ascend_rope_forward_oot_over_the_emulation(rotary_dim: int) -> None:
    from vllm_ascend.ops.rotary_embedding import rope_forward_oot

    cache, pos = rope_cache(40, rotary_dim), torch.tensor([3, 0, 39])
    q, k = torch.randn(3, 4 * 32), torch.randn(3, 2 * 32)
    got_q, got_k = rope_forward_oot(pos, q.clone(), k.clone(), cache, 32, rotary_dim, True)
    torch.testing.assert_close(got_q, ref_rope(q, pos, cache, 32, True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_rope(k, pos, cache, 32, True), rtol=1e-5, atol=1e-5)


# -- norms and activations ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_and_add_rms_norm(dtype, tol) -> None:
    x, r, w = torch.randn(7, 3, 32), torch.randn(7, 3, 32), torch.randn(32)
    y, rstd = torch_npu.npu_rms_norm(x.to(dtype), w.to(dtype), epsilon=1e-5)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (7, 3, 1)
    torch.testing.assert_close(y.float(), ref_rms(x.to(dtype).float(), w.to(dtype).float(), 1e-5), rtol=tol, atol=tol)
    y2, rstd2, total = torch_npu.npu_add_rms_norm(x.to(dtype), r.to(dtype), w.to(dtype), 1e-5)
    s = x.to(dtype).float() + r.to(dtype).float()
    torch.testing.assert_close(total.float(), s, rtol=tol, atol=tol)
    torch.testing.assert_close(y2.float(), ref_rms(s, w.to(dtype).float(), 1e-5), rtol=tol, atol=tol)
    torch.testing.assert_close(rstd2[..., 0], 1 / torch.sqrt((s * s).mean(-1) + 1e-5), rtol=1e-4, atol=1e-4)


def test_swiglu_halves_along_dim() -> None:
    x = torch.randn(5, 12)
    torch.testing.assert_close(torch_npu.npu_swiglu(x), ref_silu_mul(x[:, :6], x[:, 6:]))
    odd = torch.randn(6, 7)
    torch.testing.assert_close(torch_npu.npu_swiglu(odd, dim=0), ref_silu_mul(odd[:3], odd[3:]))


# -- MoE: gating --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (7, 16, 4), (13, 6, 1)])
def test_moe_gating_top_k_softmax_renorm(tokens, experts, k) -> None:
    logits = torch.randn(tokens, experts)
    y, ids, out = torch.ops._C_ascend.moe_gating_top_k(
        logits, k=k, k_group=1, group_count=1, group_select_mode=1, renorm=1, norm_type=0, out_flag=False,
        routed_scaling_factor=1.0, eps=1e-20, bias_opt=None)
    want_w, want_ids = ref_topk_softmax(logits, k, renorm=True)
    assert ids.dtype == torch.int32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(y, want_w)
    torch.testing.assert_close(out, torch.softmax(logits, dim=-1))


@pytest.mark.parametrize("group_select_mode", [0, 1])
def test_moe_gating_top_k_groups_sigmoid_bias_scaling(group_select_mode: int) -> None:
    logits, bias = torch.randn(5, 12), torch.randn(12) * 0.1
    y, ids, _ = torch.ops._C_ascend.moe_gating_top_k(
        logits, k=2, k_group=2, group_count=4, group_select_mode=group_select_mode, renorm=0, norm_type=1,
        out_flag=True, routed_scaling_factor=2.5, eps=1e-20, bias_opt=bias)
    for t in range(5):
        p = 1 / (1 + torch.exp(-logits[t]))
        sel = p + bias
        groups = [sel[g * 3:(g + 1) * 3] for g in range(4)]
        score = [float(g.max()) if group_select_mode == 0 else float(g.sort(descending=True).values[:2].sum())
                 for g in groups]
        kept = sorted(range(4), key=lambda g: (-score[g], g))[:2]
        cand = [e for e in range(12) if e // 3 in kept]
        top = sorted(cand, key=lambda e: (-float(sel[e]), e))[:2]
        w = torch.stack([p[e] for e in top])
        assert ids[t].tolist() == top
        torch.testing.assert_close(y[t], w / w.sum() * 2.5)


# -- MoE: routing, grouped matmul, permute / unpermute -------------------------------------------------------------
def ref_init_routing(x, ids, start, end):
    k = ids.shape[1]
    flat = ids.reshape(-1).tolist()
    entries = sorted((e, i) for i, e in enumerate(flat) if start <= e < end)
    expanded = torch.zeros(ids.numel(), x.shape[1])
    gather_idx = [-1] * len(flat)
    scatter_idx = [-1] * len(flat)
    counts = [0] * (end - start)
    for j, (e, i) in enumerate(entries):
        expanded[j] = x[i // k]
        gather_idx[i] = j
        scatter_idx[j] = i
        counts[e - start] += 1
    return expanded, gather_idx, scatter_idx, counts


@pytest.mark.parametrize("tokens,experts,k,expert_range", [(7, 8, 2, (0, 8)), (9, 12, 3, (4, 8)), (1, 4, 4, (0, 4))])
def test_npu_moe_init_routing_custom(tokens, experts, k, expert_range) -> None:
    x = torch.randn(tokens, 10)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)]).to(torch.int32)
    start, end = expert_range
    want_x, gather_idx, scatter_idx, counts = ref_init_routing(x, ids, start, end)
    scale = torch.rand(tokens)
    for row_idx_type, want_idx in ((0, gather_idx), (1, scatter_idx)):
        ex, row_idx, tok, ex_scale = torch.ops._C_ascend.npu_moe_init_routing_custom(
            x, ids, scale=scale, active_num=tokens * k, expert_num=experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[start, end], quant_mode=-1, row_idx_type=row_idx_type)
        assert torch.equal(ex, want_x) and row_idx.tolist() == want_idx and tok.tolist() == counts
        assert row_idx.dtype == torch.int32 and tok.dtype == torch.int64
        n = sum(counts)
        assert ex_scale[:n].tolist() == [float(scale[i // k]) for i in scatter_idx[:n]]
    _, _, cumsum, _ = torch.ops._C_ascend.npu_moe_init_routing_custom(
        x, ids, active_num=tokens * k, expert_num=experts, expert_tokens_num_type=0, expert_tokens_num_flag=True,
        active_expert_range=[start, end], quant_mode=-1)
    assert cumsum.tolist() == torch.tensor(counts).cumsum(0).tolist()
    _, _, pairs, _ = torch.ops._C_ascend.npu_moe_init_routing_custom(
        x, ids, active_num=tokens * k, expert_num=experts, expert_tokens_num_type=2, expert_tokens_num_flag=True,
        active_expert_range=[start, end], quant_mode=-1)
    nonempty = [[start + e, c] for e, c in enumerate(counts) if c]
    assert pairs.shape == (experts, 2) and pairs[:len(nonempty)].tolist() == nonempty
    assert not pairs[len(nonempty):].any()


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_groups_rows_by_expert(group_list_type: int) -> None:
    counts = [3, 0, 5, 1]
    x, w, bias = torch.randn(11, 6), torch.randn(4, 6, 5), torch.randn(4, 5)  # 2 trailing rows in no group
    gl = torch.tensor(counts).cumsum(0) if group_list_type == 0 else torch.tensor(counts)
    (y,) = torch_npu.npu_grouped_matmul(x=[x], weight=[w], bias=[bias], split_item=2, group_list_type=group_list_type,
                                        group_type=0, group_list=gl)
    (y_list,) = torch_npu.npu_grouped_matmul([x], list(w.unbind(0)), split_item=3, group_type=0,
                                             group_list=gl, group_list_type=group_list_type)
    row = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            torch.testing.assert_close(y[row], x[row] @ w[e] + bias[e])
            torch.testing.assert_close(y_list[row], x[row] @ w[e])
            row += 1
    assert not y[row:].any()


def test_token_permute_unpermute_follow_the_torch_npu_doc_example() -> None:
    tokens = torch.tensor([[1, 1, 1], [2, 2, 2], [3, 3, 3], [0, 0, 0]], dtype=torch.float32)
    indices = torch.tensor([[0, 4], [4, 3], [4, 2], [1, 1]])
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices, indices.numel())
    # the permuted rows of the npu_moe_token_unpermute doc example, grouped by expert 0,1,1,2,3,4,4,4
    assert permuted[:, 0].tolist() == [1, 0, 0, 3, 2, 1, 2, 3]
    assert sorted_indices.dtype == torch.int32
    for i, row in enumerate(sorted_indices.tolist()):
        assert torch.equal(permuted[row], tokens[i // 2])
    back = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.full((4, 2), 0.5))
    assert torch.equal(back, tokens)


def test_token_unpermute_weights_each_copy() -> None:
    permuted, probs = torch.randn(10, 4), torch.rand(5, 2)
    idx = torch.randperm(10).to(torch.int32)
    out = torch_npu.npu_moe_token_unpermute(permuted_tokens=permuted, sorted_indices=idx, probs=probs)
    for t in range(5):
        torch.testing.assert_close(out[t], probs[t, 0] * permuted[idx[2 * t]] + probs[t, 1] * permuted[idx[2 * t + 1]])
    torch.testing.assert_close(torch_npu.npu_moe_token_unpermute(permuted, idx), permuted[idx.long()])


def test_all_to_all_dispatcher_op_sequence_on_one_rank() -> None:
    """TokenDispatcherWithAll2AllV's operator sequence (token_dispatcher.py: _dispatch_preprocess,
    _dispatch_postprocess with 2 local experts, unquant_apply_mlp, _combine_preprocess, _combine_postprocess),
    the all-to-all being the identity on one rank."""
    tokens, hidden, inter, experts, k = 9, 8, 6, 2, 2
    x = torch.randn(tokens, hidden)
    weights, ids = ref_topk_softmax(torch.randn(tokens, experts), k, renorm=True)
    w13, w2 = torch.randn(experts, hidden, 2 * inter) * 0.3, torch.randn(experts, inter, hidden) * 0.3
    local, rev_local = torch_npu.npu_moe_token_permute(tokens=x, indices=ids, num_out_tokens=ids.numel())
    per_expert = torch.bincount(ids.reshape(-1).long(), minlength=experts)
    local_expert_of_row = torch.repeat_interleave(torch.arange(experts, dtype=torch.int32), per_expert)
    glob, rev_glob = torch_npu.npu_moe_token_permute(local, local_expert_of_row)
    h = torch_npu.npu_grouped_matmul(x=[glob], weight=[w13], split_item=2, group_list_type=1, group_type=0,
                                     group_list=per_expert)[0]
    h = torch_npu.npu_grouped_matmul(x=[torch_npu.npu_swiglu(h)], weight=[w2], split_item=2, group_list_type=1,
                                     group_type=0, group_list=per_expert)[0]
    h = torch_npu.npu_moe_token_unpermute(h, rev_glob)
    out = torch_npu.npu_moe_token_unpermute(permuted_tokens=h, sorted_indices=rev_local.to(torch.int32),
                                            probs=weights, restore_shape=x.shape)
    torch.testing.assert_close(out, ref_moe(x, weights, ids, w13, w2), rtol=1e-4, atol=1e-5)


def test_all_gather_expert_parallel_ops_drop_other_ranks_experts() -> None:
    """TokenDispatcherWithAllGather with an expert map (rank 1 of 2 owning experts 4..7): routing keeps the local
    range, the weights of other ranks' experts are zeroed, the combine reads abs(expanded_row_idx)."""
    tokens, hidden, inter, k = 6, 8, 4, 2
    x = torch.randn(tokens, hidden)
    weights, ids = ref_topk_softmax(torch.randn(tokens, 8), k, renorm=True)
    w13, w2 = torch.randn(4, hidden, 2 * inter) * 0.3, torch.randn(4, inter, hidden) * 0.3
    ex, row_idx, counts, _ = torch.ops._C_ascend.npu_moe_init_routing_custom(
        x, ids, scale=None, active_num=tokens * k, expert_num=8, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[4, 8], quant_mode=-1)
    h = torch_npu.npu_grouped_matmul(x=[ex], weight=[w13], split_item=2, group_list_type=1, group_type=0,
                                     group_list=counts)[0]
    h = torch_npu.npu_grouped_matmul(x=[torch_npu.npu_swiglu(h)], weight=[w2], split_item=2, group_list_type=1,
                                     group_type=0, group_list=counts)[0]
    local_weights = weights * (ids >= 4)
    out = torch_npu.npu_moe_token_unpermute(permuted_tokens=h, sorted_indices=torch.abs(row_idx),
                                            probs=local_weights)
    want = ref_moe(x, local_weights, torch.where(ids >= 4, ids - 4, 0), w13, w2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


# -- MLA (DeepSeek) ------------------------------------------------------------------------------------------------
def ref_interleave_rope_row(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One D-vector: pairs (x[2i], x[2i+1]) become (q[i], q[i + D/2]), then q*cos + rotate_half(q)*sin elementwise."""
    half = x.shape[0] // 2
    q = torch.empty_like(x)
    for i in range(half):
        q[i], q[i + half] = x[2 * i], x[2 * i + 1]
    out = torch.empty_like(x)
    for i in range(half):
        out[i] = q[i] * cos[i] - q[i + half] * sin[i]
        out[i + half] = q[i + half] * cos[i + half] + q[i] * sin[i + half]
    return out


def rope_tables(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, 1, d]`` as vllm-ascend's MLA tables hold them: the d/2 frequencies repeated twice."""
    freqs = positions.float().unsqueeze(1) / (10000 ** (torch.arange(d // 2).float() / (d // 2)))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().view(-1, 1, 1, d), emb.sin().view(-1, 1, 1, d)


def test_interleave_rope_deinterleaves_then_rotates_half() -> None:
    x = torch.randn(5, 3, 1, 16)
    cos, sin = rope_tables(torch.tensor([0, 3, 7, 11, 200]), 16)
    out = torch_npu.npu_interleave_rope(x, cos, sin)
    for b in range(5):
        for n in range(3):
            torch.testing.assert_close(out[b, n, 0], ref_interleave_rope_row(x[b, n, 0], cos[b, 0, 0], sin[b, 0, 0]),
                                       rtol=1e-6, atol=1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize("is_output_kv", [False, True])
def test_kv_rmsnorm_rope_cache_writes_normed_latent_and_rotated_key(is_output_kv: bool) -> None:
    rms, rope, bs = 32, 16, 8
    kv = torch.randn(6, 1, 1, rms + rope)
    gamma = torch.rand(rms) + 0.5
    cos, sin = rope_tables(torch.tensor([4, 9, 0, 17, 30, 2]), rope)
    slots = torch.tensor([3, 8, 15, 33, 20, 0])  # crosses blocks
    k_cache, ckv_cache = torch.zeros(5, bs, 1, rope), torch.zeros(5, bs, 1, rms)
    kc, ckv, k_rope, c_kv = torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, k_cache, ckv_cache,
                                                                epsilon=1e-6, cache_mode="PA",
                                                                is_output_kv=is_output_kv)
    assert kc is k_cache and ckv is ckv_cache
    want_k, want_c = torch.zeros_like(k_cache), torch.zeros_like(ckv_cache)
    for t, slot in enumerate(slots.tolist()):
        latent, r = kv[t, 0, 0, :rms], kv[t, 0, 0, rms:]
        want_c[slot // bs, slot % bs, 0] = ref_rms(latent, gamma, 1e-6)
        want_k[slot // bs, slot % bs, 0] = ref_interleave_rope_row(r, cos[t, 0, 0], sin[t, 0, 0])
    torch.testing.assert_close(ckv_cache, want_c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_cache, want_k, rtol=1e-5, atol=1e-6)
    assert k_rope.shape == (6, 1, 1, rope) and c_kv.shape == (6, 1, 1, rms)
    if is_output_kv:
        torch.testing.assert_close(c_kv[:, 0, 0], torch.stack([want_c[s // bs, s % bs, 0] for s in slots.tolist()]))
        torch.testing.assert_close(k_rope[:, 0, 0], torch.stack([want_k[s // bs, s % bs, 0] for s in slots.tolist()]))


def ref_mla_attention(q: torch.Tensor, q_rope: torch.Tensor, k: torch.Tensor, k_rope: torch.Tensor,
                      v: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [q_len, N, D], q_rope [q_len, N, R], k [L, N_kv, D], k_rope [L, N_kv, R], v [L, N_kv, V]; score of a key:
    scale * (q.k + q_rope.k_rope); bottom-right causal when ``causal``."""
    q_len, n = q.shape[0], q.shape[1]
    length, n_kv = k.shape[0], k.shape[1]
    out, lse = torch.zeros(q_len, n, v.shape[-1]), torch.zeros(q_len, n)
    for h in range(n):
        g = h * n_kv // n
        for i in range(q_len):
            last = length - q_len + i if causal else length - 1
            scores = torch.stack([(q[i, h] @ k[j, g] + q_rope[i, h] @ k_rope[j, g]) * scale for j in range(last + 1)])
            out[i, h] = torch.softmax(scores, dim=0) @ v[:last + 1, g]
            lse[i, h] = torch.logsumexp(scores, dim=0)
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
def test_fia_mla_tnd_with_query_rope_and_key_rope(causal: bool) -> None:
    """_forward_prefill (sparse_mode 3, KV = this forward's tokens) and _compute_prefill_context (sparse_mode 0,
    no mask, KV = a chunk of cached context) call forms."""
    n, d, r, dv = 4, 16, 8, 12
    q_lens, kv_lens = ([3, 1, 5], [3, 1, 5]) if causal else ([3, 1, 5], [7, 2, 4])
    q, q_rope = torch.randn(sum(q_lens), n, d), torch.randn(sum(q_lens), n, r)
    k, k_rope, v = torch.randn(sum(kv_lens), n, d), torch.randn(sum(kv_lens), n, r), torch.randn(sum(kv_lens), n, dv)
    ends, kv_ends = torch.tensor(q_lens).cumsum(0).tolist(), torch.tensor(kv_lens).cumsum(0).tolist()
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k, v, query_rope=q_rope, key_rope=k_rope, num_heads=n, num_key_value_heads=n, input_layout="TND",
        atten_mask=CAUSAL_TEMPLATE if causal else None, sparse_mode=3 if causal else 0, scale=0.3,
        antiquant_mode=0, antiquant_scale=None, softmax_lse_flag=True, actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv_ends)
    qs = ks = 0
    for qe, ke in zip(ends, kv_ends, strict=True):
        want, want_lse = ref_mla_attention(q[qs:qe], q_rope[qs:qe], k[ks:ke], k_rope[ks:ke], v[ks:ke], 0.3, causal)
        torch.testing.assert_close(out[qs:qe], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[qs:qe, :, 0], want_lse, rtol=1e-5, atol=1e-5)
        qs, ks = qe, ke
    assert out.shape == (sum(q_lens), n, dv)


def test_fia_v2_mla_decode_over_the_paged_latent_cache() -> None:
    """_forward_decode's call: BNSD_NBSD, key = value = the latent cache viewed [blocks, 1, block_size, D]."""
    n, d, r, bs = 4, 32, 8, 16
    spans = [(37, 1), (4, 1), (16, 1), (60, 1)]
    table, lat, rope_c = paged_case(spans, bs, n_kv=1, d=d, dv=r)
    kv_lens = [c + q for c, q in spans]
    q, q_rope = torch.randn(len(spans), n, 1, d), torch.randn(len(spans), n, 1, r)
    k_nope = lat.view(-1, 1, bs, d)  # the cache's memory viewed as mla_v1 does (N_kv = 1)
    k_pe = rope_c.view(-1, 1, bs, r)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        q, k_nope, k_nope, query_rope=q_rope, key_rope=k_pe, num_query_heads=n, num_key_value_heads=1,
        input_layout="BNSD_NBSD", atten_mask=None, sparse_mode=0, softmax_scale=0.2, block_table=table,
        block_size=bs, actual_seq_qlen=None, actual_seq_kvlen=kv_lens)
    assert out.shape == (n, len(spans), 1, d)
    for b, kv_len in enumerate(kv_lens):
        k, kr = ref_gather(lat, table[b], kv_len), ref_gather(rope_c, table[b], kv_len)
        want, _ = ref_mla_attention(q[b, :, 0].unsqueeze(0), q_rope[b, :, 0].unsqueeze(0), k, kr, k, 0.2, False)
        torch.testing.assert_close(out[:, b, 0], want[0], rtol=1e-5, atol=1e-5)


def test_transpose_batchmatmul_is_a_batched_matmul_then_transpose() -> None:
    x, w = torch.randn(4, 5, 8), torch.randn(4, 8, 6)  # (N, B, L) x (N, L, V) as _v_up_proj
    y = torch_npu.npu_transpose_batchmatmul(x, w, perm_y=(1, 0, 2))
    assert y.shape == (5, 4, 6)
    for b in range(5):
        for h in range(4):
            torch.testing.assert_close(y[b, h], x[h, b] @ w[h], rtol=1e-5, atol=1e-5)


def test_attention_update_merges_chunks_into_the_whole_attention() -> None:
    """Attention over KV split in three chunks, merged by lse, equals attention over all of it."""
    q, k, v = torch.randn(3, 2, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    parts = [ref_causal_attention(q, k[a:b], v[a:b], 0.35, causal=False) for a, b in ((0, 4), (4, 5), (5, 11))]
    out, lse = torch_npu.npu_attention_update([p[1].reshape(-1) for p in parts],
                                              [p[0].reshape(6, 8) for p in parts], 0)
    want, want_lse = ref_causal_attention(q, k, v, 0.35, causal=False)
    torch.testing.assert_close(out.view(3, 2, 8), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.view(3, 2), want_lse, rtol=1e-5, atol=1e-5)


def test_paged_cache_load_gathers_each_requests_tokens_from_its_start() -> None:
    bs = 8
    table, kc, vc = paged_case([(20, 1), (9, 1), (30, 1)], bs, n_kv=1, d=16, dv=4)
    lens, starts = torch.tensor([16, 3, 8], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    key, value = torch.empty(27, 1, 16), torch.empty(27, 1, 4, dtype=torch.bfloat16)
    k, v = torch_npu.atb.npu_paged_cache_load(kc, vc, table, lens, seq_starts=starts, key=key, value=value)
    assert k is key and v is value
    rows_k, rows_v = [], []
    for b in range(3):
        for p in range(int(starts[b]), int(starts[b]) + int(lens[b])):
            rows_k.append(kc[int(table[b, p // bs]), p % bs])
            rows_v.append(vc[int(table[b, p // bs]), p % bs])
    assert torch.equal(key, torch.stack(rows_k)) and torch.equal(value, torch.stack(rows_v).to(torch.bfloat16))


def test_format_cast_to_nd_is_the_tensor_itself() -> None:
    w = torch.randn(4, 4)
    assert torch_npu.npu_format_cast(w, 2) is w
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_format_cast.*acl_format=29"):
        torch_npu.npu_format_cast(w, 29)


def test_mla_operators_refuse_what_the_dbo_paths_do_not_pass() -> None:
    z = torch.zeros
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_fused_infer_attention_score_v2.*input_layout"):
        torch_npu.npu_fused_infer_attention_score_v2(z(1, 4, 8), z(1, 1, 8), z(1, 1, 8), query_rope=z(1, 4, 4),
                                                     key_rope=z(1, 1, 4), input_layout="TND_NTD", sparse_mode=3)
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_fused_infer_attention_score_v2.*dequant_scale_query"):
        torch_npu.npu_fused_infer_attention_score_v2(z(1, 4, 1, 8), z(1, 1, 16, 8), z(1, 1, 16, 8),
                                                     dequant_scale_query=z(1), input_layout="BNSD_NBSD")
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_kv_rmsnorm_rope_cache.*cache_mode='PA_NZ'"):
        torch_npu.npu_kv_rmsnorm_rope_cache(z(1, 1, 1, 12), z(8), z(1, 1, 1, 4), z(1, 1, 1, 4),
                                            torch.tensor([0]), z(1, 16, 1, 4), z(1, 16, 1, 8), cache_mode="PA_NZ")
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_kv_rmsnorm_rope_cache.*c_kv_scale"):
        torch_npu.npu_kv_rmsnorm_rope_cache(z(1, 1, 1, 12), z(8), z(1, 1, 1, 4), z(1, 1, 1, 4),
                                            torch.tensor([0]), z(1, 16, 1, 4), z(1, 16, 1, 8), c_kv_scale=z(8),
                                            cache_mode="PA")
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_fused_infer_attention_score.*block_table"):
        torch_npu.npu_fused_infer_attention_score(z(1, 4, 8), z(1, 16, 8), z(1, 16, 8), query_rope=z(1, 4, 4),
                                                  key_rope=z(1, 16, 4), block_table=z(1, 1, dtype=torch.int32),
                                                  input_layout="TND", sparse_mode=0, num_heads=4,
                                                  actual_seq_lengths=[1], actual_seq_lengths_kv=[1])
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_attention_update.*update_type=1"):
        torch_npu.npu_attention_update([z(2)], [z(2, 4)], 1)
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_transpose_batchmatmul.*scale"):
        torch_npu.npu_transpose_batchmatmul(z(2, 3, 4), z(2, 4, 5), scale=z(10))
    with pytest.raises(torch_npu.NotEmulatedError, match="torch_npu.atb.npu_ring_mla"):
        torch_npu.atb.npu_ring_mla(z(1))


# -- not emulated -------------------------------------------------------------------------------------------------
def test_an_operator_that_is_not_emulated_names_itself() -> None:
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_moe_finalize_routing"):
        torch_npu.npu_moe_finalize_routing(torch.zeros(2, 2))
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_fused_infer_attention_score.*input_layout"):
        torch_npu.npu_fused_infer_attention_score(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
                                                  input_layout="BSH", sparse_mode=3)
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_fused_infer_attention_score.*sparse_mode=0"):
        torch_npu.npu_fused_infer_attention_score(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
                                                  input_layout="TND", sparse_mode=0)
    with pytest.raises(torch_npu.NotEmulatedError, match="npu_grouped_matmul.*scale"):
        torch_npu.npu_grouped_matmul([torch.zeros(2, 2)], [torch.zeros(1, 2, 2)], scale=[torch.ones(2)],
                                     group_list=torch.tensor([2]), split_item=2, group_type=0)
    with pytest.raises(torch_npu.NotEmulatedError, match="_C_ascend.npu_moe_init_routing_custom.*quant_mode"):
        torch.ops._C_ascend.npu_moe_init_routing_custom(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int32),
                                                        expert_num=2, quant_mode=1)


# -- the real vllm-ascend call sites over the emulation ------------------------------------------------------------
@pytest.fixture(scope="module")
def config():
    cfg = _emu.vllm_config()
    with set_current_vllm_config(cfg):
        yield cfg


@pytest.mark.parametrize("state_name,query_lens,computed", [
    ("PrefillNoCache", [5, 6, 1], [0, 0, 0]),
    ("ChunkedPrefill", [3, 1, 130], [7, 200, 2]),
    ("PrefillCacheHit", [4, 9], [128, 1]),
    ("DecodeOnly", [1, 1, 1], [5, 300, 127]),
])
def test_vllm_ascend_attention_forward_over_the_emulation(config, state_name, query_lens, computed) -> None:
    """AscendAttentionBackendImpl.forward (reshape_and_cache, then the fused attention with the arguments
    _get_fia_params builds for the state) on metadata from the real AscendAttentionMetadataBuilder."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_ascend.attention.attention_v1 import (
        AscendAttentionBackendImpl,
        AscendAttentionMetadataBuilder,
        AscendAttentionState,
    )

    bs, per_req, n, n_kv, d = _emu.BLOCK_SIZE, 4, 4, 2, 32
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=n_kv, head_size=d, dtype=torch.float32)
    builder = AscendAttentionMetadataBuilder(spec, ["layers.0.attn"], config, torch.device("npu:0"))
    impl = AscendAttentionBackendImpl(num_heads=n, head_size=d, scale=d ** -0.5, num_kv_heads=n_kv,
                                      alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
                                      logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None)
    kv_cache = torch.zeros(2, len(query_lens) * per_req, bs, n_kv, d)
    history = []
    for i, c in enumerate(computed):  # tokens already in the cache, at the slots _emu.common_metadata uses
        hk, hv = torch.randn(c, n_kv, d), torch.randn(c, n_kv, d)
        for p in range(c):
            kv_cache[0, i * per_req + p // bs, p % bs], kv_cache[1, i * per_req + p // bs, p % bs] = hk[p], hv[p]
        history.append((hk, hv))
    cm = _emu.common_metadata(query_lens, computed, attn_state=AscendAttentionState[state_name],
                              num_blocks_per_req=per_req)
    md = builder.build(common_prefix_len=0, common_attn_metadata=cm)
    t = sum(query_lens)
    q, k, v = torch.randn(t, n, d), torch.randn(t, n_kv, d), torch.randn(t, n_kv, d)
    out = torch.zeros(t, n, d)
    layer = type("Layer", (), {"_k_scale_float": 1.0, "_v_scale_float": 1.0, "layer_name": "model.layers.0.attn"})
    with set_forward_context(None, config):
        impl.forward(layer, q, k, v, kv_cache, md, out)
    start = 0
    for (hk, hv), ql in zip(history, query_lens, strict=True):
        full_k, full_v = torch.cat([hk, k[start:start + ql]]), torch.cat([hv, v[start:start + ql]])
        want, _ = ref_causal_attention(q[start:start + ql], full_k, full_v, d ** -0.5)
        torch.testing.assert_close(out[start:start + ql], want, rtol=1e-5, atol=1e-5)
        start += ql


def test_vllm_ascend_all_gather_moe_over_the_emulation(config) -> None:
    """select_experts (softmax, renormalize) -> TokenDispatcherWithAllGather.token_dispatch -> unified_apply_mlp
    -> token_combine, the unquantized A2 all-gather path without expert parallelism."""
    from vllm_ascend.ops.fused_moe.experts_selector import select_experts
    from vllm_ascend.ops.fused_moe.moe_mlp import unified_apply_mlp
    from vllm_ascend.ops.fused_moe.moe_runtime_args import (
        build_fused_experts_input,
        build_mlp_compute_input,
        build_token_dispatch_input,
    )
    from vllm_ascend.ops.fused_moe.token_dispatcher import TokenDispatcherWithAllGather
    from vllm_ascend.quantization.quant_type import QuantType

    tokens, hidden, experts, k, inter = 11, 32, 8, 2, 16
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    weights, ids = select_experts(hidden_states=x, router_logits=logits, top_k=k, use_grouped_topk=False,
                                  renormalize=True)
    want_w, want_ids = ref_topk_softmax(logits, k, renorm=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)
    w13, w2 = torch.randn(experts, hidden, 2 * inter) * 0.2, torch.randn(experts, inter, hidden) * 0.2
    fused = build_fused_experts_input(hidden_states=x, topk_weights=weights, topk_ids=ids, w1=w13, w2=w2,
                                      quant_type=QuantType.NONE, dynamic_eplb=False)
    dispatcher = TokenDispatcherWithAllGather(top_k=k, num_experts=experts, num_local_experts=experts)
    dispatched = dispatcher.token_dispatch(build_token_dispatch_input(fused_experts_input=fused))
    h, _ = unified_apply_mlp(mlp_compute_input=build_mlp_compute_input(
        fused_experts_input=fused, token_dispatch_output=dispatched, use_fusion_ops=False))
    out = dispatcher.token_combine(hidden_states=h, combine_metadata=dispatched.combine_metadata)
    torch.testing.assert_close(out, ref_moe(x, want_w, want_ids, w13, w2), rtol=1e-4, atol=1e-5)
