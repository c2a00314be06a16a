"""STAND-IN ``torch_npu.atb`` (tests only): the ATB operators the DBO paths reach under their ``torch_npu.atb``
names. Any other ``torch_npu.atb.npu_*`` raises :class:`torch_npu.NotEmulatedError` naming itself when called."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["npu_paged_cache_load"]


def npu_paged_cache_load(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                         context_lens: torch.Tensor, *, seq_starts: torch.Tensor | None = None, cumsum: bool = False,
                         key: torch.Tensor | None = None, value: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each request's cached tokens into contiguous rows: request ``b`` contributes the
    ``context_lens[b]`` tokens at positions ``seq_starts[b] ...`` (0 without seq_starts) of its block-table row
    (``position p -> block block_table[b, p // block_size], offset p % block_size``), requests one after the other.
    key_cache ``[num_blocks, block_size, N, Dk]``, value_cache ``[num_blocks, block_size, N, Dv]``; written into
    ``key`` ``[num_tokens, N, Dk]`` / ``value`` (cast to their dtype) when given, and returned.

    Follows: torch_npu ATB doc ``npu_paged_cache_load`` (wheel ``op_plugin/atb/_atb_api_docs.py``: "根据blockTable
    中的blockId值、contextLens中key/value的seqLen从keyCache/valueCache中将内存不连续的token搬运、拼接成连续的
    key/value序列", seq_starts "每个batch在blocktable中对应的起始位置", cumsum: context_lens as cumulative sums).
    seq_starts is read as a token position within the request (vllm-ascend passes chunk starts that are multiples
    of the block size, where a block index and a token position agree). Reached from
    ``device/device_op.py:BaseDeviceAdaptor.kv_cache_load`` <- ``AscendMLAImpl._compute_prefill_context``.
    Not emulated: nothing else of the signature; int8 caches are copied as they are.
    """
    lens = [int(v) for v in context_lens.reshape(-1).tolist()]
    if cumsum:
        lens = [end - (lens[i - 1] if i else 0) for i, end in enumerate(lens)]
    starts = [0] * len(lens) if seq_starts is None else [int(v) for v in seq_starts.reshape(-1).tolist()]
    block_size = key_cache.shape[1]
    keys, values = [], []
    for b, (length, start) in enumerate(zip(lens, starts, strict=True)):
        if length <= 0:
            continue
        pos = torch.arange(start, start + length)
        blocks = block_table[b].to(torch.int64)[pos // block_size]
        keys.append(key_cache[blocks, pos % block_size])
        values.append(value_cache[blocks, pos % block_size])
    k = torch.cat(keys) if keys else key_cache.new_empty(0, *key_cache.shape[2:])
    v = torch.cat(values) if values else value_cache.new_empty(0, *value_cache.shape[2:])
    if key is not None:
        if key.shape[0] != k.shape[0]:
            raise RuntimeError(f"npu_paged_cache_load: key holds {key.shape[0]} rows for {k.shape[0]} tokens")
        key.copy_(k.reshape(key.shape))
        k = key
    if value is not None:
        if value.shape[0] != v.shape[0]:
            raise RuntimeError(f"npu_paged_cache_load: value holds {value.shape[0]} rows for {v.shape[0]} tokens")
        value.copy_(v.reshape(value.shape))
        v = value
    return k, v


def __getattr__(name: str) -> Any:
    if name.startswith("npu_") or name.startswith("_npu_"):
        def not_emulated(*args: Any, **kwargs: Any) -> Any:
            from torch_npu import NotEmulatedError

            raise NotEmulatedError(f"torch_npu.atb.{name} is not emulated (the DBO paths were not seen to reach it); "
                                   "the emulated operators are listed in docs/dbo-vllm-ascend.md")

        not_emulated.__name__ = name
        return not_emulated
    raise AttributeError(f"module 'torch_npu.atb' (emulation) has no attribute {name!r}")
