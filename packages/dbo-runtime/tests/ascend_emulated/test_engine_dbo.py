"""DBO on == DBO off through a whole vLLM engine on the REAL vllm-ascend NPUModelRunner (issue 27), over the
emulated NPU: the same greedy tokens, with steps really split (fresh prefills cut in the middle of a request, mixed
prefill/decode and decode-only batches, odd counts).

One engine pair per model, each in its own process (``workers/engine_generate.py``); a Qwen3-MoE with TP=1 (its
A2 MoE prepare/finalize sites yield; the attention and MoE metadata are split per micro-batch). What the emulation
cannot show: timing and overlap, HCCL across ranks (TP=1 here), ACL graphs (enforce_eager), and the real kernels'
numerics (the emulated ones are float32 references).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "workers" / "engine_generate.py"


def _generate(mode: str, family: str, stats: Path) -> list[list[int]]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "DBO_RUNTIME_STATS_DIR": str(stats)}
    proc = subprocess.run([sys.executable, str(WORKER), mode, family], capture_output=True, text=True, timeout=420,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("TOKENS "):])


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_greedy_tokens_equal_with_dbo_on_the_real_npu_model_runner(tmp_path: Path, family: str) -> None:
    off = _generate("off", family, tmp_path / "off")
    on = _generate("on", family, tmp_path / "on")
    stats = [json.loads(p.read_text()) for p in (tmp_path / "on").glob("*.json")]
    assert stats, "the DBO run wrote no split statistics"
    split = sum(s.get("split_steps", 0) for s in stats)
    assert split >= 3, f"only {split} steps split: {stats}"
    assert on == off
