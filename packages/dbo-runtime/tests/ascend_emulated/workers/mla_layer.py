"""Two MLA attention layers of the tiny DeepSeek-V2 on vllm-ascend's REAL MLA path, a batch run whole and as two DBO
micro-batches (issue 27, fault 3 and the MLA verdict), float32, one rank.

Real: vLLM's ``DeepseekV2MLAAttention`` (its linear layers, RMSNorm and rotary embedding under vllm-ascend's
platform, so vllm-ascend's ``AscendMultiHeadLatentAttention`` / ``mla_forward`` op), vllm-ascend's
``AscendMLAMetadataBuilder`` and ``AscendMLAImpl`` (``mla_v1.py``: preprocess, KV-cache write, decode and prefill
attention, context chunks, ``_v_up_proj``), ``set_ascend_forward_context``, this project's split
(``split_ubatches`` cut, ``split_common_attn_metadata``), ``own_rotary_tables`` (the fault-3 fix, as
``AscendIntegration.own_metadata`` applies it), every hook site installed into the real vllm_ascend modules with
the plugin's wrapper, ``run_ubatches`` with each micro-batch's forward context re-installed when it resumes. One
metadata builder per micro-batch, both micro-batches' metadata built before either runs, as the runner does.
STAND-IN: the NPU (emulation); the weights, the hidden states entering the layers and the cached context (seeded
random); the batches' ``AscendCommonAttentionMetadata`` (``_emu.common_metadata``); the hand-over after each MLA
layer (a ``wrap_stream_site`` of nothing), standing where a DeepSeek decoder layer's A2 MoE prepare all-gather
yields. Why one rank: at TP 1 the MLA layer has no collective of its own (its ``mla.preprocess`` site yields only
where FlashComm1 all-gathers across TP ranks); the cross-rank MoE sites of the A2 path run in
``test_engine_dbo.py``'s DeepSeek engine.

Prints ``RESULT <json>``, per attention state: the DBO difference (max |split - whole| of the second layer's output)
of the requests the cut leaves whole and of the cut request; the noise bound (max over batch compositions without
DBO of a request's difference to the whole batch); the chunk bound of a cut request (the same request prefilled in
two steps without DBO, at every boundary); and, as a negative control, the DBO difference with the fault-3 fix
taken out; the order the micro-batches ran their layers in.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _emu  # noqa: E402
import torch  # noqa: E402

LAYERS = 2
NUM_BLOCKS = 24
BLOCKS_PER_REQ = 3  # 384 tokens per request at most

# (request id, new tokens, computed tokens). The id picks the request's blocks and tokens in every composition.
CASES = {
    # decode only: 7 requests (odd), positions spread over blocks
    "DecodeOnly": dict(state="DecodeOnly", reqs=[(0, 1, 5), (1, 1, 130), (2, 1, 33), (3, 1, 9), (4, 1, 260),
                                                 (5, 1, 1), (6, 1, 77)]),
    # a fresh prefill: 3 requests of 5, 9, 4 tokens; the cut at token 9 falls inside request 1
    "PrefillNoCache": dict(state="PrefillNoCache", reqs=[(0, 5, 0), (1, 9, 0), (2, 4, 0)]),
    # chunked prefill: 2 decodes, then prefills with cached context (vllm-ascend puts decodes first); the cut at
    # token 8 leaves the last of request 2's 7 new tokens (over 20 cached) to micro-batch 1, where MLA runs it as a
    # decode
    "ChunkedPrefill": dict(state="ChunkedPrefill", reqs=[(0, 1, 40), (1, 1, 7), (2, 7, 20), (3, 5, 131),
                                                         (4, 3, 0)]),
}


def main() -> None:
    from vllm.config import set_current_vllm_config

    cfg = _emu.vllm_config("deepseek_v2_moe", max_num_batched_tokens=512)
    with set_current_vllm_config(cfg), _emu.distributed(), torch.inference_mode():
        print("RESULT " + json.dumps(run(cfg)), flush=True)


def run(cfg) -> dict:
    import vllm_ascend.ops.rotary_embedding as rope
    from dbo_runtime.ascend.patching import install_sites
    from dbo_runtime.ascend.runner import (
        PerUBatchState,
        ascend_site_wrapper,
        own_rotary_tables,
        set_vllm_forward_context,
    )
    from dbo_runtime.devices import get_backend
    from dbo_runtime.hooks import wrap_stream_site
    from dbo_runtime.ubatch import split_ubatches
    from dbo_runtime.vllm.split import split_common_attn_metadata
    from dbo_runtime.workers import run_ubatches
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention
    from vllm_ascend.ascend_config import get_ascend_config
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context
    from vllm_ascend.attention.attention_v1 import AscendAttentionState
    from vllm_ascend.attention.mla_v1 import AscendMLAMetadataBuilder
    from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec
    from vllm_ascend.utils import register_ascend_customop, set_weight_prefetch_method

    register_ascend_customop(cfg)  # as NPUWorker.__init__: vLLM's MLA wrapper becomes vllm-ascend's
    set_weight_prefetch_method(get_ascend_config().weight_prefetch_config)  # as NPUModelRunner.__init__
    hf = cfg.model_config.hf_text_config
    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layer = DeepseekV2MLAAttention(
            vllm_config=cfg, config=hf, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
            qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, cache_config=cfg.cache_config,
            prefix=f"model.layers.{i}.self_attn")
        for name, p in layer.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        layer.mla_attn.mla_attn.process_weights_after_loading(torch.float32)
        layers.append(layer)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    rope.set_cos_and_sin(cfg, cfg.scheduler_config.max_num_seqs, 1, torch.float32, torch.device("npu:0"))
    spec = AscendMLAAttentionSpec(block_size=_emu.BLOCK_SIZE, num_kv_heads=1,
                                  head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=torch.float32)
    builders = [AscendMLAMetadataBuilder(spec, names, cfg, torch.device("npu:0")) for _ in range(2)]

    def fresh_cache(context: dict[int, torch.Tensor]) -> None:
        """Each request's context (positions 0..computed-1) already in every layer's cache: the cache a previous
        step would have written, the same for every composition (each request owns the same blocks)."""
        for layer_idx, layer in enumerate(layers):
            c = torch.zeros(NUM_BLOCKS, _emu.BLOCK_SIZE, 1, hf.kv_lora_rank)
            pe = torch.zeros(NUM_BLOCKS, _emu.BLOCK_SIZE, 1, hf.qk_rope_head_dim)
            for rid, rows in context.items():
                n = rows.shape[1]
                pos = torch.arange(n)
                blocks = rid * BLOCKS_PER_REQ + pos // _emu.BLOCK_SIZE
                c[blocks, pos % _emu.BLOCK_SIZE, 0] = rows[layer_idx, :, :hf.kv_lora_rank]
                pe[blocks, pos % _emu.BLOCK_SIZE, 0] = rows[layer_idx, :, hf.kv_lora_rank:]
            layer.mla_attn.mla_attn.kv_cache = (c, pe)

    def metadata(reqs):
        """vllm-ascend's common metadata for requests (id, q_len, computed), request ``id`` owning blocks
        ``id*BLOCKS_PER_REQ...`` whatever its place in the batch; the state as ``NPUModelRunner._build_attn_state``
        gives it (no computed tokens: PrefillNoCache; one token each: DecodeOnly; else ChunkedPrefill)."""
        if all(c == 0 for _, _, c in reqs):
            state = AscendAttentionState.PrefillNoCache
        elif all(q == 1 for _, q, _ in reqs):
            state = AscendAttentionState.DecodeOnly
        else:
            state = AscendAttentionState.ChunkedPrefill
        cm = _emu.common_metadata([q for _, q, _ in reqs], [c for _, _, c in reqs], attn_state=state,
                                  num_blocks_per_req=BLOCKS_PER_REQ)
        table = torch.stack([torch.arange(rid * BLOCKS_PER_REQ, (rid + 1) * BLOCKS_PER_REQ, dtype=torch.int32)
                             for rid, _, _ in reqs])
        slots = []
        for rid, q, c in reqs:
            for p in range(c, c + q):
                slots.append((rid * BLOCKS_PER_REQ + p // _emu.BLOCK_SIZE) * _emu.BLOCK_SIZE + p % _emu.BLOCK_SIZE)
        cm.block_table_tensor = table
        cm.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        return cm

    def forward(hidden: torch.Tensor, md, n: int, ubatch: int | None = None) -> torch.Tensor:
        """Both layers under this batch's forward context; as micro-batch ``ubatch``, hand over after each layer,
        where a DeepSeek decoder layer's A2 MoE prepare all-gather yields (the next thing after MLA)."""
        with set_ascend_forward_context({name: md for name in names}, cfg, num_tokens=n, num_actual_tokens=n):
            if ubatch is not None:
                contexts[ubatch] = get_forward_context()
            out = hidden
            for i, layer in enumerate(layers):
                positions = torch.zeros(n, dtype=torch.int64)  # read from the metadata's cos/sin, not here
                out = layer(positions, out, None)
                if ubatch is not None:
                    order.append(f"{ubatch}:{i}")
                    out = hand_over(out)
            return out

    hand_over = wrap_stream_site("test.moe_prepare", lambda h: h)
    contexts: list = [None, None]
    order: list[str] = []

    def resume(ubatch: int) -> None:
        """Each time a micro-batch takes the baton: its own forward context back (vLLM's is one global), as the
        runner's ForwardContextSwitch restores it after a yield."""
        if contexts[ubatch] is not None:
            set_vllm_forward_context(contexts[ubatch])

    def tokens_of(reqs, inputs):
        return torch.cat([inputs[rid][c:c + q] for rid, q, c in reqs])

    def run_case(reqs: list[tuple[int, int, int]], state: str) -> dict:
        gen = torch.Generator().manual_seed(17)
        total = {rid: c + q for rid, q, c in reqs}
        inputs = {rid: torch.randn(total[rid], hf.hidden_size, generator=gen) for rid in total}
        context = {rid: torch.randn(LAYERS, c, hf.kv_lora_rank + hf.qk_rope_head_dim, generator=gen)
                   for rid, _, c in reqs if c}

        def run_batch(batch, reset: bool = True) -> dict[int, torch.Tensor]:
            """One step without DBO: the layer outputs of ``batch``'s tokens, per request."""
            if reset:
                fresh_cache(context)
            cm = metadata(batch)
            md = builders[0].build(0, cm)
            out = forward(tokens_of(batch, inputs), md, cm.num_actual_tokens)
            rows, start = {}, 0
            for rid, q, _ in batch:
                rows[rid] = out[start:start + q]
                start += q
            return rows

        reference = run_batch(reqs)

        # Noise (no DBO), the same requests in other batch compositions: orders, subsets, alone (decodes first,
        # as AscendMLAMetadataBuilder.reorder_batch puts them). torch's CPU GEMMs are not batch-invariant in
        # the last bits of a row, so a request's output depends on the rows beside it.
        def decodes_first(batch):
            return [r for r in batch if r[1] == 1] + [r for r in batch if r[1] > 1]

        compositions = [decodes_first(b) for b in (list(reversed(reqs)), reqs[::2], reqs[1::2],
                                                   [reqs[-1]] + reqs[:-1], reqs[1:] + reqs[:1])]
        compositions += [[r] for r in reqs]
        noise = 0.0
        for batch in compositions:
            for rid, rows in run_batch(batch).items():
                noise = max(noise, float((rows - reference[rid]).abs().max()))

        # DBO: the batch cut by split_ubatches, each half built by its own builder before either runs
        cm = metadata(reqs)
        assert str(cm.attn_state).endswith(state), (state, cm.attn_state)
        slices = split_ubatches([q for _, q, _ in reqs])
        hidden = tokens_of(reqs, inputs)

        def dbo(own) -> tuple[torch.Tensor, list]:
            fresh_cache(context)
            halves = [split_common_attn_metadata(ub, cm) for ub in slices]
            mds = [own(builders[i].build(0, h)) for i, h in enumerate(halves)]
            contexts[:] = [None, None]
            order.clear()
            outs = run_ubatches(
                [lambda i=i, ub=ub: forward(hidden[ub.token_slice], mds[i], ub.num_tokens, ubatch=i)
                 for i, ub in enumerate(slices)], backend=get_backend("cpu"), timeout_s=120,
                on_resume=[lambda: resume(0), lambda: resume(1)])
            return torch.cat(outs), mds

        # negative control: the fault-3 fix taken out (micro-batch 1's build overwrites micro-batch 0's rows)
        without_fix, _ = dbo(lambda md: md)
        split, mds = dbo(own_rotary_tables)
        per_req, cut, start = {}, {}, 0
        for rid, q, c in reqs:
            per_req[rid] = float((split[start:start + q] - reference[rid]).abs().max())
            if slices[0].token_slice.start < start + q and start < slices[0].token_slice.stop < start + q:
                cut[rid] = (q, c, slices[0].token_slice.stop - start)  # tokens in micro-batch 0
            start += q

        # A cut request's second part is a chunked prefill over its first part (attention over the cached
        # context merged by lse, the MLA prefill path in bf16): its bound is that of the same request
        # prefilled in two chunks without DBO, at every boundary.
        chunk_bound, same_boundary = 0.0, 0.0
        for rid, (q, c, b_dbo) in cut.items():
            for b in range(1, q):
                first = run_batch([(rid, b, c)])[rid]
                second = run_batch([(rid, q - b, c + b)], reset=False)[rid]
                diff = float((torch.cat((first, second)) - reference[rid]).abs().max())
                chunk_bound = max(chunk_bound, diff)
                if b == b_dbo:
                    start = sum(qq for rr, qq, _ in reqs[:[r for r, _, _ in reqs].index(rid)])
                    same_boundary = float((torch.cat((first, second)) - split[start:start + q]).abs().max())
        return {
            "cut_at": slices[0].token_slice.stop, "cut_requests": sorted(cut),
            "states": [str(md.attn_state).rsplit(".", 1)[-1] for md in mds],
            "compositions": len(compositions) + 1, "noise_bound": noise,
            "dbo_diff_uncut": max([d for r, d in per_req.items() if r not in cut], default=0.0),
            "dbo_diff_cut": max([d for r, d in per_req.items() if r in cut], default=0.0),
            "chunk_boundaries": sum(q - 1 for q, _, _ in cut.values()), "chunk_bound": chunk_bound,
            "cut_vs_same_boundary_without_dbo": same_boundary, "dbo_diff_per_request": per_req,
            "order": list(order),
            "dbo_diff_without_rotary_fix": float((without_fix - torch.cat([reference[r] for r, _, _ in reqs])
                                                  ).abs().max()),
        }

    results = {}
    installation = install_sites(wrap=ascend_site_wrapper(None, PerUBatchState()), dispatch_key="PrivateUse1")
    try:
        for case, spec_case in CASES.items():
            results[case] = run_case(spec_case["reqs"], spec_case["state"])
    finally:
        installation.uninstall()
    return results


if __name__ == "__main__":
    main()
