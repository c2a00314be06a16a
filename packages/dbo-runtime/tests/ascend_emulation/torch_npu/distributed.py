"""STAND-IN HCCL (tests only): the process-group backend ``hccl`` is gloo.

torch_npu registers HCCL for ``npu`` devices only, so a collective on a CPU tensor over an HCCL group fails ("No
backend type associated with device type cpu"). The emulation cannot reproduce that: its "npu" tensors ARE CPU
tensors, so the emulated ``hccl`` backend is registered for both device types. What HCCL-only groups forbid is
checked another way: the tests count the collectives a DBO step issues on the default group (it must issue none at
DP=1), and ``dbo-runtime doctor`` reads the backend vllm-ascend's worker asks for.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo


def _create_hccl_as_gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    return ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _create_hccl_as_gloo, devices=["cpu", "npu"])

# torch_npu adds this predicate to torch.distributed (vllm-ascend's netloader imports it).
dist.is_hccl_available = lambda: True
