"""Writes one rank of a synthetic torch_npu profile, streaming (see ``profile_analyzer.synth``).

The layout and field names follow what torch_npu writes (reference: msprof.md §1a, §2, §3): a top-level
JSON list in ``trace_view.json`` (Python events first, then the CANN/NPU metadata, then the device
events interleaved in time, then the ``torch_to_npu`` flows), ``kernel_details.csv``,
``step_trace_time.csv``, ``communication.json``, and ``profiler_info_{rank}.json``.

Events are formatted per step and appended to one part file per section, so memory stays bounded by one
step whatever the profile size; the part files are concatenated into ``trace_view.json`` at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path

from profile_analyzer.synth.schedule import (
    GROUP_NAME,
    MAIN_STREAM,
    SHARED_STREAM,
    CommOp,
    RankStep,
    SynthParams,
    iv_subtract,
    simulate,
    step_overlap,
    step_truth,
    us,
)

T0_NS = 1_764_487_800_000_000_000  # 2025-11-30 07:30:00 UTC: the synthetic profiler clock starts here
SECTIONS = ("python", "meta", "device", "flows")
TORCH_COMM_OP = {"allGather": "c10d::_allgather_base_", "reduceScatter": "c10d::_reduce_scatter_base_",
                 "alltoallv": "c10d::alltoall_base_", "receive": "c10d::recv_"}
ACL_COMM_API = {"allGather": "HcclAllGather", "reduceScatter": "HcclReduceScatter", "alltoallv": "HcclAlltoAllV",
                "receive": "HcclRecv"}
ALG_TYPE = {"allGather": "MESH-RING", "reduceScatter": "MESH-RING", "alltoallv": "MESH", "receive": "NA"}
P2P_PREFIXES = ("hcom_send", "hcom_receive", "hcom_batchsendrecv")  # torch_npu files these under "p2p"

KERNEL_DETAILS_HEADER = {
    "new": "Step Id,Device_id,Model ID,Task ID,Stream ID,Name,Type,OP State,Accelerator Core,Start Time(us),"
           "Duration(us),Wait Time(us),Block Num,Mix Block Num,HF32 Eligible,Input Shapes,Input Data Types,"
           "Input Formats,Output Shapes,Output Data Types,Output Formats,Context ID",
    "old": "Step Id,Model ID,Task ID,Stream ID,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),"
           "Block Dim,Mix Block Dim,Input Shapes,Input Data Types,Input Formats,Output Shapes,Output Data Types,"
           "Output Formats,Context ID",
}
STEP_TRACE_HEADER = {
    "new": ["Device_id", "Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication",
            "Free", "Stage", "Bubble", "Communication(Not Overlapped and Exclude Receive)", "Preparing"],
    "old": ["Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication", "Free", "Stage",
            "Bubble", "Communication(Not Overlapped and Exclude Receive)"],
}


def _us_str(ns: int) -> str:
    return f"{ns // 1000}.{ns % 1000:03d}"


class RankIds:
    """Process and thread ids of one rank, CANN-generation dependent."""

    def __init__(self, p: SynthParams, rank: int) -> None:
        self.rank = rank
        self.device = rank % 8
        self.host_pid = (4_400_000 if p.large_pids else 437_675) + rank * 131
        self.host = f"node{rank // 8}"
        P = self.host_pid
        if p.cann == "new":  # formatPid = (pid << 10) | (sortIndex << 5) | deviceId
            def fmt(sort: int) -> int:
                return (P << 10) | (sort << 5) | self.device
            self.cann_pid, self.hw_pid, self.comm_pid, self.overlap_pid = fmt(2), fmt(8), fmt(9), fmt(11)
            self.npu_label = f"NPU {self.device}"
        else:  # the older scheme seen in the real sample (800, pid*100+2, pid*10000+1100)
            self.cann_pid, self.hw_pid = P * 100 + 2, 800 + self.device
            self.comm_pid, self.overlap_pid = P * 10000 + 900, P * 10000 + 1100
            self.npu_label = "NPU"
        self.main_tid = P
        self.ub_tid = {"-": P, "A": P, "B": P + 1}
        self.dequeue_tid = P + 2


class RankWriter:
    def __init__(self, p: SynthParams, rank: int, root: Path) -> None:
        self.p = p
        self.ids = RankIds(p, rank)
        stamp = datetime.fromtimestamp(T0_NS / 1e9, tz=UTC).strftime("%Y%m%d%H%M%S%f")[:-3]
        self.dir = root / f"{self.ids.host}_{self.ids.host_pid}_{stamp}_ascend_pt"
        self.out = self.dir / "ASCEND_PROFILER_OUTPUT"
        self.out.mkdir(parents=True, exist_ok=True)
        self.parts = {s: open(self.out / f".synth_{s}.part", "w", buffering=1 << 20) for s in SECTIONS}
        self.part_has = dict.fromkeys(SECTIONS, False)
        self.kd = open(self.out / ".kernel_details.csv.part", "w", buffering=1 << 20)
        self.kd.write(KERNEL_DETAILS_HEADER[p.cann] + "\n")
        self.cj = open(self.out / ".communication.json.part", "w", buffering=1 << 20)
        self.cj.write("{")
        self.cj_first = True
        self.q = '"' if p.ts_as_string else ""
        self.cid = 0
        self.corr = 0
        self.task_id = 1000
        self.plane_task_id = 1
        self.events = 0
        self.comm_prev_end = 0
        self.stream_prev_end: dict[int, int] = {}

    # --- formatting helpers ---------------------------------------------------------------------------
    def ts(self, ns: int) -> str:
        return f"{self.q}{ns // 1000}.{ns % 1000:03d}{self.q}"

    def emit(self, section: str, events: list[str]) -> None:
        if not events:
            return
        f = self.parts[section]
        if self.part_has[section]:
            f.write(", ")
        f.write(", ".join(events))
        self.part_has[section] = True
        self.events += len(events)

    # --- metadata ---------------------------------------------------------------------------------------
    def write_meta(self) -> None:
        ids, p = self.ids, self.p
        py = [
            f'{{"ph": "M", "name": "process_name", "pid": {ids.host_pid}, "tid": 0, "args": {{"name": "Python"}}}}',
            f'{{"ph": "M", "name": "process_labels", "pid": {ids.host_pid}, "tid": 0, "args": {{"labels": "CPU"}}}}',
            f'{{"ph": "M", "name": "process_sort_index", "pid": {ids.host_pid}, "tid": 0, '
            f'"args": {{"sort_index": 0}}}}',
        ]
        host_tids = sorted({ids.main_tid, ids.dequeue_tid} | ({ids.ub_tid["B"]} if p.dbo else set()))
        for tid in host_tids:
            py.append(f'{{"ph": "M", "name": "thread_name", "pid": {ids.host_pid}, "tid": {tid}, '
                      f'"args": {{"name": "Thread {tid}"}}}}')
            py.append(f'{{"ph": "M", "name": "thread_sort_index", "pid": {ids.host_pid}, "tid": {tid}, '
                      f'"args": {{"sort_index": {tid}}}}}')
        if p.host_tracks:
            self.emit("python", py)
        meta = []

        def proc(pid: int, name: str, label: str, sort: int) -> None:
            meta.append(f'{{"name": "process_name", "pid": {pid}, "tid": 0, "args": {{"name": "{name}"}}, "ph": "M"}}')
            meta.append(f'{{"name": "process_labels", "pid": {pid}, "tid": 0, "args": {{"labels": "{label}"}}, '
                        f'"ph": "M"}}')
            meta.append(f'{{"name": "process_sort_index", "pid": {pid}, "tid": 0, "args": {{"sort_index": {sort}}}, '
                        f'"ph": "M"}}')

        def thread(pid: int, tid: int, name: str, sort: int) -> None:
            meta.append(f'{{"name": "thread_name", "pid": {pid}, "tid": {tid}, "args": {{"name": "{name}"}}, '
                        f'"ph": "M"}}')
            meta.append(f'{{"name": "thread_sort_index", "pid": {pid}, "tid": {tid}, "args": {{"sort_index": {sort}}}, '
                        f'"ph": "M"}}')

        proc(ids.hw_pid, "Ascend Hardware", ids.npu_label, 8)
        for sid in ([MAIN_STREAM] if p.dbo else [MAIN_STREAM, SHARED_STREAM]):
            thread(ids.hw_pid, sid, f"Stream {sid}", sid)
        if p.host_tracks:
            proc(ids.cann_pid, "CANN", "CPU", 2)
            for tid in host_tids:
                thread(ids.cann_pid, tid, f"Thread {tid}", tid)
        proc(ids.comm_pid, p.comm_process_name, ids.npu_label, 9)
        thread(ids.comm_pid, 0, f"Group {GROUP_NAME} Communication", 0)
        for plane in range(p.planes):
            thread(ids.comm_pid, plane + 1, f"Plane {plane}", plane + 1)
        proc(ids.overlap_pid, "Overlap Analysis", ids.npu_label, 11)
        for tid, name in enumerate(("Computing", "Communication", "Communication(Not Overlapped)", "Free")):
            thread(ids.overlap_pid, tid, name, tid)
        self.emit("meta", meta)

    # --- one step ---------------------------------------------------------------------------------------
    def write_step(self, rs: RankStep) -> None:
        p, ids = self.p, self.ids
        py: list[str] = []
        dev: list[tuple[int, str]] = []  # (sort key ns, event) so the device section is interleaved in time
        flows: list[str] = []
        kd_rows: list[tuple[int, str]] = []
        P, hw, cann = ids.host_pid, ids.hw_pid, ids.cann_pid
        sid_key = p.stream_id_key
        ts = self.ts
        if p.host_tracks:
            py.append(f'{{"ph": "X", "name": "ProfilerStep#{rs.step}", "pid": {P}, "tid": {ids.main_tid}, '
                      f'"ts": {ts(rs.host_start)}, "dur": {_us_str(rs.host_end - rs.host_start)}, "cat": "cpu_op", '
                      f'"args": {{"Sequence number": -1, "Fwd thread id": 0}}}}')
        for k in rs.kernels:
            self.cid += 1
            cid = self.cid
            dur = k.end - k.start
            if not k.is_compute:  # stream sync task: named by its task type, no framework op behind it
                self.task_id += 1
                dev.append((k.start, f'{{"name": "{k.name}", "pid": {hw}, "tid": {k.stream}, "ts": {ts(k.start)}, '
                                     f'"dur": {_us_str(dur)}, "args": {{"Model Id": 4294967295, "Task Type": '
                                     f'"{k.core}", "{sid_key}": {k.stream}, "Task Id": {self.task_id}, "Batch Id": 0, '
                                     f'"Subtask Id": 4294967295, "connection_id": {cid}}}, "ph": "X"}}'))
                self.stream_prev_end[k.stream] = k.end
                continue
            self.task_id += 1
            k.task_id = self.task_id
            if p.host_tracks:
                self.corr += 1
                corr = self.corr
                tid = ids.ub_tid[k.ubatch]
                L = k.launch
                py.append(f'{{"ph": "X", "name": "{k.torch_op}", "pid": {P}, "tid": {tid}, "ts": {ts(L)}, '
                          f'"dur": 4.000, "cat": "cpu_op", "args": {{"Sequence number": -1, "Fwd thread id": 0}}}}')
                py.append(f'{{"ph": "X", "name": "Enqueue", "pid": {P}, "tid": {tid}, "ts": {ts(L + 1000)}, '
                          f'"dur": 1.500, "cat": "enqueue", "args": {{"correlation_id": {corr}}}}}')
                py.append(f'{{"ph": "s", "bp": "e", "name": "enqueue_to_dequeue", "id": {corr}, "pid": {P}, '
                          f'"tid": {tid}, "ts": {ts(L + 1000)}, "cat": "async_task_queue"}}')
                py.append(f'{{"ph": "X", "name": "Dequeue@{k.torch_op}", "pid": {P}, "tid": {ids.dequeue_tid}, '
                          f'"ts": {ts(L + 2000)}, "dur": 2.800, "cat": "dequeue", "args": {{"correlation_id": {corr}}}}}')
                py.append(f'{{"ph": "f", "bp": "e", "name": "enqueue_to_dequeue", "id": {corr}, "pid": {P}, '
                          f'"tid": {ids.dequeue_tid}, "ts": {ts(L + 2000)}, "cat": "async_task_queue"}}')
                h2d = (cid << 32) | 0xFFFFFFF
                # the HostToDevice flow starts at the API's own ts (msprof analysis/viewer/association/
                # host_connect_device.py, HostToDevice.get_start_points; Ascend/msprof @ 9ba1ac7be913)
                dev.append((L + 3000, f'{{"name": "AscendCL@{k.acl}", "pid": {cann}, "tid": {ids.dequeue_tid}, '
                                      f'"ts": {ts(L + 3000)}, "dur": 1.700, "args": {{"Thread Id": {ids.dequeue_tid}, '
                                      f'"Mode": "ACL_NN", "level": "acl", "id": "{k.acl}", "item_id": "0", '
                                      f'"connection_id": {cid}}}, "ph": "X"}}'))
                # the HostToDevice flow starts at the launching API's own ts (msprof
                # analysis/viewer/association/host_connect_device.py get_start_points, Ascend/msprof @ 9ba1ac7be913)
                dev.append((L + 3000, f'{{"name": "HostToDevice{h2d}", "ph": "s", "cat": "HostToDevice", '
                                      f'"id": "{h2d}", "pid": {cann}, "tid": {ids.dequeue_tid}, "ts": {ts(L + 3000)}}}'))
                dev.append((k.start, f'{{"name": "HostToDevice{h2d}", "ph": "f", "id": "{h2d}", "ts": {ts(k.start)}, '
                                     f'"cat": "HostToDevice", "pid": {hw}, "tid": {k.stream}, "bp": "e"}}'))
                flows.append(f'{{"ph": "s", "bp": "e", "name": "torch_to_npu", "id": {k.start}, "pid": {P}, '
                             f'"tid": {tid}, "ts": {ts(L)}, "cat": "async_npu"}}')
                flows.append(f'{{"ph": "f", "bp": "e", "name": "torch_to_npu", "id": {k.start}, "pid": {hw}, '
                             f'"tid": {k.stream}, "ts": {ts(k.start)}, "cat": "async_npu"}}')
            dev.append((k.start, f'{{"name": "{k.name}", "pid": {hw}, "tid": {k.stream}, "ts": {ts(k.start)}, '
                                 f'"dur": {_us_str(dur)}, "args": {{"Model Id": 4294967295, "Task Type": "{k.core}", '
                                 f'"{sid_key}": {k.stream}, "Task Id": {k.task_id}, "Batch Id": 0, '
                                 f'"Subtask Id": 4294967295, "connection_id": {cid}}}, "ph": "X"}}'))
            wait = k.start - self.stream_prev_end.get(k.stream, k.start)
            self.stream_prev_end[k.stream] = k.end
            kd_rows.append((k.start, self._kd_row(rs.step, k.task_id, str(k.stream), k.name, k.op_type, k.core,
                                                  k.start, dur, max(wait, 0))))
        comm_step: dict[str, dict] = {"collective": {}, "p2p": {}}
        for c in rs.comm_ops:
            self._write_comm(rs, c, py, dev, flows, kd_rows, comm_step)
        self.emit("python", py)
        dev.sort(key=lambda x: x[0])
        self.emit("device", [e for _, e in dev])
        self.emit("flows", flows)
        kd_rows.sort(key=lambda x: x[0])
        self.kd.write("".join(r for _, r in kd_rows))
        self._write_comm_json(rs.step, comm_step)

    def _kd_row(self, step: int, task_id: int | str, stream: str, name: str, op_type: str, core: str, start: int,
                dur: int, wait: int) -> str:
        is_comm = stream == "N/A"
        shape = "N/A" if is_comm else '"""8192,7168"""'
        dtype, fmt = ("N/A", "N/A") if is_comm else ("DT_BF16", "ND")
        if self.p.cann == "new":
            block = "0" if is_comm else "24"
            return (f'{step},{self.ids.device},4294967295,{task_id},{stream},{name},{op_type},'
                    f'{"N/A" if is_comm else "dynamic"},{core},"{_us_str(start)}\t",{_us_str(dur)},{_us_str(wait)},'
                    f'{block},0,{"N/A" if is_comm else "NO"},{shape},{dtype},{fmt},{shape},{dtype},{fmt},N/A\n')
        return (f'{step},4294967295,{task_id},{stream},{name},{op_type},{core},{_us_str(start)},{_us_str(dur)},'
                f'{_us_str(wait)},{"0" if is_comm else "24"},{"N/A" if is_comm else "0"},{shape},{dtype},{fmt},'
                f'{shape},{dtype},{fmt},N/A\n')

    def _write_comm(self, rs: RankStep, c: CommOp, py: list[str], dev: list[tuple[int, str]], flows: list[str],
                    kd_rows: list[tuple[int, str]], comm_step: dict[str, dict]) -> None:
        p, ids, ts = self.p, self.ids, self.ts
        self.cid += 1
        cid = self.cid
        op = c.op_type[len("hcom_"):-1]
        cp = ids.comm_pid
        if p.host_tracks:
            self.corr += 1
            corr = self.corr
            tid = ids.ub_tid[c.ubatch]
            L = c.launch
            torch_op = TORCH_COMM_OP[op]
            py.append(f'{{"ph": "X", "name": "{torch_op}", "pid": {ids.host_pid}, "tid": {tid}, "ts": {ts(L)}, '
                      f'"dur": 4.000, "cat": "cpu_op", "args": {{"Sequence number": -1, "Fwd thread id": 0}}}}')
            py.append(f'{{"ph": "X", "name": "Enqueue", "pid": {ids.host_pid}, "tid": {tid}, "ts": {ts(L + 1000)}, '
                      f'"dur": 1.500, "cat": "enqueue", "args": {{"correlation_id": {corr}}}}}')
            py.append(f'{{"ph": "s", "bp": "e", "name": "enqueue_to_dequeue", "id": {corr}, "pid": {ids.host_pid}, '
                      f'"tid": {tid}, "ts": {ts(L + 1000)}, "cat": "async_task_queue"}}')
            py.append(f'{{"ph": "X", "name": "Dequeue@{torch_op}", "pid": {ids.host_pid}, "tid": {ids.dequeue_tid}, '
                      f'"ts": {ts(L + 2000)}, "dur": 2.800, "cat": "dequeue", "args": {{"correlation_id": {corr}}}}}')
            py.append(f'{{"ph": "f", "bp": "e", "name": "enqueue_to_dequeue", "id": {corr}, "pid": {ids.host_pid}, '
                      f'"tid": {ids.dequeue_tid}, "ts": {ts(L + 2000)}, "cat": "async_task_queue"}}')
            api = ACL_COMM_API[op]
            h2d = (cid << 32) | 0xFFFFFFF
            dev.append((L + 3000, f'{{"name": "AscendCL@{api}", "pid": {ids.cann_pid}, "tid": {ids.dequeue_tid}, '
                                  f'"ts": {ts(L + 3000)}, "dur": 1.700, "args": {{"Thread Id": {ids.dequeue_tid}, '
                                  f'"Mode": "ACL_NN", "level": "acl", "id": "{api}", "item_id": "0", '
                                  f'"connection_id": {cid}}}, "ph": "X"}}'))
            dev.append((L + 3000, f'{{"name": "HostToDevice{h2d}", "ph": "s", "cat": "HostToDevice", "id": "{h2d}", '
                                  f'"pid": {ids.cann_pid}, "tid": {ids.dequeue_tid}, "ts": {ts(L + 3000)}}}'))
            dev.append((c.start, f'{{"name": "HostToDevice{h2d}", "ph": "f", "id": "{h2d}", "ts": {ts(c.start)}, '
                                 f'"cat": "HostToDevice", "pid": {cp}, "tid": 0, "bp": "e"}}'))
            flows.append(f'{{"ph": "s", "bp": "e", "name": "torch_to_npu", "id": {c.start}, "pid": {ids.host_pid}, '
                         f'"tid": {tid}, "ts": {ts(L)}, "cat": "async_npu"}}')
            flows.append(f'{{"ph": "f", "bp": "e", "name": "torch_to_npu", "id": {c.start}, "pid": {cp}, "tid": 0, '
                         f'"ts": {ts(c.start)}, "cat": "async_npu"}}')
        count = c.nbytes // 2
        dev.append((c.start, f'{{"name": "{c.name}", "pid": {cp}, "tid": 0, "ts": {ts(c.start)}, '
                             f'"dur": {_us_str(c.end - c.start)}, "ph": "X", "args": {{"rank_size": {p.ranks}, '
                             f'"connection_id": {cid}, "model id": 4294967295, "data_type": "BF16", '
                             f'"alg_type": "{ALG_TYPE[op]}", "count": {count}, "relay": "no", "retry": "no"}}}}'))
        tasks = c.plane_tasks()
        n_payload = sum(1 for t in tasks if t[3] == "payload")
        chunk = c.nbytes // max(n_payload, 1) // p.planes
        peer = (self.ids.rank + 1) % p.ranks
        transit_ns = wait_ns = sync_ns = 0
        seen_payload = False
        for plane in range(p.planes):
            tid = plane + 1
            stream = 100 + plane
            for name, s, e, kind in tasks:
                self.plane_task_id += 1
                d = e - s
                if kind == "payload":
                    size, trans, dtype, link = chunk, "SDMA", "BF16", "HCCS"
                    bw = round(chunk / d, 4) if d else 0.0  # bytes/ns == GB/s
                else:
                    size, trans, dtype, link, bw = 4, "LOCAL", "INVALID_TYPE", "INVALID_TYPE", 0.0
                dev.append((s, f'{{"name": "{name}", "pid": {cp}, "tid": {tid}, "ts": {ts(s)}, "dur": {_us_str(d)}, '
                               f'"ph": "X", "args": {{"notify_id": "{self.plane_task_id % 4096}", '
                               f'"duration estimated(us)": {_us_str(d)}, "stream id": {stream}, '
                               f'"task id": {self.plane_task_id}, "context id": 4294967295, "task type": "{name}", '
                               f'"src rank": {self.ids.rank}, "dst rank": {peer}, "transport type": "{trans}", '
                               f'"size(Byte)": {size}, "data type": "{dtype}", "link type": "{link}", '
                               f'"bandwidth(GB/s)": {bw}, "model id": 4294967295}}}}'))
                if plane == 0:  # msprof's communication.json reads the master plane only
                    if kind == "payload":
                        transit_ns += d
                        seen_payload = True
                    elif kind == "wait":
                        wait_ns += d
                        if not seen_payload:
                            sync_ns += d
        wait = c.start - self.comm_prev_end if self.comm_prev_end else 0
        self.comm_prev_end = c.end
        core = "COMMUNICATION" if p.cann == "new" else "HCCL"
        kd_rows.append((c.start, self._kd_row(rs.step, "N/A", "N/A", c.name, c.op_type, core, c.start,
                                              c.end - c.start, max(wait, 0))))
        elapse = c.end - c.start
        size_mb = c.nbytes / p.planes / 1e6
        section = comm_step["p2p" if c.name.startswith(P2P_PREFIXES) else "collective"]
        section[f"{c.name}@{GROUP_NAME}"] = {
            "Communication Time Info": {
                "Start Timestamp(us)": float(_us_str(c.start)),
                "Elapse Time(ms)": elapse / 1e6,
                "Transit Time(ms)": transit_ns / 1e6,
                "Wait Time(ms)": wait_ns / 1e6,
                "Synchronization Time(ms)": sync_ns / 1e6,
                "Idle Time(ms)": (elapse - transit_ns - wait_ns) / 1e6,
                "Wait Time Ratio": round(wait_ns / (wait_ns + transit_ns), 4) if wait_ns + transit_ns else 0,
                "Synchronization Time Ratio": round(sync_ns / (sync_ns + transit_ns), 4) if sync_ns + transit_ns else 0,
            },
            "Communication Bandwidth Info": {
                "RDMA": _bw(0, 0), "HCCS": _bw(size_mb, transit_ns), "PCIE": _bw(0, 0),
                "SDMA": _bw(size_mb, transit_ns), "SIO": _bw(0, 0),
            },
        }

    def _write_comm_json(self, step: int, sections: dict[str, dict[str, dict]]) -> None:
        body = {name: ({**ops, "Total Op Info": self._total_op_info(ops)} if ops else {})
                for name, ops in sections.items()}
        self.cj.write(("" if self.cj_first else ", ") + json.dumps(f"step{step}") + ": " + json.dumps(body))
        self.cj_first = False

    @staticmethod
    def _total_op_info(ops: dict[str, dict]) -> dict:
        total: dict = {"Communication Time Info": {}, "Communication Bandwidth Info": {}}
        keys = ("Elapse Time(ms)", "Transit Time(ms)", "Wait Time(ms)", "Synchronization Time(ms)", "Idle Time(ms)")
        ti = {k: sum(o["Communication Time Info"][k] for o in ops.values()) for k in keys}
        ti["Wait Time Ratio"] = round(ti["Wait Time(ms)"] / (ti["Wait Time(ms)"] + ti["Transit Time(ms)"]), 4) \
            if ti["Wait Time(ms)"] + ti["Transit Time(ms)"] else 0
        ti["Synchronization Time Ratio"] = round(ti["Synchronization Time(ms)"] / (ti["Synchronization Time(ms)"]
                                                 + ti["Transit Time(ms)"]), 4) \
            if ti["Synchronization Time(ms)"] + ti["Transit Time(ms)"] else 0
        total["Communication Time Info"] = ti
        for link in ("RDMA", "HCCS", "PCIE", "SDMA", "SIO"):
            size = sum(o["Communication Bandwidth Info"][link]["Transit Size(MB)"] for o in ops.values())
            t_ms = sum(o["Communication Bandwidth Info"][link]["Transit Time(ms)"] for o in ops.values())
            total["Communication Bandwidth Info"][link] = _bw(size, int(t_ms * 1e6))
        return total

    def write_overlap(self, step_events: list[tuple[int, int, int]]) -> None:
        """(tid, start, end) Overlap Analysis events, tid 0..3 = Computing, Communication, Not Overlapped, Free."""
        names = ("Computing", "Communication", "Communication(Not Overlapped)", "Free")
        ov, ts = self.ids.overlap_pid, self.ts
        self.emit("device", [f'{{"name": "{names[t]}", "pid": {ov}, "tid": {t}, "ts": {ts(s)}, '
                             f'"dur": {_us_str(e - s)}, "ph": "X"}}' for t, s, e in step_events])

    def finish(self, steps_truth: list[dict]) -> int:
        for f in self.parts.values():
            f.close()
        tmp = self.out / ".trace_view.json.tmp"
        with open(tmp, "wb") as out:
            out.write(b"[")
            first = True
            for s in SECTIONS:
                part = self.out / f".synth_{s}.part"
                if self.part_has[s]:
                    if not first:
                        out.write(b", ")
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, out, 8 << 20)
                    first = False
                part.unlink()
            out.write(b"]")
        os.replace(tmp, self.out / "trace_view.json")
        self.kd.close()
        os.replace(self.out / ".kernel_details.csv.part", self.out / "kernel_details.csv")
        self.cj.write("}")
        self.cj.close()
        os.replace(self.out / ".communication.json.part", self.out / "communication.json")
        self._write_step_trace(steps_truth)
        self._write_info()
        return self.events

    def _write_step_trace(self, steps_truth: list[dict]) -> None:
        hdr = STEP_TRACE_HEADER[self.p.cann]
        lines = [",".join(hdr)]
        for st in steps_truth:
            vals = [st["computing_us"], st["communication_not_overlapped_us"], st["overlapped_us"],
                    st["communication_us"], st["free_us"], st["stage_us"], st["bubble_us"],
                    st["communication_not_overlapped_exclude_receive_us"]]
            row = [str(st["step"])] + [repr(float(v)) for v in vals]
            if self.p.cann == "new":
                row = [str(self.ids.device)] + row + [repr(float(st["preparing_us"]))]
            lines.append(",".join(row))
        tmp = self.out / ".step_trace_time.csv.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.out / "step_trace_time.csv")

    def _write_info(self) -> None:
        p, ids = self.p, self.ids
        info = {
            "config": {
                "common_config": {"activities": ["ProfilerActivity.CPU", "ProfilerActivity.NPU"],
                                  "schedule": {"wait": 0, "warmup": 0, "active": p.steps, "repeat": 1, "skip_first": 0},
                                  "record_shapes": False, "profile_memory": False, "with_stack": False},
                "experimental_config": {"_profiler_level": "Level1", "_aic_metrics": "AiCoreNone",
                                        "_data_simplification": True, "_export_type": ["text"]},
            },
            "start_info": {"syscnt_enable": False, "start_monotonic": T0_NS},
            "end_info": {"collectionTimeEnd": T0_NS},
            "torch_npu_version": "2.5.1.post1" if p.cann == "new" else "2.1.0",
            "cann_version": "8.1.RC1" if p.cann == "new" else "7.0.0",
            "synthetic": {"generator": "profile_analyzer.synth", "rank": ids.rank, "note":
                          "stand-in for an Ascend NPU run: written by a simulator, not by a device"},
        }
        (self.dir / f"profiler_info_{ids.rank}.json").write_text(json.dumps(info, indent=1))
        # the keys msprof-analyze's cluster analysis reads (Megatron-style parallel sizes)
        meta = {"distributed_args": {"backend": "hccl", "rank": ids.rank, "world_size": p.ranks,
                                     "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                     "data_parallel_size": p.ranks, "context_parallel_size": 1,
                                     "expert_model_parallel_size": p.ranks}, "ENV_VARIABLES": {}}
        (self.dir / "profiler_metadata.json").write_text(json.dumps(meta, indent=1))


def _bw(size_mb: float, t_ns: int) -> dict:
    t_ms = t_ns / 1e6
    return {"Transit Size(MB)": size_mb, "Transit Time(ms)": t_ms,
            "Bandwidth(GB/s)": round(size_mb / t_ms, 4) if t_ms else 0,  # MB/ms == GB/s
            "Large Packet Ratio": 1.0 if size_mb else 0, "Size Distribution": {}}


def write_rank(p: SynthParams, rank: int, root: str | Path) -> dict:
    """Simulate all ranks, write ``rank``; return its ground truth (dict) and bookkeeping."""
    p = p.resolved()
    w = RankWriter(p, rank, Path(root))
    w.write_meta()
    ubatches = ("A", "B") if p.dbo else ("-",)
    steps_truth: list[dict] = []
    pending: tuple[RankStep, object, int] | None = None  # (step, overlap, region start)

    def flush(rs: RankStep, ov, region_start: int, region_end: int) -> None:
        free = iv_subtract([(region_start, region_end)], ov.busy)
        events = [(0, s, e) for s, e in ov.computing] + [(1, s, e) for s, e in ov.communication] + \
            [(2, s, e) for s, e in ov.not_overlapped] + [(3, s, e) for s, e in free]
        events.sort(key=lambda x: (x[1], x[0]))
        w.write_overlap(events)
        step_range = (rs.first_task_start, max(rs.device_end, rs.host_end))
        steps_truth.append(step_truth(rs, ov, free, step_range, ubatches))

    for all_ranks in simulate(p, T0_NS):
        rs = all_ranks[rank]
        w.write_step(rs)
        ov = step_overlap(rs)
        if pending is None:
            region_start = ov.span[0]
        else:
            prs, pov, pstart = pending
            flush(prs, pov, pstart, ov.busy[0][0])
            region_start = ov.busy[0][0]
        pending = (rs, ov, region_start)
    prs, pov, pstart = pending
    flush(prs, pov, pstart, pov.span[1])
    events = w.finish(steps_truth)
    trace = w.out / "trace_view.json"
    return {
        "rank": rank,
        "device_id": w.ids.device,
        "profile_dir": w.dir.name,
        "trace_view_bytes": trace.stat().st_size,
        "events": events,
        "steps": steps_truth,
        "totals": {k: us(sum(int(round(s[k] * 1000)) for s in steps_truth))
                   for k in ("computing_us", "communication_us", "communication_not_overlapped_us", "overlapped_us",
                             "free_us", "comm_wait_us")},
    }
