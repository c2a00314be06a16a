"""The schedule behind the synthetic profile generator (``profile_analyzer.synth``).

This is a *stand-in for an NPU run*: no Ascend device exists here, so the generator simulates the device
streams of an MoE decoder step on N ranks and writes what the Ascend profiler would have recorded. The
simulation is a list scheduler over integer nanoseconds:

* one compute stream per rank (Ascend Hardware ``Stream 2``) runs the attention and expert kernels in
  program order; without DBO a second compute stream (``Stream 3``) runs the shared expert while the
  dispatch collective is in flight;
* one communication stream per rank runs the collectives (``hcom_allGather_``/``hcom_reduceScatter_``
  for the A2 pattern, ``hcom_alltoallv_`` dispatch/combine for A3). A collective starts on each rank when
  its input is ready and ends on every rank at the same time: ``max(arrivals) + transfer``, so the ranks
  that arrive early wait (``Notify_Wait``) for the slowest one;
* with DBO, two micro-batches ping-pong: ubatch A's collective runs under ubatch B's compute and vice
  versa, layer by layer. Layers listed in ``exposed_layers`` get collectives ``exposed_factor`` times
  longer so that they cannot be hidden.

The ground truth is computed from the simulated intervals with a small pure-Python interval algebra that
shares no code with the analyzer, following msprof's definitions (reference: docs/profile-analysis.md).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

# --------------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class SynthParams:
    """Everything that determines a synthetic profile. Equal params give byte-identical output."""

    ranks: int = 2
    steps: int = 2
    layers: int = 4
    pattern: str = "a2"  # a2: allGather + reduceScatter; a3: alltoallv dispatch + combine
    dbo: bool = False
    comm_fraction: float = 0.3  # transfer time of a layer's collectives / that layer's compute time
    seed: int = 0
    exposed_layers: tuple[int, ...] = ()  # DBO: layers whose collectives are too long to hide
    exposed_factor: float = 6.0
    shared_expert_cover: float = 0.6  # no DBO: shared-expert compute / dispatch transfer time
    slow_rank: int | None = None  # default: the last rank (when ranks > 1)
    slow_factor: float = 1.15
    layer_compute_us: float = 400.0  # compute time of one layer (both micro-batches together)
    planes: int = 2
    host_tracks: bool = True
    sync_tasks: bool = True  # EVENT_RECORD / EVENT_WAIT tasks on the compute stream
    cann: str = "new"  # "new" or "old": the defaults of the four format options below
    comm_process_name: str | None = None  # "Communication" (new) or "HCCL" (old)
    stream_id_key: str | None = None  # "Physic Stream Id" (new) or "Stream Id" (old)
    ts_as_string: bool = True
    large_pids: bool = False  # host pids that make the synthetic device pids exceed 2**32
    pp_receive_us: float = 0.0  # > 0: each step starts with an hcom_receive (pipeline stage waiting): Bubble

    def resolved(self) -> SynthParams:
        new = self.cann == "new"
        slow = self.slow_rank
        if slow is None and self.ranks > 1:
            slow = self.ranks - 1
        return SynthParams(**{
            **self.__dict__,
            "comm_process_name": self.comm_process_name or ("Communication" if new else "HCCL"),
            "stream_id_key": self.stream_id_key or ("Physic Stream Id" if new else "Stream Id"),
            "slow_rank": slow,
            "exposed_layers": tuple(sorted(set(self.exposed_layers))),
        })

    def validate(self) -> None:
        if self.ranks < 1 or self.steps < 1 or self.layers < 1:
            raise ValueError("ranks, steps and layers must be at least 1")
        if self.pattern not in ("a2", "a3"):
            raise ValueError(f"pattern must be 'a2' or 'a3', not {self.pattern!r}")
        if self.cann not in ("new", "old"):
            raise ValueError(f"cann must be 'new' or 'old', not {self.cann!r}")
        if self.comm_process_name not in (None, "Communication", "HCCL"):
            raise ValueError("comm_process_name must be 'Communication' or 'HCCL'")
        if self.stream_id_key not in (None, "Physic Stream Id", "Stream Id"):
            raise ValueError("stream_id_key must be 'Physic Stream Id' or 'Stream Id'")
        if not 0 < self.comm_fraction <= 10:
            raise ValueError("comm_fraction must be in (0, 10]")
        if self.planes < 1:
            raise ValueError("planes must be at least 1")
        if self.slow_rank is not None and not 0 <= self.slow_rank < self.ranks:
            raise ValueError("slow_rank must be a rank index")
        # a NaN passes every comparison: test for finiteness first
        if not math.isfinite(self.pp_receive_us) or self.pp_receive_us < 0:
            raise ValueError("pp_receive_us must be a finite number >= 0")
        if not math.isfinite(self.exposed_factor) or self.exposed_factor < 0:
            raise ValueError("exposed_factor must be a finite number >= 0")
        if any(not 0 <= i < self.layers for i in self.exposed_layers):
            raise ValueError("exposed_layers must be layer indices in [0, layers)")


# --------------------------------------------------------------------------------------------------
# Kernel templates: (kernel name, op type, accelerator core, share of the block, torch op, AscendCL api)

ATTN_KERNELS = (
    ("aclnnRmsNorm_RmsNormAiCore_RmsNorm", "RmsNorm", "AI_VECTOR_CORE", 0.08, "npu::npu_rms_norm", "aclnnRmsNorm"),
    ("aclnnMatmul_MatMulV3Common_MatMulV3", "MatMulV3", "AI_CORE", 0.27, "aten::mm", "aclnnMatmul"),
    ("aclnnApplyRotaryPosEmb_ApplyRotaryPosEmb_ApplyRotaryPosEmb", "ApplyRotaryPosEmb", "AI_VECTOR_CORE", 0.07,
     "npu::npu_apply_rotary_pos_emb", "aclnnApplyRotaryPosEmb"),
    ("aclnnFusedInferAttentionScore_FusedInferAttentionScore_FusedInferAttentionScore", "FusedInferAttentionScore",
     "MIX_AIC", 0.38, "npu::npu_fused_infer_attention_score", "aclnnFusedInferAttentionScore"),
    ("aclnnMatmul_MatMulV3Common_MatMulV3", "MatMulV3", "AI_CORE", 0.20, "aten::mm", "aclnnMatmul"),
)
MOE_KERNELS = (
    ("aclnnMoeGatingTopKSoftmax_MoeGatingTopKSoftmax_MoeGatingTopKSoftmax", "MoeGatingTopKSoftmax", "AI_VECTOR_CORE",
     0.06, "npu::npu_moe_gating_top_k_softmax", "aclnnMoeGatingTopKSoftmax"),
    ("aclnnGroupedMatmul_GroupedMatmul_GroupedMatmul", "GroupedMatmul", "MIX_AIC", 0.40, "npu::npu_grouped_matmul",
     "aclnnGroupedMatmul"),
    ("aclnnSwiGlu_SwiGlu_SwiGlu", "SwiGlu", "AI_VECTOR_CORE", 0.10, "npu::npu_swiglu", "aclnnSwiGlu"),
    ("aclnnGroupedMatmul_GroupedMatmul_GroupedMatmul", "GroupedMatmul", "MIX_AIC", 0.34, "npu::npu_grouped_matmul",
     "aclnnGroupedMatmul"),
    ("aclnnMoeFinalizeRouting_MoeFinalizeRouting_MoeFinalizeRouting", "MoeFinalizeRouting", "AI_VECTOR_CORE", 0.10,
     "npu::npu_moe_finalize_routing", "aclnnMoeFinalizeRouting"),
)
SHARED_KERNELS = (
    ("aclnnMatmul_MatMulV3Common_MatMulV3", "MatMulV3", "AI_CORE", 0.45, "aten::mm", "aclnnMatmul"),
    ("aclnnSwiGlu_SwiGlu_SwiGlu", "SwiGlu", "AI_VECTOR_CORE", 0.15, "npu::npu_swiglu", "aclnnSwiGlu"),
    ("aclnnMatmul_MatMulV3Common_MatMulV3", "MatMulV3", "AI_CORE", 0.40, "aten::mm", "aclnnMatmul"),
)
COMM_OPS = {  # pattern -> (dispatch op type, combine op type)
    "a2": ("allGather", "reduceScatter"),
    "a3": ("alltoallv", "alltoallv"),
}

MAIN_STREAM = 2
SHARED_STREAM = 3
GROUP_NAME = "16898834563344171674"
GROUP_TAG = "674"

# timing constants (ns)
HOST_LAUNCH_NS = 5_000  # host time per launched operator
LAUNCH_LATENCY_NS = 9_000  # launch to earliest device start
KERNEL_GAP_NS = (600, 1_800)  # device gap between back-to-back kernels on one stream
HOST_PREP_NS = 150_000  # ProfilerStep start to first launch
HOST_TAIL_NS = 20_000  # device end to ProfilerStep end (host synchronises at the end of a step)
EVENT_RECORD_NS = 400
NOTIFY_NS = 300  # Notify_Record task
HANDSHAKE_NS = 1_000  # last Notify_Wait after the payload
LINK_BYTES_PER_NS = 50  # 50 GB/s: the modelled link speed (a stand-in, no real link exists here)


# --------------------------------------------------------------------------------------------------
# Simulated tasks


class Kernel:
    """A compute kernel (or a stream sync task when ``core`` is ``EVENT_RECORD``/``EVENT_WAIT``)."""

    __slots__ = ("stream", "start", "end", "name", "op_type", "core", "layer", "ubatch", "launch", "torch_op",
                 "acl", "task_id")

    def __init__(self, stream: int, start: int, end: int, tpl: tuple, layer: int, ubatch: str, launch: int) -> None:
        self.stream = stream
        self.start = start
        self.end = end
        self.name, self.op_type, self.core, _, self.torch_op, self.acl = tpl
        self.layer = layer
        self.ubatch = ubatch
        self.launch = launch
        self.task_id = 0

    @property
    def is_compute(self) -> bool:
        return not self.core.startswith("EVENT_")


class CommOp:
    """One collective on one rank: the big-op span plus the times its plane tasks are derived from."""

    __slots__ = ("start", "arrive", "end", "transfer", "name", "op_type", "layer", "ubatch", "role", "launch",
                 "nbytes", "seq")

    def __init__(self, start: int, arrive: int, transfer: int, name: str, op_type: str, layer: int, ubatch: str,
                 role: str, launch: int, nbytes: int, seq: int) -> None:
        self.start = start
        self.arrive = arrive  # when the last rank arrived
        self.transfer = transfer
        # Notify_Record, Notify_Wait until everyone arrived (+ one handshake), payload, Notify_Record, Notify_Wait
        self.end = arrive + HANDSHAKE_NS + transfer + NOTIFY_NS + HANDSHAKE_NS
        self.name = name
        self.op_type = op_type
        self.layer = layer
        self.ubatch = ubatch
        self.role = role  # "dispatch" or "combine"
        self.launch = launch
        self.nbytes = nbytes
        self.seq = seq

    def plane_tasks(self, chunks: int = 4) -> list[tuple[str, int, int, str]]:
        """(name, start, end, kind) of the tasks on one plane, back to back from ``start`` to ``end``."""
        out = [("Notify_Record", self.start, self.start + NOTIFY_NS, "notify")]
        wait_end = self.arrive + HANDSHAKE_NS
        out.append(("Notify_Wait", self.start + NOTIFY_NS, wait_end, "wait"))
        t = wait_end
        step = self.transfer // chunks
        for i in range(chunks):
            e = wait_end + self.transfer if i == chunks - 1 else t + step
            out.append(("Memcpy", t, e, "payload"))
            t = e
        out.append(("Notify_Record", t, t + NOTIFY_NS, "notify"))
        out.append(("Notify_Wait", t + NOTIFY_NS, self.end, "wait"))
        return out


@dataclass
class RankStep:
    """What one rank did in one step."""

    rank: int
    step: int  # 1-based, as in ProfilerStep#N
    host_start: int
    host_end: int
    kernels: list[Kernel] = field(default_factory=list)  # compute kernels and sync tasks, launch order
    comm_ops: list[CommOp] = field(default_factory=list)  # launch order

    @property
    def first_task_start(self) -> int:
        """Device start of the task launched first in the step (torch_npu's step range starts there)."""
        first_k = self.kernels[0]
        if self.comm_ops and self.comm_ops[0].launch < first_k.launch:
            return self.comm_ops[0].start
        return first_k.start

    @property
    def device_end(self) -> int:
        ends = [k.end for k in self.kernels] + [c.end for c in self.comm_ops]
        return max(ends)


def _rank_factor(p: SynthParams, rank: int) -> float:
    f = 1.0 + 0.01 * ((rank * 7) % 5)
    if p.slow_rank is not None and rank == p.slow_rank and p.ranks > 1:
        f *= p.slow_factor
    return f


class _RankState:
    __slots__ = ("host", "stream_free", "comm_free", "last_combine_end")

    def __init__(self, host: int) -> None:
        self.host = host
        self.stream_free = {MAIN_STREAM: 0, SHARED_STREAM: 0}
        self.comm_free = 0
        self.last_combine_end: dict[str, int] = {}


class _StepSim:
    """Launches blocks of kernels and collectives on every rank, in program order, for one step."""

    def __init__(self, p: SynthParams, states: list[_RankState], out: list[RankStep], step: int,
                 seq: list[int]) -> None:
        self.p = p
        self.states = states
        self.out = out
        self.rng = random.Random(p.seed * 1_000_003 + step)
        self.rank_rngs = [random.Random((p.seed * 1_000_003 + step) * 131 + r) for r in range(p.ranks)]
        self.seq = seq  # one-element list: the run-wide collective counter

    def compute_block(self, tpls: tuple, total_us: float, stream: int, dep: list[int], layer: int, ub: str,
                      record: bool) -> list[int]:
        """Launch a block of kernels on every rank; return each rank's block end (after the record)."""
        p = self.p
        ends = []
        for r, st in enumerate(self.states):
            rr = self.rank_rngs[r]
            tasks = self.out[r].kernels
            fac = _rank_factor(p, r)
            free = st.stream_free[stream]
            first = True
            for tpl in tpls:
                launch = st.host
                st.host += HOST_LAUNCH_NS
                earliest = max(free, launch + LAUNCH_LATENCY_NS)
                if first:
                    if dep[r] > earliest and p.sync_tasks:
                        tasks.append(Kernel(stream, earliest, dep[r], _EVENT_WAIT, layer, ub, launch))
                    earliest = max(earliest, dep[r])
                    first = False
                dur = int(total_us * tpl[3] * fac * rr.uniform(0.95, 1.05) * 1000)
                k = Kernel(stream, earliest, earliest + max(dur, 1000), tpl, layer, ub, launch)
                tasks.append(k)
                free = k.end + rr.randint(*KERNEL_GAP_NS)
            end = tasks[-1].end
            if record and p.sync_tasks:
                tasks.append(Kernel(stream, free, free + EVENT_RECORD_NS, _EVENT_RECORD, layer, ub, st.host))
                end = free + EVENT_RECORD_NS
                free = end + rr.randint(*KERNEL_GAP_NS)
            st.stream_free[stream] = free
            ends.append(end)
        return ends

    def collective(self, op: str, role: str, transfer_us: float, dep: list[int], layer: int, ub: str) -> list[int]:
        self.seq[0] += 1
        seq = self.seq[0]
        transfer = int(transfer_us * self.rng.uniform(0.9, 1.1) * 1000)
        name = f"hcom_{op}__{GROUP_TAG}_{seq}_1"
        starts, launches = [], []
        for r, st in enumerate(self.states):
            launch = st.host
            st.host += HOST_LAUNCH_NS
            launches.append(launch)
            starts.append(max(st.comm_free, dep[r], launch + LAUNCH_LATENCY_NS))
        arrive = max(starts)
        ends = []
        for r, st in enumerate(self.states):
            c = CommOp(starts[r], arrive, transfer, name, f"hcom_{op}_", layer, ub, role, launches[r],
                       transfer * LINK_BYTES_PER_NS, seq)
            self.out[r].comm_ops.append(c)
            st.comm_free = c.end
            ends.append(c.end)
        return ends


_EVENT_WAIT = ("EVENT_WAIT", "EVENT_WAIT", "EVENT_WAIT", 0, "", "")
_EVENT_RECORD = ("EVENT_RECORD", "EVENT_RECORD", "EVENT_RECORD", 0, "", "")


def simulate(p: SynthParams, t0_ns: int) -> Iterator[list[RankStep]]:
    """Yield, step by step, the list of :class:`RankStep` of every rank (the same for every caller)."""
    p = p.resolved()
    states = [_RankState(t0_ns + r * 37_000) for r in range(p.ranks)]
    ubatches = ("A", "B") if p.dbo else ("-",)
    per_ub_us = p.layer_compute_us / len(ubatches)
    disp_type, comb_type = COMM_OPS[p.pattern]
    seq = [0]
    for step in range(1, p.steps + 1):
        out = [RankStep(r, step, st.host, 0) for r, st in enumerate(states)]
        for st in states:
            st.host += HOST_PREP_NS
            st.last_combine_end = {}
        sim = _StepSim(p, states, out, step, seq)
        block, coll = sim.compute_block, sim.collective
        if p.pp_receive_us > 0:  # the stage waits for the previous pipeline stage's activations
            recv = coll("receive", "receive", p.pp_receive_us, [0] * p.ranks, -1, "-")
            for r, st in enumerate(states):
                st.last_combine_end = dict.fromkeys(("A", "B") if p.dbo else ("-",), recv[r])
        for layer in range(p.layers):
            factor = p.exposed_factor if layer in p.exposed_layers else 1.0
            transfer_us = p.comm_fraction * per_ub_us / 2 * factor
            attn_us, moe_us = 0.4 * per_ub_us, 0.6 * per_ub_us
            if p.dbo:
                a_attn = block(ATTN_KERNELS, attn_us, MAIN_STREAM, _prev(states, "A"), layer, "A", True)
                a_disp = coll(disp_type, "dispatch", transfer_us, a_attn, layer, "A")
                b_attn = block(ATTN_KERNELS, attn_us, MAIN_STREAM, _prev(states, "B"), layer, "B", True)
                b_disp = coll(disp_type, "dispatch", transfer_us, b_attn, layer, "B")
                a_moe = block(MOE_KERNELS, moe_us, MAIN_STREAM, a_disp, layer, "A", True)
                a_comb = coll(comb_type, "combine", transfer_us, a_moe, layer, "A")
                b_moe = block(MOE_KERNELS, moe_us, MAIN_STREAM, b_disp, layer, "B", True)
                b_comb = coll(comb_type, "combine", transfer_us, b_moe, layer, "B")
                for r, st in enumerate(states):
                    st.last_combine_end = {"A": a_comb[r], "B": b_comb[r]}
            else:
                attn = block(ATTN_KERNELS, attn_us, MAIN_STREAM, _prev(states, "-"), layer, "-", True)
                disp = coll(disp_type, "dispatch", transfer_us, attn, layer, "-")
                shared_us = p.shared_expert_cover * transfer_us
                shared = block(SHARED_KERNELS, shared_us, SHARED_STREAM, attn, layer, "-", False)
                moe = block(MOE_KERNELS, moe_us, MAIN_STREAM, disp, layer, "-", True)
                comb = coll(comb_type, "combine", transfer_us, [max(a, b) for a, b in zip(moe, shared, strict=True)],
                            layer, "-")
                for r, st in enumerate(states):
                    st.last_combine_end = {"-": comb[r]}
        for r, st in enumerate(states):
            rs = out[r]
            rs.host_end = max(st.host, rs.device_end) + HOST_TAIL_NS
            st.host = rs.host_end
            # the next step's kernels cannot start before this step is over
            st.stream_free = {s: rs.host_end for s in st.stream_free}
            st.comm_free = rs.host_end
        yield out


def _prev(states: list[_RankState], ub: str) -> list[int]:
    return [st.last_combine_end.get(ub, 0) for st in states]


# --------------------------------------------------------------------------------------------------
# Independent interval algebra for the ground truth (lists of (start, end), integer ns)


def iv_union(ivs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(ivs):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def iv_subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """a − b for normalised sets."""
    out = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            if cur >= e:
                break
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def iv_total(a: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in a)


def iv_intersect_len(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return iv_total(a) - iv_total(iv_subtract(a, b))


# --------------------------------------------------------------------------------------------------
# Overlap Analysis track and step figures exactly as msprof and torch_npu define them


@dataclass
class StepOverlap:
    """The merged Overlap Analysis intervals of one rank-step, plus what the ground truth needs."""

    computing: list[tuple[int, int]]
    communication: list[tuple[int, int]]
    not_overlapped: list[tuple[int, int]]
    busy: list[tuple[int, int]]
    span: tuple[int, int]


def step_overlap(rs: RankStep) -> StepOverlap:
    comp = iv_union([(k.start, k.end) for k in rs.kernels if k.is_compute])
    comm = iv_union([(c.start, c.end) for c in rs.comm_ops])
    busy = iv_union(comp + comm)
    all_tasks = [(k.start, k.end) for k in rs.kernels] + [(c.start, c.end) for c in rs.comm_ops]
    span = (min(s for s, _ in all_tasks), max(e for _, e in all_tasks))
    span = (min(span[0], busy[0][0]), max(span[1], busy[-1][1]))
    return StepOverlap(comp, comm, iv_subtract(comm, comp), busy, span)


def us(ns: int) -> float:
    """ns -> µs, exact to the ns (3 decimals)."""
    return round(ns / 1000.0, 3)


def step_truth(rs: RankStep, ov: StepOverlap, free: list[tuple[int, int]], step_range: tuple[int, int],
               ubatches: tuple[str, ...]) -> dict:
    """Ground-truth figures of one rank-step.

    Overlap events are assigned to the step whose range holds their *start* (torch_npu's rule), so the
    free gap between two steps belongs to the earlier one: ``free`` holds the step's own gaps and that one.
    """
    lo, hi = step_range
    # every event of this step's own intervals starts inside its range by construction; assert it
    for s, _ in ov.busy + free:
        if not lo <= s < hi:
            raise AssertionError(f"synthetic step {rs.step}: interval start {s} outside step range {step_range}")
    computing = iv_total(ov.computing)
    communication = iv_total(ov.communication)
    not_overlapped = iv_total(ov.not_overlapped)
    free_ns = iv_total(free)
    starts = [s for s, _ in ov.computing + ov.communication + ov.not_overlapped + free]
    ends = [e for _, e in ov.computing + ov.communication + ov.not_overlapped + free]
    e2e = max(ends) - min(starts)
    first_cc = min(s for s, _ in ov.computing + ov.communication)
    layers = []
    comp_by_ub = {ub: iv_union([(k.start, k.end) for k in rs.kernels if k.is_compute and k.ubatch == ub])
                  for ub in ubatches}
    prev_compute: dict[int, str] = {}
    compute_sorted = sorted((k for k in rs.kernels if k.is_compute), key=lambda k: k.end)
    ends_sorted = [k.end for k in compute_sorted]
    ops = []
    for c in rs.comm_ops:
        span = [(c.start, c.end)]
        exposed = iv_total(iv_subtract(span, ov.computing))
        i = bisect_right(ends_sorted, c.start) - 1
        before = compute_sorted[i].name if i >= 0 else ""
        prev_compute[c.seq] = before
        op = {
            "name": c.name, "type": c.op_type, "layer": c.layer, "role": c.role,
            "start_us": us(c.start), "end_us": us(c.end),
            "comm_us": us(c.end - c.start), "exposed_us": us(exposed),
            "wait_us": us(c.arrive + HANDSHAKE_NS - c.start - NOTIFY_NS),
            "compute_before": before,
        }
        if len(ubatches) == 2 and c.ubatch in ubatches:
            other = "B" if c.ubatch == "A" else "A"
            op["ubatch"] = c.ubatch
            op["covered_by_other_ubatch_us"] = us(iv_intersect_len(span, comp_by_ub[other]))
        ops.append(op)
    for layer in sorted({c.layer for c in rs.comm_ops if c.role != "receive"}):
        lops = [o for o in ops if o["layer"] == layer]
        entry = {
            "layer": layer,
            "comm_us": us(sum(c.end - c.start for c in rs.comm_ops if c.layer == layer)),
            "exposed_comm_us": us(sum(iv_total(iv_subtract([(c.start, c.end)], ov.computing))
                                      for c in rs.comm_ops if c.layer == layer)),
        }
        if len(ubatches) == 2:
            per_ub = {}
            for ub in ubatches:
                uops = [c for c in rs.comm_ops if c.layer == layer and c.ubatch == ub]
                other = "B" if ub == "A" else "A"
                comm_ns = sum(c.end - c.start for c in uops)
                cov = sum(iv_intersect_len([(c.start, c.end)], comp_by_ub[other]) for c in uops)
                per_ub[ub] = {"comm_us": us(comm_ns), "covered_by_other_us": us(cov),
                              "covered_fraction": round(cov / comm_ns, 6) if comm_ns else 0.0}
            entry["ubatches"] = per_ub
        entry["ops"] = [o["name"] for o in lops]
        layers.append(entry)
    streams = {}
    for sid in sorted({k.stream for k in rs.kernels}):
        busy = iv_total(iv_union([(k.start, k.end) for k in rs.kernels if k.is_compute and k.stream == sid]))
        streams[f"Stream {sid}"] = {"busy_us": us(busy), "kernels": sum(1 for k in rs.kernels
                                                                        if k.is_compute and k.stream == sid)}
    # Bubble: the hcom_receive ops (pipeline-stage waits); torch_npu counts them into the step's e2e span too
    receives = [c for c in rs.comm_ops if c.role == "receive"]
    bubble = sum(c.end - c.start for c in receives)
    if receives:
        e2e = max(max(ends), max(c.end for c in receives)) - min(min(starts), min(c.start for c in receives))
    return {
        "step": rs.step,
        "computing_us": us(computing),
        "communication_us": us(communication),
        "communication_not_overlapped_us": us(not_overlapped),
        "overlapped_us": us(communication - not_overlapped),
        "free_us": us(free_ns),
        "stage_us": us(e2e - bubble),
        "bubble_us": us(bubble),
        "communication_not_overlapped_exclude_receive_us": us(not_overlapped - bubble),
        "preparing_us": us(first_cc - rs.host_start),
        "step_range_us": [us(lo), us(hi)],
        "device_span_us": [us(ov.span[0]), us(ov.span[1])],
        "comm_wait_us": us(sum(c.arrive + HANDSHAKE_NS - c.start - NOTIFY_NS for c in rs.comm_ops)),
        "streams": streams,
        "layers": layers,
        "comm_ops": ops,
    }
