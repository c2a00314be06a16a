"""vLLM's KV-cache capacity arithmetic (vLLM 0.32, `vllm/v1/core/kv_cache_utils.py`), without vLLM.

For one tensor-parallel rank and a budget `kv_cache_memory_bytes` (what `--kv-cache-memory-bytes` hands
the engine unchanged):

1. Each attention layer gets a page (one block of `block_size` tokens):
   full/sliding: `block_size * kv_heads_per_rank * (head_size + head_size_v) * dtype_bytes`;
   MLA:          `block_size * 1 * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes`.
2. The layers are split into KV cache groups (`get_kv_cache_groups`): one group when every layer has the
   same spec, otherwise one group per `group_size` layers of each kind (hybrid sliding/full models).
3. `bytes_per_block` = the largest group's summed page size; `num_blocks = budget // bytes_per_block`.
4. A request of `max_model_len` tokens needs `cdiv(L, block)` blocks in a full/MLA group and
   `cdiv(min(window - 1 + in_flight, L), block) + 1` in a sliding group, summed over groups.
   `max_concurrency = num_blocks / blocks_per_request`, `kv_cache_tokens = int(max_concurrency * L)`
   (vLLM's "KV cache size: N tokens" log line).
5. The start-up check fails when `bytes_per_block * blocks_per_request` exceeds the budget; from vLLM 0.32 on
   (PR #47272) it plans against the budget minus one block, the null block the block pool holds back, while
   vLLM <= 0.27 (0.23 is what vLLM-Ascend 0.23 pairs with) compares against the whole budget:
   `kv_capacity.settings.check_rule` picks the rule of a vLLM version.

Every function takes a :class:`kv_capacity.settings.Settings` (model, budget, max_model_len, block size, TP,
KV dtype, scheduler settings, check rule), or the model and those settings as keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from kv_capacity.errors import KVCapacityInputError
from kv_capacity.model_spec import FULL, MLA, SLIDING, ModelSpec, dtype_bytes
from kv_capacity.settings import NEWEST_RULE_DESCRIPTION, Settings, check_rule
from kv_capacity.sizes import format_gib

# --kv-cache-dtype values whose KV cache uses plain elements of this many bytes.
KV_CACHE_DTYPE_BYTES: dict[str, int | None] = {
    "auto": None,  # the model dtype
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}
ACCEPTED_KV_CACHE_DTYPES = ", ".join(KV_CACHE_DTYPE_BYTES)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV cache spec on one rank (vLLM's FullAttentionSpec / SlidingWindowSpec / MLAAttentionSpec)."""

    kind: str
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """vLLM's `cdiv(spec.max_memory_usage_bytes(cfg), spec.page_size_bytes)` for this spec."""
        if self.kind == SLIDING:
            assert self.sliding_window is not None
            tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
            return cdiv(tokens, self.block_size) + 1
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: layers that share a block table.

    `uniform_type` groups (same kind, different page sizes) hold per-layer specs, as vLLM's
    UniformTypeKVCacheSpecs does; otherwise all layers share `specs[0]`.
    """

    kind: str
    layers: tuple[int, ...]
    specs: tuple[LayerKV, ...]
    uniform_type: bool = False

    @property
    def block_size(self) -> int:
        return self.specs[0].block_size

    @property
    def page_size_bytes(self) -> int:
        """Page size of the group's spec (summed over layers for a uniform-type group)."""
        if self.uniform_type:
            return sum(s.page_size_bytes for s in self.specs)
        return self.specs[0].page_size_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes in this group's share of the pool (all its layers)."""
        return (
            sum(s.page_size_bytes for s in self.specs)
            if self.uniform_type
            else self.specs[0].page_size_bytes * len(self.layers)
        )

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return max(s.blocks_per_request(max_model_len, max_in_flight_tokens) for s in self.specs)


@dataclass(frozen=True)
class CapacityPlan:
    """What vLLM would size for one rank. All byte figures are per rank (per device)."""

    model: str
    kv_cache_memory_bytes: int
    max_model_len: int
    block_size: int
    tensor_parallel_size: int
    kv_cache_dtype: str
    kv_dtype_bytes: int
    num_kv_heads_per_rank: int
    max_in_flight_tokens: int
    groups: tuple[KVCacheGroup, ...]
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float
    kv_cache_tokens: int
    bytes_per_token: int
    needed_bytes: int
    fits: bool
    estimated_max_model_len: int
    min_kv_cache_memory_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    check_rule: str = NEWEST_RULE_DESCRIPTION
    null_block_reserved: bool = True

    @property
    def page_size_bytes(self) -> list[int]:
        """Page size per KV cache group, in group order."""
        return [g.page_size_bytes for g in self.groups]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; the keys of the CLI's `--format json`."""
        return {
            "model": self.model,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "kv_cache_memory_gib": round(self.kv_cache_memory_bytes / (1 << 30), 4),
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "num_kv_heads_per_rank": self.num_kv_heads_per_rank,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            "num_kv_cache_groups": len(self.groups),
            "kv_cache_groups": [
                {
                    "kind": g.kind,
                    "num_layers": len(g.layers),
                    "block_size": g.block_size,
                    "page_size_bytes": g.page_size_bytes,
                    "blocks_per_request": g.blocks_per_request(self.max_model_len, self.max_in_flight_tokens),
                }
                for g in self.groups
            ],
            "page_size_bytes": self.page_size_bytes,
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "blocks_per_request": self.blocks_per_request,
            "max_concurrency": self.max_concurrency,
            "kv_cache_tokens": self.kv_cache_tokens,
            "bytes_per_token": self.bytes_per_token,
            "needed_bytes": self.needed_bytes,
            "fits": self.fits,
            "estimated_max_model_len": self.estimated_max_model_len,
            "min_kv_cache_memory_bytes": self.min_kv_cache_memory_bytes,
            "vllm_log": self.vllm_log_line,
            "check_rule": self.check_rule,
            "null_block_reserved": self.null_block_reserved,
            "notes": list(self.notes),
        }

    @property
    def vllm_log_line(self) -> str:
        """The capacity line vLLM 0.32 logs at start-up for these settings (CUDA spelling: "GPU")."""
        return self.log_line("GPU")

    def log_line(self, device: str = "GPU") -> str:
        """vLLM 0.32's capacity log line; `device` is "GPU" on CUDA, else the device type upper-cased
        ("NPU" on Ascend, "CPU" on the CPU backend)."""
        return (
            f"{device} KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
            f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )

    @property
    def vllm_error_message(self) -> str | None:
        """The ValueError text vLLM raises at start-up, or None when the budget fits."""
        if self.fits:
            return None
        return vllm_failure_message(
            check_memory=self.kv_cache_memory_bytes - (self.bytes_per_block if self.null_block_reserved else 0),
            needed=self.needed_bytes,
            max_model_len=self.max_model_len,
            estimated_max_model_len=self.estimated_max_model_len,
        )


def vllm_failure_message(
    *, check_memory: int, needed: int, max_model_len: int, estimated_max_model_len: int
) -> str:
    """vLLM's `_check_enough_kv_cache_memory` message (vllm/v1/core/kv_cache_utils.py, 0.32)."""
    if check_memory <= 0:
        return (
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
            "the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). "
            "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        )
    estimated = ""
    if estimated_max_model_len > 0:
        estimated = f"Based on the available memory, the estimated maximum model length is {estimated_max_model_len}. "
    return (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({format_gib(check_memory)} GiB). {estimated}Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVCapacityInputError(f"{name} {value!r} is not allowed; expected a positive integer")
    return value


def resolve_kv_dtype_bytes(spec: ModelSpec, kv_cache_dtype: str) -> int:
    """Bytes per KV element for `--kv-cache-dtype` (auto = the model dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise KVCapacityInputError(
            f"kv cache dtype {kv_cache_dtype!r} is not supported; expected one of {ACCEPTED_KV_CACHE_DTYPES}"
        )
    size = KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    return dtype_bytes(spec.dtype) if size is None else size


def kv_heads_per_rank(spec: ModelSpec, tensor_parallel_size: int) -> int:
    """KV heads each TP rank holds: MLA 1 (replicated), else max(1, heads // tp), as vLLM's model code."""
    tp = _positive_int(tensor_parallel_size, "tensor parallel size")
    if spec.is_mla:
        return 1
    if spec.num_attention_heads % tp:
        raise KVCapacityInputError(
            f"tensor parallel size {tp} does not divide the {spec.num_attention_heads} attention heads of "
            f"{spec.name}; expected a divisor of {spec.num_attention_heads}"
        )
    heads = spec.num_kv_heads
    if (heads >= tp and heads % tp) or (heads < tp and tp % heads):
        raise KVCapacityInputError(
            f"tensor parallel size {tp} neither divides nor is a multiple of the {heads} KV heads of {spec.name}; "
            "vLLM requires one or the other"
        )
    return max(1, heads // tp)


def layer_specs(
    spec: ModelSpec, *, block_size: int, tensor_parallel_size: int, kv_cache_dtype: str
) -> list[LayerKV]:
    """Per-layer KV cache specs on one rank, as the model's attention layers would report them."""
    block = _positive_int(block_size, "block size")
    heads = kv_heads_per_rank(spec, tensor_parallel_size)
    nbytes = resolve_kv_dtype_bytes(spec, kv_cache_dtype)
    out = []
    for kind in spec.layer_kinds:
        if kind == MLA:
            out.append(LayerKV(MLA, block, 1, spec.head_size, 0, nbytes))
        elif kind == SLIDING:
            # vLLM 0.32 gives sliding layers the primary block size when the backend can run it unsplit
            # (Attention.get_kv_cache_spec -> _largest_kernel_block_within), true of the common backends.
            out.append(
                LayerKV(SLIDING, block, heads, spec.head_size, spec.head_size_v, nbytes, spec.sliding_window)
            )
        else:
            out.append(LayerKV(FULL, block, heads, spec.head_size, spec.head_size_v, nbytes))
    return out


def _same_type(specs: list[LayerKV]) -> bool:
    """vLLM's UniformTypeKVCacheSpecs.is_uniform_type for the kinds sized here."""
    if len({s.block_size for s in specs}) > 1:
        return False
    first = specs[0]
    if first.kind == SLIDING:
        return all(s.kind == SLIDING and s.sliding_window == first.sliding_window for s in specs)
    return all(s.kind in (FULL, MLA) for s in specs)


def kv_cache_groups(specs: list[LayerKV]) -> list[KVCacheGroup]:
    """vLLM's get_kv_cache_groups for full / sliding-window / MLA layers (hybrid KV cache manager on)."""
    if not specs:
        raise KVCapacityInputError("model has no attention layers; nothing to size")
    indices = tuple(range(len(specs)))
    if all(s == specs[0] for s in specs):
        return [KVCacheGroup(specs[0].kind, indices, (specs[0],))]
    if _same_type(specs):
        return [KVCacheGroup(specs[0].kind, indices, tuple(specs), uniform_type=True)]

    # Hybrid: unify page sizes by growing the block size of the smaller pages
    # (unify_kv_cache_spec_page_size), then split each kind into groups of `group_size` layers.
    max_page = max(s.page_size_bytes for s in specs)
    unified = []
    for s in specs:
        if s.page_size_bytes != max_page:
            if max_page % s.page_size_bytes:
                raise KVCapacityInputError(
                    "model mixes layers whose page sizes do not divide each other; this hybrid layout cannot be sized"
                )
            s = replace(s, block_size=s.block_size * (max_page // s.page_size_bytes))
        unified.append(s)

    buckets: dict[LayerKV, list[int]] = {}
    for i, s in enumerate(unified):
        buckets.setdefault(s, []).append(i)
    layer_lists = list(buckets.values())
    min_layers = min(len(v) for v in layer_lists)
    max_layers = max(len(v) for v in layer_lists)
    group_size = max_layers if max_layers < min_layers * 1.5 else min_layers
    groups = []
    for spec, layers in buckets.items():
        # layers[i::num_groups] rather than consecutive slices, as vLLM does (keeps PP stages balanced).
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroup(spec.kind, tuple(layers[i::num_groups]), (spec,)))
    return groups


def _groups_and_block_bytes(
    specs: list[LayerKV], disable_hybrid_kv_cache_manager: bool = False
) -> tuple[list[KVCacheGroup], int]:
    """The groups and the pool's bytes per block: the largest group's pages (vLLM's
    _get_kv_cache_bytes_per_block; a group short of group_size layers is thereby padded)."""
    kinds = {s.kind for s in specs}
    if disable_hybrid_kv_cache_manager and SLIDING in kinds and len(kinds) > 1:
        # unify_hybrid_kv_cache_specs: sliding layers keep their compute but get full-attention caches.
        specs = [replace(s, kind=FULL, sliding_window=None) if s.kind == SLIDING else s for s in specs]
    groups = kv_cache_groups(specs)
    return groups, max(g.bytes_per_block for g in groups)


@dataclass(frozen=True)
class _Layout:
    """Everything about a (model, block, TP, dtype) that does not depend on the budget or the length."""

    groups: tuple[KVCacheGroup, ...]
    bytes_per_block: int
    dtype_bytes: int
    bytes_per_token: int


@lru_cache(maxsize=256)
def _layout(
    spec: ModelSpec, block_size: int, tensor_parallel_size: int, kv_cache_dtype: str, disable_hybrid: bool
) -> _Layout:
    specs = layer_specs(
        spec, block_size=block_size, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype
    )
    groups, bytes_per_block = _groups_and_block_bytes(specs, disable_hybrid)
    return _Layout(
        tuple(groups),
        bytes_per_block,
        specs[0].dtype_bytes,
        sum(s.page_size_bytes for s in specs) // block_size,
    )


def _blocks_per_request(groups: list[KVCacheGroup], max_model_len: int, in_flight: int) -> int:
    return sum(g.blocks_per_request(max_model_len, in_flight) for g in groups)


def _estimate_max_model_len(
    groups: list[KVCacheGroup], bytes_per_block: int, upper: int, memory: int, in_flight: int
) -> int:
    """vLLM's `_estimate_max_model_len_from_groups`: binary search over [1, max_model_len]."""

    def fits(length: int) -> bool:
        return bytes_per_block * _blocks_per_request(groups, length, in_flight) <= memory

    if not fits(1):
        return 0
    left, right, result = 1, upper, 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


def plan(settings: Settings | ModelSpec, /, **fields: Any) -> CapacityPlan:
    """The KV cache vLLM would allocate on each rank for ``settings.kv_cache_memory_bytes``, and whether it
    starts (under ``settings.rule``, the start-up check of a vLLM version: :func:`check_rule`; default the newest).

    ``plan(spec, kv_cache_memory_bytes=..., max_model_len=..., ...)`` is short for ``plan(Settings(spec, ...))``.
    `disable_hybrid_kv_cache_manager` mirrors vLLM's flag: a model mixing sliding and full layers then caches
    every layer in full.
    """
    s = Settings.of(settings, fields)
    spec = s.model
    budget = _positive_int(s.kv_cache_memory_bytes, "kv cache memory bytes")
    length = _positive_int(s.max_model_len, "max model len")
    in_flight = _in_flight_tokens(s)
    layout = _layout(spec, s.block_size, s.tensor_parallel_size, s.kv_cache_dtype, bool(s.disable_hybrid_kv_cache_manager))
    groups, bytes_per_block = layout.groups, layout.bytes_per_block

    num_blocks = budget // bytes_per_block
    per_request = _blocks_per_request(groups, length, in_flight)
    max_concurrency = num_blocks / per_request
    kv_cache_tokens = int(max_concurrency * length)
    needed = bytes_per_block * per_request
    rule = s.rule or check_rule(None)
    reserved = bytes_per_block if rule.null_block_reserved else 0
    check_memory = budget - reserved  # vLLM >= 0.32 holds the null block back (get_kv_cache_configs)
    fits = check_memory > 0 and needed <= check_memory
    estimated = (
        length
        if fits
        else (
            _estimate_max_model_len(groups, bytes_per_block, length, check_memory, in_flight)
            if check_memory > 0
            else 0
        )
    )
    tp = s.tensor_parallel_size
    notes = list(spec.notes)
    heads = kv_heads_per_rank(spec, tp)
    if not spec.is_mla and spec.num_kv_heads < tp:
        notes.append(
            f"{spec.num_kv_heads} KV heads < TP {tp}: each head is replicated on "
            f"{tp // spec.num_kv_heads} ranks, capacity stops growing with TP"
        )
    if spec.is_mla and tp > 1:
        notes.append("MLA latent cache is replicated on every TP rank: TP does not add token capacity")
    if spec.max_position_embeddings and length > spec.max_position_embeddings:
        notes.append(
            f"max_model_len {length} exceeds the model's max_position_embeddings {spec.max_position_embeddings}: "
            "vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or rope scaling raises the limit)"
        )
    if (
        s.disable_hybrid_kv_cache_manager
        and spec.num_sliding_layers
        and not any(g.kind == SLIDING for g in groups)
    ):
        notes.append("hybrid KV cache manager disabled: sliding-window layers are cached like full attention")
    if any(g.kind == SLIDING for g in groups):
        notes.append(
            f"sliding-window blocks per request assume {in_flight} in-flight tokens "
            f"(max_num_batched_tokens x concurrent batches)"
        )

    return CapacityPlan(
        model=spec.name,
        kv_cache_memory_bytes=budget,
        max_model_len=length,
        block_size=s.block_size,
        tensor_parallel_size=tp,
        kv_cache_dtype=s.kv_cache_dtype,
        kv_dtype_bytes=layout.dtype_bytes,
        num_kv_heads_per_rank=heads,
        max_in_flight_tokens=in_flight,
        groups=tuple(groups),
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        blocks_per_request=per_request,
        max_concurrency=max_concurrency,
        kv_cache_tokens=kv_cache_tokens,
        bytes_per_token=layout.bytes_per_token,
        needed_bytes=needed,
        fits=fits,
        estimated_max_model_len=estimated,
        min_kv_cache_memory_bytes=bytes_per_block * per_request + reserved,
        notes=tuple(notes),
        check_rule=rule.description,
        null_block_reserved=rule.null_block_reserved,
    )


def required_bytes(settings: Settings | ModelSpec, /, *, concurrency: int, **fields: Any) -> int:
    """The smallest `--kv-cache-memory-bytes` whose pool holds `concurrency` requests of `max_model_len`
    (``settings.kv_cache_memory_bytes`` and ``settings.rule`` play no part).

    The pool has `num_blocks - 1` usable blocks (the null block), so the answer is
    `bytes_per_block * (concurrency * blocks_per_request + 1)`; for concurrency 1 it equals the smallest
    budget vLLM's start-up check accepts. One byte less loses a block and no longer holds them.
    ``required_bytes(spec, concurrency=N, max_model_len=..., ...)`` is short for the Settings form.
    """
    s = Settings.of(settings, fields)
    length = _positive_int(s.max_model_len, "max model len")
    count = _positive_int(concurrency, "concurrency")
    in_flight = _in_flight_tokens(s)
    layout = _layout(s.model, s.block_size, s.tensor_parallel_size, s.kv_cache_dtype,
                     bool(s.disable_hybrid_kv_cache_manager))
    return layout.bytes_per_block * (count * _blocks_per_request(layout.groups, length, in_flight) + 1)


def _in_flight_tokens(s: Settings) -> int:
    """vLLM's max_in_flight_tokens: the scheduler's token budget per step times the batches in flight."""
    return _positive_int(s.max_num_batched_tokens, "max num batched tokens") * _positive_int(
        s.max_concurrent_batches, "max concurrent batches"
    )


def bytes_per_token(spec: ModelSpec, *, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto") -> int:
    """KV bytes one token takes on one rank across all layers (before block rounding)."""
    specs = layer_specs(
        spec, block_size=1, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype
    )
    return sum(s.page_size_bytes for s in specs)


__all__ = [
    "CapacityPlan",
    "KVCacheGroup",
    "LayerKV",
    "bytes_per_token",
    "kv_cache_groups",
    "plan",
    "required_bytes",
    "vllm_failure_message",
]
