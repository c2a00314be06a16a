"""STAND-IN ``torch_npu._C`` (tests only): the two names vllm-ascend reaches outside the operators."""

from __future__ import annotations

import torch


def _weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # torch_npu returns a tensor sharing the storage without owning it; on the CPU a view keeps the same memory.
    return tensor.view(tensor.shape)


def _npu_getDevice() -> int:
    from torch_npu import npu

    return npu.current_device()


class _NPUTaskGroupHandle:
    """The handle of a captured ACL graph task group (a type annotation in vllm-ascend; graphs are not emulated)."""
