"""STAND-IN operators (tests only): CPU versions of the torch_npu operators the DBO paths of vllm-ascend 0.23 reach.

Each function is written from an operator's documentation, not from a kernel: the docstrings shipped in the
torch-npu 2.10.0.post4 wheel (``torch_npu/_op_plugin_docs.py``, cited as "torch_npu doc <name>"), the ATB API docs
and meta registrations in the same wheel where an ATB operator has no docstring, and, where the wheel's text is
ambiguous, the formula of the CANN operator it calls (cited). Each one is checked against an independent plain-torch
reference in ``tests/ascend_emulated/test_emulated_ops.py``. Computation is float32 (bf16/fp16 inputs are upcast and
the result cast back); there are no kernels, no NZ formats and no timing.

Arguments outside what the DBO paths pass (quantization, other layouts, other sparse modes, ...) raise
:class:`torch_npu.NotEmulatedError` naming the operator and the argument, rather than computing something else.
The ``torch.ops._C_ascend`` operators the paths reach are registered by :mod:`torch_npu._c_ascend_ops`.
The list, with where each one is reached from, is in docs/dbo-vllm-ascend.md ("Emulated operators").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "_npu_reshape_and_cache",
    "_npu_paged_attention",
    "npu_fused_infer_attention_score",
    "_npu_rotary_embedding",
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_fused_infer_attention_score_v2",
    "npu_interleave_rope",
    "npu_kv_rmsnorm_rope_cache",
    "npu_transpose_batchmatmul",
    "npu_attention_update",
    "npu_format_cast",
]

_INT_MAX = 2147483647


def _refuse(op: str, what: str) -> None:
    from torch_npu import NotEmulatedError

    raise NotEmulatedError(f"torch_npu.{op}: {what} is not emulated (the DBO paths were not seen to use it)")


def _require_none(op: str, **args: Any) -> None:
    for name, value in args.items():
        if value is not None:
            _refuse(op, f"argument {name}")


def _ints(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in values]


# -- KV cache and attention -----------------------------------------------------------------------------------------
def _npu_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """Scatter each token's key/value (``[num_tokens, num_kv_heads, head_size]``) into the paged caches
    (``[num_blocks, block_size, num_kv_heads, head_size]``) at ``slot = block_id * block_size + offset``, in place.

    Follows: ATB ``ReshapeAndCacheOperation`` (the operator behind ``torch_npu._npu_reshape_and_cache``, listed in
    the wheel's ``op_plugin/atb/_atb_ops.py`` without a docstring; Ascend ATB API reference "ReshapeAndCacheOperation":
    slotMapping is ``block_id * block_size + offset_in_block``, keyCache/valueCache are modified in place; "取值为负数时
    不进行任何搬运操作" - a negative slot copies nothing).
    Not emulated: NZ caches (4-D ``[num_blocks, H/16, block_size, 16]``), KV-head compression (``wins``/``seqLen``).
    """
    op = "_npu_reshape_and_cache"
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        _refuse(op, f"a cache of {key_cache.dim()} dimensions (only ND [num_blocks, block_size, heads, head_size])")
    slots = slot_indices.reshape(-1).to(torch.int64)
    if slots.numel() != key.shape[0] or slots.numel() != value.shape[0]:
        raise RuntimeError(f"{op}: {slots.numel()} slots for {key.shape[0]} keys / {value.shape[0]} values")
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T [masked]) v for one request, GQA by head groups, float32.
    q [S_q, N, D], k [S_kv, N_kv, D], v [S_kv, N_kv, D_v], visible [S_q, S_kv] bool (None: all).
    Returns (out [S_q, N, D_v], lse [S_q, N]); a query row that sees no key gets out 0 and lse -inf.

    Each query row is computed on its own (products of one row), so a row's result does not depend on how many
    rows of its request are computed with it: torch's CPU GEMMs round a row differently with more rows beside it,
    and a prefill cut by DBO computes fewer rows per call. The emulated attention is therefore batch-invariant by
    construction; a device kernel's tiling need not be (docs/dbo-vllm-ascend.md, "What the emulation cannot
    show")."""
    if q.shape[0] > 1:
        rows = [_attend(q[i:i + 1], k, v, scale, None if visible is None else visible[i:i + 1])
                for i in range(q.shape[0])]
        return torch.cat([o for o, _ in rows]), torch.cat([s for _, s in rows])
    n, n_kv = q.shape[1], k.shape[1]
    group = n // n_kv
    qf = q.float().reshape(q.shape[0], n_kv, group, q.shape[2])
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n_kv, group, S_q]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key: exp(-inf - -inf)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(q.shape[0], n, v.shape[2]), lse.permute(2, 0, 1).reshape(q.shape[0], n)


def _gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request from a paged cache ``[num_blocks, block_size, ...]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    if num_blocks > block_table_row.numel():
        raise RuntimeError(f"a KV length of {length} needs {num_blocks} blocks, the block table row has "
                           f"{block_table_row.numel()}")
    blocks = block_table_row[:num_blocks].to(torch.int64)
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def _check_causal_mask(op: str, atten_mask: torch.Tensor | None) -> None:
    """sparse_mode 2/3/4 take an "optimized" lower-triangle template of 2048 x 2048 (1 = masked above the
    diagonal); the causal pattern itself comes from sparse_mode. Checked: the shape and a corner of the template."""
    if atten_mask is None:
        raise RuntimeError(f"{op}: sparse_mode=3 needs atten_mask (the 2048x2048 causal template)")
    if tuple(atten_mask.shape[-2:]) != (2048, 2048) or atten_mask.dim() > 4 or any(
            d != 1 for d in atten_mask.shape[:-2]):
        raise RuntimeError(f"{op}: sparse_mode=3 needs atten_mask of shape (2048, 2048), (1, 2048, 2048) or "
                           f"(1, 1, 2048, 2048), got {tuple(atten_mask.shape)}")
    corner = atten_mask.reshape(2048, 2048)[:64, :64].to(torch.bool)
    if not torch.equal(corner, torch.ones(64, 64, dtype=torch.bool).triu(1)):
        raise RuntimeError(f"{op}: atten_mask is not the upper-triangle template (1 above the diagonal) that "
                           "sparse_mode=3 expects")


def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: Any = None,
        atten_mask: torch.Tensor | None = None, actual_seq_lengths: Sequence[int] | None = None,
        actual_seq_lengths_kv: Sequence[int] | None = None, dequant_scale1: Any = None, quant_scale1: Any = None,
        dequant_scale2: Any = None, quant_scale2: Any = None, quant_offset2: Any = None,
        antiquant_scale: Any = None, antiquant_offset: Any = None, block_table: torch.Tensor | None = None,
        query_padding_size: Any = None, kv_padding_size: Any = None, key_antiquant_scale: Any = None,
        key_antiquant_offset: Any = None, value_antiquant_scale: Any = None, value_antiquant_offset: Any = None,
        key_shared_prefix: Any = None, value_shared_prefix: Any = None, actual_shared_prefix_len: Any = None,
        query_rope: Any = None, key_rope: Any = None, key_rope_antiquant_scale: Any = None, num_heads: int = 1,
        scale: float = 1.0, pre_tokens: int = _INT_MAX, next_tokens: int = _INT_MAX, input_layout: str = "BSH",
        num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0,
        antiquant_mode: int = 0, softmax_lse_flag: bool = False, key_antiquant_mode: int = 0,
        value_antiquant_mode: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused inference attention, ``softmax(scale * q k^T + mask) v``, in the one configuration vllm-ascend's
    ``AscendAttentionBackendImpl.forward_fused_infer_attention`` uses for causal decoder attention: input_layout
    "TND", sparse_mode 3 (rightDownCausal: query row ``i`` of a request with ``q_len`` query and ``kv_len`` KV tokens
    sees KV positions ``j <= kv_len - q_len + i``), GQA (``num_heads % num_key_value_heads == 0``).

    Follows: torch_npu doc ``npu_fused_infer_attention_score``. In TND, ``actual_seq_lengths`` holds each request's
    query END (cumulative sum; its length is the batch). ``actual_seq_lengths_kv`` holds cumulative KV ends when
    key/value are TND tensors ``[T_kv, N_kv, D]`` (no block_table: vllm-ascend's PrefillNoCache), and per-request KV
    lengths when ``block_table`` is given (page attention; key/value ``[num_blocks, block_size, N_kv * D]``,
    block_table ``[B, max_blocks]``). Outputs: attention_out with query's shape; softmax_lse ``[T, N, 1]`` float32
    (log-sum-exp of the scaled, masked scores) when ``softmax_lse_flag``, else a ``[1]`` zero tensor.
    pre_tokens/next_tokens are ignored under sparse_mode 3, as documented.

    Not emulated (NotEmulatedError): other layouts (BSH, BSND, BNSD, ...), sparse modes other than 3 (0 without
    mask outside MLA, 1, 2, 4, 9), pse_shift, every quantization / antiquant argument, left padding, shared prefix,
    MLA query_rope/key_rope with a block table, the (blocknum, N_kv, blocksize, D) cache layout.

    MLA (``query_rope``/``key_rope``, doc: "query_rope和key_rope输入时即为MLA场景"): the scores are
    ``scale * (q . k + q_rope . k_rope)`` (the rope parts are the query's and key's last D dimensions split off;
    value has none), as vllm-ascend's ``AscendMLAImpl._forward_prefill`` (sparse_mode 3 with the template) and
    ``_compute_prefill_context`` (sparse_mode 0, no mask: every row sees the whole context chunk, TND with
    cumulative ``actual_seq_lengths_kv``) pass them. The output takes query's dtype. The kernel documents only
    bf16 for TND with D != 512 and D = 128; the tiny models' D = 64 and float32 (and the float32 key beside a bf16
    query that ``_compute_prefill_context`` passes in a float32 model) are computed here in float32, not refused. A query row that sees no key (not possible
    under sparse_mode 3 when q_len <= kv_len) returns 0. Query dtype float32 is accepted here although the kernel
    documents only fp16/bf16/int8.
    """
    op = "npu_fused_infer_attention_score"
    _require_none(op, pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
                  dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
                  antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
                  query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
                  key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
                  value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
                  key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
                  actual_shared_prefix_len=actual_shared_prefix_len,
                  key_rope_antiquant_scale=key_rope_antiquant_scale)
    if input_layout != "TND":
        _refuse(op, f"input_layout={input_layout!r} (only 'TND')")
    if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
        _refuse(op, "antiquant modes")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _refuse(op, f"query dtype {query.dtype}")
    mla = query_rope is not None or key_rope is not None
    if mla:
        # MLA (doc: query_rope/key_rope "要求同时配置"): scores = q.k + q_rope.k_rope, value without rope.
        # vllm-ascend's AscendMLAImpl._forward_prefill (sparse_mode 3, causal) and _compute_prefill_context
        # (sparse_mode 0, no mask: a chunk of cached context every query row sees) pass them, TND, no block table.
        if query_rope is None or key_rope is None:
            raise RuntimeError(f"{op}: query_rope and key_rope must be given together")
        if block_table is not None:
            _refuse(op, "query_rope/key_rope with a block_table (MLA page attention with D=512; "
                        "vllm-ascend's decode takes npu_fused_infer_attention_score_v2)")
        if query_rope.shape[:2] != query.shape[:2] or key_rope.shape[:2] != key.shape[:2]:
            raise RuntimeError(f"{op}: query_rope {tuple(query_rope.shape)} / key_rope {tuple(key_rope.shape)} must "
                               f"match query {tuple(query.shape)} / key {tuple(key.shape)} but for D")
        query = torch.cat((query.float(), query_rope.float()), dim=-1)
        key = torch.cat((key.float(), key_rope.float()), dim=-1)
    if sparse_mode == 3:
        _check_causal_mask(op, atten_mask)
    elif sparse_mode == 0 and mla and atten_mask is None:
        pass  # no mask: every query row sees its request's whole KV (doc: sparse_mode 0 "atten_mask未传入则不做mask")
    else:
        _refuse(op, f"sparse_mode={sparse_mode}" + (" with an atten_mask" if atten_mask is not None else "")
                + " (only 3, rightDownCausal; 0 without mask only for MLA query_rope/key_rope)")
    if actual_seq_lengths is None or actual_seq_lengths_kv is None:
        raise RuntimeError(f"{op}: TND layout needs actual_seq_lengths and actual_seq_lengths_kv")
    if query.dim() != 3 or query.shape[1] != num_heads:
        raise RuntimeError(f"{op}: TND query must be [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
    n_kv = num_key_value_heads or num_heads
    if num_heads % n_kv:
        raise RuntimeError(f"{op}: num_heads {num_heads} is not a multiple of num_key_value_heads {n_kv}")
    out_dtype = query_rope.dtype if mla else query.dtype  # query was upcast above; the doc: rope dtype = query's
    q_ends = _ints(actual_seq_lengths)
    kv_arg = _ints(actual_seq_lengths_kv)
    batch = len(q_ends)
    if len(kv_arg) != batch:
        raise RuntimeError(f"{op}: {batch} query lengths but {len(kv_arg)} KV lengths")
    head_dim = query.shape[2]
    paged = block_table is not None
    if paged:
        if key.dim() != 3:
            _refuse(op, f"a paged cache of {key.dim()} dimensions (only [num_blocks, block_size, N_kv * D])")
        if block_size != key.shape[1]:
            raise RuntimeError(f"{op}: block_size {block_size} but the cache blocks hold {key.shape[1]} tokens")
        if block_table.dim() != 2 or block_table.shape[0] < batch:
            raise RuntimeError(f"{op}: block_table must be [B={batch}, max_blocks], got {tuple(block_table.shape)}")
        key_c = key.reshape(key.shape[0], key.shape[1], n_kv, head_dim)
        value_c = value.reshape(value.shape[0], value.shape[1], n_kv, -1)
        kv_lens = kv_arg
    else:
        if key.dim() != 3:
            raise RuntimeError(f"{op}: TND key/value must be [T_kv, N_kv, D], got {tuple(key.shape)}")
        kv_lens = [end - (kv_arg[b - 1] if b else 0) for b, end in enumerate(kv_arg)]
    v_dim = value_c.shape[-1] if paged else value.shape[-1]
    out = torch.zeros(query.shape[0], num_heads, v_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((query.shape[0], num_heads), float("-inf"), dtype=torch.float32, device=query.device)
    q_start = 0
    for b in range(batch):
        q_end, kv_len = q_ends[b], kv_lens[b]
        q_len = q_end - q_start
        if q_len < 0 or kv_len < 0:
            raise RuntimeError(f"{op}: request {b} has a negative length (actual_seq_lengths must be cumulative)")
        if q_len and kv_len:
            if paged:
                k = _gather_paged(key_c, block_table[b], kv_len)
                v = _gather_paged(value_c, block_table[b], kv_len)
            else:
                kv_start = kv_arg[b - 1] if b else 0
                k, v = key[kv_start:kv_start + kv_len], value[kv_start:kv_start + kv_len]
            visible = None
            if sparse_mode == 3:
                rows = torch.arange(q_len).unsqueeze(1)
                cols = torch.arange(kv_len).unsqueeze(0)
                visible = cols <= kv_len - q_len + rows
            o, s = _attend(query[q_start:q_end], k, v, scale, visible)
            out[q_start:q_end], lse[q_start:q_end] = o, s
        q_start = q_end
    attn_out = out.to(out_dtype)
    if softmax_lse_flag:
        return attn_out, lse.unsqueeze(-1)
    return attn_out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _npu_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                         context_lens: Any, out: torch.Tensor) -> torch.Tensor:
    """Decode attention over a paged KV cache: query token ``i`` (``[num_tokens, num_heads, head_size]``, one token
    per request) attends to the first ``context_lens[i]`` tokens of its blocks ``block_table[i]``; written into
    ``out`` (``[num_tokens, num_heads, head_size_v]``) and returned. No mask (mask_type UNDEFINED).

    Follows: torch_npu ATB doc ``_npu_paged_attention_v2`` (wheel ``op_plugin/atb/_atb_api_docs.py``; the same ATB
    PagedAttention operator, ``_npu_paged_attention`` has no docstring of its own): key_cache/value_cache
    ``[num_blocks, block_size, kv_head_num, head_size]`` (A2/A3 ND), block_table ``[num_tokens, max_blocks]``,
    GQA when ``num_heads % num_kv_heads == 0``.
    Not emulated: masks (alibi, norm), NZ caches, quantized caches. Reached only when
    ``attention/utils.py:using_paged_attention`` is true (FULL_DECODE_ONLY graphs or a 512 head size), never in the
    eager DBO runs.
    """
    op = "_npu_paged_attention"
    if key_cache.dim() != 4:
        _refuse(op, f"a cache of {key_cache.dim()} dimensions (only ND [num_blocks, block_size, heads, head_size])")
    lens = _ints(context_lens)
    if len(lens) != query.shape[0]:
        raise RuntimeError(f"{op}: {len(lens)} context lengths for {query.shape[0]} query tokens")
    if num_heads % num_kv_heads:
        raise RuntimeError(f"{op}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for i, kv_len in enumerate(lens):
        if kv_len == 0:
            out[i] = 0
            continue
        k = _gather_paged(key_cache, block_table[i], kv_len)
        v = _gather_paged(value_cache, block_table[i], kv_len)
        o, _ = _attend(query[i:i + 1], k, v, scale_value, None)
        out[i] = o[0].to(out.dtype)
    return out


# -- rotary embedding -----------------------------------------------------------------------------------------------
def _npu_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                          cos_sin_cache: torch.Tensor, is_neox_style: bool) -> None:
    """Rotary position embedding applied IN PLACE to ``query`` and ``key`` (``[num_tokens, heads * head_size]``)
    at ``positions``; ``cos_sin_cache`` is ``[max_position, rot_dim]`` with cos in the first half and sin in the
    second. The first ``rot_dim`` elements of each head rotate: neox style pairs ``x[i]`` with ``x[i + rot_dim/2]``,
    GPT-J style pairs ``x[2i]`` with ``x[2i + 1]``.

    Follows: the contract of vLLM's ``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``
    kernel (vllm ``_custom_ops.rotary_embedding``; its torch form is
    ``vllm/model_executor/layers/rotary_embedding/base.py:RotaryEmbedding.forward_static``), which
    ``torch_npu._npu_rotary_embedding`` takes over in vllm-ascend's ``ops/rotary_embedding.py:rope_forward_oot``
    (listed in the wheel's ``op_plugin/atb/_atb_ops.py``; the wheel has no docstring for it).
    Not emulated: nothing beyond this contract (no offsets / batched variant). Computed in float32.
    """
    op = "_npu_rotary_embedding"
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim > head_size or rot_dim % 2:
        raise RuntimeError(f"{op}: cos_sin_cache last dim {rot_dim} does not fit head_size {head_size}")
    pos = positions.reshape(-1).to(torch.int64)
    cos, sin = cos_sin_cache.index_select(0, pos).float().chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(pos.numel(), -1, head_size)
        rot = heads[..., :rot_dim].float()
        if is_neox_style:
            x1, x2 = rot[..., :rot_dim // 2], rot[..., rot_dim // 2:]
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        heads[..., :rot_dim] = rotated.to(x.dtype)


# -- norms and activations ------------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm: ``y = x / sqrt(mean(x^2) + epsilon) * gamma`` over the last ``gamma.dim()`` dimensions; returns
    ``(y, rstd)`` with rstd float32, shaped like x with the normalized dimensions kept as 1.

    Follows: torch_npu doc ``npu_rms_norm`` (and the wheel's meta registration ``npu_rms_norm_meta`` for the rstd
    shape). Not emulated: nothing (fp16/bf16/fp32 all accepted; computed in float32).
    """
    return _rms(self, gamma, epsilon)


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``x = x1 + x2``, returns ``(rms_norm(x) * gamma, rstd, x)``.

    Follows: the wheel's meta registration ``npu_add_rms_norm_meta`` (``op_plugin/meta/_meta_registrations.py``:
    outputs y like x1, rstd float32, x like x1; the wheel has no docstring for it) with the npu_rms_norm formula.
    The sum is formed in float32 and returned in x1's dtype. Not emulated: nothing else.
    """
    total = x1.float() + x2.float()
    y, rstd = _rms(total, gamma, epsilon)
    return y.to(x1.dtype), rstd, total.to(x1.dtype)


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: split ``self`` in halves A, B along ``dim``; ``A * sigmoid(A) * B``.

    Follows: torch_npu doc ``npu_swiglu``. Computed in float32, returned in the input dtype.
    """
    a, b = self.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


# -- MoE --------------------------------------------------------------------------------------------------------------
def npu_grouped_matmul(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *, bias: Any = None,
                       scale: Any = None, offset: Any = None, antiquant_scale: Any = None,
                       antiquant_offset: Any = None, per_token_scale: Any = None,
                       group_list: torch.Tensor | None = None, activation_input: Any = None,
                       activation_quant_scale: Any = None, activation_quant_offset: Any = None,
                       split_item: int = 0, group_type: int | None = None, group_list_type: int = 0,
                       act_type: int = 0, output_dtype: torch.dtype | None = None,
                       tuning_config: Any = None) -> list[torch.Tensor]:
    """Grouped matmul along M (group_type 0): x is one ``[M, K]`` tensor whose rows are split into consecutive
    groups by ``group_list``; group ``e`` is multiplied by weight ``e`` (one ``[E, K, N]`` tensor or E ``[K, N]``
    tensors) plus optional bias ``e``; returns ``[y]`` with y ``[M, N]`` (split_item 2/3: one output tensor).
    ``group_list_type`` 0: cumulative row ends; 1: row counts per group. Rows after the last group are 0 here
    (the kernel leaves them undefined).

    Follows: torch_npu doc ``npu_grouped_matmul`` (non-quantized formula ``y_i = x_i x weight_i + bias_i``;
    "group_list为torch.Tensor" scenarios 单单单 / 单多单 with group_type 0).
    Not emulated: quantized / antiquant / per-token-scale inputs, activation fusion (act_type != 0), group_type -1
    or 1, List[int] group_list, several x tensors, split_item 0/1 (one output per group).
    """
    op = "npu_grouped_matmul"
    _require_none(op, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                  antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                  activation_input=activation_input, activation_quant_scale=activation_quant_scale,
                  activation_quant_offset=activation_quant_offset)
    if act_type:
        _refuse(op, f"act_type={act_type}")
    if group_type != 0:
        _refuse(op, f"group_type={group_type} (only 0, grouping along M)")
    if split_item not in (2, 3):
        _refuse(op, f"split_item={split_item} (only 2/3, a single output tensor)")
    if not isinstance(group_list, torch.Tensor):
        _refuse(op, "a group_list that is not a tensor")
    if group_list_type not in (0, 1):
        raise RuntimeError(f"{op}: group_list_type must be 0 (cumsum) or 1 (count), got {group_list_type}")
    if len(x) != 1:
        _refuse(op, f"{len(x)} x tensors (only one)")
    xt = x[0]
    if xt.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _refuse(op, f"x dtype {xt.dtype} (quantized inputs)")
    if output_dtype not in (None, xt.dtype):
        _refuse(op, f"output_dtype={output_dtype} for {xt.dtype} inputs")
    if len(weight) == 1 and weight[0].dim() == 3:
        weights = list(weight[0].unbind(0))
    elif all(w.dim() == 2 for w in weight):
        weights = list(weight)
    else:
        raise RuntimeError(f"{op}: weight must be one [E, K, N] tensor or E [K, N] tensors")
    for w in weights:
        if w.dtype != xt.dtype:
            _refuse(op, f"weight dtype {w.dtype} with x dtype {xt.dtype} (quantized weights)")
    biases: list[torch.Tensor | None] = [None] * len(weights)
    if bias is not None:
        if len(bias) == 1 and bias[0].dim() == 2:
            biases = list(bias[0].unbind(0))
        elif len(bias) == len(weights):
            biases = list(bias)
        else:
            raise RuntimeError(f"{op}: {len(bias)} bias tensors for {len(weights)} weights")
    counts = _ints(group_list)
    if len(counts) != len(weights):
        raise RuntimeError(f"{op}: group_list has {len(counts)} groups for {len(weights)} weights")
    if group_list_type == 0:
        counts = [end - (counts[i - 1] if i else 0) for i, end in enumerate(counts)]
    if any(c < 0 for c in counts) or sum(counts) > xt.shape[0]:
        raise RuntimeError(f"{op}: group_list {group_list.tolist()} does not fit {xt.shape[0]} rows")
    n = weights[0].shape[1]
    y = torch.zeros(xt.shape[0], n, dtype=torch.float32, device=xt.device)
    start = 0
    for w, b, c in zip(weights, biases, counts, strict=True):
        if c:
            rows = xt[start:start + c].float() @ w.float()
            if b is not None:
                rows = rows + b.float()
            y[start:start + c] = rows
        start += c
    return [y.to(xt.dtype)]


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None,
                          padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE permute: copy each token once per chosen expert and order the copies by expert (stable).
    ``indices`` ``[num_tokens, topK]`` (or 1-D: topK = 1). Returns ``(permuted_tokens, sorted_indices)`` where
    ``sorted_indices[i]`` (int32) is the row of ``permuted_tokens`` that holds flat entry ``i = token * topK + k``.

    Follows: torch_npu doc ``npu_moe_token_permute``; the doc gives no formula, so the formula of the CANN operator
    it calls is used (ops-transformer ``moe/moe_token_permute/README.md``: ``sortedIndicesFirst = argSort(indices)``,
    ``sortedIndicesOut = argSort(sortedIndicesFirst)``, ``permuteTokens[sortedIndicesOut[i]] = tokens[i // topK]``).
    ``num_out_tokens`` None or 0 keeps every row; otherwise the sorted rows are sliced ``[:num_out_tokens]``.
    Not emulated: ``padded_mode=True``.
    """
    op = "npu_moe_token_permute"
    if padded_mode:
        _refuse(op, "padded_mode=True")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    flat = indices.reshape(-1).to(torch.int64)
    first = torch.argsort(flat, stable=True)
    sorted_indices = torch.argsort(first, stable=True).to(torch.int32)
    permuted = tokens.index_select(0, first // topk)
    if num_out_tokens:
        permuted = permuted[:num_out_tokens]
    return permuted, sorted_indices


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape: Any = None) -> torch.Tensor:
    """MoE unpermute: ``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK + k]]`` (topK =
    ``probs.shape[1]``; without probs topK = 1 and the weight is 1), ``[num_tokens, hidden]``.

    Follows: torch_npu doc ``npu_moe_token_unpermute`` ("根据sorted_indices存储的下标，获取permuted_tokens中存储的输入
    数据；如果存在probs数据，permuted_tokens会与probs相乘；最后进行累加求和"), with the gather direction from the CANN
    operator's formula (ops-transformer ``moe/moe_token_unpermute/README.md``: ``T[k] = T[S[k]]``, ``O[i] = sum``
    over ``k in [i*topK, (i+1)*topK)`` of ``T[k] * P``). It is the inverse of :func:`npu_moe_token_permute`, and of
    ``npu_moe_init_routing_custom``'s gather-type (row_idx_type 0) expanded_row_idx, as vllm-ascend pairs them.
    ``restore_shape`` only acts in padded mode (doc) and is ignored. Not emulated: ``padded_mode=True``; an index
    outside permuted_tokens (rows dropped by num_out_tokens) raises.
    """
    op = "npu_moe_token_unpermute"
    if padded_mode:
        _refuse(op, "padded_mode=True")
    idx = sorted_indices.reshape(-1).to(torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= permuted_tokens.shape[0]):
        _refuse(op, f"sorted_indices outside the {permuted_tokens.shape[0]} permuted rows (dropped tokens)")
    gathered = permuted_tokens.index_select(0, idx).float()
    if probs is None:
        return gathered.to(permuted_tokens.dtype)
    topk = probs.shape[1]
    if idx.numel() != probs.numel():
        raise RuntimeError(f"{op}: {idx.numel()} indices for probs of shape {tuple(probs.shape)}")
    out = (gathered.reshape(-1, topk, gathered.shape[-1]) * probs.float().unsqueeze(-1)).sum(dim=1)
    return out.to(permuted_tokens.dtype)


# -- MLA (DeepSeek) ----------------------------------------------------------------------------------------------
# vllm-ascend's attention/mla_v1.py:AscendMLAImpl in eager mode with its custom kernels absent, enable_kv_nz off, no
# quantization, no MLAPO, no speculative decoding, num_heads a power of 2 (no head padding).
def _deinterleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """InterleaveRope in float32: ``q = x.reshape(..., D/2, 2).transpose(-1, -2).reshape(..., D)`` (pairs
    (x0, x1), (x2, x3), ... become halves), then ``q * cos + RotateHalf(q) * sin`` with
    ``RotateHalf(q) = cat(-q[D/2:], q[:D/2])``."""
    d = x.shape[-1]
    q = x.float().reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)
    rotated = torch.cat((-q[..., d // 2:], q[..., :d // 2]), dim=-1)
    return q * cos.float() + rotated * sin.float()


def npu_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of an interleaved (GPT-J ordered) ``x`` ``[B, N, S, D]``: de-interleave, then rotate-half
    with ``cos``/``sin`` ``[B, 1, S or 1, D]``; the result is in the de-interleaved order, shaped and typed like x.

    Follows: no docstring in the wheel (only the meta registration ``npu_interleave_rope_meta``: output like x); the
    formula of the torch_npu API page (Ascend op-plugin ``docs/context/torch_npu-npu_interleave_rope.md`` and the
    CANN InterleaveRope operator page: ``q = reshape(x, [B, N, S, D//2, 2]).transpose(-1, -2).reshape([B, N, S, D])``,
    ``q_embed = q * cos + RotateHalf(q) * sin``). Reached from ``AscendMLAImpl.rope_single`` (decode and prefill
    query rope). The kernel's D = 64 and fp16/bf16 constraints are not checked (float32 computed here).
    Not emulated: cos/sin with N != 1 (the page requires N = 1).
    """
    op = "npu_interleave_rope"
    if x.dim() != 4 or cos.dim() != 4 or sin.shape != cos.shape:
        raise RuntimeError(f"{op}: x, cos, sin must be 4-D [B, N, S, D] (cos and sin alike), got "
                           f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if cos.shape[1] != 1:
        _refuse(op, f"cos/sin with N={cos.shape[1]} (the operator takes N = 1)")
    if x.shape[-1] % 2 or cos.shape[-1] != x.shape[-1]:
        raise RuntimeError(f"{op}: D {x.shape[-1]} must be even and equal cos's {cos.shape[-1]}")
    return _deinterleave_rope(x, cos, sin).to(x.dtype)


def npu_kv_rmsnorm_rope_cache(kv: torch.Tensor, gamma: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              index: torch.Tensor, k_cache: torch.Tensor, ckv_cache: torch.Tensor, *,
                              k_rope_scale: Any = None, c_kv_scale: Any = None, k_rope_offset: Any = None,
                              c_kv_offset: Any = None, v: Any = None, epsilon: float = 1e-5,
                              cache_mode: str = "Norm", is_output_kv: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA key path: ``kv`` ``[B, 1, S, rms_size + rope_size]`` splits into ``rms_in`` (first ``gamma.numel()``)
    and ``rope_in`` (the rest); ``c_kv = RMSNorm(rms_in) * gamma``; ``k_rope = InterleaveRope(rope_in, cos, sin)``
    (see :func:`npu_interleave_rope`); both are scattered IN PLACE into the paged caches at the global token offsets
    ``index`` (``cache_mode`` "PA": ``k_cache`` ``[block_num, block_size, 1, rope_size]``, ``ckv_cache``
    ``[block_num, block_size, 1, rms_size]``, ``slot = block * block_size + offset``). Returns ``(k_cache,
    ckv_cache, k_rope, c_kv)``; the last two (``[B, 1, S, rope]`` / ``[B, 1, S, rms]``) only when ``is_output_kv``,
    else empty tensors of those shapes (here zeros).

    Follows: no docstring in the wheel (meta registration ``npu_kv_rmsnorm_rope_cache_meta``: outputs like k_cache,
    like ckv_cache, then k_rope / c_kv shaped from kv, cos and gamma); the formula and the cache modes of the
    torch_npu API page (Ascend op-plugin ``docs/context/torch_npu-npu_kv_rmsnorm_rope_cache.md``: split, RMSNorm
    over the 512 rms elements with gamma and epsilon, the InterleaveRope reshape/transpose then RotateHalf; PA: index
    ``[batch_size * seq_len]``, "index里的值表示全局的偏移"). Reached from ``AscendMLAImpl.exec_kv_decode`` (caches
    returned) and ``exec_kv_prefill`` (``is_output_kv=True``).
    Not emulated: quantization (k_rope_scale / c_kv_scale / offsets, int8 caches), the ``v`` input, cache modes
    other than "PA"/"PA_BNSD" (Norm, PA_NZ, PA_BLK_*), negative or repeated indices (undefined on the device). The
    kernel's 512/64 sizes are not checked; computed in float32.
    """
    op = "npu_kv_rmsnorm_rope_cache"
    _require_none(op, k_rope_scale=k_rope_scale, c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset,
                  c_kv_offset=c_kv_offset, v=v)
    if cache_mode not in ("PA", "PA_BNSD"):
        _refuse(op, f"cache_mode={cache_mode!r} (only 'PA' / 'PA_BNSD')")
    if kv.dim() != 4 or kv.shape[1] != 1 or gamma.dim() != 1 or cos.dim() != 4 or sin.shape != cos.shape:
        raise RuntimeError(f"{op}: kv must be [B, 1, S, H], gamma 1-D, cos/sin 4-D alike; got {tuple(kv.shape)}, "
                           f"{tuple(gamma.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    rms_size, rope_size = gamma.shape[0], cos.shape[-1]
    if kv.shape[-1] != rms_size + rope_size:
        raise RuntimeError(f"{op}: kv's last dim {kv.shape[-1]} is not rms {rms_size} + rope {rope_size}")
    if k_cache.dim() != 4 or ckv_cache.dim() != 4 or k_cache.shape[2] != 1 or ckv_cache.shape[2] != 1:
        _refuse(op, f"caches of shape {tuple(k_cache.shape)} / {tuple(ckv_cache.shape)} (only ND "
                    "[block_num, block_size, 1, D])")
    slots = index.reshape(-1).to(torch.int64)
    b, _, s, _ = kv.shape
    if slots.numel() != b * s:
        raise RuntimeError(f"{op}: {slots.numel()} indices for {b * s} tokens")
    if slots.numel() and int(slots.min()) < 0:
        _refuse(op, "a negative index (padding slots)")
    if slots.unique().numel() != slots.numel():
        _refuse(op, "repeated indices (undefined on the device)")
    rms_in, rope_in = kv.float().split([rms_size, rope_size], dim=-1)
    c_kv = (rms_in * torch.rsqrt(rms_in.pow(2).mean(dim=-1, keepdim=True) + epsilon) * gamma.float()).to(kv.dtype)
    k_rope = _deinterleave_rope(rope_in, cos, sin).to(kv.dtype)
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k_rope.reshape(b * s, 1, rope_size).to(k_cache.dtype)
    ckv_cache[blocks, offsets] = c_kv.reshape(b * s, 1, rms_size).to(ckv_cache.dtype)
    if not is_output_kv:
        k_rope, c_kv = torch.zeros_like(k_rope), torch.zeros_like(c_kv)
    return k_cache, ckv_cache, k_rope, c_kv


def npu_fused_infer_attention_score_v2(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, query_rope: torch.Tensor | None = None,
        key_rope: torch.Tensor | None = None, pse_shift: Any = None, atten_mask: Any = None,
        actual_seq_qlen: Sequence[int] | None = None, actual_seq_kvlen: Sequence[int] | None = None,
        block_table: torch.Tensor | None = None, dequant_scale_query: Any = None, dequant_scale_key: Any = None,
        dequant_offset_key: Any = None, dequant_scale_value: Any = None, dequant_offset_value: Any = None,
        dequant_scale_key_rope: Any = None, quant_scale_out: Any = None, quant_offset_out: Any = None,
        quant_scale_p: Any = None, learnable_sink: Any = None, num_query_heads: int = 1,
        num_key_value_heads: int = 0, softmax_scale: float = 1.0, pre_tokens: int = _INT_MAX,
        next_tokens: int = _INT_MAX, input_layout: str = "BSH", sparse_mode: int = 0, block_size: int = 0,
        query_quant_mode: int = 0, key_quant_mode: int = 0, value_quant_mode: int = 0, inner_precise: int = 0,
        return_softmax_lse: bool = False, query_dtype: Any = None, key_dtype: Any = None, value_dtype: Any = None,
        query_rope_dtype: Any = None, key_rope_dtype: Any = None, key_shared_prefix_dtype: Any = None,
        value_shared_prefix_dtype: Any = None, dequant_scale_query_dtype: Any = None,
        dequant_scale_key_dtype: Any = None, dequant_scale_value_dtype: Any = None,
        dequant_scale_key_rope_dtype: Any = None, out_dtype: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache, the one configuration ``AscendMLAImpl._forward_decode``
    uses without speculative decoding, NZ caches or quantization: input_layout "BNSD_NBSD", query
    ``[B, N, 1, D]`` with ``query_rope`` ``[B, N, 1, D_rope]``; key = value = the latent cache viewed as
    ``[block_num, 1, block_size, D]`` with ``key_rope`` ``[block_num, 1, block_size, D_rope]`` (page attention,
    KV_N = 1), ``block_table`` ``[B, max_blocks]``, ``actual_seq_kvlen`` per-request KV lengths (page attention),
    sparse_mode 0 without mask. Row b, head n: ``softmax(softmax_scale * (q . K + q_rope . K_rope)) V`` over the
    request's first ``actual_seq_kvlen[b]`` cached tokens. Output ``[N, B, 1, D]`` (NBSD), softmax_lse ``[1]`` zero
    (``return_softmax_lse`` False).

    Follows: torch_npu doc ``npu_fused_infer_attention_score_v2`` (formula; "BNSD_NBSD输入(B,Q_N,Q_S,D)输出
    (Q_N,B,Q_S,D)仅支持Q_S为1~16"; MLA with D = 512: "Q_S等于1时只支持sparse=0且不传mask", page attention required,
    key n = 1; cache layout (blocknum, KV_N, blocksize, D) for BNSD; "actual_seq_kvlen ... 在PA场景下, 其长度等于
    key/value的Batch值, 代表每个Batch的实际长度"; key S = 0 gives zeros).
    Not emulated: other layouts (TND/TND_NTD of speculative decoding, BSND_NBSD of NZ caches), Q_S > 1, sparse_mode
    != 0 or a mask, no block table, pse_shift, learnable_sink, every quantization argument and quant mode,
    return_softmax_lse, out_dtype, the ``.out`` overload (graph capture). The D = 512 / D_rope = 64 sizes are not
    checked; computed in float32.
    """
    op = "npu_fused_infer_attention_score_v2"
    _require_none(op, pse_shift=pse_shift, atten_mask=atten_mask, dequant_scale_query=dequant_scale_query,
                  dequant_scale_key=dequant_scale_key, dequant_offset_key=dequant_offset_key,
                  dequant_scale_value=dequant_scale_value, dequant_offset_value=dequant_offset_value,
                  dequant_scale_key_rope=dequant_scale_key_rope, quant_scale_out=quant_scale_out,
                  quant_offset_out=quant_offset_out, quant_scale_p=quant_scale_p, learnable_sink=learnable_sink,
                  out_dtype=out_dtype)
    if input_layout != "BNSD_NBSD":
        _refuse(op, f"input_layout={input_layout!r} (only 'BNSD_NBSD')")
    if sparse_mode != 0:
        _refuse(op, f"sparse_mode={sparse_mode} (only 0 without mask)")
    if query_quant_mode or key_quant_mode or value_quant_mode:
        _refuse(op, "quant modes")
    if return_softmax_lse:
        _refuse(op, "return_softmax_lse=True")
    if query_rope is None or key_rope is None:
        _refuse(op, "attention without query_rope/key_rope (only the MLA form)")
    if block_table is None:
        _refuse(op, "no block_table (MLA requires page attention)")
    if query.dim() != 4 or query.shape[2] != 1 or query.shape[1] != num_query_heads:
        _refuse(op, f"query of shape {tuple(query.shape)} (only [B, N={num_query_heads}, Q_S=1, D])")
    if key.dim() != 4 or key.shape[1] != 1 or key.shape[2] != block_size or not torch.equal(
            torch.tensor(key.shape), torch.tensor(value.shape)):
        _refuse(op, f"key {tuple(key.shape)} / value {tuple(value.shape)} (only equal [block_num, 1, "
                    f"block_size={block_size}, D] caches)")
    if num_key_value_heads not in (0, 1):
        _refuse(op, f"num_key_value_heads={num_key_value_heads} (MLA: 1)")
    if query_rope.shape[:3] != query.shape[:3] or key_rope.shape[:3] != key.shape[:3]:
        raise RuntimeError(f"{op}: query_rope {tuple(query_rope.shape)} / key_rope {tuple(key_rope.shape)} must match "
                           f"query / key but for D")
    batch = query.shape[0]
    kv_lens = _ints(actual_seq_kvlen) if actual_seq_kvlen is not None else None
    if kv_lens is None or len(kv_lens) < batch:
        raise RuntimeError(f"{op}: page attention needs actual_seq_kvlen with one length per request ({batch})")
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise RuntimeError(f"{op}: block_table must be [B={batch}, max_blocks], got {tuple(block_table.shape)}")
    # [block_num, 1, block_size, D] -> [block_num, block_size, 1, D] for the paged gather
    k_c = torch.cat((key.float(), key_rope.float()), dim=-1).transpose(1, 2)
    v_c = value.float().transpose(1, 2)
    q = torch.cat((query.float(), query_rope.float()), dim=-1)  # [B, N, 1, D + D_rope]
    out = torch.zeros(num_query_heads, batch, 1, value.shape[-1], dtype=torch.float32, device=query.device)
    for b in range(batch):
        if kv_lens[b] == 0:
            continue
        k = _gather_paged(k_c, block_table[b], kv_lens[b])
        v = _gather_paged(v_c, block_table[b], kv_lens[b])
        o, _ = _attend(q[b].transpose(0, 1), k, v, softmax_scale, None)  # [1, N, D]
        out[:, b, 0] = o[0]
    return out.to(query.dtype), torch.zeros(1, dtype=torch.float32, device=query.device)


def npu_transpose_batchmatmul(input: torch.Tensor, weight: torch.Tensor, *, bias: Any = None,  # noqa: A002
                              scale: Any = None, perm_x1: Sequence[int] | None = None,
                              perm_x2: Sequence[int] | None = None, perm_y: Sequence[int] | None = None,
                              batch_split_factor: int = 1) -> torch.Tensor:
    """``y = permute(bmm(permute(input, perm_x1), permute(weight, perm_x2)), perm_y)``: input permuted to
    ``[Batch, M, K]``, weight to ``[Batch, K, N]``, the product ``[Batch, M, N]`` permuted by perm_y.

    Follows: torch_npu doc ``npu_transpose_batchmatmul`` (perm_x1 "将input在矩阵乘之前排列成[B, M, K]", perm_x2
    "[B, K, N]", perm_y "将y在矩阵乘后重新排列") and its meta registration (defaults perm_x1 = perm_x2 = [0, 1, 2],
    perm_y = [1, 0, 2]; perm_x1 in {[0,1,2], [1,0,2]}, perm_y only [1,0,2]; output (M, Batch, N); no bias).
    Reached from ``AscendMLAImpl._v_up_proj`` (decode: ``[N, B, L] x [N, L, V] -> [B, N, V]``).
    Not emulated: scale (int8 output quantization), batch_split_factor != 1, perm_x2 other than [0, 1, 2].
    """
    op = "npu_transpose_batchmatmul"
    _require_none(op, scale=scale)
    if bias is not None:
        raise RuntimeError(f"{op}: the bias is not supported in TransposeBatchMatMul (meta registration)")
    if batch_split_factor != 1:
        _refuse(op, f"batch_split_factor={batch_split_factor}")
    p1 = list(perm_x1 or (0, 1, 2))
    p2 = list(perm_x2 or (0, 1, 2))
    py = list(perm_y or (1, 0, 2))
    if p1 not in ([0, 1, 2], [1, 0, 2]):
        raise RuntimeError(f"{op}: perm_x1 should be [0, 1, 2] or [1, 0, 2], got {p1}")
    if p2 != [0, 1, 2]:
        _refuse(op, f"perm_x2={p2}")
    if py != [1, 0, 2]:
        raise RuntimeError(f"{op}: perm_y should be [1, 0, 2], got {py}")
    if input.dim() != 3 or weight.dim() != 3:
        raise RuntimeError(f"{op}: input and weight must be 3-D")
    y = torch.bmm(input.float().permute(p1), weight.float().permute(p2))
    return y.permute(py).contiguous().to(input.dtype)


def npu_attention_update(lse: Sequence[torch.Tensor], local_out: Sequence[torch.Tensor], update_type: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results: ``lse_max = max_i lse_i``, ``lse_m = lse_max + log(sum_i exp(lse_i -
    lse_max))``, ``O = sum_i O_i * exp(lse_i - lse_m)``; lse_i ``[T * N]``, O_i ``[T * N, D]``. Returns ``(O, lse_out)``,
    O in local_out[0]'s dtype; lse_out (float32) is the merged lse (the doc: valid only for update_type 1).

    Follows: torch_npu doc ``npu_attention_update`` (the formula; shapes from its meta registration). Reached from
    ``AscendMLAImpl._compute_prefill_context`` (update_type 0: the prefix output merged with each context chunk's).
    Not emulated: update_type other than 0. A row whose every lse is -inf gives 0.
    """
    op = "npu_attention_update"
    if update_type != 0:
        _refuse(op, f"update_type={update_type} (only 0)")
    if len(lse) != len(local_out) or not lse:
        raise RuntimeError(f"{op}: {len(lse)} lse tensors for {len(local_out)} outputs")
    lses = torch.stack([x.reshape(-1).float() for x in lse])  # [sp, T*N]
    outs = torch.stack([x.float() for x in local_out])  # [sp, T*N, D]
    lse_max = lses.max(dim=0).values
    finite_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    lse_m = finite_max + torch.log(torch.exp(lses - finite_max).sum(dim=0))
    weights = torch.nan_to_num(torch.exp(lses - lse_m), nan=0.0)
    merged = (outs * weights.unsqueeze(-1)).sum(dim=0)
    return merged.to(local_out[0].dtype), lse_m


def npu_format_cast(self: torch.Tensor, acl_format: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Change a tensor's NPU storage format. ND (2) is the only format here: the tensor is returned as it is.

    Follows: torch_npu doc ``npu_format_cast`` ("修改NPU张量的格式"). Reached from
    ``AscendMLAImpl.process_weights_after_loading`` (``kv_b_proj`` weight to ``ACL_FORMAT_FRACTAL_ND``) and
    ``utils.py:maybe_trans_nz`` only where ``_should_trans_nz`` holds (not for float weights without enable_nz).
    Not emulated: any other format (FRACTAL_NZ 29, NC1HWC0, ...), whose layout would change the data.
    """
    if int(acl_format) != 2:
        _refuse("npu_format_cast", f"acl_format={acl_format} (only 2, ACL_FORMAT_FRACTAL_ND)")
    return self


from torch_npu import _c_ascend_ops  # noqa: E402,F401  (registers torch.ops._C_ascend.*)
