"""A DeepSeek-style MoE decoder in plain torch, expert-parallel across ranks, with DBO hook sites.

Each layer: RMSNorm -> causal multi-head attention with RoPE over a per-request KV cache -> residual ->
RMSNorm -> router (softmax, top-k) and a shared expert -> routed experts (expert parallel) -> residual.
Attention is data parallel (every rank owns its own requests, weights replicated); the routed experts are
split over the ranks, so the tokens travel to the experts and back in one of two patterns:

- ``a2``: all-gather every rank's tokens before the experts (MoE prepare), reduce-scatter the partial expert
  outputs after them (MoE finalize); vLLM-Ascend's A2 ``PrepareAndFinalizeWithAllGather``.
- ``a3``: all-to-all dispatch of each token to the ranks that own its experts, all-to-all combine back;
  vLLM-Ascend's A3 ``TokenDispatcherWithAll2AllV``.

The communication boundaries go through :func:`dbo_runtime.hooks.dbo_async_site`, the same implementation the
vLLM-Ascend adapter uses. Everything is deterministic from ``MoEConfig.seed``.

Batch invariance: DBO on and off must give bitwise equal fp32 outputs, but CPU GEMMs with fewer than 4 rows take
another code path than larger ones, so every matmul pads its rows to at least ``_MIN_ROWS``. Attention always
runs over the whole fixed-length KV cache with a causal mask by position, so a request split between the two
micro-batches sees exactly the same reduction lengths as unsplit.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from dbo_runtime.context import dbo_current_ubatch_id, dbo_enabled
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.hooks import dbo_async_site
from dbo_runtime.reference.comm import Collectives, PendingCollective
from dbo_runtime.reference.profiling import compute_span_name

# (h, ids, weights, layer, real rows) -> a call that returns the routed experts' output; made before the shared
# expert runs and called after it (A3 starts its counts exchange in between)
MoEPath = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], Callable[[], torch.Tensor]]

__all__ = ["PATTERNS", "DTYPES", "MoEConfig", "Batch", "KVCache", "StepTimer", "ReferenceMoE", "batch_inputs"]

PATTERNS = ("a2", "a3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MIN_ROWS = 8


@dataclass(frozen=True)
class MoEConfig:
    """Shape of the reference model. The defaults are small enough for a 2-core CPU.

    What decides how much communication a micro-batch can hide is the compute per communicated byte: a token moves
    ``hidden`` values each way, and costs about ``hidden x (top_k x expert_intermediate + shared_intermediate)``
    multiply-adds in the MoE. With intermediates of 2048 and top-2 that factor is 6144, the same order as
    DeepSeek-V2-Lite's (top-6 x 1408 routed + 2 shared experts x 1408 = 11264). Intermediates of 512 would give
    1536, and the fixed per-byte and per-boundary costs of this CPU stand-in (gloo's loopback copies on the same
    cores, launches, handoffs) would weigh four times more against the compute than on a real model.
    """

    hidden_size: int = 256
    num_heads: int = 4
    head_dim: int = 64
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 2048
    shared_intermediate: int = 2048
    rope_theta: float = 10000.0
    seed: int = 0

    def validate(self, world_size: int) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "num_layers", "num_experts", "top_k",
                     "expert_intermediate", "shared_intermediate"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DBOConfigError(f"{name}={value!r} is invalid; accepted: an integer >= 1")
        if self.head_dim % 2:
            raise DBOConfigError(f"head_dim={self.head_dim} is invalid; accepted: an even number (RoPE pairs)")
        if self.top_k > self.num_experts:
            raise DBOConfigError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; accepted: <= experts")
        if self.num_experts > 256:
            raise DBOConfigError(f"num_experts={self.num_experts} is invalid; accepted: at most 256")
        if world_size < 1 or self.num_experts % world_size:
            raise DBOConfigError(
                f"num_experts={self.num_experts} cannot be split over {world_size} ranks; accepted: a world size "
                f"that divides the number of experts"
            )

    def fingerprint(self) -> int:
        """A 62-bit digest of the configuration, compared across ranks."""
        digest = hashlib.sha256(repr(sorted(asdict(self).items())).encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2


@dataclass(frozen=True)
class Batch:
    """One step's requests on one rank: new tokens and tokens already in the KV cache, per request."""

    num_scheduled_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.num_scheduled_tokens) != len(self.num_computed_tokens) or not self.num_scheduled_tokens:
            raise DBOConfigError("a batch needs at least one request and one computed count per request")
        if any(n < 1 for n in self.num_scheduled_tokens) or any(c < 0 for c in self.num_computed_tokens):
            raise DBOConfigError("scheduled tokens must be >= 1 and computed tokens >= 0 for every request")

    @classmethod
    def prefill(cls, sizes: list[int], context: int = 0) -> Batch:
        return cls(tuple(sizes), tuple([context] * len(sizes)))

    @classmethod
    def decode(cls, num_requests: int, context: int) -> Batch:
        return cls(tuple([1] * num_requests), tuple([context] * num_requests))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_scheduled_tokens)

    @property
    def query_start_loc(self) -> list[int]:
        out = [0]
        for n in self.num_scheduled_tokens:
            out.append(out[-1] + n)
        return out

    @property
    def seq_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.num_computed_tokens, self.num_scheduled_tokens, strict=True)]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(c, c + n) for c, n in zip(self.num_computed_tokens, self.num_scheduled_tokens,
                                                               strict=True)])  # fmt: skip


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _randn(shape: tuple[int, ...], scale: float, *key: object) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(*key)) * scale


def batch_inputs(config: MoEConfig, batch: Batch, *, rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The hidden states entering layer 0 for ``batch`` on ``rank`` (deterministic)."""
    return _randn((batch.num_tokens, config.hidden_size), 1.0, config.seed, "inputs", rank, step).to(dtype)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` whose rows do not depend on how many rows there are (see the module docstring)."""
    rows = x.shape[-2]
    if rows >= _MIN_ROWS:
        return x @ w
    pad = x.new_zeros((*x.shape[:-2], _MIN_ROWS - rows, x.shape[-1]))
    return (torch.cat([x, pad], dim=-2) @ w)[..., :rows, :]


class KVCache:
    """Per layer, per request, a fixed-length K and V buffer; the context part is deterministic random."""

    def __init__(self, config: MoEConfig, batch: Batch, *, rank: int, dtype: torch.dtype) -> None:
        self.length = max(_MIN_ROWS, -(-batch.max_seq_len // 16) * 16)
        shape = (batch.num_requests, self.length, config.num_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        for layer in range(config.num_layers):
            for r, ctx in enumerate(batch.num_computed_tokens):
                if ctx:
                    kshape = (ctx, config.num_heads, config.head_dim)
                    self.k[layer][r, :ctx] = _randn(kshape, 1.0, config.seed, "k", rank, layer, r).to(dtype)
                    self.v[layer][r, :ctx] = _randn(kshape, 1.0, config.seed, "v", rank, layer, r).to(dtype)


class StepTimer:
    """Sums the compute time of a step (only one micro-batch thread runs at a time, so the spans never overlap)."""

    def __init__(self) -> None:
        self.compute_s = 0.0

    @contextlib.contextmanager
    def compute(self, tag: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with record_function(compute_span_name(tag)):
            yield
        self.compute_s += time.perf_counter() - t0


@dataclass
class _Part:
    """The tokens one forward pass covers (the whole batch, or one micro-batch)."""

    x: torch.Tensor  # [rows, hidden], DP padding included
    positions: torch.Tensor  # [real rows]
    requests: list[int]  # batch request index of each local request
    query_start_loc: list[int]  # local, over the real rows

    @property
    def num_real(self) -> int:
        return self.query_start_loc[-1]


@dataclass
class _A3Layout:
    """Where this part's tokens go in the A3 dispatch: row indices per destination rank, their counts, and the
    counts exchange in flight."""

    index: list[torch.Tensor]
    in_splits: list[int]
    counts: PendingCollective


class ReferenceMoE:
    """The model on one rank: replicated attention and shared expert, this rank's share of the routed experts."""

    def __init__(self, config: MoEConfig, *, pattern: str, comm: Collectives, dtype: torch.dtype,
                 timer: StepTimer | None = None) -> None:  # fmt: skip
        if pattern not in PATTERNS:
            raise DBOConfigError(f"pattern {pattern!r} is invalid; accepted: {', '.join(PATTERNS)}")
        config.validate(comm.world_size)
        self.config = config
        self.pattern = pattern
        self.comm = comm
        self.dtype = dtype
        self.timer = timer or StepTimer()
        self.rank, self.world_size = comm.rank, comm.world_size
        self.experts_per_rank = config.num_experts // comm.world_size
        h, nh, hd = config.hidden_size, config.num_heads, config.head_dim
        s = config.seed

        def w(shape: tuple[int, ...], *key: object) -> torch.Tensor:
            return _randn(shape, shape[0] ** -0.5, s, *key).to(dtype)

        self.layers = []
        for layer in range(config.num_layers):
            first = self.rank * self.experts_per_rank
            experts = {
                e: (w((h, 2 * config.expert_intermediate), "w13", layer, e), w((config.expert_intermediate, h), "w2", layer, e))
                for e in range(first, first + self.experts_per_rank)
            }
            self.layers.append({
                "norm1": (1.0 + 0.1 * _randn((h,), 1.0, s, "norm1", layer)).to(dtype),
                "norm2": (1.0 + 0.1 * _randn((h,), 1.0, s, "norm2", layer)).to(dtype),
                "wqkv": w((h, 3 * nh * hd), "wqkv", layer),
                "wo": w((nh * hd, h), "wo", layer),
                "gate": w((h, config.num_experts), "gate", layer),
                "shared13": w((h, 2 * config.shared_intermediate), "shared13", layer),
                "shared2": w((config.shared_intermediate, h), "shared2", layer),
                "experts": experts,
            })  # fmt: skip
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self._inv_freq = inv_freq

    # -- blocks ----------------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[:, None] * self._inv_freq[None, :]  # [n, hd/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        return out.to(x.dtype)

    def _mlp(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        gate_up = _mm(x, w13)
        gate, up = gate_up.chunk(2, dim=-1)
        return _mm(F.silu(gate) * up, w2)

    def _attention(self, part: _Part, h: torch.Tensor, layer: int, kv: KVCache) -> torch.Tensor:
        cfg = self.config
        nh, hd = cfg.num_heads, cfg.head_dim
        n = part.num_real
        p = self.layers[layer]
        qkv = _mm(h[:n], p["wqkv"]).view(n, 3, nh, hd)
        q = self._rope(qkv[:, 0], part.positions)
        k = self._rope(qkv[:, 1], part.positions)
        v = qkv[:, 2]
        out = h.new_zeros((h.shape[0], nh * hd))
        kcache, vcache = kv.k[layer], kv.v[layer]
        key_pos = torch.arange(kv.length)
        scale = hd**-0.5
        for i, req in enumerate(part.requests):
            a, b = part.query_start_loc[i], part.query_start_loc[i + 1]
            if a == b:
                continue
            pos = part.positions[a:b]
            kcache[req, pos] = k[a:b]
            vcache[req, pos] = v[a:b]
            qh = q[a:b].transpose(0, 1)  # [heads, n, hd]
            scores = _mm(qh, kcache[req].permute(1, 2, 0)).float() * scale  # [heads, n, L]
            scores.masked_fill_(key_pos[None, None, :] > pos[None, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(h.dtype)
            ctx = _mm(probs, vcache[req].transpose(0, 1))  # [heads, n, hd]
            out[a:b] = ctx.transpose(0, 1).reshape(b - a, nh * hd)
        return _mm(out, p["wo"])

    def _route(self, h: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _mm(h, self.layers[layer]["gate"]).float()
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.config.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(h.dtype)

    def _local_experts(self, xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int) -> torch.Tensor:
        """Sum of weight x expert(x) over the experts this rank owns (the others contribute nothing).

        Each token's terms are added in expert order, whatever the batch: every split of the batch sums alike.
        """
        out = xs.new_zeros(xs.shape)
        for e, (w13, w2) in self.layers[layer]["experts"].items():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self._mlp(xs[rows], w13, w2)
            out.index_add_(0, rows, y * weights[rows, slots, None])  # a token picks an expert at most once
        return out

    # -- expert parallel MoE, both patterns ------------------------------------------------------------------
    def _moe_a2(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int) -> torch.Tensor:
        hs, k = self.config.hidden_size, self.config.top_k
        tag = f"layer{layer}"
        with self.timer.compute(tag):
            payload = torch.cat([h, ids.to(h.dtype), weights], dim=1)

        def prepare():
            pending = self.comm.all_gather(payload, tag=tag)
            return pending.wait, pending.result

        gathered = dbo_async_site(f"{tag}.moe.prepare", prepare)
        with self.timer.compute(tag):
            xs, g_ids, g_w = gathered[:, :hs], gathered[:, hs : hs + k].long(), gathered[:, hs + k :]
            partial = self._local_experts(xs, g_ids, g_w, layer)

        def finalize():
            pending = self.comm.reduce_scatter(partial, tag=tag)
            return pending.wait, pending.result

        return dbo_async_site(f"{tag}.moe.finalize", finalize)

    def _a3_layout(self, ids: torch.Tensor, layer: int, num_real: int) -> _A3Layout:
        """Which local tokens go to which rank, and the start of the counts exchange (DeepEP's layout step).

        Runs right after routing, before the shared expert: the counts all-to-all is then in flight during that
        compute instead of being a blocking rank synchronisation at the dispatch site.
        """
        with self.timer.compute(f"layer{layer}"):
            owner = ids[:num_real] // self.experts_per_rank
            index = [(owner == j).any(dim=1).nonzero(as_tuple=True)[0] for j in range(self.world_size)]
        in_splits = [int(idx.numel()) for idx in index]
        return _A3Layout(index, in_splits, self.comm.exchange_counts_async(in_splits, tag=f"layer{layer}"))

    def _moe_a3(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int,
                layout: _A3Layout) -> torch.Tensor:  # fmt: skip
        hs, k = self.config.hidden_size, self.config.top_k
        tag = f"layer{layer}"
        index, in_splits = layout.index, layout.in_splits
        with self.timer.compute(tag):
            payload = torch.cat([h, ids.to(h.dtype), weights], dim=1)
            send = torch.cat([payload[idx] for idx in index])
        out_splits: list[int] = []

        def dispatch():
            out_splits.extend(int(v) for v in layout.counts.result().tolist())
            pending = self.comm.all_to_all(send, out_splits=out_splits, in_splits=in_splits, tag=tag)
            return pending.wait, pending.result

        recv = dbo_async_site(f"{tag}.moe.dispatch", dispatch)
        with self.timer.compute(tag):
            partial = self._local_experts(recv[:, :hs], recv[:, hs : hs + k].long(), recv[:, hs + k :], layer)

        def combine():
            pending = self.comm.all_to_all(partial, out_splits=in_splits, in_splits=out_splits, tag=tag)
            return pending.wait, pending.result

        back = dbo_async_site(f"{tag}.moe.combine", combine)
        with self.timer.compute(tag):
            routed = h.new_zeros(h.shape)
            offset = 0
            for idx in index:  # rank order: the same sum for every split of the batch
                routed[idx] = routed[idx] + back[offset : offset + idx.numel()]
                offset += idx.numel()
        return routed

    # -- forward ---------------------------------------------------------------------------------------------
    def forward_part(self, part: _Part, kv: KVCache) -> torch.Tensor:
        """Every layer over one part of the batch (the whole batch, or one micro-batch inside its thread)."""
        x = part.x
        for layer in range(self.config.num_layers):
            x = self.layer_forward(part, x, layer, kv)
        return x

    def layer_forward(self, part: _Part, x: torch.Tensor, layer: int, kv: KVCache,
                      moe: MoEPath | None = None) -> torch.Tensor:  # fmt: skip
        """One layer: attention, router, shared expert and routed experts. ``moe`` is how the routed experts'
        output is obtained: by default the pattern's collectives (:meth:`_pattern_moe`); :meth:`local_moe` gives
        the same compute with no collective (for timing the compute alone, as ``dbo-runtime estimate`` does)."""
        p = self.layers[layer]
        tag = f"layer{layer}"
        with self.timer.compute(tag):
            x = x + self._attention(part, self._rms_norm(x, p["norm1"]), layer, kv)
            h = self._rms_norm(x, p["norm2"])
            ids, weights = self._route(h, layer)
        finish = (moe or self._pattern_moe)(h, ids, weights, layer, part.num_real)  # before the shared expert
        with self.timer.compute(tag):
            shared = self._mlp(h, p["shared13"], p["shared2"])
        routed = finish()
        with self.timer.compute(tag):
            return x + shared + routed

    def _pattern_moe(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int,
                     num_real: int) -> Callable[[], torch.Tensor]:  # fmt: skip
        if self.pattern == "a3":
            layout = self._a3_layout(ids, layer, num_real)  # its counts exchange runs under the shared expert
            return lambda: self._moe_a3(h, ids, weights, layer, layout)
        return lambda: self._moe_a2(h, ids, weights, layer)

    def local_moe(self, world_size: int) -> MoEPath:
        """The A2 routed experts with each collective replaced by its local effect: the all-gather delivers
        ``world_size`` ranks' tokens (here, this part's tokens ``world_size`` times) and the reduce-scatter keeps
        this part's rows. The compute of one rank of ``world_size`` with no communication."""
        hs, k = self.config.hidden_size, self.config.top_k

        def moe(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int,
                num_real: int) -> Callable[[], torch.Tensor]:  # fmt: skip
            def finish() -> torch.Tensor:
                gathered = torch.cat([torch.cat([h, ids.to(h.dtype), weights], dim=1)] * world_size)
                partial = self._local_experts(gathered[:, :hs], gathered[:, hs:hs + k].long(), gathered[:, hs + k:],
                                              layer)
                return partial[: h.shape[0]]

            return finish

        return moe

    def whole_part(self, x: torch.Tensor, batch: Batch) -> _Part:
        return _Part(x, batch.positions(), list(range(batch.num_requests)), batch.query_start_loc)

    def owner(self) -> str:
        return f"ubatch{dbo_current_ubatch_id()}" if dbo_enabled() else "full"
