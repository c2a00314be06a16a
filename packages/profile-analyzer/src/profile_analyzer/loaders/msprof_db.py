"""The msprof / torch_npu DB export (``export_type=db``): SQLite files read with the standard library.

* torch_npu: ``*_ascend_pt/ASCEND_PROFILER_OUTPUT/ascend_pytorch_profiler[_{rank}].db`` (plus ``analysis.db``);
* plain msprof: ``PROF_*/msprof_{timestamp}.db``.

The tables and columns read, and where their layout comes from:

==========================  ===========================================================  ==========================
table                       columns read                                                 source of the layout
==========================  ===========================================================  ==========================
STRING_IDS                  id, value (every text column of the other tables is an id)   msprof msprof_db.cpp
TASK                        startNs, endNs, deviceId, connectionId, globalTaskId,        msprof msprof_db.cpp
                            taskType, streamId
COMPUTE_TASK_INFO           globalTaskId, name, taskType, opType                         msprof msprof_db.cpp
COMMUNICATION_OP            opName, startNs, endNs, connectionId, groupName, opId        msprof msprof_db.cpp
COMMUNICATION_TASK_INFO     globalTaskId, name, taskType, planeId, groupName             msprof msprof_db.cpp
CANN_API (optional)         startNs, endNs, globalTid, connectionId, name                msprof msprof_db.cpp
OVERLAP_ANALYSIS (opt.)     deviceId, startNs, endNs, type (0..3)                        msprof msprof_db.cpp,
                                                                                         db_constant.h
PYTORCH_API (optional)      startNs, endNs, globalTid, connectionId, name                torch_npu _constant.py
CONNECTION_IDS (optional)   id, connectionId                                             torch_npu _constant.py
analysis.db StepTraceTime   step, computing, ... preparing [, deviceId]                  torch_npu _constant.py
analysis.db CommAnalyzer-   hccl_op_name, elapse_time, transit_time, wait_time,          torch_npu _constant.py,
Time                        synchronization_time, step, type                             msprof-analyze
==========================  ===========================================================  ==========================

Sources (read for this module): Ascend/msprof @ 9ba1ac7be913 ``analysis/csrc/application/database/msprof_db.cpp``
(``TableColumns``) and ``db_constant.h`` (``OVERLAP_TYPE_TABLE``: COMPUTE 0, COMMUNICATION 1,
COMM_NOT_OVERLAP_COMP 2, FREE 3), ``docs/en/user_guide/profile_data_file_references_db.md`` (times in ns;
globalTid = pid << 32 | tid); Ascend/pytorch @ d41eb70909f5 ``torch_npu/profiler/analysis/prof_common_func/
_constant.py`` (``DbConstant``, ``TableColumnsManager``); Ascend/msprof-analyze @ 8399c1cdd2ae
``prof_common/constant.py`` (table names), ``cluster_analyse/analysis/msprof_step_trace_time_adapter.py``
(COMPUTE_TASK_INFO JOIN TASK on globalTaskId), ``prof_exports/communication_bottleneck_export.py``
(TASK.connectionId = CONNECTION_IDS.connectionId, CONNECTION_IDS.id = PYTORCH_API.connectionId),
``cluster_utils/data_transfer_adapter.py`` (CommAnalyzerTime columns = communication.json's time info, ms).

The tables become the same columns the JSON loader builds from trace_view.json / msprof_*.json, and then go
through the same code (:func:`profile_analyzer.loaders.ascend.columns_to_ranks`), so both exports of one
profile give the same :class:`Timeline`: a TASK row with compute-task info is an ``Ascend Hardware`` task named
after the operator, one without it is named after its task type (as msprof's timeline does), a TASK row with
communication-task info is a ``Plane <planeId>`` task of its group, a COMMUNICATION_OP row is a whole operator on
``Group <groupName> Communication``; PYTORCH_API -> CONNECTION_IDS -> TASK links are torch_npu's ``async_npu``
flows (the steps) and CANN_API -> TASK links by connectionId are msprof's ``HostToDevice`` flows (launch times).
Tested on real DBs (MindStudio Insight's torch_npu samples, two ranks at Level1 and Level2, in
``tests/data/msinsight/db``: every figure equals torch_npu's own StepTraceTime, Overlap Analysis and
CommAnalyzerTime) and on synthetic ones (``profile-analyzer synth --export db``: both exports of one profile).
In those real files COMMUNICATION_TASK_INFO.name is the operator's name and taskType the HCCL task type.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import numpy as np

from profile_analyzer.errors import ProfileError
from profile_analyzer.timeline import RankTimeline, Warning_

DB_FORMATS = ("torch_npu_db", "msprof_db")
TORCH_NPU_DB = re.compile(r"^ascend_pytorch_profiler(?:_(\d+))?\.db$")
MSPROF_DB = re.compile(r"^msprof_\d+\.db$")
SQLITE_MAGIC = b"SQLite format 3\x00"

# table -> the columns this loader needs; None: the table may be absent
REQUIRED: dict[str, tuple[str, ...]] = {
    "STRING_IDS": ("id", "value"),
    "TASK": ("startNs", "endNs", "deviceId", "connectionId", "globalTaskId", "taskType", "streamId"),
}
OPTIONAL: dict[str, tuple[str, ...]] = {
    "COMPUTE_TASK_INFO": ("globalTaskId", "name", "taskType", "opType"),
    "COMMUNICATION_OP": ("opName", "startNs", "endNs", "connectionId", "groupName", "opId"),
    "COMMUNICATION_TASK_INFO": ("globalTaskId", "name", "taskType", "planeId", "groupName"),
    "CANN_API": ("startNs", "endNs", "globalTid", "connectionId", "name"),
    "OVERLAP_ANALYSIS": ("deviceId", "startNs", "endNs", "type"),
    "PYTORCH_API": ("startNs", "endNs", "globalTid", "connectionId", "name"),
    "CONNECTION_IDS": ("id", "connectionId"),
    "RANK_DEVICE_MAP": ("rankId", "deviceId"),
}
ANALYSIS_OPTIONAL: dict[str, tuple[str, ...]] = {
    "StepTraceTime": ("step", "computing", "communication_not_overlapped", "overlapped", "communication", "free"),
    "CommAnalyzerTime": ("hccl_op_name", "elapse_time", "transit_time", "wait_time", "synchronization_time", "step",
                         "type"),
}
LAYOUT = ("expected the msprof/torch_npu DB export layout (msprof msprof_db.cpp, torch_npu TableColumnsManager)")
OVERLAP_TYPE_NAMES = {0: "Computing", 1: "Communication", 2: "Communication(Not Overlapped)", 3: "Free"}
# StepTraceTime column -> the step_trace_time.csv column it is the DB form of (torch_npu writes both from one list)
STEP_TRACE_COLUMNS = {"deviceId": "Device_id", "step": "Step", "computing": "Computing",
                      "communication_not_overlapped": "Communication(Not Overlapped)", "overlapped": "Overlapped",
                      "communication": "Communication", "free": "Free", "stage": "Stage", "bubble": "Bubble",
                      "communication_not_overlapped_and_exclude_receive":
                          "Communication(Not Overlapped and Exclude Receive)", "preparing": "Preparing"}

# the synthetic pids the columns use for the processes a DB has no pid for (ordered as in a trace_view.json:
# host processes first, then Ascend Hardware, Communication, Overlap Analysis)
_HW, _COMM, _OVERLAP = 1 << 62, (1 << 62) + 1, (1 << 62) + 2


def find_db(path: Path) -> Path | None:
    """The DB export in ``path`` (a .db file, an ``*_ascend_pt`` or its ASCEND_PROFILER_OUTPUT, a ``PROF_*``)."""
    if path.is_file():
        return path if TORCH_NPU_DB.match(path.name) or MSPROF_DB.match(path.name) else None
    if not path.is_dir():
        return None
    out = path / "ASCEND_PROFILER_OUTPUT" if (path / "ASCEND_PROFILER_OUTPUT").is_dir() else path
    dbs = sorted(f for f in out.glob("ascend_pytorch_profiler*.db") if TORCH_NPU_DB.match(f.name))
    if dbs:
        return dbs[0]
    dbs = sorted(f for f in path.glob("msprof_*.db") if MSPROF_DB.match(f.name))
    return dbs[-1] if dbs else None


def db_format(db: Path) -> str:
    return "torch_npu_db" if TORCH_NPU_DB.match(db.name) else "msprof_db"


def rank_in_name(db: Path) -> int | None:
    m = TORCH_NPU_DB.match(db.name)
    return int(m.group(1)) if m and m.group(1) else None


def _connect(path: Path) -> sqlite3.Connection:
    try:
        with open(path, "rb") as f:
            magic = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise ProfileError(path, f"cannot be read ({exc.strerror or exc}); expected a readable SQLite file") from None
    if magic != SQLITE_MAGIC:
        raise ProfileError(path, "not an SQLite database; expected the profiler's DB export (export_type=db)")
    # torch_npu writes its DBs in WAL mode: a plain read-only open still creates <db>-shm / <db>-wal beside the
    # user's profile. A finished profile has no -wal with data in it; read it as immutable then, which writes
    # nothing. With a non-empty -wal (a writer that stopped before its checkpoint) its data must be read too.
    wal = path.with_name(path.name + "-wal")
    try:
        pending = wal.stat().st_size > 0
    except OSError:
        pending = False
    uri = path.resolve().as_uri() + ("?mode=ro" if pending else "?immutable=1")
    try:
        return sqlite3.connect(uri, uri=True)
    except sqlite3.Error as exc:
        raise ProfileError(path, f"cannot be opened as SQLite ({exc})") from None


def _columns(db: sqlite3.Connection, path: Path, table: str) -> set[str] | None:
    try:
        rows = db.execute(f'PRAGMA table_info("{table}")').fetchall()
    except sqlite3.DatabaseError as exc:
        raise ProfileError(path, f"unreadable SQLite ({exc}); {LAYOUT}") from None
    return {r[1] for r in rows} if rows else None


def _check_layout(db: sqlite3.Connection, path: Path, required: dict[str, tuple[str, ...]],
                  optional: dict[str, tuple[str, ...]]) -> set[str]:
    """The tables present; raises one line naming the first table or column that is missing."""
    present = set()
    for table, cols in {**required, **optional}.items():
        have = _columns(db, path, table)
        if have is None:
            if table in required:
                raise ProfileError(path, f"no table {table} (with columns {', '.join(cols)}); {LAYOUT}")
            continue
        missing = [c for c in cols if c not in have]
        if missing:
            raise ProfileError(path, f"table {table} has no column {missing[0]} (expected {', '.join(cols)}; found "
                                     f"{', '.join(sorted(have))[:120]}); {LAYOUT}")
        present.add(table)
    return present


def _query(db: sqlite3.Connection, path: Path, sql: str) -> list[tuple]:
    try:
        return db.execute(sql).fetchall()
    except sqlite3.DatabaseError as exc:
        raise ProfileError(path, f"query failed ({exc}); {LAYOUT}") from None


_INTEGER_TEXT = re.compile(r"[+-]?[0-9]{1,19}", re.ASCII)
# |time| below 9e18 ns (285 years), the JSON loader's bound (9e15 µs): room in int64 for a sum or a difference
_LIMIT_NS = 9 * 10**18


def _integer(v: object) -> int | None:
    """An integer column's value, or None where it holds none (NULL, a fraction, text that is not ASCII digits,
    a blob, out of range). torch_npu stores PYTORCH_API times as TEXT: digits in text are numbers."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        number = v
    elif isinstance(v, float) and v.is_integer():
        number = int(v)
    elif isinstance(v, str) and _INTEGER_TEXT.fullmatch(v.strip()):
        number = int(v.strip())
    else:
        return None
    return number if abs(number) < _LIMIT_NS else None


def _time_and_duration(start: object, end: object) -> tuple[int, int, int]:
    """(start ns, duration ns, problem) of a startNs/endNs pair, with the JSON loader's problem codes
    (_timestamps.PROBLEMS): a pair that cannot be placed is (0, 0, why) and is refused or skipped by the same rule
    (``set_aside_unplaceable``) as a trace_view.json event with that ts or dur."""
    from profile_analyzer.loaders._timestamps import BAD_DUR, BAD_TS, NEGATIVE_DUR, NO_DUR, NO_TS

    st, en = _integer(start), _integer(end)
    if st is None:
        return 0, 0, NO_TS if start is None else BAD_TS
    if en is None:
        return 0, 0, NO_DUR if end is None else BAD_DUR
    if en < st:
        return 0, 0, NEGATIVE_DUR
    if en - st >= _LIMIT_NS:
        return 0, 0, BAD_DUR
    return st, en - st, 0


def _int(v: object, path: Path, what: str) -> int:
    """An integer column that is not a time (globalTid, planeId): one that holds none is a bad file."""
    number = _integer(v)
    if number is None:
        raise ProfileError(path, f"{what} {str(v)[:40]!r} is not an integer; expected an integer in ASCII digits")
    return number


def load_db(db_path: Path, rank: int, host_events: bool = False) -> list[RankTimeline]:
    """One DB export -> one rank per NPU in it (the same as the JSON export of the same profile would give)."""
    from profile_analyzer.loaders.ascend import HCCL_PROCESS_NAMES, _check_tracks, columns_to_ranks  # noqa: F401

    fmt = db_format(db_path)
    db = _connect(db_path)
    try:
        present = _check_layout(db, db_path, REQUIRED, OPTIONAL)
        cols, kernel_details, n_steps = _columns_from_db(db, db_path, present, host_events)
        if "RANK_DEVICE_MAP" in present and rank_in_name(db_path) is None:
            ranks = _query(db, db_path, "SELECT rankId FROM RANK_DEVICE_MAP")
            if len(ranks) == 1 and isinstance(ranks[0][0], int) and 0 <= ranks[0][0] < (1 << 31):
                rank = ranks[0][0]
    finally:
        db.close()
    warnings: list[Warning_] = []
    step_trace, comm = None, None
    analysis = db_path.parent / "analysis.db"
    if fmt == "torch_npu_db":
        if analysis.is_file():
            step_trace, comm = _read_analysis_db(analysis, warnings)
        else:
            warnings.append(Warning_(str(analysis), "analysis.db",
                                     ["profiler_agreement with the profiler's step_trace_time and communication figures"]))
    rts = columns_to_ranks(cols, rank=rank, source=str(db_path), fmt=fmt, kernel_details=kernel_details,
                           step_trace=step_trace, warnings=warnings, host_events=host_events)
    for rt in rts:
        rt.profiler_step_trace_source = "analysis.db:StepTraceTime"
        rt.profiler_comm_source = "analysis.db:CommAnalyzerTime"
        if comm is not None and len(rts) == 1:
            rt.profiler_comm = comm
        if n_steps == 0 and fmt == "msprof_db":
            rt.warnings.append(Warning_(str(db_path), "framework ProfilerStep#N ranges",
                                        ["steps (the whole capture is one step)", "Preparing"]))
        _check_tracks(rt, db_path)
    return rts


def _columns_from_db(db: sqlite3.Connection, path: Path, present: set[str], host_events: bool):
    from profile_analyzer.loaders._columns import Columns

    strings = dict(_query(db, path, "SELECT id, value FROM STRING_IDS"))

    def s(i: object) -> str:
        return str(strings.get(i, "" if i is None else i))

    names: list[str] = []
    name_idx: dict[str, int] = {}
    task_types: list[str | None] = [None]
    tt_idx: dict[str | None, int] = {None: 0}
    tracks: list[tuple[object, object]] = []
    track_idx: dict[tuple[object, object], int] = {}
    ev: list[tuple[int, int, int, int, int, int]] = []  # track, start, dur, name id, task type id, problem
    process_name: dict[object, str] = {}
    process_label: dict[object, str] = {}
    thread_name: dict[tuple[object, object], str] = {}

    def name_id(n: str) -> int:
        i = name_idx.get(n)
        if i is None:
            i = name_idx[n] = len(names)
            names.append(n)
        return i

    def tt_id(t: str | None) -> int:
        i = tt_idx.get(t)
        if i is None:
            i = tt_idx[t] = len(task_types)
            task_types.append(t)
        return i

    def track(pid: object, tid: object) -> int:
        key = (pid, tid)
        i = track_idx.get(key)
        if i is None:
            i = track_idx[key] = len(tracks)
            tracks.append(key)
        return i

    def add(pid: object, tid: object, start: object, end: object, name: str, task_type: str | None = None) -> None:
        st, dur, problem = _time_and_duration(start, end)
        ev.append((track(pid, tid), st, dur, name_id(name), tt_id(task_type), problem))

    # device tasks
    compute_info: dict[int, tuple[str, str, str]] = {}
    if "COMPUTE_TASK_INFO" in present:
        for gid, nm, tt, ot in _query(db, path, "SELECT globalTaskId, name, taskType, opType FROM COMPUTE_TASK_INFO"):
            compute_info[gid] = (s(nm), s(tt), s(ot))
    comm_info: dict[int, tuple[str, int, str]] = {}
    if "COMMUNICATION_TASK_INFO" in present:
        # name is the operator's name, taskType the HCCL task type (Notify_Wait, Memcpy, ...), which msprof's JSON
        # timeline uses as the plane task's name (MindStudio Insight's real samples, tests/data/msinsight/db)
        for gid, nm, tt, plane, grp in _query(db, path, "SELECT globalTaskId, name, taskType, planeId, groupName "
                                                        "FROM COMMUNICATION_TASK_INFO"):
            comm_info[gid] = (s(tt) or s(nm), _int(plane, path, "COMMUNICATION_TASK_INFO.planeId"), s(grp))
    task_rows = _query(db, path, "SELECT startNs, endNs, deviceId, connectionId, globalTaskId, taskType, streamId "
                                 "FROM TASK ORDER BY startNs, globalTaskId")
    devices = sorted({int(r[2]) for r in task_rows if isinstance(r[2], int)})
    multi = len(devices) > 1

    def dev_pid(base: int, device: int) -> object:
        return (base, device) if multi else base

    comm_ops = []
    if "COMMUNICATION_OP" in present:
        comm_ops = _query(db, path, "SELECT opName, startNs, endNs, connectionId, groupName, opId"
                                    + (", deviceId" if "deviceId" in (_columns(db, path, "COMMUNICATION_OP") or ()) else
                                       ", NULL") + " FROM COMMUNICATION_OP ORDER BY startNs, opId")
    groups = sorted({s(r[4]) for r in comm_ops} | {g for _, _, g in comm_info.values()})
    group_tid = {}
    planes_of: dict[str, list[int]] = {}
    for _, plane, g in comm_info.values():
        planes_of.setdefault(g, [])
        if plane not in planes_of[g]:
            planes_of[g].append(plane)
    tid = 0
    for g in groups:  # msprof: tid k = the group's operators, k + plane + 1 = its planes
        group_tid[g] = tid
        tid += 1 + (max(planes_of.get(g, [-1])) + 1)
    conn_device: dict[int, int] = {}
    for st, en, dev, conn, gid, tt, stream in task_rows:
        conn_device.setdefault(conn, dev)
        if gid in comm_info:
            nm, plane, g = comm_info[gid]
            pid = dev_pid(_COMM, dev)
            t = group_tid[g] + plane + 1
            thread_name[(pid, t)] = f"Plane {plane}"
            add(pid, t, st, en, nm, s(tt))
        else:
            pid = dev_pid(_HW, dev)
            thread_name[(pid, stream)] = f"Stream {stream}"
            info = compute_info.get(gid)
            add(pid, stream, st, en, info[0] if info else s(tt), info[1] if info else s(tt))
    for dev in devices:
        for base, pname in ((_HW, "Ascend Hardware"), (_COMM, "Communication"), (_OVERLAP, "Overlap Analysis")):
            process_name[dev_pid(base, dev)] = pname
            process_label[dev_pid(base, dev)] = f"NPU {dev}"
    for nm, st, en, conn, grp, _op, dev in comm_ops:
        dev = dev if isinstance(dev, int) else conn_device.get(conn, devices[0] if devices else 0)
        pid = dev_pid(_COMM, dev)
        process_name.setdefault(pid, "Communication")
        process_label.setdefault(pid, f"NPU {dev}")
        g = s(grp)
        thread_name[(pid, group_tid[g])] = f"Group {g} Communication"
        add(pid, group_tid[g], st, en, s(nm))
    if "OVERLAP_ANALYSIS" in present:
        for dev, st, en, ty in _query(db, path, "SELECT deviceId, startNs, endNs, type FROM OVERLAP_ANALYSIS "
                                                "ORDER BY startNs, id"):
            if ty in OVERLAP_TYPE_NAMES:
                pid = dev_pid(_OVERLAP, dev)
                thread_name[(pid, int(ty))] = OVERLAP_TYPE_NAMES[int(ty)]
                add(pid, int(ty), st, en, OVERLAP_TYPE_NAMES[int(ty)])
    # host side: torch ops (ProfilerStep#N always, the rest with host_events) and CANN API calls
    flows: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    # where a host -> device link ends: an Ascend Hardware task or a whole communication operator, never a plane task
    # (msprof's HostToDevice flows end there: host_connect_device.py add_task_connection_data, add_hccl_end_points)
    dev_start_of_conn: dict[int, list[int]] = {}
    # (a start that is not a time links nothing: its task is refused or skipped with the rest)
    for st, _en, _dev, conn, gid, _tt, _stream in task_rows:
        if gid not in comm_info and _integer(st) is not None:
            dev_start_of_conn.setdefault(conn, []).append(_integer(st))
    for conn, st, *_ in ((r[3], r[1]) for r in comm_ops):
        if _integer(st) is not None:
            dev_start_of_conn.setdefault(conn, []).append(_integer(st))
    n_steps = 0
    if "PYTORCH_API" in present:
        conn_of_api: dict[int, list[int]] = {}
        if "CONNECTION_IDS" in present:
            for api_id, conn in _query(db, path, "SELECT id, connectionId FROM CONNECTION_IDS"):
                conn_of_api.setdefault(api_id, []).append(conn)
        hs, hd, ids = [], [], []
        for st, en, gtid, api_conn, nm in _query(db, path, "SELECT startNs, endNs, globalTid, connectionId, name "
                                                            "FROM PYTORCH_API ORDER BY CAST(startNs AS INTEGER)"):
            g = _int(gtid, path, "PYTORCH_API.globalTid")
            pid, t = g >> 32, g & 0xFFFFFFFF
            name = s(nm)
            process_name[pid] = "Python"
            process_label[pid] = "CPU"
            thread_name[(pid, t)] = f"Thread {t}"
            if name.startswith("ProfilerStep#"):
                n_steps += 1
            if host_events or name.startswith("ProfilerStep#"):
                add(pid, t, st, en, name)
            host_start = _integer(st)
            for conn in conn_of_api.get(api_conn, []) if api_conn is not None and host_start is not None else []:
                for d in dev_start_of_conn.get(conn, []):
                    hs.append(host_start)
                    hd.append(d)
                    ids.append(d)  # torch_npu numbers its async_npu flows by the device task's ts in ns
        _add_flow(flows, "async_npu", hs, hd, ids)
    if "CANN_API" in present:
        hs, hd, ids = [], [], []
        for st, en, gtid, conn, nm in _query(db, path, "SELECT startNs, endNs, globalTid, connectionId, name "
                                                       "FROM CANN_API ORDER BY startNs"):
            g = _int(gtid, path, "CANN_API.globalTid")
            pid, t = ("CANN", g >> 32), g & 0xFFFFFFFF
            process_name[pid] = "CANN"
            process_label[pid] = "CPU"
            thread_name[(pid, t)] = f"Thread {t}"
            if host_events:
                add(pid, t, st, en, s(nm))
            host_start = _integer(st)
            for k, d in enumerate(dev_start_of_conn.get(conn, []) if host_start is not None else []):
                hs.append(host_start)
                hd.append(d)
                ids.append((int(conn) << 20) + k)  # msprof: HostToDevice ids are (connectionId << 32) + context
        _add_flow(flows, "HostToDevice", hs, hd, ids)
    # tracks in the order a trace_view.json gives them (by (pid, tid), host processes first)
    order = sorted(range(len(tracks)), key=lambda i: _track_key(tracks[i]))
    renumber = np.empty(len(tracks), dtype=np.int32)
    renumber[order] = np.arange(len(tracks), dtype=np.int32)
    arr = np.array(ev, dtype=np.int64).reshape(-1, 6)
    n = arr.shape[0]
    z = np.full(n, -1, dtype=np.int64)
    columns = Columns(track=renumber[arr[:, 0]] if n else np.zeros(0, np.int32), start_ns=arr[:, 1], dur_ns=arr[:, 2],
                      name_id=arr[:, 3].astype(np.int32), cat_id=np.zeros(n, np.int32),
                      task_type_id=arr[:, 4].astype(np.int32), stream_arg=z, correlation=z.copy(),
                      tracks=[tracks[i] for i in order], names=names, cats=[None], task_types=task_types,
                      process_name=process_name, process_label=process_label, thread_name=thread_name, flows=flows,
                      distributed_info=None, n_events=n, problem=arr[:, 5].astype(np.uint8))
    kernel_details = {"types": {**{nm: ot for nm, _tt, ot in compute_info.values() if ot and ot != "N/A"},
                                **{s(r[0]): re.sub(r"__.*$", "_", s(r[0])) for r in comm_ops}},
                      "comm_names": frozenset(s(r[0]) for r in comm_ops), "rows": len(compute_info) + len(comm_ops)}
    if not compute_info and not comm_ops:
        kernel_details = None
    return columns, kernel_details, n_steps


def _track_key(t: tuple[object, object]) -> tuple:
    pid, tid = t
    if isinstance(pid, tuple) and pid and pid[0] == "CANN":  # CANN after Python, before the device processes
        return (1, pid[1], tid)
    if isinstance(pid, tuple):  # (device process, device id) with several NPUs
        return (2, pid[1], pid[0], tid)
    if isinstance(pid, int) and pid >= _HW:
        return (2, 0, pid, tid)
    return (0, pid, tid)


def _add_flow(flows: dict, cat: str, host: list[int], dev: list[int], ids: list[int]) -> None:
    """Host -> device links as flow pairs that :func:`match_flows` pairs by id, numbered as the JSON export numbers
    them (the id decides which link wins where two device tasks start at the same ns)."""
    id_arr = np.array(ids, dtype=np.int64)
    flows[(cat, "s")] = (id_arr, np.array(host, dtype=np.int64))
    flows[(cat, "f")] = (id_arr.copy(), np.array(dev, dtype=np.int64))


def _read_analysis_db(path: Path, warnings: list[Warning_]):
    """analysis.db -> (step_trace_time rows keyed as in the CSV, communication.json-like per-step totals)."""
    db = _connect(path)
    try:
        present = _check_layout(db, path, {}, ANALYSIS_OPTIONAL)
        step_trace = None
        if "StepTraceTime" in present:
            have = _columns(db, path, "StepTraceTime") or set()
            cols = [c for c in STEP_TRACE_COLUMNS if c in have]
            rows = _query(db, path, f"SELECT {', '.join(cols)} FROM StepTraceTime")
            step_trace = []
            for r in rows:
                d: dict[str, float | str] = {}
                for c, v in zip(cols, r, strict=True):
                    d[STEP_TRACE_COLUMNS[c]] = float(v) if isinstance(v, (int, float)) else ("" if v is None else str(v))
                    if c == "step" and isinstance(v, str) and re.fullmatch(r"\d+", v):
                        d["Step"] = float(v)
                step_trace.append(d)
        else:
            warnings.append(Warning_(str(path), "the StepTraceTime table", ["profiler_agreement (step_trace_time)"]))
        comm = None
        if "CommAnalyzerTime" in present:
            # per step and kind, the operators' ms summed in file order, then collective + p2p in µs: the
            # arithmetic of communication.json's "Total Op Info" as the JSON loader reads it
            per: dict[tuple[int | None, str], list[float]] = {}
            for step, kind, el, tr, wa, sy in _query(db, path, "SELECT step, type, elapse_time, transit_time, wait_time, "
                                                                "synchronization_time FROM CommAnalyzerTime ORDER BY rowid"):
                m = re.match(r"^step(\d*)$", str(step or ""))
                if not m or kind not in ("collective", "p2p"):
                    continue
                acc = per.setdefault((int(m.group(1)) if m.group(1) else None, kind), [0.0, 0.0, 0.0, 0.0])
                for i, v in enumerate((el, tr, wa, sy)):
                    acc[i] += float(v)
            comm = {}
            for kind in ("collective", "p2p"):
                for (key, k), acc in per.items():
                    if k != kind:
                        continue
                    tot = comm.setdefault(key, {"elapse_us": 0.0, "transit_us": 0.0, "wait_us": 0.0, "sync_wait_us": 0.0})
                    for i, name in enumerate(("elapse_us", "transit_us", "wait_us", "sync_wait_us")):
                        tot[name] += acc[i] * 1000.0
            comm = comm or None
        return step_trace, comm
    finally:
        db.close()
