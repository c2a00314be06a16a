"""What DBO on vLLM-Ascend cannot be combined with: pure functions over a VllmConfig-like object.

Only attribute names of vLLM's config objects are read (``parallel_config``, ``model_config``,
``speculative_config``, ``additional_config``), so the checks run on stand-in objects in tests and on the real
``VllmConfig`` inside the platform hook. Each conflict names the flag that removes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dbo_runtime.ascend.sites import DENSE_ARCHITECTURES, REFUSED_MODELS, SUPPORTED_ARCHITECTURES
from dbo_runtime.errors import DBOConfigError

__all__ = [
    "Conflict",
    "find_conflicts",
    "validate_dbo_config",
    "dbo_requested",
    "batch_may_split",
    "SPLIT_VETO_MOE_COMM_TYPES",
    "flashcomm1_enabled",
]

# MoE communication types whose kernels fuse dispatch/compute/combine: nothing to overlap, and their per-rank
# state (mc2_mask, HCCL comm names) is not per micro-batch. Per batch they veto the split.
SPLIT_VETO_MOE_COMM_TYPES: frozenset[str] = frozenset({"MC2", "FUSED_MC2"})

_DRAFT_METHODS = ("eagle", "mtp")


@dataclass(frozen=True)
class Conflict:
    """One thing DBO cannot run with: what, why, and the flag to change."""

    what: str
    why: str
    flag: str

    def __str__(self) -> str:
        return f"{self.what} ({self.why}); change: {self.flag}"


def _get(obj: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if obj is None:
            return default
        obj = obj.get(part, default) if isinstance(obj, Mapping) else getattr(obj, part, default)
    return obj


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


def dbo_requested(config: Any) -> bool:
    return bool(_get(config, "parallel_config.enable_dbo", False))


def _architectures(config: Any) -> list[str]:
    archs = _get(config, "model_config.architectures")
    if not archs:
        archs = _get(config, "model_config.hf_config.architectures")
    return list(archs or [])


def flashcomm1_enabled(additional: Any, env: Mapping[str, str]) -> bool:
    """vLLM-Ascend's FlashComm1 switch as ``ascend_config.py`` reads it: ``additional_config["enable_flashcomm1"]``,
    else the deprecated ``VLLM_ASCEND_ENABLE_FLASHCOMM1`` (off by default)."""
    if isinstance(additional, Mapping) and "enable_flashcomm1" in additional:
        return _truthy(additional["enable_flashcomm1"])
    return _truthy(env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1", "0"))


def find_conflicts(config: Any, env: Mapping[str, str] | None = None) -> list[Conflict]:
    """Every reason DBO cannot run with ``config`` (a VllmConfig or a stand-in with the same attribute names)."""
    env = os.environ if env is None else env
    additional = _get(config, "additional_config") or {}
    conflicts: list[Conflict] = []

    fused_mc2 = additional.get("enable_fused_mc2") if isinstance(additional, Mapping) else None
    if fused_mc2 is None:
        fused_mc2 = env.get("VLLM_ASCEND_ENABLE_FUSED_MC2")
    if _truthy(fused_mc2):
        conflicts.append(Conflict(
            "fused MC2 (enable_fused_mc2)",
            "its dispatch+FFN+combine kernel leaves no communication to overlap and is not per micro-batch",
            "--additional-config '{\"enable_fused_mc2\": 0}' (and unset VLLM_ASCEND_ENABLE_FUSED_MC2)",
        ))
    if isinstance(additional, Mapping) and _truthy(additional.get("enable_prefill_mc2", False)):
        conflicts.append(Conflict(
            "MC2 for prefill (enable_prefill_mc2)",
            "MC2 dispatch/combine is one fused HCCL kernel per layer, so split prefill batches could not overlap",
            "--additional-config '{\"enable_prefill_mc2\": false}'",
        ))

    if str(env.get("DBO_RUNTIME_SCHEDULER", "")).strip() == "greenlet":
        conflicts.append(Conflict(
            "the greenlet scheduler (DBO_RUNTIME_SCHEDULER=greenlet)",
            "on vLLM-Ascend the hook sites run inside torch custom ops (the MoE layers inside vllm::moe_forward, "
            "the FlashComm1 ops), and a greenlet switch inside an op's Python kernel aborts the process (pybind11 "
            "'loader_life_support: internal error'; seen in the emulated engine)",
            "unset DBO_RUNTIME_SCHEDULER (the thread scheduler)",
        ))

    pcp = _get(config, "parallel_config.prefill_context_parallel_size", 1) or 1
    if int(pcp) > 1:
        conflicts.append(Conflict(
            f"prefill context parallel (prefill_context_parallel_size={pcp})",
            "PCP shards each prefill across ranks with its own metadata, which the micro-batch split does not carry",
            "--prefill-context-parallel-size 1",
        ))

    ubatch_size = _get(config, "parallel_config.ubatch_size", 0) or 0
    if int(ubatch_size) > 1:
        conflicts.append(Conflict(
            f"more than two micro-batches (ubatch_size={ubatch_size})",
            "the runtime ping-pongs exactly two micro-batches",
            "--ubatch-size 0",
        ))

    spec = _get(config, "speculative_config")
    if spec is not None:
        method = str(_get(spec, "method", "") or "").lower()
        if any(m in method for m in _DRAFT_METHODS):
            conflicts.append(Conflict(
                f"{method} speculative drafting",
                "the drafter runs its own forward on the unsplit batch (upstream asserts the same for EAGLE)",
                "remove --speculative-config",
            ))

    if _get(config, "model_config.disable_cascade_attn", True) is False:
        conflicts.append(Conflict(
            "cascade attention",
            "a shared-prefix cascade kernel spans requests that the split puts in different micro-batches",
            "--disable-cascade-attn",
        ))

    archs = _architectures(config)
    dense = sorted(a for a in archs if a in DENSE_ARCHITECTURES)
    if dense and not flashcomm1_enabled(additional, env):
        conflicts.append(Conflict(
            f"dense model {', '.join(dense)} without FlashComm1",
            "with FlashComm1 off its tensor-parallel all-reduces (vLLM's RowParallelLinear) are not DBO sites, so "
            "the two micro-batches would run one after the other, without ACL graphs, overlapping nothing: DBO "
            "would only cost (docs/dbo-vllm-ascend.md, 'Dense models')",
            "--additional-config '{\"enable_flashcomm1\": true}', or drop --enable-dbo",
        ))
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if not archs or unsupported:
        shown = ", ".join(unsupported or ["<unknown architecture>"])
        reasons = [f"{a}: {REFUSED_MODELS[a]}" for a in unsupported if a in REFUSED_MODELS]
        conflicts.append(Conflict(
            f"model architecture {shown}",
            "; ".join([*reasons, "DBO hook sites are mapped only for " + ", ".join(sorted(SUPPORTED_ARCHITECTURES))]),
            "serve a supported model or drop --enable-dbo",
        ))
    return conflicts


def validate_dbo_config(config: Any, env: Mapping[str, str] | None = None) -> None:
    """Raise DBOConfigError with one message listing every conflict; return None when DBO can run."""
    conflicts = find_conflicts(config, env)
    if conflicts:
        raise DBOConfigError(
            "--enable-dbo on vLLM-Ascend cannot be combined with: " + "; ".join(str(c) for c in conflicts)
        )


def batch_may_split(*, moe_comm_type: str | None, use_cascade_attn: bool = False, num_reqs: int = 2) -> bool:
    """Per-batch veto on top of the token thresholds: batches whose MoE communication is MC2-family, that use
    cascade attention, or that are empty never split. One long request may split (it straddles the cut)."""
    if moe_comm_type is not None and moe_comm_type.upper().rsplit(".", 1)[-1] in SPLIT_VETO_MOE_COMM_TYPES:
        return False
    if use_cascade_attn:
        return False
    return num_reqs >= 1
