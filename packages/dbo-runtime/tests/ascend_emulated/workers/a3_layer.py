"""One EP rank of a 2-rank expert-parallel MoE layer on vllm-ascend's A3 all-to-all path, run whole and as two
DBO micro-batches (issue 27).

Real: ``TokenDispatcherWithAll2AllV.token_dispatch`` / ``token_combine`` (its all-to-all-v over the EP group of
vLLM's ``init_distributed_environment(..., "hccl")`` + ``ensure_model_parallel_initialized``), every hook site of
this project's table installed into the real vllm_ascend modules with the plugin's wrapper (the dispatch and
combine sites yield), ``run_ubatches`` on the CPU backend. STAND-IN: the experts (one float32 matrix per expert,
the same on every rank, applied row by row per ``group_list`` count instead of ``npu_grouped_matmul``), the router (random
top-k per token, seeded), the NPU (emulation). argv: RANK PORT; prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _emu  # noqa: E402
import torch  # noqa: E402

HIDDEN, EXPERTS, TOP_K = 16, 4, 2
TOKEN_COUNTS = (9, 7, 1, 2)  # odd counts; per rank, split into two micro-batches of n // 2 and n - n // 2


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    from vllm.config import set_current_vllm_config

    config = _emu.vllm_config("qwen3_moe", tensor_parallel_size=2, enable_expert_parallel=True)
    with set_current_vllm_config(config), _emu.distributed(rank, 2, port):
        from dbo_runtime.ascend.patching import install_sites
        from dbo_runtime.ascend.runner import PerUBatchState, ascend_site_wrapper
        from dbo_runtime.devices import get_backend
        from dbo_runtime.workers import run_ubatches
        from vllm.distributed.parallel_state import get_ep_group
        from vllm_ascend.ops.fused_moe.moe_stage_contracts import MoETokenDispatchInput
        from vllm_ascend.ops.fused_moe.moe_stage_params import MoEQuantParams, MoERoutingParams
        from vllm_ascend.ops.fused_moe.token_dispatcher import TokenDispatcherWithAll2AllV

        ep = get_ep_group()
        assert ep.world_size == 2, ep.world_size
        local = EXPERTS // ep.world_size
        dispatcher = TokenDispatcherWithAll2AllV(top_k=TOP_K, num_experts=EXPERTS, num_local_experts=local)
        weights = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7)) / HIDDEN ** 0.5
        mine = weights[ep.rank_in_group * local:(ep.rank_in_group + 1) * local]

        def moe(hidden: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            out = dispatcher.token_dispatch(MoETokenDispatchInput(
                hidden_states=hidden, topk_weights=probs, topk_ids=ids, routing=MoERoutingParams(expert_map=None, global_redundant_expert_num=0, mc2_mask=None,
                                         apply_router_weight_on_input=False),
                quant=MoEQuantParams()))
            rows, start = [], 0
            for e, count in enumerate(out.group_list.tolist()):  # group_list_type 1: tokens per local expert
                # one row at a time: a GEMM of more rows may sum in another order (CPU sgemm), which is not
                # what this compares
                chunk = out.hidden_states[start:start + int(count)]
                rows.append(torch.bmm(chunk.unsqueeze(1), mine[e].expand(len(chunk), HIDDEN, HIDDEN)).squeeze(1))
                start += int(count)
            return dispatcher.token_combine(torch.cat(rows), out.combine_metadata)

        results = []
        gen = torch.Generator().manual_seed(100 + rank)
        installation = install_sites(wrap=ascend_site_wrapper(None, PerUBatchState()), dispatch_key="PrivateUse1")
        try:
            for n in TOKEN_COUNTS:
                hidden = torch.randn(n, HIDDEN, generator=gen)
                ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(n)]).to(torch.int32)
                probs = torch.rand(n, TOP_K, generator=gen)
                whole = moe(hidden, ids, probs)
                cut = n // 2
                parts = [slice(0, cut), slice(cut, n)]
                halves = run_ubatches([lambda s=s, h=hidden, i=ids, p=probs: moe(h[s], i[s], p[s]) for s in parts],
                                      backend=get_backend("cpu"), timeout_s=60)
                split = torch.cat(halves)
                reference = torch.stack([sum(probs[t, k] * (hidden[t] @ weights[int(ids[t, k])])
                                             for k in range(TOP_K)) for t in range(n)])
                results.append({"tokens": n, "equal": bool(torch.equal(whole, split)),
                                "max_diff": float((whole - split).abs().max()),
                                "reference_diff": float((whole - reference).abs().max())})
        finally:
            installation.uninstall()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
