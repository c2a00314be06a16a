"""STAND-IN HCCL (tests only): the process-group backend ``hccl`` is gloo.

torch_npu registers HCCL for ``npu`` devices only, so a collective on a CPU tensor over an HCCL group fails ("No
backend type associated with device type cpu"). The emulation cannot reproduce that: its "npu" tensors ARE CPU
tensors, so the emulated ``hccl`` backend is registered for both device types. What HCCL-only groups forbid is
checked another way: the tests count the collectives a DBO step issues on the default group (it must issue none at
DP=1), and ``dbo-runtime doctor`` reads the backend vllm-ascend's worker asks for.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo


def _get_hccl_comm_name(self, rank: int) -> str:
    return f"emulated-hccl-{id(self):x}-rank{rank}"


# The one HCCL-specific query vllm-ascend makes of a group's backend: the name of its HCCL communicator
# (``get_hccl_comm_name``, read by the MoE token dispatchers for fused kernels, which the emulation does not provide).
# The process group hands back its backend as the C++ gloo type, so the method goes on that type.
ProcessGroupGloo.get_hccl_comm_name = _get_hccl_comm_name


def _create_hccl_as_gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    return ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _create_hccl_as_gloo, devices=["cpu", "npu"])

# torch_npu adds this predicate to torch.distributed (vllm-ascend's netloader imports it).
dist.is_hccl_available = lambda: True


def _histc_counts_integers(histc):
    """torch_npu's ``histc`` takes integer tensors (vllm-ascend's all-to-all dispatcher counts int32 expert ids with
    it); the CPU kernel refuses them. Integer inputs are counted as float32 (exact below 2**24), the result in the
    input's dtype as on the NPU; every other call is torch's own."""

    def call(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's parameter names
        if out is None and not input.is_floating_point() and not input.is_complex():
            return histc(input.to(torch.float32), bins=bins, min=min, max=max).to(input.dtype)
        return histc(input, bins=bins, min=min, max=max) if out is None else histc(input, bins=bins, min=min,
                                                                                       max=max, out=out)

    call.__wrapped__ = histc
    return call


if not hasattr(torch.histc, "__wrapped__"):
    torch.histc = _histc_counts_integers(torch.histc)
