"""The A3 all-to-all MoE path under DBO on two expert-parallel ranks (issue 27): vllm-ascend's real
``TokenDispatcherWithAll2AllV`` dispatch and combine (all-to-all-v over the EP group), its sites installed with the
plugin's wrapper so the two micro-batches ping-pong at them across both ranks, float32, odd token counts (9, 7, 1, 2
per rank: micro-batches of 4+5, 3+4, 0+1, 1+1). The split output equals the whole batch's bit for bit, and both equal
a per-token reference. Stand-ins are listed in ``workers/a3_layer.py``; what it cannot show: the MC2 path A3 takes
for decode batches within its token capacity (not emulated; DBO vetoes the split there anyway), HCCL, overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _emu

WORKER = Path(__file__).resolve().parent / "workers" / "a3_layer.py"


def test_a3_all_to_all_micro_batches_equal_the_whole_batch() -> None:
    port = _emu.free_port()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])
        assert [r["tokens"] for r in results] == [9, 7, 1, 2]
        for r in results:
            assert r["equal"], r
            assert r["reference_diff"] <= 1e-5, r
