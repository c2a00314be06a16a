"""Pure parts of the NPU model-runner wrapper: the attention-metadata split (on a STAND-IN dataclass with the field
names of vllm_ascend 0.23.0.post1's AscendCommonAttentionMetadata, which inherits vLLM's CommonAttentionMetadata)
and the split decision."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from dbo_runtime.ascend.runner import decide_split, split_common_attn_metadata
from dbo_runtime.ascend.validate import batch_may_split
from dbo_runtime.ubatch import UBatchSlice, slice_request_metadata


@dataclass
class StandinAscendCommonAttentionMetadata:
    """Stand-in: the fields of vLLM 0.23 CommonAttentionMetadata + vllm_ascend AscendCommonAttentionMetadata."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: Any = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    _seq_lens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None
    # vllm_ascend additions
    seq_lens_cpu: torch.Tensor = None
    num_computed_tokens_cpu: torch.Tensor = None
    decode_token_per_req: int = 1
    actual_seq_lengths_q: list[int] = field(default_factory=list)
    positions_cpu: torch.Tensor = None
    attn_state: Any = None
    graph_pad_size: int = -1
    num_input_tokens: int = 0
    prefill_context_parallel_metadata: Any = None
    kvcomp_metadata: Any = None


QUERY_LENS = [4, 10, 2]
COMPUTED = [0, 5, 20]


def _batch(mrope: bool = False) -> StandinAscendCommonAttentionMetadata:
    qsl = torch.tensor([0, 4, 14, 16], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(COMPUTED, QUERY_LENS, strict=True)], dtype=torch.int32)
    n = 16
    positions = torch.arange(100, 100 + n) if not mrope else torch.arange(3 * n).reshape(3, n)
    return StandinAscendCommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens.clone(),
        seq_lens_cpu=seq_lens.clone(), _seq_lens_cpu=seq_lens.clone(), seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_computed_tokens_cpu=torch.tensor(COMPUTED), num_reqs=3, num_actual_tokens=n, max_query_len=10,
        max_seq_len=22, block_table_tensor=torch.arange(30).reshape(3, 10), slot_mapping=torch.arange(1000, 1000 + n),
        positions=positions, is_prefilling=torch.tensor([True, True, False]), actual_seq_lengths_q=[4, 14, 16],
        attn_state="ChunkedPrefill", graph_pad_size=8, num_input_tokens=n,
        logits_indices_padded=torch.arange(3), num_logits_indices=3,
    )


UB0 = UBatchSlice(slice(0, 2), slice(0, 8))   # request 1 straddles the cut at token 8
UB1 = UBatchSlice(slice(1, 3), slice(8, 16))


def test_split_straddling_request_with_ascend_fields() -> None:
    cm = _batch()
    before = dataclasses.asdict(cm)
    a, b = split_common_attn_metadata(UB0, cm), split_common_attn_metadata(UB1, cm)
    assert type(a) is type(cm)
    assert a.query_start_loc_cpu.tolist() == [0, 4, 8] and b.query_start_loc_cpu.tolist() == [0, 6, 8]
    assert a.query_start_loc.dtype == torch.int32
    # request 1: the first half sees its context up to the cut, the second half the whole sequence
    assert a.seq_lens.tolist() == [4, 9] and b.seq_lens.tolist() == [15, 22]
    assert a.seq_lens_cpu.tolist() == [4, 9] and a._seq_lens_cpu.tolist() == [4, 9]
    assert a.seq_lens_cpu_upper_bound.tolist() == [4, 9]
    assert (a.num_reqs, a.num_actual_tokens, a.max_query_len, a.max_seq_len) == (2, 8, 4, 9)
    assert (b.num_reqs, b.num_actual_tokens, b.max_query_len, b.max_seq_len) == (2, 8, 6, 22)
    assert a.block_table_tensor.tolist() == cm.block_table_tensor[0:2].tolist()
    assert b.block_table_tensor.tolist() == cm.block_table_tensor[1:3].tolist()
    assert b.slot_mapping.tolist() == list(range(1008, 1016)) and b.positions.tolist() == list(range(108, 116))
    # computed tokens are each micro-batch's own: request 1 has 5 + micro-batch 0's 4 tokens in micro-batch 1
    assert a.num_computed_tokens_cpu.tolist() == [0, 5]
    assert b.num_computed_tokens_cpu.tolist() == [9, 20] and b.is_prefilling.tolist() == [True, False]
    # Ascend-specific fields
    assert (a.num_input_tokens, b.num_input_tokens) == (8, 8)
    assert (a.graph_pad_size, b.graph_pad_size) == (-1, -1)
    assert a.actual_seq_lengths_q == [4, 8] and b.actual_seq_lengths_q == [6, 8]
    assert a.attn_state == b.attn_state == "ChunkedPrefill"
    assert a.logits_indices_padded is None and a.num_logits_indices is None
    # the input is untouched
    after = dataclasses.asdict(cm)
    assert all(torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
               for k in before)


def test_split_agrees_with_dbo_runtime_ubatch_slicing() -> None:
    cm = _batch()
    for ub in (UB0, UB1):
        qsl, lens = slice_request_metadata(cm.query_start_loc_cpu.tolist(), cm.seq_lens.tolist(), ub)
        sub = split_common_attn_metadata(ub, cm)
        assert sub.query_start_loc_cpu.tolist() == qsl and sub.seq_lens.tolist() == lens


def test_split_mrope_positions_and_refuses_pcp() -> None:
    cm = _batch(mrope=True)
    b = split_common_attn_metadata(UB1, cm)
    assert b.positions.shape == (3, 8) and torch.equal(b.positions, cm.positions[:, 8:16])
    cm.prefill_context_parallel_metadata = object()
    with pytest.raises(ValueError, match="prefill context parallel"):
        split_common_attn_metadata(UB0, cm)


def _decide(*, moe_comm_type: str | None, use_cascade_attn: bool = False, num_reqs: int = 4, **kw: Any) -> Any:
    """The Ascend decision: the shared decide_split with vLLM-Ascend's per-batch veto (ascend_may_split's core)."""
    return decide_split(may_split=batch_may_split(moe_comm_type=moe_comm_type, use_cascade_attn=use_cascade_attn,
                                                  num_reqs=num_reqs), **kw)


def test_decide_split_votes_on_logical_tokens_and_vetoes() -> None:
    common = dict(uniform_decode=False, decode_token_threshold=32, prefill_token_threshold=512)
    yes = _decide(num_tokens=600, num_tokens_padded=600, moe_comm_type="ALLGATHER", is_dummy=False, **common)
    assert yes.split and yes.padded_num_tokens == 600
    # a graph-padded dummy must not pass the threshold on its padded size (the DP hang of the micropuma fork)
    assert not _decide(num_tokens=1, num_tokens_padded=4104, moe_comm_type="ALLGATHER", is_dummy=False,
                       **common).split
    assert not _decide(num_tokens=600, num_tokens_padded=600, moe_comm_type="ALLGATHER", is_dummy=True,
                       **common).split
    assert not _decide(num_tokens=600, num_tokens_padded=600, moe_comm_type="MoECommType.MC2",
                       is_dummy=False, **common).split
    assert not _decide(num_tokens=600, num_tokens_padded=600, moe_comm_type=None, use_cascade_attn=True,
                       is_dummy=False, **common).split
    decode = dict(common, uniform_decode=True)
    assert _decide(num_tokens=64, num_tokens_padded=64, moe_comm_type=None, is_dummy=False, **decode).split
    assert not _decide(num_tokens=16, num_tokens_padded=16, moe_comm_type=None, is_dummy=False,
                       **decode).split


class RecordingNPUStandin:
    """Stand-in for dbo_runtime.devices.npu.NPUBackend: records set_stream_limit calls (no torch_npu here)."""

    name = "npu"
    has_streams = True

    def __init__(self) -> None:
        self.limits: list[tuple[str, int, int]] = []
        self.count = 0

    def new_stream(self) -> str:
        self.count += 1
        return f"stream{self.count}"

    def set_stream_limit(self, stream: str, *, cube_num: int = -1, vector_num: int = -1) -> None:
        self.limits.append((stream, cube_num, vector_num))

    def current_stream(self) -> str:
        return "stream0"


def test_comm_core_limits_from_environment() -> None:
    from dbo_runtime.devices.limits import COMM_AIC_ENV, COMM_AIV_ENV, CommLimitedBackend, comm_core_limits
    from dbo_runtime.errors import DBOConfigError

    assert comm_core_limits({}) == (-1, -1)
    assert comm_core_limits({COMM_AIC_ENV: "4", COMM_AIV_ENV: "16"}) == (4, 16)
    for bad in ({COMM_AIV_ENV: "8"}, {COMM_AIC_ENV: "x"}, {COMM_AIC_ENV: "0"}):
        with pytest.raises(DBOConfigError, match="DBO_RUNTIME_ASCEND_COMM_A"):
            comm_core_limits(bad)
    inner = RecordingNPUStandin()
    limited = CommLimitedBackend(inner, cube_num=4, vector_num=16)  # type: ignore[arg-type]
    assert limited.new_stream() == "stream1" and inner.limits == [("stream1", 4, 16)]
    assert limited.current_stream() == "stream0" and limited.name == "npu"
    unlimited = CommLimitedBackend(inner, cube_num=-1, vector_num=-1)  # type: ignore[arg-type]
    unlimited.new_stream()
    assert len(inner.limits) == 1


def _run(texts: list[list[str]], logprobs: list[list[float]]) -> dict:
    return {"results": [{"prompt": f"p{i}", "text": "".join(t), "tokens": t, "logprobs": lp}
                        for i, (t, lp) in enumerate(zip(texts, logprobs, strict=True))]}


def test_compare_diff_text_identity_and_logprobs(tmp_path) -> None:
    import json

    from dbo_runtime.ascend.compare import diff_runs
    from dbo_runtime.cli import main as cli_main

    a = _run([["a", "b", "c"], ["x", "y"]], [[-0.1, -0.2, -0.3], [-1.0, -2.0]])
    b = _run([["a", "b", "c"], ["x", "z"]], [[-0.1, -0.25, -0.3], [-1.5, -0.1]])
    d = diff_runs(a, b)
    assert (d.prompts, d.identical, d.first_divergence) == (2, 1, (None, 1))
    # common tokens: 3 of prompt 0 and the first of prompt 1
    assert d.compared_tokens == 4
    assert d.max_abs_logprob_diff == pytest.approx(0.5) and d.mean_abs_logprob_diff == pytest.approx(0.55 / 4)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert cli_main(["ascend-compare", "diff", str(pa), str(pb)]) == 0
    assert cli_main(["ascend-compare", "diff", str(pa), str(pb), "--min-identical", "0.9"]) == 1
    assert cli_main(["ascend-compare", "diff", str(pa), str(pb), "--max-logprob-diff", "0.1"]) == 1
    pb.write_text(json.dumps({"results": [{"prompt": "other", "text": "", "tokens": [], "logprobs": []}]}))
    with pytest.raises(Exception, match="different prompts"):
        diff_runs(a, json.loads(pb.read_text()))
    assert cli_main(["ascend-compare", "diff", str(pa), str(pb)]) == 2


def test_pad_last_slice_for_the_forward_pass() -> None:
    from dbo_runtime.ascend.runner import pad_last_slice

    padded = pad_last_slice([UB0, UB1], 20)
    assert [s.token_slice for s in padded] == [slice(0, 8), slice(8, 20)]
    assert padded[1].request_slice == UB1.request_slice
    assert pad_last_slice([UB0, UB1], 16)[1].token_slice == slice(8, 16)
    with pytest.raises(ValueError, match="below the last slice"):
        pad_last_slice([UB0, UB1], 12)
