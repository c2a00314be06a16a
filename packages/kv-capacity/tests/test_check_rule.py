"""The start-up check rule per vLLM version (issue 9 fault 7): vLLM <= 0.27 (0.23.0 read from its wheel, what
vLLM-Ascend 0.23 pairs with) compares the KV need with the whole budget; vLLM >= 0.32 (PR #47272) first holds one
block back for the block pool's null block. The expected figures are derived here from the model's shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kv_capacity import load_model, plan
from kv_capacity.errors import KVCapacityInputError
from kv_capacity.planner import check_rule

GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_rule_per_version() -> None:
    assert check_rule("0.23.0").null_block_reserved is False
    assert check_rule("v0.27.1").null_block_reserved is False
    assert check_rule("0.32.0+cpu").null_block_reserved is True
    assert check_rule("1.0.0").null_block_reserved is True
    between = check_rule("0.29.0")
    assert between.null_block_reserved and "newest rule assumed" in between.description
    assert "no vLLM version given or installed" in check_rule(None).description
    with pytest.raises(KVCapacityInputError, match="not understood; expected e.g. 0.23.0"):
        check_rule("latest")


def test_both_rules_on_llama_at_128k() -> None:
    spec = load_model("llama-3.1-8b")
    page = 32 * 16 * 8 * 256 * 2  # one block id over the 32 layers
    per_request = cdiv(131072, 16)
    old = plan(spec, kv_cache_memory_bytes=8 * GiB, max_model_len=131072, block_size=16, rule=check_rule("0.23.0"))
    new = plan(spec, kv_cache_memory_bytes=8 * GiB, max_model_len=131072, block_size=16, rule=check_rule("0.32.0"))
    assert old.estimated_max_model_len == (8 * GiB // page) * 16 == 65536
    assert new.estimated_max_model_len == (8 * GiB - page) // page * 16 == 65520
    assert old.min_kv_cache_memory_bytes == page * per_request
    assert new.min_kv_cache_memory_bytes == page * (per_request + 1)
    assert "(8.0 GiB)" in (old.vllm_error_message or "") and "65536" in (old.vllm_error_message or "")
    # a budget of exactly the blocks one request needs: vLLM 0.23 starts, vLLM 0.32 refuses
    exact = page * per_request
    assert plan(spec, kv_cache_memory_bytes=exact, max_model_len=131072, block_size=16,
                rule=check_rule("0.23.0")).fits
    assert not plan(spec, kv_cache_memory_bytes=exact, max_model_len=131072, block_size=16,
                    rule=check_rule("0.32.0")).fits


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kv_capacity", *args], capture_output=True, text=True, timeout=120)


def test_plan_takes_vllm_version_and_names_the_rule() -> None:
    page = 32 * 16 * 8 * 256 * 2
    exact = str(page * cdiv(131072, 16))
    common = ["plan", "--model", "llama-3.1-8b", "--max-model-len", "131072", "--block-size", "16",
              "--kv-cache-memory-bytes", exact, "--format", "json"]
    old = _cli(*common, "--vllm-version", "0.23.0")
    new = _cli(*common, "--vllm-version", "0.32.0")
    assert old.returncode == 0 and new.returncode == 1, (old.stderr, new.stderr)
    assert json.loads(old.stdout)["null_block_reserved"] is False
    assert "vLLM <= 0.27" in json.loads(old.stdout)["check_rule"]
    assert json.loads(new.stdout)["null_block_reserved"] is True
    text = _cli("plan", "--model", "llama-3.1-8b", "--max-model-len", "8192", "--kv-cache-memory-bytes", "8G")
    # no vLLM in this interpreter: the newest rule, named
    shown = " ".join(text.stdout.split())
    assert text.returncode == 0 and "start-up check: vLLM >= 0.32" in shown
    assert "no vLLM version given or installed" in shown
    bad = _cli(*common, "--vllm-version", "newest")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "0.23.0" in bad.stderr
