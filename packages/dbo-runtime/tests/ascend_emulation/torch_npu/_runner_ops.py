"""STAND-IN operators (tests only) that the NPU worker and runner reach outside the model's layers.

``_npu_matmul_add_fp32(x, weight, c)``: only called by vllm-ascend's ``NPUWorker._warm_up_atb`` (worker.py) to warm
ATB up, its result unused. It has no entry in torch-npu 2.10.0.post4's ``_op_plugin_docs.py``; the semantics here
(``c += x^T @ weight`` in float32, the shapes the warm-up passes: (2, 4), (2, 4), (4, 4)) are read from that call
and the op's name, not from documentation.
"""

from __future__ import annotations

import torch

__all__ = ["_npu_matmul_add_fp32"]


def _npu_matmul_add_fp32(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return c.add_(x.transpose(0, 1).to(torch.float32) @ weight.to(torch.float32))
