"""What the emulated-Ascend tests share: a real ``VllmConfig`` under vllm-ascend's ``NPUPlatform`` (a generated tiny
model, float32, block size 128 as on Ascend), vLLM's distributed state on gloo-backed "hccl" groups, and real
``AscendCommonAttentionMetadata`` batches.

Import order matters: ``vllm_ascend.platform`` and ``vllm_ascend.ops`` first (their import cycle resolves in that
order, as when vLLM loads the platform plugin).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import vllm_ascend.ops  # noqa: F401
import vllm_ascend.platform  # noqa: F401  (first: the order the plugin loader uses)

BLOCK_SIZE = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model(family: str = "qwen3") -> Path:
    from dbo_runtime.vllm.tinymodels import ensure_family_model

    cache = Path(os.environ.get("DBO_EMULATED_MODELS") or Path(__file__).resolve().parents[4] / ".cache" / "emulated")
    return ensure_family_model(family, cache)


def vllm_config(family: str = "qwen3", **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(tiny_model(family)), dtype="float32", max_model_len=512, block_size=BLOCK_SIZE,
                enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=512)
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


@contextlib.contextmanager
def distributed(rank: int = 0, world: int = 1, port: int | None = None, *, tp: int | None = None) -> Iterator[None]:
    """vLLM's own ``init_distributed_environment`` with the backend vllm-ascend's worker passes ("hccl", emulated on
    gloo) and its model-parallel groups (TP = ``tp`` or the world)."""
    from vllm.distributed import parallel_state as ps

    port = port or free_port()
    ps.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "hccl")
    ps.ensure_model_parallel_initialized(tp or world, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def common_metadata(query_lens: Sequence[int], computed: Sequence[int], *, attn_state: Any,
                    num_blocks_per_req: int = 4) -> Any:
    """An ``AscendCommonAttentionMetadata`` as vllm-ascend's runner fills it: request ``i`` owns blocks
    ``i*num_blocks_per_req ...``, its tokens' slots follow its positions in those blocks."""
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    positions, slots = [], []
    for i, (c, q) in enumerate(zip(computed, query_lens, strict=True)):
        for p in range(c, c + q):
            positions.append(p)
            slots.append((i * num_blocks_per_req + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE)
    n = len(query_lens)
    block_table = torch.arange(n * num_blocks_per_req, dtype=torch.int32).reshape(n, num_blocks_per_req)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AscendCommonAttentionMetadata(
        query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t.clone(), seq_lens=seq_t.clone(),
        seq_lens_cpu=seq_t.clone(), _seq_lens_cpu=seq_t.clone(),
        num_computed_tokens_cpu=torch.tensor(list(computed), dtype=torch.int32), num_reqs=n,
        num_actual_tokens=qsl[-1], max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64), actual_seq_lengths_q=qsl[1:],
        attn_state=attn_state, num_input_tokens=qsl[-1], causal=True,
    )
