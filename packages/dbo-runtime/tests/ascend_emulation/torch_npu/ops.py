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
    Returns (out [S_q, N, D_v], lse [S_q, N]); a query row that sees no key gets out 0 and lse -inf."""
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
    mask, 1, 2, 4, 9), pse_shift, every quantization / antiquant argument, left padding, shared prefix, MLA
    query_rope/key_rope, the (blocknum, N_kv, blocksize, D) cache layout. A query row that sees no key (not possible
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
                  actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope, key_rope=key_rope,
                  key_rope_antiquant_scale=key_rope_antiquant_scale)
    if input_layout != "TND":
        _refuse(op, f"input_layout={input_layout!r} (only 'TND')")
    if sparse_mode != 3:
        _refuse(op, f"sparse_mode={sparse_mode} (only 3, rightDownCausal)")
    if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
        _refuse(op, "antiquant modes")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _refuse(op, f"query dtype {query.dtype}")
    _check_causal_mask(op, atten_mask)
    if actual_seq_lengths is None or actual_seq_lengths_kv is None:
        raise RuntimeError(f"{op}: TND layout needs actual_seq_lengths and actual_seq_lengths_kv")
    if query.dim() != 3 or query.shape[1] != num_heads:
        raise RuntimeError(f"{op}: TND query must be [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
    n_kv = num_key_value_heads or num_heads
    if num_heads % n_kv:
        raise RuntimeError(f"{op}: num_heads {num_heads} is not a multiple of num_key_value_heads {n_kv}")
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
            rows = torch.arange(q_len).unsqueeze(1)
            cols = torch.arange(kv_len).unsqueeze(0)
            visible = cols <= kv_len - q_len + rows
            o, s = _attend(query[q_start:q_end], k, v, scale, visible)
            out[q_start:q_end], lse[q_start:q_end] = o, s
        q_start = q_end
    attn_out = out.to(query.dtype)
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


from torch_npu import _c_ascend_ops  # noqa: E402,F401  (registers torch.ops._C_ascend.*)
