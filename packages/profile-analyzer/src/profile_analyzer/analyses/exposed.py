"""Exposed communication: time when a communication operator runs and no compute does.

The exposed set is ``comm - comp`` (msprof's Communication(Not Overlapped)). Each communication operator
is charged the exposed time inside its own span; operators are grouped by their *kind* (the op name with
the per-instance suffix removed: ``hcom_allReduce__275_237_1`` -> ``hcom_allReduce``) and by the compute
operator that ended last before the operator started, or, in traces with named ranges on the compute
threads (``record_function``), the innermost named range around that compute or else the named range
that ended last before it on its thread (which tells the user which layer exposes it).
When communication operators run at once (nested ranges, two groups), each exposed instant is charged
to the one that started last, so the per-operator figures add up to the total ``exposed_us``.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.timeline import COMM_KINDS, Kind, RankTimeline, is_step_name

# torch.compile's and autograd's wrapper ranges: they enclose whole graphs, so they name no code region
_WRAPPER_RANGE = re.compile(r"^(Torch-Compiled Region|TorchDynamo Cache Lookup|## Call CompiledFxGraph|Pregraph bytecode|"
                            r"AOTDispatcher|CompiledFunction|autograd::engine::)")
_INSTANCE_SUFFIX = re.compile(r"(__\d+(_\d+)*|_\d+(_\d+)+)$")


@lru_cache(maxsize=1 << 16)
def short_name(name: str) -> str:
    """A kernel name without ``void`` and its parameter list: ``void k<int>(int*, ...)`` -> ``k<int>``."""
    n = name[5:] if name.startswith("void ") else name
    if "(" not in n:
        return n
    depth = 0
    for i, ch in enumerate(n):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            return n[:i]
    return n


_INDEX_TOKENS = re.compile(r"(?i)(?<![a-z])(layers?|ubatch|micro_?batch)([._\-]?)\d+(?!\d)")


@lru_cache(maxsize=1 << 16)
def op_kind(name: str) -> str:
    """The operator without what varies per call: ``hcom_allGather__063_2_1`` -> ``hcom_allGather``;
    ``ncclKernel_X(ncclDevComm*, ...)`` -> ``ncclKernel_X``; ``dbo.ubatch0.comm.all_gather.layer3`` ->
    ``dbo.ubatch*.comm.all_gather.layer*``."""
    n = short_name(name)
    n = _INSTANCE_SUFFIX.sub("", n) or n
    return _INDEX_TOKENS.sub(lambda m: f"{m.group(1)}{m.group(2)}*", n)


def compute_label(rt: RankTimeline, name_id: int) -> str:
    t = rt.op_types.get(name_id)
    name = short_name(rt.names[name_id])
    # a Level-0 profile has no operator types (kernel_details.csv Type "N/A"): the kernel's own name says it
    return f"{t} ({name})" if t and t != name and t != "N/A" else name


class _CodeRegion:
    """Label of a compute task for the "compute just before" grouping: the innermost named range enclosing it
    on its own stream/thread (a ``record_function`` such as ``dbo.ubatch0.compute.layer3`` in a CPU trace),
    else the operator itself (its kernel_details Type and name on Ascend)."""

    def __init__(self, rt: RankTimeline) -> None:
        self.rt = rt
        self.cache: dict[int, str] = {}
        host = np.flatnonzero(rt.kind == int(Kind.HOST))
        if host.size:
            step_ids = np.array([i for i, n in enumerate(rt.names) if is_step_name(n) or _WRAPPER_RANGE.match(n)],
                                dtype=np.int32)
            host = host[~np.isin(rt.name_id[host], step_ids)]
        self.by_stream: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for st in np.unique(rt.stream[host]):
            h = host[rt.stream[host] == st]
            h = h[np.argsort(rt.start_ns[h], kind="stable")]
            self.by_stream[int(st)] = (rt.start_ns[h], rt.end_ns[h], rt.name_id[h])

    def many(self, tasks: np.ndarray, n_before: int = 0, before_start: str = "") -> list[str]:
        """``n_before`` times ``before_start``, then the label of each of ``tasks``; where no stream has named ranges
        (the usual device trace) a label is its task's name, so it is worked out once per distinct name."""
        if self.by_stream:
            return [before_start] * n_before + [self(t) for t in tasks.tolist()]
        ids, of_task = np.unique(self.rt.name_id[tasks], return_inverse=True)
        labels = [compute_label(self.rt, i) for i in ids.tolist()]
        return [before_start] * n_before + [labels[j] for j in of_task.tolist()]

    def __call__(self, task: int) -> str:
        got = self.cache.get(task)
        if got is not None:
            return got
        rt = self.rt
        label = compute_label(rt, int(rt.name_id[task]))
        ranges = self.by_stream.get(int(rt.stream[task]))
        if ranges is not None:
            rs, re_, rn = ranges
            j = int(np.searchsorted(rs, rt.start_ns[task], side="right")) - 1
            found = False
            for _ in range(64):
                if j < 0:
                    break
                if re_[j] >= rt.end_ns[task]:
                    label = rt.names[int(rn[j])]
                    found = True
                    break
                j -= 1
            if not found:  # between named regions: the one that ended last before it on this thread
                before = np.flatnonzero(re_ <= rt.start_ns[task])
                if before.size:
                    label = rt.names[int(rn[before[np.argmax(re_[before])]])]
        self.cache[task] = label
        return label


def exclusive_exposure(starts: np.ndarray, ends: np.ndarray, exposed: iv.IntervalSet) -> np.ndarray:
    """Exposed time charged to each operator so that nothing is counted twice: every exposed instant goes
    to the operator that started last among those running then (the innermost one when ranges nest)."""
    order = np.argsort(starts, kind="stable")
    s_sorted, e_sorted = starts[order], ends[order]
    if starts.size and exposed[0].size and (e_sorted >= s_sorted).all() and (e_sorted[:-1] <= s_sorted[1:]).all():
        # no two operators run at once (the usual case): each is charged the exposed time inside its own span,
        # which is what the sweep gives then
        return iv.overlap_with_each(starts, ends, exposed)
    return sweep_exposure(starts, ends, exposed, order)


def sweep_exposure(starts: np.ndarray, ends: np.ndarray, exposed: iv.IntervalSet,
                   order: np.ndarray | None = None) -> np.ndarray:
    """The general path of :func:`exclusive_exposure`: the exposed set cut at every boundary, each piece charged
    to the operator that started last among those running then (a heap of the running ones)."""
    n = starts.size
    out = np.zeros(n, dtype=np.int64)
    es, ee = exposed
    if n == 0 or es.size == 0:
        return out
    if order is None:
        order = np.argsort(starts, kind="stable")
    s_sorted = starts[order]
    bounds = np.unique(np.concatenate([starts, ends, es, ee]))
    mids_lo, mids_hi = bounds[:-1], bounds[1:]
    k = np.searchsorted(es, mids_lo, side="right") - 1
    is_exp = (k >= 0) & (mids_lo < ee[np.maximum(k, 0)])
    seg_lo, seg_hi = mids_lo[is_exp], mids_hi[is_exp]
    import heapq

    heap: list[tuple[int, int]] = []  # (-start, op index)
    j = 0
    for a, b in zip(seg_lo.tolist(), seg_hi.tolist(), strict=True):
        while j < n and s_sorted[j] <= a:
            i = int(order[j])
            heapq.heappush(heap, (-int(starts[i]), i))
            j += 1
        while heap and ends[heap[0][1]] <= a:
            heapq.heappop(heap)
        if heap:
            out[heap[0][1]] += b - a
    return out


def _groups(labels: list[str], of_item: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Items labelled ``labels[of_item[i]]`` (labels may repeat) -> (group of each item, the distinct labels), the
    groups numbered in the order their label first appears among the items (the order a dict filled item by item
    keeps)."""
    ids: dict[str, int] = {}
    lab_group = np.array([ids.setdefault(x, len(ids)) for x in labels], dtype=np.int64)
    group = lab_group[of_item] if of_item.size else np.zeros(0, np.int64)
    if group.size == 0:
        return group, []
    present, first = np.unique(group, return_index=True)
    order = present[np.argsort(first, kind="stable")]
    renumber = np.empty(len(ids), dtype=np.int64)
    renumber[order] = np.arange(order.size)
    values = list(ids)
    return renumber[group], [values[i] for i in order.tolist()]


def _group_sums(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Integer sums of ``values`` per group (int64, exact)."""
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, group, values.astype(np.int64))
    return out


def exposed_communication(rt: RankTimeline, comp: iv.IntervalSet, comm_not_overlapped: iv.IntervalSet,
                          lo: int, hi: int, top: int = 20) -> dict[str, object]:
    exposed = iv.clip(comm_not_overlapped, lo, hi)
    total_exposed = iv.total(exposed)
    ops = np.flatnonzero(rt.of_kind(*COMM_KINDS) & (rt.start_ns >= lo) & (rt.start_ns < hi))
    os_, oe = rt.start_ns[ops], rt.end_ns[ops]
    per_op = exclusive_exposure(os_, oe, exposed)
    comp_idx = np.flatnonzero(rt.kind == int(Kind.COMPUTE))
    comp_end_order = comp_idx[np.argsort(rt.end_ns[comp_idx], kind="stable")]
    comp_ends = rt.end_ns[comp_end_order]
    before = np.searchsorted(comp_ends, os_, side="right") - 1
    # the kind of each op, worked out once per distinct name
    name_ids, name_of_op = np.unique(rt.name_id[ops], return_inverse=True)
    kind_group, kind_values = _groups([op_kind(rt.names[i]) for i in name_ids.tolist()], name_of_op)
    kinds = [kind_values[g] for g in kind_group.tolist()]
    label = _CodeRegion(rt)
    # the label of the compute before each op, worked out once per distinct compute task
    befores, before_of_op = np.unique(before, return_inverse=True)
    prev_group, prev_values = _groups(label.many(comp_end_order[befores[befores >= 0]], n_before=int((befores < 0).sum()),
                                                 before_start="(start of trace)"), before_of_op)
    span = oe - os_

    def table(group: np.ndarray, values: list[str], label: str) -> list[dict[str, object]]:
        # per group, in the order groups first appear among the ops: count, exposed and total time (integer ns
        # summed exactly, as the float sums of whole ns they replace)
        count = np.bincount(group, minlength=len(values))
        ex = _group_sums(group, per_op, len(values))
        tot = _group_sums(group, span, len(values))
        rows = [{label: k, "count": int(c), "exposed_us": float(x) / 1000.0, "total_us": float(t) / 1000.0,
                 "exposed_pct": (100.0 * float(x) / float(t)) if t else 0.0}
                for k, c, x, t in zip(values, count.tolist(), ex.tolist(), tot.tolist(), strict=True)]
        rows.sort(key=lambda r: -r["exposed_us"])  # type: ignore[operator]
        return rows[:top]

    # the worst single exposed intervals, each attributed to the op that covers its start
    gs, ge = exposed
    worst = np.argsort(-(ge - gs), kind="stable")[:top]
    op_order = np.argsort(os_, kind="stable")
    sorted_os = os_[op_order]
    # each op's occurrence among the ops of its kind, in start order
    occ_of = np.zeros(ops.size, dtype=np.int64)
    if ops.size:
        g = kind_group[op_order]
        by_kind = np.argsort(g, kind="stable")
        counts = np.bincount(g, minlength=len(kind_values))
        first = np.cumsum(counts) - counts
        occ_sorted = np.empty(ops.size, dtype=np.int64)
        occ_sorted[by_kind] = np.arange(ops.size) - first[g[by_kind]]
        occ_of[op_order] = occ_sorted
    t0 = rt.t0_ns()
    gaps = []
    for w in worst:
        s, e = int(gs[w]), int(ge[w])
        j = np.searchsorted(sorted_os, s, side="right") - 1
        op_i = None
        while j >= 0:
            cand = op_order[j]
            if oe[cand] >= e or oe[cand] > s:
                op_i = cand
                break
            j -= 1
        bprev = np.searchsorted(comp_ends, s, side="right") - 1
        gaps.append({
            "rank": rt.rank,
            "start_us": (s - t0) / 1000.0,
            "end_us": (e - t0) / 1000.0,
            "dur_us": (e - s) / 1000.0,
            "comm_op": rt.names[int(rt.name_id[ops[op_i]])] if op_i is not None else None,
            "comm_kind": kinds[op_i] if op_i is not None else None,
            "occurrence": int(occ_of[op_i]) if op_i is not None else None,
            "stream": rt.streams[int(rt.stream[ops[op_i]])].label if op_i is not None else None,
            "preceding_compute": label(int(comp_end_order[bprev])) if bprev >= 0 else None,
        })
    return {
        "exposed_us": total_exposed / 1000.0,
        "by_operator": table(kind_group, kind_values, "operator"),
        "by_preceding_compute": table(prev_group, prev_values, "preceding_compute"),
        "worst_gaps": gaps,
    }
