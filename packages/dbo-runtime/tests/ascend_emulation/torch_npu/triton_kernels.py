"""STAND-IN (tests only): CPU versions of the Triton kernels vLLM-Ascend's runner launches outside the model.

On an Ascend host these run through triton-ascend. Here Triton has no driver (vLLM disables it), so the launch
``kernel[grid](...)`` of a ``@triton.jit`` placeholder fails. Each kernel below is written from its Triton source
(the file is named), with plain torch, for the arguments the DBO paths pass (no context parallelism), and replaces
the name in the modules that launch it when they are imported (:func:`install`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

import torch


class _Launch:
    """``kernel[grid](*args)`` -> ``fn(*args)``: the grid is the Triton launch grid, meaningless on the CPU."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.fn


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor, block_table_stride: int,
                         block_size: int, slot_mapping: torch.Tensor, *, TOTAL_CP_WORLD_SIZE: int,
                         TOTAL_CP_RANK: int, CP_KV_CACHE_INTERLEAVE_SIZE: int, PAD_ID: int,
                         BLOCK_SIZE: int) -> None:
    """vllm/v1/worker/block_table.py ``_compute_slot_mapping_kernel``: each request's tokens get
    ``block_table[req, pos // block_size] * block_size + pos % block_size``; slots from ``num_tokens`` to
    ``max_num_tokens`` get ``PAD_ID``."""
    if TOTAL_CP_WORLD_SIZE != 1:
        from torch_npu import NotEmulatedError

        raise NotEmulatedError("_compute_slot_mapping_kernel with context parallelism is not emulated")
    qsl = query_start_loc.to(torch.int64).tolist()
    for req in range(len(qsl) - 1):
        start, end = qsl[req], qsl[req + 1]
        if end <= start:
            continue
        pos = positions[start:end].to(torch.int64)
        blocks = block_table[req, pos // block_size].to(torch.int64)
        slot_mapping[start:end] = blocks * block_size + pos % block_size
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


# module -> {name: replacement}
REPLACEMENTS: dict[str, dict[str, Any]] = {
    "vllm_ascend.worker.block_table": {"_compute_slot_mapping_kernel": _Launch(compute_slot_mapping)},
    "vllm.v1.worker.block_table": {"_compute_slot_mapping_kernel": _Launch(compute_slot_mapping)},
}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in REPLACEMENTS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_replace(module: Any) -> None:
            exec_module(module)
            for attr, value in REPLACEMENTS[name].items():
                setattr(module, attr, value)

        loader.exec_module = exec_and_replace  # type: ignore[method-assign]
        return spec


def install() -> None:
    for name, replacements in REPLACEMENTS.items():
        module = sys.modules.get(name)
        if module is not None:
            for attr, value in replacements.items():
                setattr(module, attr, value)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
