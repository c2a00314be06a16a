"""Fault 1 (issue 27): with data parallel size 1, DBO's split decision issues no collective.

vllm-ascend's worker initialises the default process group with "hccl", which torch_npu registers for npu devices
only, so the old all-reduce of a CPU vote tensor on the default group failed at the first (profile) step. The
emulation's hccl is gloo and accepts CPU tensors (its "npu" tensors are CPU tensors), so it cannot fail that way:
the test instead asserts that no collective at all runs on any group during the decision at DP=1 (on today's code
before the fix, an all_reduce on the default group did), on two real TP ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _emu

WORKER = Path(__file__).resolve().parent / "workers" / "dp1_step.py"


def test_two_tp_ranks_at_dp1_decide_without_a_collective() -> None:
    port = _emu.free_port()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port), "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        assert result["enable_dbo"] is True  # the plugin turned DBO back on after NPUPlatform reset it
        assert result["split"] is True  # 16 decode tokens over the threshold of 2
        assert result["calls"] == [], f"collectives during the DP=1 decision: {result['calls']}"
