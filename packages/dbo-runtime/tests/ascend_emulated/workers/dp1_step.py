"""One TP rank of a TP=2, DP=1 vLLM-Ascend deployment taking DBO's split decision for a step (fault 1, issue 27).

Real: vLLM's ``init_distributed_environment`` with the backend vllm-ascend's worker passes ("hccl": the emulation's
gloo), the ``VllmConfig`` under ``NPUPlatform`` with this project's plugin turning DBO back on, and
``AscendIntegration.determine_batch_execution_and_padding``. STAND-IN: the runner object (its parallel config and
vllm config are the real ones) and the original method's result. Prints one JSON line: the decision and every
collective issued during it, with its group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _emu  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    from dbo_runtime.ascend.runner import AscendIntegration, ForwardContextSwitch
    from dbo_runtime.devices import get_backend
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor

    config = _emu.vllm_config(enable_dbo=True, tensor_parallel_size=2, dbo_decode_token_threshold=2,
                              dbo_prefill_token_threshold=4, additional_config={"enable_flashcomm1": True})
    calls: list[str] = []
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object", "barrier"):
        original = getattr(dist, name)

        def counting(*args, _name=name, _orig=original, **kwargs):
            group = kwargs.get("group")
            calls.append(f"{_name}:{'default' if group in (None, dist.group.WORLD) else 'subgroup'}")
            return _orig(*args, **kwargs)

        setattr(dist, name, counting)
    with set_current_vllm_config(config), _emu.distributed(rank, 2, port):
        integration = AscendIntegration(ForwardContextSwitch(lambda ctx: None), backend=lambda: get_backend("cpu"))
        runner = SimpleNamespace(parallel_config=config.parallel_config, vllm_config=config, uniform_decode_query_len=1)

        def original(runner, num_tokens, *args, **kwargs):
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_tokens), False, None, None

        calls.clear()
        result = integration.determine_batch_execution_and_padding(
            runner, original, 16, 4, np.array([4, 4, 4, 4]), 4)
    print(json.dumps({"enable_dbo": config.parallel_config.enable_dbo, "split": bool(result[2]), "calls": calls}))


if __name__ == "__main__":
    main()
