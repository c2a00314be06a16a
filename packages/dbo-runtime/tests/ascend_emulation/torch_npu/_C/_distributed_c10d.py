"""STAND-IN ``torch_npu._C._distributed_c10d`` (tests only): ``ProcessGroupHCCL`` and its ``Options``; the
emulated HCCL groups are gloo groups (torch_npu.distributed)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class ProcessGroupHCCL:
    class Options:
        def __init__(self) -> None:
            self.hccl_config: dict[str, Any] = {}
            self._timeout = None
            self.is_high_priority_stream = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from torch_npu import NotEmulatedError

        raise NotEmulatedError("ProcessGroupHCCL is not constructed directly in the emulation; "
                               "init_process_group(backend='hccl') makes a gloo group")


def _get_backend_gloo(group: dist.ProcessGroup) -> Any:
    return group
