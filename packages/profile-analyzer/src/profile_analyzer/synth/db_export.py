"""The DB export (``export_type=db``) of a synthetic torch_npu rank, written from its text export.

torch_npu with ``export_type=db`` writes ``ASCEND_PROFILER_OUTPUT/ascend_pytorch_profiler_{rank}.db`` (the CANN
tables of ``msprof_*.db`` plus torch_npu's own) and ``analysis.db`` (step_trace_time and communication tables)
instead of trace_view.json and the CSV/JSON summaries. This module turns the text export that
:mod:`profile_analyzer.synth.writer` wrote for one rank into those two SQLite files, event by event, the way
msprof maps its timeline to its tables (what goes where is documented at each table below), so that the same
synthetic profile exists in both exports. Checked against real torch_npu DBs (tests/data/msinsight/db, MindStudio
Insight's samples): the column meanings follow them (docs/profile-analysis.md).

Table layouts (column names and order) are those of:

* msprof ``analysis/csrc/application/database/msprof_db.cpp`` (Ascend/msprof @ 9ba1ac7be913): STRING_IDS, TASK,
  COMPUTE_TASK_INFO, COMMUNICATION_TASK_INFO, COMMUNICATION_OP, CANN_API, OVERLAP_ANALYSIS, RANK_DEVICE_MAP,
  META_DATA, SESSION_TIME_INFO; the OVERLAP_ANALYSIS ``type`` values from ``db_constant.h`` (OVERLAP_TYPE_TABLE:
  COMPUTE 0, COMMUNICATION 1, COMM_NOT_OVERLAP_COMP 2, FREE 3);
* torch_npu ``torch_npu/profiler/analysis/prof_common_func/_constant.py`` (Ascend/pytorch @ d41eb70909f5,
  ``TableColumnsManager``): PYTORCH_API, CONNECTION_IDS, STEP_TIME, and analysis.db's StepTraceTime and
  CommAnalyzerTime (whose ``deviceId`` first column torch_npu's ``_trace_step_time_db_parser.py`` writes);
* the joins msprof-analyze makes (Ascend/msprof-analyze @ 8399c1cdd2ae): TASK.globalTaskId =
  COMPUTE_TASK_INFO.globalTaskId (``msprof_step_trace_time_adapter.py``), TASK.connectionId = CONNECTION_IDS.connectionId
  and CONNECTION_IDS.id = PYTORCH_API.connectionId (``prof_exports/communication_bottleneck_export.py``),
  COMMUNICATION_OP.connectionId = CANN_API.connectionId (``prof_exports/cluster_time_summary_export.py``).

Every text column holds a STRING_IDS id, as msprof writes them ("all data is mapped in numbers", msprof
``docs/en/user_guide/profile_data_file_references_db.md``); times are integer ns.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sqlite3
from decimal import Decimal
from pathlib import Path

# (table, [(column, type)]) in the order the sources above give
MSPROF_TABLES: dict[str, list[tuple[str, str]]] = {
    "STRING_IDS": [("id", "INTEGER PRIMARY KEY"), ("value", "TEXT")],
    "SESSION_TIME_INFO": [("startTimeNs", "INTEGER"), ("endTimeNs", "INTEGER")],
    "RANK_DEVICE_MAP": [("rankId", "INTEGER"), ("deviceId", "INTEGER")],
    "META_DATA": [("name", "TEXT"), ("value", "TEXT")],
    "TASK": [("startNs", "INTEGER"), ("endNs", "INTEGER"), ("deviceId", "INTEGER"), ("connectionId", "INTEGER"),
             ("globalTaskId", "INTEGER"), ("globalPid", "INTEGER"), ("taskType", "INTEGER"), ("contextId", "INTEGER"),
             ("streamId", "INTEGER"), ("taskId", "INTEGER"), ("modelId", "INTEGER")],
    "COMPUTE_TASK_INFO": [("name", "INTEGER"), ("globalTaskId", "INTEGER PRIMARY KEY"), ("blockNum", "INTEGER"),
                          ("mixBlockNum", "INTEGER"), ("taskType", "INTEGER"), ("opType", "INTEGER"),
                          ("inputFormats", "INTEGER"), ("inputDataTypes", "INTEGER"), ("inputShapes", "INTEGER"),
                          ("outputFormats", "INTEGER"), ("outputDataTypes", "INTEGER"), ("outputShapes", "INTEGER"),
                          ("attrInfo", "INTEGER"), ("opState", "INTEGER"), ("hf32Eligible", "INTEGER")],
    "COMMUNICATION_TASK_INFO": [("name", "INTEGER"), ("globalTaskId", "INTEGER"), ("taskType", "INTEGER"),
                                ("planeId", "INTEGER"), ("groupName", "INTEGER"), ("notifyId", "INTEGER"),
                                ("rdmaType", "INTEGER"), ("srcRank", "INTEGER"), ("dstRank", "INTEGER"),
                                ("transportType", "INTEGER"), ("size", "INTEGER"), ("dataType", "INTEGER"),
                                ("linkType", "INTEGER"), ("opId", "INTEGER"), ("isMaster", "INTEGER"),
                                ("bandwidth", "NUMERIC")],
    "COMMUNICATION_OP": [("opName", "INTEGER"), ("startNs", "INTEGER"), ("endNs", "INTEGER"),
                         ("connectionId", "INTEGER"), ("groupName", "INTEGER"), ("opId", "INTEGER PRIMARY KEY"),
                         ("relay", "INTEGER"), ("retry", "INTEGER"), ("dataType", "INTEGER"), ("algType", "INTEGER"),
                         ("count", "NUMERIC"), ("opType", "INTEGER"), ("deviceId", "INTEGER"), ("rankSize", "INTEGER")],
    "CANN_API": [("startNs", "INTEGER"), ("endNs", "INTEGER"), ("type", "INTEGER"), ("globalTid", "INTEGER"),
                 ("connectionId", "INTEGER PRIMARY KEY"), ("name", "INTEGER")],
    "ENUM_API_TYPE": [("id", "INTEGER PRIMARY KEY"), ("name", "TEXT")],
    "OVERLAP_ANALYSIS": [("id", "INTEGER PRIMARY KEY"), ("deviceId", "INTEGER"), ("startNs", "NUMERIC"),
                         ("endNs", "NUMERIC"), ("type", "INTEGER")],
    # torch_npu's own tables
    "PYTORCH_API": [("startNs", "TEXT"), ("endNs", "TEXT"), ("globalTid", "INTEGER"), ("connectionId", "INTEGER"),
                    ("name", "INTEGER"), ("sequenceNumber", "INTEGER"), ("fwdThreadId", "INTEGER"),
                    ("inputDtypes", "INTEGER"), ("inputShapes", "INTEGER"), ("callchainId", "INTEGER"),
                    ("type", "INTEGER")],
    "CONNECTION_IDS": [("id", "INTEGER"), ("connectionId", "INTEGER")],
    "STEP_TIME": [("id", "INTEGER"), ("startNs", "INTEGER"), ("endNs", "INTEGER")],
}
ANALYSIS_TABLES: dict[str, list[tuple[str, str]]] = {
    "StepTraceTime": [("deviceId", "INTEGER"), ("step", "TEXT"), ("computing", "NUMERIC"),
                      ("communication_not_overlapped", "NUMERIC"), ("overlapped", "NUMERIC"),
                      ("communication", "NUMERIC"), ("free", "NUMERIC"), ("stage", "NUMERIC"), ("bubble", "NUMERIC"),
                      ("communication_not_overlapped_and_exclude_receive", "NUMERIC"), ("preparing", "NUMERIC")],
    "CommAnalyzerTime": [("hccl_op_name", "TEXT"), ("group_name", "TEXT"), ("start_timestamp", "NUMERIC"),
                         ("elapse_time", "NUMERIC"), ("transit_time", "NUMERIC"), ("wait_time", "NUMERIC"),
                         ("synchronization_time", "NUMERIC"), ("idle_time", "NUMERIC"), ("step", "TEXT"),
                         ("type", "TEXT")],
}
# ENUM_API_TYPE rows (msprof db_constant.h API_LEVEL_TABLE names -> CANN's MSPROF_REPORT_*_LEVEL values): node = 10000
# is what torch_npu's StepInfoDbParser.NODE_LEVEL selects; acl = 20000 is CANN's MSPROF_REPORT_ACL_LEVEL (prof_api.h,
# not read here). The loader reads neither: it needs CANN_API's start and connectionId only.
API_LEVELS = {"acl": 20000, "node": 10000}
OVERLAP_TYPES = {"Computing": 0, "Communication": 1, "Communication(Not Overlapped)": 2, "Free": 3}
STEP_TRACE_COLUMNS = ("Computing", "Communication(Not Overlapped)", "Overlapped", "Communication", "Free", "Stage",
                      "Bubble", "Communication(Not Overlapped and Exclude Receive)", "Preparing")
_COMM_GROUP = re.compile(r"^Group (.*) Communication$")
_PLANE = re.compile(r"^Plane (\d+)$")


def ns(v: object) -> int:
    """A µs value (a decimal string or a Decimal from the JSON) as exact integer ns."""
    return int((Decimal(str(v).strip()) * 1000).to_integral_value())


class _Strings:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, s: object) -> int:
        key = str(s)
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.ids) + 1
        return i


def _create(db: sqlite3.Connection, tables: dict[str, list[tuple[str, str]]]) -> None:
    for name, cols in tables.items():
        db.execute(f"CREATE TABLE {name} ({', '.join(f'{c} {t}' for c, t in cols)})")


def _insert(db: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
    if rows:
        db.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)


def write_db_export(profile_dir: Path, rank: int) -> list[Path]:
    """Write ``ascend_pytorch_profiler_{rank}.db`` and ``analysis.db`` next to the text export in
    ``profile_dir/ASCEND_PROFILER_OUTPUT``; returns their paths."""
    out = profile_dir / "ASCEND_PROFILER_OUTPUT"
    events = json.loads((out / "trace_view.json").read_bytes(), parse_float=Decimal)
    op_types = _kernel_types(out / "kernel_details.csv")
    sid = _Strings()
    pname: dict[object, str] = {}
    plabel: dict[object, str] = {}
    tname: dict[tuple[object, object], str] = {}
    for e in events:
        if e.get("ph") == "M":
            if e["name"] == "process_name":
                pname[e["pid"]] = e["args"]["name"]
            elif e["name"] == "process_labels":
                plabel[e["pid"]] = e["args"]["labels"]
            elif e["name"] == "thread_name":
                tname[(e["pid"], e["tid"])] = e["args"]["name"]
    host_pid = next(p for p, n in pname.items() if n == "Python")
    device = next((int(lb.split()[1]) for p, lb in plabel.items() if lb.startswith("NPU ") and
                   pname.get(p) == "Ascend Hardware"), rank % 8)

    def gtid(tid: int) -> int:  # msprof: globalTid = pid << 32 | tid
        return (int(host_pid) << 32) | int(tid)

    tasks, compute, comm_tasks, comm_ops, cann, overlap = [], [], [], [], [], []
    torch_ops: dict[tuple[int, int], tuple] = {}  # (tid, start ns) -> PYTORCH_API row without connection
    task_at: dict[tuple[str, object, int], int] = {}  # (kind, track tid, start ns) -> connection id of the task
    ops_by_group: dict[str, list[tuple[int, int, int]]] = {}  # group -> (start, end, opId)
    xs = [e for e in events if e.get("ph") == "X"]
    gid = 0
    for e in xs:  # big communication ops first: the plane tasks name the op they belong to
        if pname.get(e["pid"]) in ("Communication", "HCCL"):
            m = _COMM_GROUP.match(tname.get((e["pid"], e["tid"]), ""))
            if m:
                a = e.get("args", {})
                s = ns(e["ts"])
                op_id = len(comm_ops) + 1
                name = e["name"]
                op_type = re.sub(r"__.*$", "_", name)  # hcom_allGather__674_1_1 -> hcom_allGather_
                comm_ops.append((sid(name), s, s + ns(e["dur"]), int(a.get("connection_id", -1)), sid(m.group(1)),
                                 op_id, sid(a.get("relay", "no")), sid(a.get("retry", "no")), sid(a.get("data_type", "")),
                                 sid(a.get("alg_type", "")), int(a.get("count", 0)), sid(op_types.get(name, op_type)),
                                 device, int(a.get("rank_size", 0))))
                ops_by_group.setdefault(m.group(1), []).append((s, s + ns(e["dur"]), op_id))
                task_at[("comm", e["tid"], s)] = int(a.get("connection_id", -1))
    for e in xs:
        p, a = pname.get(e["pid"]), e.get("args", {}) or {}
        s = ns(e["ts"])
        end = s + ns(e["dur"])
        if p == "Ascend Hardware":
            gid += 1
            ttype = a.get("Task Type", "")
            stream = int(a.get("Physic Stream Id", a.get("Stream Id", e["tid"])))
            conn = int(a.get("connection_id", -1))
            tasks.append((s, end, device, conn, gid, int(host_pid), sid(ttype), int(a.get("Subtask Id", 0)), stream,
                          int(a.get("Task Id", 0)), int(a.get("Model Id", 0))))
            task_at[("hw", e["tid"], s)] = conn
            if e["name"] != ttype:  # a task named after its type (EVENT_RECORD ...) has no compute-task info
                na = sid("N/A")
                compute.append((sid(e["name"]), gid, 0, 0, sid(ttype), sid(op_types.get(e["name"], "")),
                                na, na, na, na, na, na, na, na, na))
        elif p in ("Communication", "HCCL"):
            m = _PLANE.match(tname.get((e["pid"], e["tid"]), ""))
            if not m:
                continue
            gid += 1
            group = next(iter(ops_by_group)) if len(ops_by_group) == 1 else ""
            op_id = next((o for os_, oe, o in ops_by_group.get(group, []) if os_ <= s < oe), 0)
            conn = comm_ops[op_id - 1][3] if op_id else -1
            tasks.append((s, end, device, conn, gid, int(host_pid), sid(a.get("task type", e["name"])), 0,
                          int(a.get("stream id", 0)), int(a.get("task id", 0)), int(a.get("model id", 0))))
            # as torch_npu writes it (MindStudio Insight's real samples): name = the operator's name, taskType = the
            # HCCL task type (the JSON event's name: Notify_Wait, Memcpy, ...)
            op_name = comm_ops[op_id - 1][0] if op_id else sid("")
            comm_tasks.append((op_name, gid, sid(e["name"]), int(m.group(1)), sid(group),
                               int(a.get("notify_id", 0)), 0, int(a.get("src rank", 0)), int(a.get("dst rank", 0)),
                               0, int(a.get("size(Byte)", 0)), 0, 0, op_id, 1 if m.group(1) == "0" else 0,
                               float(a.get("bandwidth(GB/s)", 0)) * 1e9))
        elif p == "CANN":
            level, _, api = e["name"].partition("@")
            cann.append((s, end, API_LEVELS.get(str(a.get("level", "acl")), 20000), gtid(e["tid"]),
                         int(a.get("connection_id", -1)), sid(api)))
        elif p == "Overlap Analysis":
            overlap.append((len(overlap) + 1, device, s, end, OVERLAP_TYPES[tname[(e["pid"], e["tid"])]]))
        elif p == "Python" and e.get("cat") == "cpu_op":
            torch_ops[(int(e["tid"]), s)] = (str(s), str(end), gtid(e["tid"]), sid(e["name"]),
                                             int(a.get("Sequence number", -1)), int(a.get("Fwd thread id", 0)),
                                             e["name"])
    # torch op -> device task: torch_npu's async_npu flow (s on the op, f on the task) is CONNECTION_IDS in the DB
    flow_s = {str(e["id"]): e for e in events if e.get("ph") == "s" and e.get("cat") == "async_npu"}
    links: dict[tuple[int, int], list[int]] = {}
    for f in (e for e in events if e.get("ph") == "f" and e.get("cat") == "async_npu"):
        st = flow_s.get(str(f["id"]))
        if st is None:
            continue
        kind = "hw" if pname.get(f["pid"]) == "Ascend Hardware" else "comm"
        conn = task_at.get((kind, f["tid"], ns(f["ts"])))
        if conn is not None:
            links.setdefault((int(st["tid"]), ns(st["ts"])), []).append(conn)
    pytorch_api, connection_ids, step_time = [], [], []
    for n_op, (key, row) in enumerate(sorted(torch_ops.items(), key=lambda kv: kv[0][1]), 1):
        conns = links.get(key, [])
        for c in conns:
            connection_ids.append((n_op, c))
        na = sid("")
        pytorch_api.append(row[:3] + (n_op if conns else None, row[3], row[4], row[5], na, na, None, 1))
        m = re.match(r"^ProfilerStep#(\d+)$", row[6])
        if m:
            step_time.append((int(m.group(1)), int(row[0]), int(row[1])))
    path = out / f"ascend_pytorch_profiler_{rank}.db"
    tmp = path.with_suffix(".db.tmp")
    if tmp.exists():
        tmp.unlink()
    db = sqlite3.connect(tmp)
    try:
        _create(db, MSPROF_TABLES)
        starts = [t[0] for t in tasks] or [0]
        ends = [t[1] for t in tasks] or [0]
        _insert(db, "SESSION_TIME_INFO", [(min(starts), max(ends))])
        _insert(db, "RANK_DEVICE_MAP", [(rank, device)])
        _insert(db, "META_DATA", [("SCHEMA_VERSION", "1.2.0"), ("synthetic", "profile_analyzer.synth")])
        _insert(db, "ENUM_API_TYPE", [(v, k) for k, v in API_LEVELS.items()])
        for table, rows in (("TASK", tasks), ("COMPUTE_TASK_INFO", compute), ("COMMUNICATION_TASK_INFO", comm_tasks),
                            ("COMMUNICATION_OP", comm_ops), ("CANN_API", cann), ("OVERLAP_ANALYSIS", overlap),
                            ("PYTORCH_API", pytorch_api), ("CONNECTION_IDS", connection_ids), ("STEP_TIME", step_time)):
            _insert(db, table, rows)
        _insert(db, "STRING_IDS", [(i, s) for s, i in sid.ids.items()])
        db.commit()
    finally:
        db.close()
    os.replace(tmp, path)
    return [path, _write_analysis_db(out, device)]


def _kernel_types(path: Path) -> dict[str, str]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        return {r["Name"]: r["Type"] for r in rows}


def _write_analysis_db(out: Path, device: int) -> Path:
    """analysis.db: torch_npu's StepTraceTime (step_trace_time.csv's figures, µs) and CommAnalyzerTime
    (communication.json's per-operator time info, ms; ``step`` is "step<N>", ``type`` collective or p2p)."""
    steps = []
    with open(out / "step_trace_time.csv", newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            steps.append((int(float(r.get("Device_id", device))), r["Step"],
                          *[float(r[c]) if c in r else 0.0 for c in STEP_TRACE_COLUMNS]))
    comm = []
    for step, kinds in json.loads((out / "communication.json").read_text()).items():
        for kind, op_map in kinds.items():
            for key, info in op_map.items():
                if key == "Total Op Info":
                    continue
                name, _, group = key.partition("@")
                t = info["Communication Time Info"]
                comm.append((name, group, t["Start Timestamp(us)"], t["Elapse Time(ms)"], t["Transit Time(ms)"],
                             t["Wait Time(ms)"], t["Synchronization Time(ms)"], t["Idle Time(ms)"], step, kind))
    path = out / "analysis.db"
    tmp = path.with_suffix(".db.tmp")
    if tmp.exists():
        tmp.unlink()
    db = sqlite3.connect(tmp)
    try:
        _create(db, ANALYSIS_TABLES)
        _insert(db, "StepTraceTime", steps)
        _insert(db, "CommAnalyzerTime", comm)
        db.commit()
    finally:
        db.close()
    os.replace(tmp, path)
    return path
