"""STAND-IN ``torch.ops._C_ascend`` operators (tests only): the two vllm-ascend custom kernels the DBO MoE paths call
even when vllm-ascend's own ``vllm_ascend_C`` library is not built (``device/device_op.py:BaseDeviceAdaptor``
calls them unconditionally on A2/A3).

Each is registered with :mod:`torch.library` under the namespace ``_C_ascend`` with the schema of vllm-ascend
0.23.0.post1's ``csrc/torch_binding.cpp`` and a CPU (CompositeExplicitAutograd) implementation written from the
operator's reference: the golden functions of vllm-ascend's own operator tests (sdist
``tests/e2e/nightly/single_node/ops/singlecard_ops/``) and the torch_npu doc of the operator each one mirrors.
Arguments outside the DBO paths (quantization, drop/pad mode) raise :class:`torch_npu.NotEmulatedError`.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("_C_ascend", "FRAGMENT")  # module-level: the registrations live as long as it

_LIB.define(
    "npu_moe_init_routing_custom(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
    "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
    "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
    "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define(
    "moe_gating_top_k(Tensor x, int k, int k_group, int group_count, int group_select_mode, int renorm, "
    "int norm_type, bool out_flag, float routed_scaling_factor, float eps, Tensor? bias_opt=None) "
    "-> (Tensor y, Tensor expert_idx, Tensor out)")


def _refuse(op: str, what: str) -> None:
    from torch_npu import NotEmulatedError

    raise NotEmulatedError(f"torch.ops._C_ascend.{op}: {what} is not emulated (the DBO paths were not seen to "
                           "use it)")


def npu_moe_init_routing_custom(x: torch.Tensor, expert_idx: torch.Tensor, *, scale: torch.Tensor | None = None,
                                offset: torch.Tensor | None = None, active_num: int = -1,
                                expert_capacity: int = -1, expert_num: int = -1, drop_pad_mode: int = 0,
                                expert_tokens_num_type: int = 0, expert_tokens_num_flag: bool = False,
                                quant_mode: int = 0, active_expert_range: list[int] | None = None,
                                row_idx_type: int = 0
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing: expand each token (``x`` ``[NUM_ROWS, H]``) once per chosen expert (``expert_idx``
    ``[NUM_ROWS, K]``), sort the copies by expert id (stable, on the flat index ``row * K + k``), keep the experts
    in ``active_expert_range = [start, end)``. Returns
    ``(expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale)``:

    - expanded_x ``[min(NUM_ROWS*K, active_num) or NUM_ROWS*K, H]``: the first ``available`` rows are the sorted
      copies (``available`` = entries with an expert in range, capped by active_num > 0); the rest are 0 here
      (undefined on the device).
    - expanded_row_idx ``[NUM_ROWS*K]`` int32. row_idx_type 0 ("gather"): indexed by flat entry, the expanded row
      holding it, -1 for entries outside the range. row_idx_type 1 ("scatter"): indexed by expanded row, the flat
      entry it holds, for the first ``available`` rows; the rest are -1 here (undefined on the device).
    - expert_token_cumsum_or_count int64: per expert in the range, counts (type 1) or their cumsum (type 0), or
      ``[expert_num, 2]`` (expert, count) pairs of the non-empty experts followed by a (0, 0) pair (type 2).
    - expanded_scale ``[len(expanded_x)]`` float32: ``scale[row]`` of each expanded row when a 1-D scale is given,
      else 0 (undefined on the device).

    Follows: schema ``npu_moe_init_routing_custom`` in vllm-ascend ``csrc/torch_binding.cpp`` and its meta
    function (``csrc/torch_binding_meta.cpp``) for shapes; semantics from ``moe_init_routing_golden`` in vllm-ascend
    ``tests/e2e/nightly/single_node/ops/singlecard_ops/test_moe_init_routing_custom.py`` and the torch_npu doc
    ``npu_moe_init_routing_v2`` (same signature; "-1和0均表示按全部tokens处理").
    Not emulated: quantization (quant_mode 0/1), offset, a 2-D (dynamic-quant) scale, drop/pad mode
    (drop_pad_mode 1).
    """
    op = "npu_moe_init_routing_custom"
    if quant_mode != -1:
        _refuse(op, f"quant_mode={quant_mode} (only -1, no quantization)")
    if drop_pad_mode != 0:
        _refuse(op, f"drop_pad_mode={drop_pad_mode} (only 0, dropless)")
    if offset is not None:
        _refuse(op, "offset")
    if scale is not None and scale.dim() != 1:
        _refuse(op, f"a {scale.dim()}-D scale (quantization scales)")
    if x.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        raise RuntimeError(f"{op}: x must be [NUM_ROWS, H] and expert_idx [NUM_ROWS, K], got {tuple(x.shape)} "
                           f"and {tuple(expert_idx.shape)}")
    if expert_tokens_num_type not in (0, 1, 2):
        raise RuntimeError(f"{op}: expert_tokens_num_type must be 0, 1 or 2, got {expert_tokens_num_type}")
    start, end = (0, expert_num) if not active_expert_range else (int(active_expert_range[0]),
                                                                    int(active_expert_range[1]))
    if not 0 <= start < end or (expert_num > 0 and end > expert_num):
        raise RuntimeError(f"{op}: active_expert_range [{start}, {end}) with expert_num {expert_num}")
    num_rows, k = expert_idx.shape
    flat = expert_idx.reshape(-1).to(torch.int64)
    in_range = (flat >= start) & (flat < end)
    available = int(in_range.sum())
    keys = torch.where(flat < start, torch.full_like(flat, torch.iinfo(torch.int32).max), flat)
    order = torch.argsort(keys, stable=True)  # sorted position -> flat entry; in-range entries come first
    out_rows = min(num_rows * k, active_num) if active_num > 0 else num_rows * k
    kept = min(available, out_rows)
    expanded_x = torch.zeros(out_rows, x.shape[1], dtype=x.dtype, device=x.device)
    expanded_x[:kept] = x.index_select(0, order[:kept] // k)
    expanded_row_idx = torch.full((num_rows * k,), -1, dtype=torch.int32, device=x.device)
    if row_idx_type == 0:
        expanded_row_idx[order[:available]] = torch.arange(available, dtype=torch.int32, device=x.device)
    elif row_idx_type == 1:
        expanded_row_idx[:available] = order[:available].to(torch.int32)
    else:
        raise RuntimeError(f"{op}: row_idx_type must be 0 or 1, got {row_idx_type}")
    valid_experts = flat[order[:available]]
    counts = torch.bincount(valid_experts - start, minlength=end - start).to(torch.int64)
    if expert_tokens_num_type == 1:
        expert_tokens = counts
    elif expert_tokens_num_type == 0:
        expert_tokens = counts.cumsum(0)
    else:
        expert_tokens = torch.zeros(expert_num, 2, dtype=torch.int64, device=x.device)
        nonzero = torch.nonzero(counts).reshape(-1)
        expert_tokens[:nonzero.numel(), 0] = nonzero + start
        expert_tokens[:nonzero.numel(), 1] = counts[nonzero]
    if not expert_tokens_num_flag:
        expert_tokens = torch.zeros_like(expert_tokens)
    expanded_scale = torch.zeros(out_rows, dtype=torch.float32, device=x.device)
    if scale is not None:
        expanded_scale[:kept] = scale.float().index_select(0, order[:kept] // k)
    return expanded_x, expanded_row_idx, expert_tokens, expanded_scale


def moe_gating_top_k(x: torch.Tensor, k: int, k_group: int, group_count: int, group_select_mode: int,
                     renorm: int, norm_type: int, out_flag: bool, routed_scaling_factor: float, eps: float,
                     bias_opt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE gating: ``norm = softmax(x)`` (norm_type 0) or ``sigmoid(x)`` (norm_type 1) over the experts
    (``x`` ``[rows, E]``); selection scores ``norm + bias``; with ``group_count > 1`` only the ``k_group`` best
    groups stay (group score: max, group_select_mode 0, or sum of its top 2, mode 1); the top ``k`` experts by
    selection score (ties to the lower id). Returns ``(y, expert_idx, out)``: ``y = norm[expert_idx]`` (without
    bias), divided by ``sum(y) + eps`` when renorm is 1 or norm_type is 1, times ``routed_scaling_factor``, in x's
    dtype; expert_idx int32; out = norm, float32 ``[rows, E]`` (returned whatever out_flag says).

    Follows: schema ``moe_gating_top_k`` in vllm-ascend ``csrc/torch_binding.cpp`` (shapes from
    ``csrc/torch_binding_meta.cpp``); semantics from ``moe_gating_top_k_numpy_ref`` in vllm-ascend
    ``tests/e2e/nightly/single_node/ops/singlecard_ops/test_npu_moe_gating_top_k.py`` and the torch_npu doc
    ``npu_moe_gating_top_k`` (argument constraints, checked here: E <= 2048, E divisible by group_count with more
    than 2 experts per group, 1 <= k_group <= group_count, 1 <= k <= E / group_count * k_group).
    Not emulated: nothing else of this schema. Computed in float32.
    """
    op = "moe_gating_top_k"
    if x.dim() != 2:
        raise RuntimeError(f"{op}: x must be 2-D, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f"{op}: float16, float32 or bfloat16 x expected, got {x.dtype}")
    rows, experts = x.shape
    if experts > 2048 or group_count < 1 or experts % group_count or experts // group_count <= 2:
        raise RuntimeError(f"{op}: {experts} experts in {group_count} groups violates the kernel's constraints")
    if not 1 <= k_group <= group_count or not 1 <= k <= experts // group_count * k_group:
        raise RuntimeError(f"{op}: k={k}, k_group={k_group} with {experts} experts in {group_count} groups")
    if norm_type not in (0, 1):
        raise RuntimeError(f"{op}: norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")
    xf = x.float()
    norm = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    select = norm if bias_opt is None else norm + bias_opt.float()
    if group_count > 1:
        grouped = select.reshape(rows, group_count, -1)
        if group_select_mode == 0:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :k_group]
        keep = torch.zeros(rows, group_count, dtype=torch.bool, device=x.device)
        keep.scatter_(1, best, True)
        select = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(rows, experts)
    idx = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1 or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), norm


_LIB.impl("npu_moe_init_routing_custom", npu_moe_init_routing_custom, "CompositeExplicitAutograd")
_LIB.impl("moe_gating_top_k", moe_gating_top_k, "CompositeExplicitAutograd")
