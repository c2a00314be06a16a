"""Ascend profiles: torch_npu ``*_ascend_pt`` directories and plain msprof ``PROF_*`` directories.

Both hold the same Chrome-trace content (torch_npu's trace_view.json concatenates msprof_*.json and adds
host events). Tracks are recognised only by their metadata names:

* ``Ascend Hardware`` process, threads ``Stream <id>`` (tid = physical stream id): device tasks;
* ``Communication`` (current CANN) or ``HCCL`` (older) process: threads whose name contains
  ``Communication`` hold whole operator spans (``hcom_allReduce__...``), ``Plane <n>`` threads hold the
  small tasks;
* ``Overlap Analysis``: the profiler's own Computing / Communication / Communication(Not Overlapped) /
  Free answer, kept as a reference;
* processes labelled ``CPU`` (Python, CANN, ...): host events; ``ProfilerStep#N`` gives the steps.

A device task on an Ascend Hardware stream is *compute* unless its name is a task-type name in capitals
(EVENT_RECORD, MEMCPY_ASYNC, ...), an HCCL task name (Notify_Wait, Memcpy, Reduce_Inline, ...), an
``hcom_*`` op, an MC2 ``*AicpuKernel``/``*AivKernel``, its Task Type is HCCL/COMMUNICATION, or
kernel_details.csv marks it ``Accelerator Core`` = HCCL/COMMUNICATION. This mirrors msprof, whose
Computing set is the tasks that have compute-task info.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import numpy as np

from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders._columns import Columns, columnarise, compiled, match_flows
from profile_analyzer.loaders._common import (
    STEP_NAME,
    build_steps,
    merge_columns,
    read_csv_rows,
    set_aside_unplaceable,
    to_float,
)
from profile_analyzer.loaders._slicer import ByteProgress
from profile_analyzer.timeline import Kind, RankTimeline, TimelineBuilder, Warning_

HCCL_PROCESS_NAMES = frozenset({"Communication", "HCCL"})
HARDWARE_PROCESS = "Ascend Hardware"
OVERLAP_PROCESS = "Overlap Analysis"
OVERLAP_TRACKS = ("Computing", "Communication", "Communication(Not Overlapped)", "Free")
_STREAM_RE = re.compile(r"^Stream (\d+)$")
_TASK_TYPE_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_HCCL_TASK = re.compile(r"^(Notify_|Memcpy$|Reduce_Inline|Inline_Reduce|RDMA|Write_With|Local_Copy|Send_|Recv_)")
_COMM_TASK_TYPES = frozenset({"HCCL", "COMMUNICATION", "COMM"})
_WAIT_NAMES = frozenset({"EVENT_WAIT", "NOTIFY_WAIT", "Notify_Wait"})
_HOST_PROCESS_PREFIXES = ("Python", "CANN", "Ascend CL", "Thread")


def classify_hw_task(name: str, task_type: str | None, comm_names: frozenset[str]) -> Kind:
    if name in _WAIT_NAMES:
        return Kind.IDLE_WAIT
    if (name.startswith("hcom_") or _HCCL_TASK.match(name) or name.endswith(("AicpuKernel", "AivKernel"))
            or name in comm_names or (task_type or "").upper() in _COMM_TASK_TYPES):
        return Kind.COMM_TASK
    # msprof names a device task that has no compute-task info after its task type ("SDMA", "Notify Wait",
    # "Write Value": HCCL's own tasks shown on its stream, as in MindStudio Insight's real Level1 samples)
    if name == task_type or _TASK_TYPE_NAME.match(name):
        return Kind.OTHER
    return Kind.COMPUTE


def _device_of(label: str | None) -> int | None:
    if label and label.startswith("NPU "):
        try:
            return int(label.split()[1])
        except (IndexError, ValueError):
            return None
    return None


def read_kernel_details(path: Path) -> dict[str, object]:
    """kernel_details.csv (both header generations) -> name->Type, the set of communication op names, count."""
    header, rows = read_csv_rows(path, materialise=False)
    col = {h: i for i, h in enumerate(header)}
    if "Name" not in col or "Start Time(us)" not in col:
        raise ProfileError(path, "not a kernel_details.csv: expected columns Name, Type, Accelerator Core, Start Time(us)")
    i_name, i_type = col["Name"], col.get("Type")
    i_core = col.get("Accelerator Core", col.get("Task Type"))
    types: dict[str, str] = {}
    cores: dict[str, str] = {}
    n = 0
    width = max(i_name, i_type or 0, i_core or 0)
    if i_type is None or i_core is None:
        for r in rows:
            n += 1
            if len(r) > i_name:
                types.setdefault(r[i_name], r[i_type] if i_type is not None and i_type < len(r) else "")
                if i_core is not None and i_core < len(r):
                    cores.setdefault(r[i_name], r[i_core])
    elif (fast := _kernel_names_compiled(path, header, i_name, i_type, i_core)) is not None:
        types, cores, n = fast
    else:
        for r in rows:
            n += 1
            if len(r) > width:
                name = r[i_name]
                if name not in types:
                    types[name] = r[i_type]
                    cores[name] = r[i_core]
    comm = frozenset(nm for nm, c in cores.items() if c.strip().upper() in ("HCCL", "COMMUNICATION"))
    return {"types": types, "comm_names": comm, "rows": n}


def _kernel_names_compiled(path: Path, header: list[str], i_name: int, i_type: int,
                           i_core: int) -> tuple[dict[str, str], dict[str, str], int] | None:
    """The rows' first Type and core per Name and the row count, read by the compiled reader (``_scan.kernel_names``:
    about ten times the csv module's speed), or None where it is not built, the header line is not a plain one, or
    it declines the rows (then the csv module reads them)."""
    mod = compiled()
    if mod is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    end = data.find(b"\n", start)
    if end < 0:
        return None
    first = data[start:end].rstrip(b"\r")
    try:
        if b'"' in first or [h.strip() for h in first.decode("utf-8").split(",")] != header:
            return None
    except UnicodeDecodeError:
        return None
    with memoryview(data) as view:
        return mod.kernel_names(view[end + 1:], i_name, i_type, i_core)  # type: ignore[attr-defined]


class _CommTimeInfo(msgspec.Struct, gc=False):
    elapse: float = msgspec.field(default=0.0, name="Elapse Time(ms)")
    transit: float = msgspec.field(default=0.0, name="Transit Time(ms)")
    wait: float = msgspec.field(default=0.0, name="Wait Time(ms)")
    sync: float = msgspec.field(default=0.0, name="Synchronization Time(ms)")


class _CommOpInfo(msgspec.Struct, gc=False):
    time: _CommTimeInfo | None = msgspec.field(default=None, name="Communication Time Info")


_comm_json_decoder = msgspec.json.Decoder(dict[str, dict[str, dict[str, _CommOpInfo]]])


def read_communication_json(path: Path, warnings: list[Warning_]) -> dict[int | None, dict[str, float]] | None:
    """torch_npu communication.json -> per step, the 'Total Op Info' time figures (µs) of collective + p2p.

    Decoded into small typed structs (bandwidth tables are skipped). A file without the expected shape is
    not fatal (it only feeds a cross-check): it adds a warning.
    """
    try:
        data = _comm_json_decoder.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        warnings.append(Warning_(str(path), f"a readable communication.json ({exc.__class__.__name__})",
                                 ["profiler_agreement of communication elapse and wait"]))
        return None
    out: dict[int | None, dict[str, float]] = {}
    for step_key, kinds in data.items():
        m = re.match(r"^step(\d*)$", step_key)
        if not m:
            continue
        step = int(m.group(1)) if m.group(1) else None
        tot = {"elapse_us": 0.0, "transit_us": 0.0, "wait_us": 0.0, "sync_wait_us": 0.0}
        for kind in ("collective", "p2p"):
            info = kinds.get(kind, {}).get("Total Op Info")
            if info is not None and info.time is not None:
                tot["elapse_us"] += info.time.elapse * 1000.0
                tot["transit_us"] += info.time.transit * 1000.0
                tot["wait_us"] += info.time.wait * 1000.0
                tot["sync_wait_us"] += info.time.sync * 1000.0
        out[step] = tot
    return out or None


def read_step_trace_time(path: Path) -> list[dict[str, float | str]]:
    header, rows = read_csv_rows(path)
    if "Computing" not in header:
        raise ProfileError(path, "not a step_trace_time.csv: expected a Computing column")
    out: list[dict[str, float | str]] = []
    for r in rows:
        d: dict[str, float | str] = {}
        for h, v in zip(header, r, strict=False):
            f = to_float(v)
            d[h] = f if f is not None else v
        out.append(d)
    return out


_DEVICE_PROCESSES = frozenset({HARDWARE_PROCESS, OVERLAP_PROCESS}) | HCCL_PROCESS_NAMES


def device_groups(cols: Columns, source: str, warnings: list[Warning_]) -> dict[int | None, frozenset[object]]:
    """The device processes (Ascend Hardware, Communication/HCCL, Overlap Analysis) of a trace, grouped by
    the NPU they belong to, read from their ``NPU <id>`` labels (current CANN): {device id: pids}. One
    group ``{None: ...}`` when the trace holds one device or its labels carry no id (older CANN writes a bare
    ``NPU``; several Ascend Hardware processes without ids are then analysed as one device, with a warning)."""
    pids = [pid for pid, name in cols.process_name.items() if name in _DEVICE_PROCESSES]
    ids = {pid: _device_of(cols.process_label.get(pid)) for pid in pids}
    known = sorted({d for d in ids.values() if d is not None})
    if len(known) <= 1:
        hw = [pid for pid in pids if cols.process_name[pid] == HARDWARE_PROCESS]
        if len(hw) > 1 and not known:
            warnings.append(Warning_(source, "device ids on the 'Ascend Hardware' processes (labels are a bare 'NPU')",
                                     [f"{len(hw)} Ascend Hardware processes are analysed as one device: if they are "
                                      "different NPUs, their overlap figures are mixed"]))
        return {known[0] if known else None: frozenset(pids)}
    unlabelled = [pid for pid, d in ids.items() if d is None]
    if unlabelled:
        warnings.append(Warning_(source, "an 'NPU <id>' label on some device processes",
                                 [f"processes {', '.join(cols.process_name[p] for p in unlabelled)} (no device id) "
                                  "are left out of every device"]))
    return {d: frozenset(pid for pid, i in ids.items() if i == d) for d in known}


def columns_to_ranks(cols: Columns, *, rank: int, source: str, fmt: str, kernel_details: dict[str, object] | None,
                     step_trace: list[dict[str, float | str]] | None, warnings: list[Warning_],
                     host_events: bool = False) -> list[RankTimeline]:
    """One :class:`RankTimeline` per NPU in the trace: a trace of one device gives one, at ``rank``; a trace
    that holds several NPUs (one process driving several devices) gives one per device, numbered by device id,
    each with the host events and its own device processes only."""
    groups = device_groups(cols, source, warnings)
    if len(groups) == 1:
        return [columns_to_rank(cols, rank=rank, source=source, fmt=fmt, kernel_details=kernel_details,
                                step_trace=step_trace, warnings=warnings, host_events=host_events)]
    every = frozenset().union(*groups.values())
    return [columns_to_rank(cols, rank=int(d), source=source, fmt=fmt, kernel_details=kernel_details,  # type: ignore[arg-type]
                            step_trace=step_trace, warnings=list(warnings), host_events=host_events,
                            skip_pids=every - pids)
            for d, pids in groups.items()]


def columns_to_rank(cols: Columns, *, rank: int, source: str, fmt: str, kernel_details: dict[str, object] | None,
                    step_trace: list[dict[str, float | str]] | None, warnings: list[Warning_],
                    host_events: bool = False, skip_pids: frozenset[object] = frozenset()) -> RankTimeline:
    """The tracks of ``cols`` as one rank; the processes in ``skip_pids`` (another device's) are left out."""
    comm_names: frozenset[str] = kernel_details["comm_names"] if kernel_details else frozenset()  # type: ignore[assignment]
    b = TimelineBuilder()
    n_tracks = len(cols.tracks)
    role = np.zeros(n_tracks, dtype=np.int8)  # 0 skip, 1 hw, 2 comm op, 3 plane, 4 host, 5 overlap
    track_stream = np.full(n_tracks, -1, dtype=np.int32)
    overlap_track_name: dict[int, str] = {}
    devices: set[int] = set()
    for t, (pid, tid) in enumerate(cols.tracks):
        if pid in skip_pids:
            continue
        pname = cols.process_name.get(pid, "")
        tname = cols.thread_name.get((pid, tid), "")
        label = cols.process_label.get(pid, "")
        if pname == HARDWARE_PROCESS:
            role[t] = 1
            m = _STREAM_RE.match(tname)
            sid = int(m.group(1)) if m else (tid if isinstance(tid, int) else None)
            d = _device_of(label)
            if d is not None:
                devices.add(d)
            track_stream[t] = b.stream_index(("hw", pid, tid), tname or f"Stream {sid}", "compute", sid)
        elif pname in HCCL_PROCESS_NAMES:
            if "Communication" in tname or not tname.startswith("Plane"):
                role[t] = 2
            else:
                role[t] = 3
            track_stream[t] = b.stream_index(("comm", pid, tid), tname or f"{pname} {tid}", "communication")
        elif pname == OVERLAP_PROCESS:
            role[t] = 5
            overlap_track_name[t] = tname
        elif label.startswith("CPU") or pname.startswith(_HOST_PROCESS_PREFIXES):
            role[t] = 4
            track_stream[t] = b.stream_index(("host", pid, tid), f"{pname} {tname}".strip(), "host")
    # device tasks (hardware, communication op and plane tracks) must be placeable; other bad events are dropped
    cols = set_aside_unplaceable(cols, np.isin(role, (1, 2, 3))[cols.track] if cols.track.size else
                                 np.zeros(0, bool), source, warnings)
    ev_role = role[cols.track] if cols.track.size else np.zeros(0, np.int8)
    names = cols.names
    ttypes = cols.task_types

    # device tasks: one classification per distinct (name, task type) pair
    hw = ev_role == 1
    kind = np.full(cols.track.size, -1, dtype=np.int16)
    if hw.any():
        key = cols.name_id[hw].astype(np.int64) * (len(ttypes) + 1) + cols.task_type_id[hw]
        uniq, inv = np.unique(key, return_inverse=True)
        table = np.array([int(classify_hw_task(names[k // (len(ttypes) + 1)], ttypes[k % (len(ttypes) + 1)], comm_names))
                          for k in uniq], dtype=np.int16)
        kind[hw] = table[inv]
    kind[ev_role == 2] = int(Kind.COMMUNICATION)
    plane = ev_role == 3
    if plane.any():
        wait_ids = np.array([i for i, n in enumerate(names) if n in _WAIT_NAMES], dtype=np.int32)
        is_wait = np.isin(cols.name_id[plane], wait_ids)
        kind[plane] = np.where(is_wait, int(Kind.IDLE_WAIT), int(Kind.COMM_TASK))
    if host_events:
        kind[ev_role == 4] = int(Kind.HOST)

    keep = kind >= 0
    start = cols.start_ns[keep]
    end = start + cols.dur_ns[keep]
    b.names.extend(names)
    b._name_idx.update({n: i for i, n in enumerate(names)})
    b.add(start, end, track_stream[cols.track[keep]], kind[keep].astype(np.int8), cols.name_id[keep])
    lh, ld_s, ld_e = _launch_links(cols, ev_role, "HostToDevice")
    if lh.size == 0:
        lh, ld_s, ld_e = _launch_links(cols, ev_role, "async_npu")
    launch = np.full(start.size, -1, dtype=np.int64)
    if lh.size:
        order = np.argsort(ld_s, kind="stable")
        dev_sorted, host_sorted = ld_s[order], lh[order]
        hw_kept = np.flatnonzero(ev_role[keep] == 1)
        pos = np.clip(np.searchsorted(dev_sorted, start[hw_kept]), 0, dev_sorted.size - 1)
        hit = dev_sorted[pos] == start[hw_kept]
        launch[hw_kept[hit]] = host_sorted[pos[hit]]

    # streams that mostly carry communication tasks are communication streams
    st = track_stream[cols.track[keep]]
    kd = kind[keep]
    for s in b.streams:
        if s.kind == "compute":
            on = st == s.index
            n_comm = int(np.count_nonzero(on & ((kd == Kind.COMM_TASK) | (kd == Kind.IDLE_WAIT))))
            n_comp = int(np.count_nonzero(on & (kd == Kind.COMPUTE)))
            if n_comm > n_comp:
                b.streams[s.index] = type(s)(s.index, s.label, "communication", s.stream_id)

    # the profiler's Overlap Analysis track
    profiler_overlap = None
    if overlap_track_name:
        profiler_overlap = {}
        for t, tname in overlap_track_name.items():
            sel = cols.track == t
            s = cols.start_ns[sel]
            o = np.argsort(s, kind="stable")
            profiler_overlap[tname] = (s[o], (s + cols.dur_ns[sel])[o])
        for tname in OVERLAP_TRACKS:
            profiler_overlap.setdefault(tname, (np.zeros(0, np.int64), np.zeros(0, np.int64)))

    # steps
    host_sel = ev_role == 4
    step_ids_l, hs_l, he_l = [], [], []
    if host_sel.any():
        # the distinct names of host events (sorted ids, as np.unique gives them, without hashing every event)
        host_name_ids = np.flatnonzero(np.bincount(cols.name_id[host_sel], minlength=len(names))).tolist()
        step_name_ids = {i: int(m.group(1)) for i in host_name_ids if (m := STEP_NAME.match(names[i]))}
        if step_name_ids:
            sel = host_sel & np.isin(cols.name_id, np.fromiter(step_name_ids, dtype=np.int32))
            for i in np.flatnonzero(sel):
                step_ids_l.append(step_name_ids[int(cols.name_id[i])])
                hs_l.append(int(cols.start_ns[i]))
                he_l.append(int(cols.start_ns[i] + cols.dur_ns[i]))
    dev = (kind >= 0) & (kind != int(Kind.HOST))
    dev_start = int(cols.start_ns[dev].min()) if dev.any() else 0
    dev_end = int((cols.start_ns + cols.dur_ns)[dev].max()) if dev.any() else 0
    sh, sd_s, sd_e = _launch_links(cols, ev_role, "async_npu")
    steps = build_steps(np.array(step_ids_l, np.int64), np.array(hs_l, np.int64), np.array(he_l, np.int64), sh, sd_s, sd_e,
                        dev_start, dev_end)
    if kernel_details:
        type_by_name: dict[str, str] = kernel_details["types"]  # type: ignore[assignment]
        # Level 0 writes Type "N/A" for every operator: no type is known then
        op_types = {i: t for i, n in enumerate(names) if (t := type_by_name.get(n)) and t != "N/A"}
    else:
        op_types = {}
    device_id = min(devices) if devices else None
    if step_trace is not None and device_id is not None and step_trace and "Device_id" in step_trace[0]:
        step_trace = [r for r in step_trace if r.get("Device_id") in (device_id, float(device_id), -1, -1.0)] or step_trace
    return b.build(rank, source, fmt, steps=steps, op_types=op_types, profiler_overlap=profiler_overlap, launch_ns=launch,
                   profiler_step_trace=step_trace, warnings=warnings, device_id=device_id)


def _launch_links(cols: Columns, ev_role: np.ndarray, cat: str = "async_npu") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(host ts, device task start, device task end) from one kind of flow: ``async_npu`` (torch op ->
    kernel, what torch_npu uses for steps) or ``HostToDevice`` (the CANN launch -> kernel)."""
    host, dev = match_flows(cols.flows, cat)
    if host.size == 0:
        return host, dev, dev
    hw = ev_role == 1
    hs = cols.start_ns[hw]
    he = hs + cols.dur_ns[hw]
    o = np.argsort(hs)
    hs, he = hs[o], he[o]
    i = np.clip(np.searchsorted(hs, dev), 0, max(hs.size - 1, 0))
    dev_end = np.where((hs.size > 0) & (hs[i] == dev), he[i], dev) if hs.size else dev
    return host, dev, dev_end


# ---------------------------------------------------------------------------------------------------
# directory layouts


def msprof_json_files(output_dir: Path) -> list[Path]:
    files = sorted(output_dir.glob("msprof_*.json"))
    return [f for f in files if re.match(r"^msprof_(slice_\d+_)?\d+\.json$", f.name)] or files


def load_torch_npu(root: Path, rank: int, host_events: bool = False,
                   on_bytes: ByteProgress | None = None) -> list[RankTimeline]:
    """``*_ascend_pt`` (or its ASCEND_PROFILER_OUTPUT) -> one rank (one per NPU if the trace holds several)."""
    out = root / "ASCEND_PROFILER_OUTPUT" if (root / "ASCEND_PROFILER_OUTPUT").is_dir() else root
    warnings: list[Warning_] = []
    trace = out / "trace_view.json"
    fmt = "torch_npu"
    if trace.is_file():
        cols = columnarise(trace, kineto_args=False, keep_host_x=host_events, on_bytes=on_bytes)
        source = str(trace)
    else:
        base = out.parent if out.name == "ASCEND_PROFILER_OUTPUT" else out
        prof_outputs = sorted(base.glob("PROF_*/mindstudio_profiler_output"))
        files = [f for d in prof_outputs for f in msprof_json_files(d)]
        if not files:
            raise ProfileError(out, "no trace_view.json (and no PROF_*/mindstudio_profiler_output/msprof_*.json); "
                                    "expected a torch_npu ASCEND_PROFILER_OUTPUT directory")
        cols = merge_columns([columnarise(f, kineto_args=False, keep_host_x=host_events) for f in files])
        source = str(files[0].parent)
        warnings.append(Warning_(str(trace), "trace_view.json", ["host events and steps (read from msprof_*.json instead)"]))
    kd_path = out / "kernel_details.csv"
    kd = None
    if kd_path.is_file():
        kd = read_kernel_details(kd_path)
    else:
        warnings.append(Warning_(str(kd_path), "kernel_details.csv",
                                 ["operator types (grouping uses kernel names)",
                                  "compute/communication classification (falls back to the task-name rule)"]))
    st_path = out / "step_trace_time.csv"
    st = read_step_trace_time(st_path) if st_path.is_file() else None
    rts = columns_to_ranks(cols, rank=rank, source=source, fmt=fmt, kernel_details=kd, step_trace=st,
                           warnings=warnings, host_events=host_events)
    cj = out / "communication.json"
    for rt in rts:
        if cj.is_file() and len(rts) == 1:  # its figures are per rank: they cannot be told apart per device
            rt.profiler_comm = read_communication_json(cj, rt.warnings)
        _check_tracks(rt, Path(source))
    return rts


def load_msprof(prof_dir: Path, rank: int, host_events: bool = False,
                on_bytes: ByteProgress | None = None) -> list[RankTimeline]:
    """A plain ``PROF_*`` directory (or its mindstudio_profiler_output, or one msprof_*.json) -> one rank (one
    per NPU if the trace holds several)."""
    if prof_dir.is_file():
        files = [prof_dir]
    else:
        out = prof_dir / "mindstudio_profiler_output" if (prof_dir / "mindstudio_profiler_output").is_dir() else prof_dir
        files = msprof_json_files(out)
        if not files:
            raise ProfileError(out, "no msprof_*.json; expected a PROF_*/mindstudio_profiler_output directory written by msprof --export=on")
    cols = merge_columns([columnarise(f, kineto_args=False, keep_host_x=host_events, on_bytes=on_bytes) for f in files])
    rts = columns_to_ranks(cols, rank=rank, source=str(files[0] if len(files) == 1 else files[0].parent),
                           fmt="msprof", kernel_details=None, step_trace=None, warnings=[], host_events=host_events)
    for rt in rts:
        if rt.steps.ids.tolist() == [-1]:
            rt.warnings.append(Warning_(str(files[0].parent), "framework ProfilerStep#N ranges",
                                        ["steps (the whole capture is one step)", "Preparing"]))
        _check_tracks(rt, files[0])
    return rts


def _check_tracks(rt: RankTimeline, path: Path) -> None:
    if not any(s.kind != "host" for s in rt.streams):
        raise ProfileError(path, "no 'Ascend Hardware' or 'Communication'/'HCCL' device tracks; expected a trace "
                                 "captured with NPU activities")
    if rt.profiler_overlap is None:
        others = rt.profiler_step_trace or rt.profiler_comm  # step_trace_time / communication figures still checked
        rt.warnings.append(Warning_(str(path), "the 'Overlap Analysis' track", [
            "profiler_agreement against the Overlap Analysis intervals (step_trace_time and communication figures "
            "are still checked)" if others else "profiler_agreement (no reference to compare with)"]))
