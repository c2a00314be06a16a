"""What would dual batch overlap give? Simulate the micro-batch ping-pong from a step taken with DBO off.

The public API of this module is the one schedule simulation of the toolkit: ``profile-analyzer whatif``
feeds it segments read from a profile, ``dbo-runtime estimate`` feeds it segments predicted from a model's
config and hardware rates.

The model of a step
-------------------
A DBO-off step is a chain of segments in time order, each ``compute`` or ``comm`` (communication that nothing
hides). With DBO on, every micro-batch runs the same chain over its share of the tokens; a segment's time for
one micro-batch is its ``part_us`` (for a profile: ``fixed + (full - fixed) * scale``, the latency of a
collective does not shrink with the tokens; for an estimate: whatever the cost model says).

The schedule is the one vLLM's DBO (and dbo-runtime) runs, on one compute resource and one communication
resource per rank:

* compute is strictly round-robin: micro-batch 0 runs its compute up to its next collective, launches it,
  and yields; micro-batch 1 does the same; micro-batch 0 resumes when it is its turn *and* its collective has
  completed (the compute resource waits otherwise: nobody else may run in between);
* collectives run one at a time on the communication resource, in launch order;
* every handoff between micro-batches costs ``switch_us`` of compute-resource time (the yield: an OS-thread
  handoff, a greenlet switch, a stream-event wait);
* a collective's ``host_us`` is the part of its transfer that the rank's compute resource does too (a CPU
  collective's copies: gloo moves the bytes with the same cores that compute). With DBO off it lies inside the
  wait; with DBO on it takes the cores from the compute that runs beside the collective: a compute piece that
  overlaps a collective in flight is longer by the host work it meets (at most the overlap), and host work that
  meets idle cores costs nothing. A device collective moved by a DMA engine has none;
* segments flagged ``split=False`` (work outside the micro-batched region, e.g. sampling) run once, whole,
  before or after the ping-pong.

The step with DBO on ends when the last micro-batch's last segment ends. Per layer, the predicted time is
when the layer's last segment (of every micro-batch) ends minus when the previous layer's ended (these add up
to the step, but a layer is credited with the previous layer's tail it hides); a layer "cannot pay" where the
layer scheduled alone (``alone_us``: its own fill and drain, no neighbour to hide in) is not below its DBO-off
time: too little communication to hide the switches and the collective latency paid twice.

Reading segments from a profile
-------------------------------
For one rank and one step: every interval of the union of communication tasks becomes one ``comm`` segment of
its exposed length (the part no compute task overlaps) where the rank waited for it; everything else in the
step window (compute, the part of a collective that compute already overlapped, gaps) is ``compute``. A piece
of exposed communication is a wait only where a transfer ends with it: a piece that ends where compute resumes
while the collective goes on is host time between operators, and one that ends with the range that launched an
asynchronous collective (its transfer, on a thread or stream without compute, outlives the range) is the launch;
both stay in the compute, because DBO does not switch micro-batches there (A3's token-count exchange, launched
under the shared expert, is one). Free time between two pieces of communication is waiting for communication and
joins it, and pieces of one operator with only compute that overlapped it in between are one segment. So the
segments add up to the measured DBO-off step exactly. A collective's host work is the time of the tasks a CPU
collective backend runs to move its bytes (``HOST_COPY``: gloo's own ``gloo:<collective>`` ranges) ending in its
segment, paired across ranks by their order (every rank issues its collectives in one order) and taken from the
rank that waited least for its peers (the shortest): the rest of such a task on a faster rank is that rank waiting.
A segment's layer is the number in a ``layer<N>`` / ``layers.<N>.`` name of
the tasks it covers; without such names a "layer" is one period of the sequence of collective names (two
all-reduces per layer in a tensor-parallel dense model read as one period of length 1 unless their names
differ).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.errors import ProfileError
from profile_analyzer.timeline import COMM_KINDS, COMPUTE_KINDS, RankTimeline, Timeline

__all__ = ["Segment", "Schedule", "LayerResult", "simulate", "split_parts", "segments_from_rank", "step_windows", "whatif",
           "measured", "collectives_by_name", "LAYER_NAME", "HOST_COPY", "host_copies", "paired_host"]

LAYER_NAME = re.compile(r"(?<![a-z])layers?[._#-]?(\d+)(?!\d)", re.IGNORECASE)
"""A layer index in a task name: ``layer3``, ``attn_layer_3``, ``model.layers.3.mlp``, ``Layer#3``."""

KINDS = ("compute", "comm")

HOST_COPY = re.compile(r"^gloo:")
"""Tasks in which a CPU collective backend moves the bytes with the host's cores (gloo's ``gloo:all_gather``,
``gloo:all_reduce``, ... ranges): their time, on the rank that waited least, is the collective's host work."""


@dataclass(frozen=True)
class Segment:
    """One piece of a DBO-off step: ``full_us`` with the whole batch, ``part_us`` for one micro-batch's share."""

    kind: str
    full_us: float
    part_us: float | None = None
    layer: int | None = None
    name: str = ""
    split: bool = True
    host_us: float = 0.0
    host_part_us: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"segment kind must be one of {KINDS}, got {self.kind!r}")
        for what, v in (("full_us", self.full_us), ("part_us", self.part_us), ("host_us", self.host_us),
                        ("host_part_us", self.host_part_us)):
            if v is not None and not (v >= 0 and np.isfinite(v)):
                raise ValueError(f"segment {what} must be a finite non-negative number, got {v!r}")


@dataclass
class LayerResult:
    layer: int | None
    off_us: float
    on_us: float
    compute_us: float
    comm_us: float
    alone_us: float
    pays: bool


@dataclass
class Event:
    """One scheduled piece: micro-batch ``ubatch`` (-1: unsplit work) ran ``kind`` from ``start_us`` to ``end_us``."""

    ubatch: int
    kind: str
    start_us: float
    end_us: float
    layer: int | None
    name: str


@dataclass
class Schedule:
    ubatches: int
    switch_us: float
    off_us: float
    on_us: float
    switches: int
    compute_idle_us: float
    comm_exposed_us: float
    layers: list[LayerResult]
    events: list[Event] = field(repr=False)
    host_us: float = 0.0
    """Compute-resource time the collectives' host work took from the compute beside them (see the module doc)."""

    @property
    def speedup(self) -> float:
        return self.off_us / self.on_us if self.on_us > 0 else float("nan")

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        d = {"ubatches": self.ubatches, "switch_us": self.switch_us, "off_us": self.off_us, "on_us": self.on_us,
             "speedup": self.speedup, "switches": self.switches, "compute_idle_us": self.compute_idle_us,
             "comm_exposed_us": self.comm_exposed_us, "host_us": self.host_us, "layers": [asdict(x) for x in self.layers],
             "layers_that_cannot_pay": [x.layer for x in self.layers if not x.pays]}
        if events:
            d["events"] = [asdict(e) for e in self.events]
        return d


def split_parts(segments: Sequence[Segment], ubatches: int = 2, *, compute_scale: float | None = None,
                comm_scale: float | None = None, comm_fixed_us: float = 0.0, compute_fixed_us: float = 0.0
                ) -> list[Segment]:
    """Fill in ``part_us`` where it is missing: ``fixed + (full - fixed) * scale`` (scale defaults to
    ``1/ubatches``: time proportional to tokens, above a fixed part such as a collective's latency), and
    ``host_part_us``: the host work in proportion to the bytes (``host_us * comm scale``), or to ``part_us`` where
    that was given."""
    if ubatches < 2:
        raise ValueError(f"ubatches must be 2 or more, got {ubatches}")
    scales = {"compute": 1.0 / ubatches if compute_scale is None else compute_scale,
              "comm": 1.0 / ubatches if comm_scale is None else comm_scale}
    fixed = {"compute": compute_fixed_us, "comm": comm_fixed_us}
    for k, s in scales.items():
        if not (0 < s <= 1):
            raise ValueError(f"{k} scale must be in (0, 1], got {s}")
    out = []
    for s in segments:
        if s.part_us is not None or not s.split:
            s = s if s.part_us is not None else replace(s, part_us=s.full_us)
            host = s.host_us * (s.part_us / s.full_us if s.full_us > 0 else 1.0)
        else:
            f = min(fixed[s.kind], s.full_us)
            s = replace(s, part_us=f + (s.full_us - f) * scales[s.kind])
            host = s.host_us * scales[s.kind]
        out.append(s if s.host_part_us is not None else replace(s, host_part_us=min(host, s.part_us)))
    return out


def _chunks(segments: Sequence[Segment]) -> list[tuple[list[Segment], Segment | None]]:
    """Compute segments up to (and with) the next comm segment: one chunk per yield."""
    chunks: list[tuple[list[Segment], Segment | None]] = []
    pending: list[Segment] = []
    for s in segments:
        if s.kind == "comm":
            chunks.append((pending, s))
            pending = []
        else:
            pending.append(s)
    if pending:
        chunks.append((pending, None))
    return chunks


def simulate(segments: Sequence[Segment], ubatches: int = 2, switch_us: float = 0.0, *,
             compute_scale: float | None = None, comm_scale: float | None = None, comm_fixed_us: float = 0.0
             ) -> Schedule:
    """Simulate the ``ubatches``-way ping-pong of one step given as its DBO-off chain of segments."""
    if not (switch_us >= 0 and np.isfinite(switch_us)):
        raise ValueError(f"switch_us must be a finite non-negative number, got {switch_us!r}")
    segs = split_parts(segments, ubatches, compute_scale=compute_scale, comm_scale=comm_scale,
                       comm_fixed_us=comm_fixed_us)
    split_idx = [i for i, s in enumerate(segs) if s.split]
    if split_idx and split_idx[-1] - split_idx[0] + 1 != len(split_idx):
        raise ValueError("unsplit segments may only come before or after the micro-batched ones")
    lo, hi = (split_idx[0], split_idx[-1] + 1) if split_idx else (len(segs), len(segs))
    before, body, after = segs[:lo], segs[lo:hi], segs[hi:]
    off_us = float(sum(s.full_us for s in segs))
    events: list[Event] = []
    t = 0.0
    layer_end: dict[int | None, float] = {}

    def serial(part: Sequence[Segment], t: float) -> float:
        for s in part:
            events.append(Event(-1, s.kind, t, t + s.full_us, s.layer, s.name))
            t += s.full_us
            layer_end[s.layer] = t
        return t

    t = serial(before, t)
    chunks = _chunks(body)
    compute_free = comm_free = t
    ready = [t] * ubatches
    switches = 0
    idle = 0.0
    current = None
    comm_exposed = 0.0
    in_flight: list[list[float]] = []  # [start, end, host work not yet charged] of collectives with host work
    host_total = 0.0

    def charge(a: float, b: float) -> float:
        """The host work of collectives in flight that a compute piece running from ``a`` to ``b`` meets."""
        taken = 0.0
        for c in in_flight:
            if c[2] > 0 and c[0] < b and c[1] > a:
                x = min(c[2], min(b, c[1]) - max(a, c[0]))
                c[2] -= x
                taken += x
        return taken

    for compute, comm in chunks:
        for u in range(ubatches):
            start = max(compute_free, ready[u])
            if current is not None and current != u:
                start += switch_us
                switches += 1
            idle += max(0.0, ready[u] - compute_free)
            current = u
            for s in compute:
                extra = charge(start, start + s.part_us) if in_flight else 0.0
                host_total += extra
                events.append(Event(u, "compute", start, start + s.part_us + extra, s.layer, s.name))
                start += s.part_us + extra
                layer_end[s.layer] = max(layer_end.get(s.layer, 0.0), start)
            compute_free = start
            if comm is None:
                ready[u] = start
                continue
            cstart = max(start, comm_free)
            comm_free = cend = cstart + comm.part_us
            events.append(Event(u, "comm", cstart, cend, comm.layer, comm.name))
            if comm.host_part_us:
                in_flight = [c for c in in_flight if c[2] > 0 and c[1] > start]
                in_flight.append([cstart, cend, comm.host_part_us])
            layer_end[comm.layer] = max(layer_end.get(comm.layer, 0.0), cend)
            ready[u] = cend
    end = max([compute_free, *ready]) if chunks else t
    # communication still in flight after the last compute of every micro-batch is exposed
    comm_exposed = max(0.0, end - compute_free)
    t = serial(after, end)
    on_us = t
    # per layer, in order of first appearance in the chain
    order: list[int | None] = []
    off_by: dict[int | None, list[float]] = {}
    for s in segs:
        if s.layer not in off_by:
            order.append(s.layer)
            off_by[s.layer] = [0.0, 0.0]
        off_by[s.layer][0 if s.kind == "compute" else 1] += s.full_us
    layers = []
    prev = 0.0
    for key in order:
        e = max(prev, layer_end.get(key, prev))
        comp, comm = off_by[key]
        mine = [x for x in segs if x.layer == key]
        alone = _alone(mine, ubatches, switch_us) if len(order) > 1 else on_us
        layers.append(LayerResult(key, comp + comm, e - prev, comp, comm, alone, alone < comp + comm))
        prev = e
    if layers and prev < on_us:  # rounding: give the rest to the last row
        layers[-1].on_us += on_us - prev
    return Schedule(ubatches, switch_us, off_us, on_us, switches, idle, comm_exposed, layers, events, host_total)


def _alone(segs: list[Segment], ubatches: int, switch_us: float) -> float:
    """One layer's segments scheduled by themselves (fill and drain included): does this layer pay on its own?"""
    return simulate(segs, ubatches, switch_us).on_us


# ---------------------------------------------------------------------------------------------- from a profile


def _layer_of(names: Sequence[str]) -> int | None:
    for n in names:
        m = LAYER_NAME.search(n)
        if m:
            return int(m.group(1))
    return None


def _period(names: Sequence[str]) -> int | None:
    """The smallest p with names[i] == names[i + p] for every i (and at least two periods), else None."""
    n = len(names)
    for p in range(1, n // 2 + 1):
        if all(names[i] == names[i + p] for i in range(n - p)):
            return p
    return None


def step_windows(rt: RankTimeline, step: int | None = None) -> list[tuple[int, int, int | None]]:
    """(start_ns, end_ns, step id) of every step of the rank, or of the one asked for; a profile without step
    ranges is one window from its first to its last compute or communication task (id None)."""
    steps = rt.steps
    if len(steps):
        order = np.argsort(steps.start_ns, kind="stable")
        if step is not None:
            order = [i for i in order if int(steps.ids[i]) == step]
            if not order:
                raise ProfileError(rt.source, f"step {step} not in rank {rt.rank}; steps present: "
                                              f"{sorted(int(x) for x in steps.ids)}")
        return [(int(steps.start_ns[i]), int(steps.end_ns[i]), int(steps.ids[i])) for i in order]
    if step is not None:
        raise ProfileError(rt.source, f"step {step} asked for, but rank {rt.rank} has no step ranges")
    work = rt.of_kind(*COMPUTE_KINDS) | rt.of_kind(*COMM_KINDS)
    if not work.any():
        raise ProfileError(rt.source, f"rank {rt.rank} has no compute or communication tasks to simulate")
    return [(int(rt.start_ns[work].min()), int(rt.end_ns[work].max()), None)]


def host_copies(rt: RankTimeline, window: tuple[int, int]) -> list[tuple[int, float]]:
    """(end_ns, µs) of the rank's ``HOST_COPY`` tasks that end inside ``window``, in the order they started."""
    lo, hi = window
    ids = [i for i, n in enumerate(rt.names) if HOST_COPY.search(n)]
    if not ids:
        return []
    idx = np.nonzero(np.isin(rt.name_id, ids) & (rt.end_ns > lo) & (rt.end_ns <= hi))[0]
    idx = idx[np.argsort(rt.start_ns[idx], kind="stable")]
    return [(int(e), (e - b) / 1000.0) for b, e in zip(rt.start_ns[idx].tolist(), rt.end_ns[idx].tolist(), strict=True)]


def segments_from_rank(rt: RankTimeline, window: tuple[int, int] | None = None,
                       host: Sequence[tuple[int, float]] | None = None) -> list[Segment]:
    """The DBO-off chain of one rank between ``window`` = (start_ns, end_ns) (default: its last step). ``host``:
    (end_ns, µs) of each collective's host work (default: the rank's own ``host_copies``); a communication segment
    carries the host work that ends inside it (host work that ends in compute overlapped compute already)."""
    lo, hi = window if window is not None else step_windows(rt)[-1][:2]
    inside = (rt.start_ns < hi) & (rt.end_ns > lo)
    comp_mask = rt.of_kind(*COMPUTE_KINDS) & inside
    comm_mask = rt.of_kind(*COMM_KINDS) & inside
    comp = iv.clip(iv.union(*rt.select(comp_mask)), lo, hi)
    comm = iv.clip(iv.union(*rt.select(comm_mask)), lo, hi)
    exposed = iv.difference(comm, comp)
    cno = _waits(rt, comm_mask, comm, exposed)
    no_wait = iv.difference(exposed, cno)  # exposed, but the rank did not wait: it joins the compute
    # the step window as elementary pieces: compute (any compute task, including what overlapped communication),
    # exposed communication, and free time (neither)
    free = iv.gaps(iv.union_sets(comp, comm), lo, hi)
    pieces = sorted([(int(a), int(b), "compute") for a, b in zip(*iv.union_sets(comp, no_wait), strict=True)]
                    + [(int(a), int(b), "comm") for a, b in zip(*cno, strict=True)]
                    + [(int(a), int(b), "free") for a, b in zip(*free, strict=True)])
    # free time between two pieces of communication is the rank waiting for communication; elsewhere it is
    # host work between operators and belongs with the compute
    kinds = [k for _, _, k in pieces]
    for i, k in enumerate(kinds):
        if k == "free":
            comm_both = (0 < i < len(kinds) - 1 and kinds[i - 1] == "comm"
                         and next((x for x in kinds[i + 1:] if x != "free"), None) == "comm")
            kinds[i] = "comm" if comm_both else "compute"
    runs: list[list[int]] = []  # [start, end, kind index, total ns]
    for (a, b, _), k in zip(pieces, kinds, strict=True):
        if runs and runs[-1][2] == k:
            runs[-1][1] = b
            runs[-1][3] += b - a
        else:
            runs.append([a, b, k, b - a])
    c_idx = np.nonzero(comm_mask)[0]
    c_s, c_e = rt.start_ns[c_idx], rt.end_ns[c_idx]
    # longest task first, so that a segment is named by its outermost operator
    by_len = c_idx[np.argsort(-(c_e - c_s), kind="stable")]
    segs: list[Segment] = []
    owners: list[int] = []  # per segment: the outermost communication task it lies in (-1: compute)
    spans: list[tuple[int, int]] = []  # per segment: from where to where in the step
    for a, b, k, tot in runs:
        if tot == 0:
            continue
        if k == "compute":
            segs.append(Segment("compute", tot / 1000.0))
            owners.append(-1)
            spans.append((a, b))
            continue
        hit = by_len[(rt.start_ns[by_len] < b) & (rt.end_ns[by_len] > a)]
        names = [rt.names[int(rt.name_id[j])] for j in hit]
        owner = int(hit[0]) if hit.size else -2
        # one collective whose tail compute already overlapped (gaps between compute operators leave bits of it
        # exposed): one segment, the compute in between moved before it
        if len(segs) >= 2 and owners[-1] == -1 and owners[-2] == owner:
            mid = segs.pop()
            owners.pop()
            prev = segs.pop()
            owners.pop()
            mid_span = spans.pop()
            prev_span = spans.pop()
            if segs and segs[-1].kind == "compute":
                segs[-1] = replace(segs[-1], full_us=segs[-1].full_us + mid.full_us)
                spans[-1] = (spans[-1][0], mid_span[1])
            else:
                segs.append(mid)
                owners.append(-1)
                spans.append(mid_span)
            segs.append(replace(prev, full_us=prev.full_us + tot / 1000.0))
            owners.append(owner)
            spans.append((prev_span[0], b))
            continue
        segs.append(Segment("comm", tot / 1000.0, name=names[0] if names else "communication",
                            layer=_layer_of(names)))
        owners.append(owner)
        spans.append((a, b))
    return _assign_layers(_with_host(segs, spans, host_copies(rt, (lo, hi)) if host is None else host))


def _with_host(segs: list[Segment], spans: list[tuple[int, int]], host: Sequence[tuple[int, float]]
               ) -> list[Segment]:
    """Each communication segment with the host work that ends inside it (at most the segment itself)."""
    if not host:
        return segs
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    per = [0.0] * len(segs)
    for end, us in host:
        i = int(np.searchsorted(starts, end, side="left")) - 1  # the segment the host work ends in
        if 0 <= i < len(segs) and segs[i].kind == "comm" and spans[i][0] < end <= spans[i][1]:
            per[i] += us
    return [replace(s, host_us=min(h, s.full_us)) if h else s for s, h in zip(segs, per, strict=True)]


def paired_host(timeline: Timeline, windows: dict[int, tuple[int, int]]) -> dict[int, list[tuple[int, float]]]:
    """Per rank, its ``host_copies`` in ``windows[rank]``, each as long as the shortest of the tasks in the same
    place of every rank's order (every rank issues its collectives in one order; the rest of a longer one is that
    rank waiting for its peers). Ranks whose counts differ keep their own times."""
    own = {r: host_copies(timeline.ranks[r], w) for r, w in windows.items()}
    counts = {len(v) for v in own.values()}
    if len(counts) != 1 or len(own) < 2:
        return own
    shortest = [min(own[r][k][1] for r in own) for k in range(counts.pop())]
    return {r: [(end, shortest[k]) for k, (end, _) in enumerate(v)] for r, v in own.items()}


def _waits(rt: RankTimeline, comm_mask: np.ndarray, comm: iv.IntervalSet, exposed: iv.IntervalSet
           ) -> iv.IntervalSet:
    """The pieces of ``exposed`` communication during which the rank waited for it. Two kinds of piece are not
    waiting, and go to the compute: one that ends where compute resumes while the communication goes on (host time
    between two operators while a collective is in flight), and one that ends where the range that launched an
    asynchronous collective ends (its transfer, on a thread or stream that does no compute, outlives it): the rank
    launched and went on, it did not wait."""
    es, ee = exposed
    if es.size == 0:
        return exposed
    keep = np.isin(ee, comm[1])
    idx = np.nonzero(comm_mask)[0]
    starts, ends = rt.start_ns[idx], rt.end_ns[idx]
    on_compute = np.isin(rt.stream[idx], rt.stream[rt.of_kind(*COMPUTE_KINDS)])
    if on_compute.all() or not on_compute.any():  # no launch ranges, or no transfers apart from them
        return es[keep], ee[keep]
    t_order = np.argsort(starts[~on_compute], kind="stable")
    t_start, t_end = starts[~on_compute][t_order], ends[~on_compute][t_order]
    l_start = np.sort(starts[on_compute])
    by_end = np.argsort(ends, kind="stable")
    sorted_ends = ends[by_end]
    for i in np.nonzero(keep)[0]:
        ending = by_end[np.searchsorted(sorted_ends, ee[i], "left"):np.searchsorted(sorted_ends, ee[i], "right")]
        if ending.size == 0 or not on_compute[ending].all():
            continue  # a transfer ends here (or the step window cut it): the rank waited for it
        for j in ending:
            # the transfer this range launched: the first to start after it starts and before the next launch
            nxt = np.searchsorted(l_start, ends[j], side="right")
            limit = l_start[nxt] if nxt < l_start.size else np.iinfo(np.int64).max
            k = np.searchsorted(t_start, starts[j], side="left")
            if k >= t_start.size or t_start[k] >= limit or t_end[k] <= ends[j]:
                break  # a synchronous range: its transfer ended inside it
        else:
            keep[i] = False
    return es[keep], ee[keep]


def _assign_layers(segs: list[Segment]) -> list[Segment]:
    """Each compute segment belongs to the layer of the collective that ends its chunk (the last one's to the
    last layer); without layer names the collective-name period numbers the layers. With layer names, the
    segments before the first layer are unsplit (they run once, before the micro-batches exist)."""
    comms = [s for s in segs if s.kind == "comm"]
    named = any(s.layer is not None for s in comms)
    if comms and not named:
        p = _period([_strip_digits(s.name) for s in comms])
        numbered = [replace(s, layer=(i // p) if p else i) for i, s in enumerate(comms)]
        it = iter(numbered)
        segs = [next(it) if s.kind == "comm" else s for s in segs]
    out: list[Segment] = []
    pending: list[Segment] = []
    last_layer: int | None = None
    for s in segs:
        if s.kind == "compute":
            pending.append(s)
            continue
        out.extend(replace(c, layer=s.layer) for c in pending)
        out.append(s)
        pending = []
        last_layer = s.layer
    out.extend(replace(c, layer=last_layer) for c in pending)
    # with layers named in the profile, what comes before the first layer (e.g. the data-parallel vote on whether
    # to split, vLLM's and dbo-runtime's first collective) runs once, before the micro-batches exist
    first = next((i for i, s in enumerate(out) if s.layer is not None), None)
    if named and first:
        out[:first] = [replace(s, split=False) for s in out[:first]]
    return out


def _strip_digits(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def collectives_by_name(timeline: Timeline, ranks: Sequence[int], top: int = 4) -> list[dict[str, Any]]:
    """The communication operators of ``ranks`` by name, the longest in total first: count, mean and total µs."""
    totals: dict[str, list[float]] = {}
    for r in ranks:
        rt = timeline.ranks[r]
        idx = np.nonzero(rt.of_kind(*COMM_KINDS))[0]
        durs = (rt.end_ns[idx] - rt.start_ns[idx]) / 1000.0
        for name_id, dur in zip(rt.name_id[idx].tolist(), durs.tolist(), strict=True):
            t = totals.setdefault(rt.names[name_id], [0, 0.0])
            t[0] += 1
            t[1] += dur
    rows = [{"name": n, "count": int(c), "mean_us": tot / c, "total_us": tot} for n, (c, tot) in totals.items()]
    return sorted(rows, key=lambda x: -x["total_us"])[:top]


def measured(timeline: Timeline, rank: int | None = None) -> dict[str, Any]:
    """The steps of a profile as measured (a profile taken with DBO on, to check a prediction against): per step
    the slowest rank's step window; a profile without step ranges is one step from its first to its last task."""
    if rank is not None and rank not in timeline.ranks:
        raise ProfileError(timeline.source, f"rank {rank} not in the profile; ranks present: {sorted(timeline.ranks)}")
    ranks = [rank] if rank is not None else sorted(timeline.ranks)
    per_step: dict[int | None, float] = {}
    for r in ranks:
        for lo, hi, sid in step_windows(timeline.ranks[r]):
            per_step[sid] = max(per_step.get(sid, 0.0), (hi - lo) / 1000.0)
    total = sum(per_step.values())
    return {"path": timeline.source, "ranks": ranks, "steps": len(per_step), "on_us": total,
            "mean_step_us": total / len(per_step), "collectives": collectives_by_name(timeline, ranks)}


def whatif(timeline: Timeline, *, ubatches: int = 2, switch_us: float = 30.0, rank: int | None = None,
           step: int | None = None, compute_scale: float | None = None, comm_scale: float | None = None,
           comm_fixed_us: float = 0.0, measured_off_us: float | None = None,
           measured_on: Timeline | None = None, host_work: bool = True) -> dict[str, Any]:
    """Every step of every rank simulated with DBO on; a step is as slow as its slowest rank.

    ``ranks[*].steps``: per step off/on; ``ranks[*]`` itself carries the full schedule summary and the per-layer
    rows of that rank's longest DBO-off step (or of ``step``). ``measured_off_us``: the DBO-off step time measured
    without the profiler (one step; with several steps, their mean). A CPU profiler's own cost lands on
    host-side compute (every operator is recorded), not on a collective's transfer, so the compute segments are
    scaled to make the step add up to it; device kernel times (NPU, GPU) need no such help.

    ``measured_on``: a profile of the same work taken with DBO on; the result's ``measured_on`` compares the
    predicted mean step with its measured one, and puts each profile's communication operators side by side
    (the prediction assumes DBO runs the same collectives; where DBO changes them it cannot know).

    ``host_work``: charge the collectives' host work (``HOST_COPY`` tasks, paired across ranks) to the compute
    beside them; False leaves the compute resource to the compute alone.
    """
    if rank is not None and rank not in timeline.ranks:
        raise ProfileError(timeline.source, f"rank {rank} not in the profile; ranks present: {sorted(timeline.ranks)}")
    ranks = [rank] if rank is not None else sorted(timeline.ranks)
    rows = []
    per_step: dict[int | None, list[tuple[float, float]]] = {}
    windows = {r: step_windows(timeline.ranks[r], step) for r in ranks}
    host: dict[tuple[int, int | None], list[tuple[int, float]]] = {}
    for sid in {w[2] for ws in windows.values() for w in ws} if host_work else ():
        mine = {r: (lo, hi) for r, ws in windows.items() for lo, hi, x in ws if x == sid}
        host.update({(r, sid): v for r, v in paired_host(timeline, mine).items()})
    for r in ranks:
        rt = timeline.ranks[r]
        chains = [(sid, segments_from_rank(rt, (lo, hi), host.get((r, sid), [])))
                  for lo, hi, sid in windows[r]]
        scale = 1.0
        if measured_off_us is not None:
            comp = sum(x.full_us for _, segs in chains for x in segs if x.kind == "compute")
            comm = sum(x.full_us for _, segs in chains for x in segs if x.kind == "comm")
            target = measured_off_us * len(chains)
            if target <= comm or comp <= 0:
                raise ProfileError(timeline.source, f"the measured DBO-off step ({measured_off_us:.1f} µs) must be "
                                                    f"longer than rank {r}'s exposed communication per step "
                                                    f"({comm / len(chains):.1f} µs)")
            scale = (target - comm) / comp
            chains = [(sid, [replace(x, full_us=x.full_us * scale) if x.kind == "compute" else x for x in segs])
                      for sid, segs in chains]
        steps = []
        longest: tuple[float, Schedule, list[Segment], int | None] | None = None
        for sid, segs in chains:
            sched = simulate(segs, ubatches, switch_us, compute_scale=compute_scale, comm_scale=comm_scale,
                             comm_fixed_us=comm_fixed_us)
            steps.append({"step": sid, "off_us": sched.off_us, "on_us": sched.on_us, "speedup": sched.speedup,
                          "host_us": sched.host_us,
                          "collectives": sum(x.kind == "comm" for x in segs),
                          "comm_us": sum(x.full_us for x in segs if x.kind == "comm")})
            per_step.setdefault(sid, []).append((sched.off_us, sched.on_us))
            if longest is None or sched.off_us > longest[0]:
                longest = (sched.off_us, sched, segs, sid)
        assert longest is not None
        _, sched, segs, sid = longest
        d = sched.to_dict()
        d.update(rank=r, step=sid, compute_calibration=scale, comm_us=sum(x.full_us for x in segs if x.kind == "comm"),
                 collectives=sum(x.kind == "comm" for x in segs), steps=steps)
        rows.append(d)
    # a step ends when its slowest rank does
    off = sum(max(o for o, _ in v) for v in per_step.values())
    on = sum(max(n for _, n in v) for v in per_step.values())
    result: dict[str, Any] = {
        "source": {"path": timeline.source, "format": timeline.format, "ranks": ranks},
        "settings": {"ubatches": ubatches, "switch_us": switch_us,
                     "compute_scale": 1.0 / ubatches if compute_scale is None else compute_scale,
                     "comm_scale": 1.0 / ubatches if comm_scale is None else comm_scale,
                     "comm_fixed_us": comm_fixed_us, "measured_off_us": measured_off_us, "host_work": host_work},
        "summary": {"steps": len(per_step), "off_us": off, "on_us": on, "speedup": off / on if on else None,
                    "pays": on < off, "exposed_comm_us": max(sum(s["comm_us"] for s in x["steps"]) for x in rows)},
        "ranks": rows,
        # ranks of a directory of ranks that could not be read: left out of every figure above
        "unreadable": [{"rank": u.rank, "path": u.path, "reason": u.reason}
                       for t in (timeline, measured_on) if t is not None for u in t.unreadable],
    }
    if measured_on is not None:
        m = measured(measured_on, rank)
        predicted = on / len(per_step)
        m.update(predicted_mean_step_us=predicted, error=predicted / m["mean_step_us"] - 1,
                 collectives_off=collectives_by_name(timeline, ranks))
        result["measured_on"] = m
    return result
