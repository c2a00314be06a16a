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
from profile_analyzer.timeline import Kind, RankTimeline, Warning_

__all__ = ["CommRule", "RULES", "compile_patterns", "classify_name", "apply_comm_rules", "mixed_stream_warnings",
           "suggested_pattern"]


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

# DeepEP's kernel namespaces (csrc/kernels/*.cu: deep_ep::intranode, ::internode, ::internode_ll, ::layout). Forks
# keep that structure under a namespace of their own (``vendor::ep::internode::dispatch<...>``), so the rule keys on
# the shape: a namespace ``ep`` (or one that ends in ``_ep``: ``uccl_ep``) followed by one of DeepEP's kernel
# namespaces; ``deep_ep``/``deepep`` in any case are DeepEP whatever follows.
_EP_NS = r"(?:^|[\s*&(<,:])(?:\w*_)?[Ee][Pp]::(?:intranode|internode|internode_ll|low_latency|layout)::\w"
# DeepEP's kernels that forks move out of the namespace (csrc/kernels/intranode.cu, internode.cu, layout.cu)
_EP_KERNELS = (r"(?:notify_dispatch|cached_notify_dispatch|cached_notify_combine|cached_notify|notify_combine|"
               r"get_dispatch_layout|clean_low_latency_buffer)")

RULES: tuple[CommRule, ...] = (
    CommRule("DeepEP", _NS + r"[Dd]eep_?[Ee][Pp]\w*::|" + _EP_NS, "communication",
             "github.com/deepseek-ai/DeepEP csrc/kernels/{intranode,internode,internode_ll,layout}.cu: every kernel "
             "lives in namespace deep_ep::{intranode,internode,internode_ll,layout} (dispatch, combine, "
             "notify_dispatch, cached_notify, get_dispatch_layout, clean_low_latency_buffer); forks keep that "
             "structure under a namespace of their own (<anything>::ep::internode::dispatch), so the rule matches "
             "the shape, not the spelling deep_ep",
             ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*)",
              "void deep_ep::internode_ll::combine<false, 7168>(void*, int*)",
              "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, int)",
              "void vendor_x::ep::internode::dispatch<true, 8, 4>(int4*, float*, int*)",
              "void mori::ep::internode_ll::combine<7168>(void*, int*)",
              "void DeepEP::intranode::combine<nv_bfloat16, 8, 768>(nv_bfloat16*, float*)")),
    CommRule("DeepEP kernel names without a namespace", r"(?:^|[\s:])" + _EP_KERNELS + r"(?:_kernel)?\s*[<(]",
             "communication",
             "DeepEP csrc/kernels/intranode.cu, internode.cu, layout.cu (the same kernels as vendor forks name them "
             "after moving them out of the namespace)",
             ("cached_notify_dispatch_kernel<8>(int const*, int, void**, int**, int)",
              "void notify_dispatch<8>(int const*, int*, int)")),
    CommRule("SHMEM libraries (NVSHMEM, ROCSHMEM, Intel SHMEM)", r"(?i)(?<![a-z])(?:nv|roc|i)shmem", "communication",
             "NVIDIA NVSHMEM: device kernels and on-stream collectives are named nvshmem*/nvshmemi_*/nvshmemx_* "
             "(docs.nvidia.com/nvshmem/api); its ports keep the names with their own prefix: ROCm rocSHMEM "
             "(rocshmem_*), Intel SHMEM (ishmem_*)",
             ("nvshmemi_proxy_progress_kernel", "void nvshmemx_barrier_all_on_stream_kernel()",
              "void rocshmem::rocshmem_wg_barrier_all()", "ishmemx_put_work_group")),
    CommRule("pplx-kernels all-to-all", _NS + r"pplx\w*::\w*(?:dispatch|combine)|(?:^|[\s:])"
             r"(?:internode|intranode)_(?:dispatch|combine)(?:_kernel)?\s*[<(]", "communication",
             "github.com/perplexityai/pplx-kernels csrc/all_to_all/internode_{dispatch,combine}.cu (namespace pplx); "
             "the kernel names also without that namespace (a fork's)",
             ("void pplx::internode_dispatch_kernel<256, false>(int, int)",
              "void my_a2a::intranode_combine_kernel<128>(void*)")),
    CommRule("vLLM custom all-reduce", r"cross_device_reduce_\w+", "communication",
             "github.com/vllm-project/vllm csrc/custom_all_reduce.cuh (cross_device_reduce_1stage/_2stage; SGLang "
             "and other forks keep the kernel names in a namespace of their own)",
             ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, "
              "vllm::Signal*, __nv_bfloat16*, int, int)",
              "void sglang::cross_device_reduce_2stage<half, 8>(sglang::RankData*)")),
    CommRule("MSCCL / MSCCL++", r"(?i)(?<![a-z])msccl", "communication",
             "github.com/microsoft/mscclpp (kernels in namespace mscclpp) and MSCCL (mscclKernel_*), any case",
             ("void mscclpp::allreduce8<__half>(__half*, mscclpp::DeviceHandle<mscclpp::SmChannel>*)",
              "mscclKernel_Sum_half_Simple_false")),
    # Ascend
    CommRule("MC2 dispatch/combine (Ascend)", r"(?:^|[\s/_])(?:aclnn)?MoeDistribute(?:Dispatch|Combine)\w*$|"
             r"^(?:aclnn)?(?:NotifyDispatch|DispatchLayout|MoeDispatchNormal|MoeCombineNormal|CamMoeDistribute"
             r"(?:Dispatch|Combine))\w*$", "communication",
             "CANN ops-transformer mc2/moe_distribute_dispatch, moe_distribute_combine (torch_npu "
             "npu_moe_distribute_dispatch/_combine, any version suffix V2/V3/...): the expert-parallel all-to-all of "
             "a MoE layer, with only quantisation and packing around the transfer; vllm-ascend's DeepEP-style ports "
             "of the same (csrc: notify_dispatch, dispatch_layout, moe_dispatch_normal, moe_combine_normal)",
             ("MoeDistributeDispatch", "MoeDistributeCombineV2", "aclnnMoeDistributeDispatch",
              "MoeDistributeDispatchV3_quant", "aclnnNotifyDispatch_NotifyDispatch")),
    # before the fused rule: an MC2 operator's KFC/AI CPU task is its communication part
    CommRule("HCCL on the AI CPU (Ascend)", r"^(?:[Hh][Cc][Cc][Ll]\w*|HcomAicpu\w*|\w*K[Ff][Cc](?:[A-Z_]\w*)?)$",
             "communication",
             "CANN HCCL: collectives scheduled by the AI CPU (HcclAicpuKernel, the MC2 KFC server tasks) show as "
             "AI_CPU tasks on a hardware stream (msprof's overlap_analysis_processor.cpp counts KFC/MC2 ops as "
             "communication, reference/msprof.md 3b)",
             ("HcclAicpuKernel", "hcclKfcServer", "MatmulAllReduceKfc", "HCCLAicpuOrchestration")),
    CommRule("MC2 GEMM + collective (Ascend)", r"^(?:aclnn)?(?:Inplace)?(?:Quant)?(?:Grouped|Batch)?(?:Mat[Mm]ul|Mm(?![a-z]))"
             r"(?:All[Rr]educe|Reduce[Ss]catter|All[Tt]o[Aa]ll)\w*$|^(?:aclnn)?(?:All[Gg]ather|All[Tt]o[Aa]ll)\w*?"
             r"(?:Grouped|Batch)?(?:Mat[Mm]ul|Mm(?![a-z]))\w*$|^(?:aclnn)?QuantAllReduce\w*$", "fused",
             "CANN ops-transformer mc2/ (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter, "
             "grouped_matmul_all_reduce, alltoall_allgather_batch_matmul, ...; torch_npu npu_mm_all_reduce_base, "
             "npu_all_gather_base_mm, npu_mm_reduce_scatter_base): one operator that pipelines a GEMM with its "
             "collective, named <GEMM><collective> or <collective><GEMM> in either capitalisation",
             ("MatmulAllReduce", "AllGatherMatmul", "MatmulReduceScatter", "aclnnMatmulAllReduceAddRmsNorm",
              "MatMulAllReduceV2", "AlltoAllAllGatherBatchMatMul", "BatchMatMulReduceScatterAlltoAll",
              "GroupedMatmulAllReduce", "InplaceMatmulAllReduceAddRmsNorm", "QuantAllReduce",
              "AllGatherMatmulReduceScatter")),
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
    each rule changed goes to ``rt.comm_rules_applied``, and a stream where communication runs beside kernels no
    rule names gets a warning (:func:`mixed_stream_warnings`). Returns how many tasks changed kind."""
    changed = _reclassify(rt, extra, host_ranges)
    rt.warnings.extend(mixed_stream_warnings(rt, extra))
    return changed


def _reclassify(rt: RankTimeline, extra: Sequence[Any], host_ranges: bool) -> int:
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


# A stream where recognised communication is at least a third of the kernels is a communication stream (DeepEP's
# comm stream, a collective library's own stream): every other kernel on it is suspect. Below it (a compute stream
# that also runs an MC2 dispatch or a custom all-reduce between its GEMMs) only names that read like communication are.
COMM_STREAM_SHARE = 1 / 3
_COMM_WORDS = re.compile(r"(?i)dispatch|combine|notify|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|a2a|"
                         r"(?<![a-z])send|(?<![a-z])recv|broadcast|barrier|shmem|(?:^|::)ep::")
MAX_NAMED = 3


def kernel_base_name(name: str) -> str:
    """``void vendor::ep::internode::dispatch<true, 8>(int4*, ...)`` -> ``vendor::ep::internode::dispatch``: the
    qualified name without return type, template arguments or parameters."""
    out = []
    depth = 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif ch == "(" and depth == 0 and out:
            break
        elif depth == 0:
            out.append(ch)
    base = "".join(out).strip()
    return base.rsplit(" ", 1)[-1] if " " in base else base


def suggested_pattern(names: Sequence[str]) -> str:
    """A ``--comm-pattern`` (RE2) that matches each of ``names`` by its base name."""
    bases = list(dict.fromkeys(kernel_base_name(n) or n for n in names))
    return "|".join(re.escape(b) for b in bases)


def mixed_stream_warnings(rt: RankTimeline, extra: Sequence[Any] = ()) -> list[Warning_]:
    """One warning per device stream that holds recognised communication kernels and also kernels no rule names
    (counted as compute), naming the largest of those by time and the ``--comm-pattern`` that would count them.

    On a communication stream (recognised communication >= :data:`COMM_STREAM_SHARE` of its kernels) every
    unnamed kernel is listed; on a compute stream only unnamed kernels whose names read like communication
    (dispatch, combine, notify, all_reduce, ...), so that the GEMMs beside an MC2 dispatch raise nothing."""
    comm = rt.kind == int(Kind.COMMUNICATION)
    comp = rt.kind == int(Kind.COMPUTE)
    if not comm.any() or not comp.any():
        return []
    out: list[Warning_] = []
    streams_with_both = np.intersect1d(np.unique(rt.stream[comm]), np.unique(rt.stream[comp]))
    dur = rt.end_ns - rt.start_ns
    for si in streams_with_both.tolist():
        s = rt.streams[si]
        if s.kind == "host":
            continue
        on = rt.stream == si
        n_comm = int((comm & on).sum())
        sel = comp & on
        n_comp = int(sel.sum())
        ids = rt.name_id[sel]
        time_by_name = np.bincount(ids, weights=dur[sel], minlength=len(rt.names))
        count_by_name = np.bincount(ids, minlength=len(rt.names))
        present = np.flatnonzero(count_by_name)
        if n_comm < COMM_STREAM_SHARE * (n_comm + n_comp):
            present = np.array([i for i in present.tolist() if _COMM_WORDS.search(rt.names[i])], dtype=np.int64)
        if present.size == 0:
            continue
        top = present[np.argsort(-time_by_name[present], kind="stable")][:MAX_NAMED].tolist()
        listed = ", ".join(f"{kernel_base_name(rt.names[i]) or rt.names[i]} ({time_by_name[i] / 1000.0:,.1f} µs, "
                           f"{int(count_by_name[i])} task{'s' if count_by_name[i] != 1 else ''})" for i in top)
        more = f" and {present.size - len(top)} more" if present.size > len(top) else ""
        pattern = suggested_pattern([rt.names[i] for i in top])
        text = (f"rank {rt.rank}, {s.label}: recognised communication runs on this stream beside {present.size} "
                f"kernel name(s) no communication rule names, counted as compute: {listed}{more}; if they are "
                f"communication, count them with --comm-pattern '{pattern}'")
        out.append(Warning_(rt.source, f"a communication rule for {present.size} kernel name(s) on {s.label}",
                            ["Computing", "Communication", "Overlapped", "Communication(Not Overlapped)"], text=text))
    return out
