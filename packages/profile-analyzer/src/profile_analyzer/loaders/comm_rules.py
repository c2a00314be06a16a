"""Communication kernels that the loaders' format rules do not name: the vendor rule table.

Each loader knows its format's own communication (HCCL ``hcom_*`` ops on the Communication track, NCCL/RCCL/gloo
kernels, ``c10d::``/``gloo:`` ranges). Expert-parallel libraries and fused operators launch kernels of their own;
without this table a profile whose communication is all of that kind reads as compute with "no communication".
After a rank is loaded, every task the loader called compute is matched against :data:`RULES` (then the user's
``--comm-pattern`` regexes, which mean plain communication), the first match deciding its kind:

* ``communication``: the kernel moves data between ranks (or signals, or waits for peers); it enters
  Communication like an NCCL kernel does;
* ``fused``: one kernel that computes and communicates at once (a GEMM pipelined with its collective, MC2 on
  Ascend). Rule: its span counts in Computing *and* in Communication, so all of it is Overlapped (the
  communication inside runs beside its own compute, which is the point of fusing) and none of it is exposed.
  That is also what msprof answers for MC2 operators when the Communication track holds their KFC op (the
  compute task is in its Computing set, the op span in Communication). The report gives the fused time
  separately (``fused_us``) so that self-overlap is never mistaken for two operators overlapping.

In a CPU-only Kineto trace (no device kernels) the host ranges are the work: ranges the loader kept as host
ranges are matched too (a ``deep_ep`` dispatch range of a CPU run, a user's ``--comm-pattern``).

The user's patterns run on RE2 (google-re2), a regex engine without backtracking: matching takes time linear in
the name whatever the pattern, so a catastrophic one (``(a+)+$``) cannot hang a report, as it did with Python's
``re``. RE2 syntax is Python's without backreferences and lookaround (refused with one line); the digit, word and space
classes match ASCII only. The built-in table is ours and stays on ``re``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import re2

from profile_analyzer.errors import ProfileError
from profile_analyzer.timeline import Kind, RankTimeline

__all__ = ["CommRule", "RULES", "compile_patterns", "classify_name", "apply_comm_rules"]


@dataclass(frozen=True)
class CommRule:
    name: str
    pattern: str
    kind: str  # "communication" | "fused"
    source: str
    examples: tuple[str, ...]

    @property
    def regex(self) -> re.Pattern[str]:
        return _compiled(self.pattern)


_CACHE: dict[str, re.Pattern[str]] = {}


def _compiled(p: str) -> re.Pattern[str]:
    got = _CACHE.get(p)
    if got is None:
        got = _CACHE[p] = re.compile(p)
    return got


# a C++ namespace qualifier as demangled kernel names print it: "void deep_ep::intranode::dispatch<8>(int4*, ...)"
_NS = r"(?:^|[\s*&(<,]|::)"

RULES: tuple[CommRule, ...] = (
    CommRule("DeepEP", _NS + r"deep_?ep\w*::", "communication",
             "github.com/deepseek-ai/DeepEP csrc/kernels/{intranode,internode,internode_ll,layout}.cu: every kernel "
             "lives in namespace deep_ep (dispatch, combine, notify_dispatch, cached_notify_dispatch, "
             "cached_notify_combine, get_dispatch_layout, clean_low_latency_buffer); forks keep the deep_ep prefix",
             ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*)",
              "void deep_ep::internode_ll::combine<false, 7168>(void*, int*)",
              "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, int)")),
    CommRule("DeepEP kernel names without a namespace", r"(?:^|[\s:])(?:notify_dispatch|cached_notify_dispatch|"
             r"cached_notify_combine|cached_notify|notify_combine|get_dispatch_layout|clean_low_latency_buffer)"
             r"(?:_kernel)?\s*[<(]", "communication",
             "DeepEP csrc/kernels/intranode.cu, internode.cu, layout.cu (the same kernels as vendor forks name them "
             "after moving them out of the namespace)",
             ("cached_notify_dispatch_kernel<8>(int const*, int, void**, int**, int)",)),
    CommRule("NVSHMEM", r"(?i)nvshmem", "communication",
             "NVIDIA NVSHMEM: device kernels and on-stream collectives are named nvshmem*/nvshmemi_*/nvshmemx_* "
             "(docs.nvidia.com/nvshmem/api)",
             ("nvshmemi_proxy_progress_kernel", "void nvshmemx_barrier_all_on_stream_kernel()")),
    CommRule("pplx-kernels all-to-all", _NS + r"pplx::\w*(?:dispatch|combine)", "communication",
             "github.com/perplexityai/pplx-kernels csrc/all_to_all/internode_{dispatch,combine}.cu (namespace pplx)",
             ("void pplx::internode_dispatch_kernel<256, false>(int, int)",)),
    CommRule("vLLM custom all-reduce", r"cross_device_reduce_[12]stage", "communication",
             "github.com/vllm-project/vllm csrc/custom_all_reduce.cuh (cross_device_reduce_1stage/_2stage)",
             ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, "
              "vllm::Signal*, __nv_bfloat16*, int, int)",)),
    CommRule("MSCCL++", r"(?i)mscclpp", "communication",
             "github.com/microsoft/mscclpp: kernels in namespace mscclpp",
             ("void mscclpp::allreduce8<__half>(__half*, mscclpp::DeviceHandle<mscclpp::SmChannel>*)",)),
    # Ascend
    CommRule("MC2 dispatch/combine (Ascend)", r"^(?:aclnn)?MoeDistribute(?:Dispatch|Combine)(?:V\d+)?(?:Add\w*)?"
             r"(?:_\w+)?$", "communication",
             "CANN ops-transformer mc2/moe_distribute_dispatch, moe_distribute_combine (torch_npu "
             "npu_moe_distribute_dispatch/_combine): the expert-parallel all-to-all of a MoE layer, with only "
             "quantisation and packing around the transfer",
             ("MoeDistributeDispatch", "MoeDistributeCombineV2", "aclnnMoeDistributeDispatch")),
    # before the fused rule: an MC2 operator's KFC/AI CPU task is its communication part
    CommRule("HCCL on the AI CPU (Ascend)", r"^(?:Hccl\w*|hccl\w*|HcomAicpu\w*|\w*Kfc\w*)$", "communication",
             "CANN HCCL: collectives scheduled by the AI CPU (HcclAicpuKernel, the MC2 KFC server tasks) show as "
             "AI_CPU tasks on a hardware stream (msprof's overlap_analysis_processor.cpp counts KFC/MC2 ops as "
             "communication, reference/msprof.md 3b)",
             ("HcclAicpuKernel", "hcclKfcServer", "MatmulAllReduceKfc")),
    CommRule("MC2 GEMM + collective (Ascend)", r"^(?:aclnn)?(?:MatmulAllReduce\w*|AllGatherMatmul\w*|"
             r"MatmulReduceScatter\w*|GroupedMatmulAllReduce\w*|AlltoAllAllGatherBatchMatMul\w*|"
             r"BatchMatMulReduceScatterAlltoAll\w*|MatmulAllReduceAddRmsNorm\w*|InplaceMatmulAllReduceAddRmsNorm\w*|"
             r"AllGatherMatmulReduceScatter\w*|QuantAllReduce\w*)$", "fused",
             "CANN ops-transformer mc2/ (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter, "
             "grouped_matmul_all_reduce, ...; torch_npu npu_mm_all_reduce_base, npu_all_gather_base_mm, "
             "npu_mm_reduce_scatter_base): one operator that pipelines a GEMM with its collective",
             ("MatmulAllReduce", "AllGatherMatmul", "MatmulReduceScatter", "aclnnMatmulAllReduceAddRmsNorm")),
)


PATTERN_SYNTAX = ("a regular expression in RE2 syntax (Python's, without backreferences or lookaround; matched "
                  "anywhere in a kernel or operator name, in linear time)")
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # RE2 would also print its refusal on stderr: the one line is ours


def compile_patterns(patterns: Sequence[str]) -> tuple[Any, ...]:
    """The user's ``--comm-pattern`` regexes, compiled by RE2 (linear-time matching); a bad one is a ProfileError
    naming it."""
    out = []
    for p in patterns:
        try:
            out.append(re2.compile(p, _RE2_OPTIONS))
        except (re2.error, TypeError, ValueError) as exc:
            reason = exc.args[0] if exc.args else exc
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
            reason = " ".join(str(reason).split())[:120]
            shown = p if len(p) <= 60 else f"{p[:50]}... ({len(p):,} characters)"
            raise ProfileError("--comm-pattern", f"{shown!r} is not a regular expression RE2 accepts ({reason}); "
                                                 f"expected {PATTERN_SYNTAX}") from None
    return tuple(out)


def classify_name(name: str, extra: Sequence[Any] = ()) -> tuple[str, str] | None:
    """(kind, rule name) of the first rule that matches ``name``; the user's patterns come last."""
    for rule in RULES:
        if rule.regex.search(name):
            return rule.kind, rule.name
    for p in extra:
        if p.search(name):
            return "communication", f"--comm-pattern {p.pattern}"
    return None


def apply_comm_rules(rt: RankTimeline, extra: Sequence[Any] = (), host_ranges: bool = False) -> int:
    """Reclassify the compute tasks of ``rt`` (and its host ranges when ``host_ranges``) that a rule names; what
    each rule changed goes to ``rt.comm_rules_applied``. Returns how many tasks changed kind."""
    cand = rt.kind == int(Kind.COMPUTE)
    if host_ranges:
        cand |= rt.kind == int(Kind.HOST)
    if not cand.any():
        return 0
    ids = np.unique(rt.name_id[cand])
    new_kind = np.full(len(rt.names), -1, np.int8)
    rule_of: dict[int, tuple[str, str]] = {}
    for i in ids.tolist():
        got = classify_name(rt.names[i], extra)
        if got is not None:
            new_kind[i] = int(Kind.FUSED) if got[0] == "fused" else int(Kind.COMMUNICATION)
            rule_of[i] = got
    if not rule_of:
        return 0
    nk = new_kind[rt.name_id]
    change = cand & (nk >= 0)
    rt.kind[change] = nk[change]
    counts = np.bincount(rt.name_id[change], minlength=len(rt.names))
    for i, (kind, rule) in rule_of.items():
        prev = rt.comm_rules_applied.get(rule, (kind, 0))[1]
        rt.comm_rules_applied[rule] = (kind, prev + int(counts[i]))
    used = set(np.unique(rt.stream[change & (rt.kind == int(Kind.COMMUNICATION))]).tolist())
    if used:
        from dataclasses import replace

        rt.streams = [replace(s, kind="communication") if s.index in used and s.kind in ("host",) else s
                      for s in rt.streams]
    return int(change.sum())
