"""Test-only fault injection for one TP rank of a real vLLM engine, loaded in each worker process by vLLM's own
``--worker-extension-cls dbo_fault_worker.FaultInjection`` (this folder on ``PYTHONPATH``).

``DBO_RUNTIME_TEST_RANK_FAULT="SITE:UBATCH:RANK:ACTION:ARMFILE"``: once ARMFILE exists, micro-batch UBATCH of world
rank RANK, arriving at DBO hook site SITE during a split step, either kills its own process (``sigkill``: a worker
that crashed or was OOM-killed; nothing of it runs afterwards) or raises (``raise``). Before it does, it writes
``ARMFILE.fired`` (JSON: pid, rank, site, micro-batch, wall time), so that the test measures from that moment.
The other ranks run on. (The runtime's own ``DBO_RUNTIME_TEST_FAULT`` raises on every rank alike.)
"""

from __future__ import annotations

import json
import os
import signal
import time

ENV = "DBO_RUNTIME_TEST_RANK_FAULT"


class FaultInjection:
    """The mixin vLLM adds to the worker class; the work is done at import (below)."""


def _install() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    site, ubatch, rank, action, arm_file = spec.split(":", 4)
    import dbo_runtime.vllm.cpu as cpu

    original = cpu.maybe_inject_fault
    fired: list[bool] = []

    def maybe_inject_fault(at_site: str) -> None:
        original(at_site)
        if fired or at_site != site or not os.path.exists(arm_file):
            return
        import torch.distributed as dist
        from dbo_runtime.context import dbo_current_ubatch_id, dbo_enabled

        if not dbo_enabled() or dbo_current_ubatch_id() != int(ubatch) or dist.get_rank() != int(rank):
            return
        fired.append(True)
        with open(arm_file + ".fired", "w") as f:
            json.dump({"pid": os.getpid(), "rank": int(rank), "site": site, "ubatch": int(ubatch),
                       "action": action, "time": time.time()}, f)
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"test fault: rank {rank} micro-batch {ubatch} raised at hook site {site!r}")

    cpu.maybe_inject_fault = maybe_inject_fault


_install()
