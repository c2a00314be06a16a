"""Kineto traces: overlap equals HTA's |comm ∩ comp| / |comm|.

Two hand-built traces with ground truth by construction (a CUDA-style one with NCCL kernels and a CPU one
with ubatch ranges), and a real torch.profiler trace of two gloo processes on this machine's CPU.
"""

from __future__ import annotations

import gzip
import json
import os
import socket

import profile_analyzer as pa
import pytest


def _gpu_trace(rank: int, shift: int) -> dict:
    """Compute kernels on stream 7, NCCL kernels on stream 20; two ProfilerSteps with launches."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 100, "tid": 1, "ts": 0, "dur": 400},
          {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#2", "pid": 100, "tid": 1, "ts": 400, "dur": 400}]
    comp = [(10, 110), (120, 200), (450, 600)]
    comm = [(100, 160 + shift), (300, 350), (590, 700)]
    corr = 0
    for s, e in comp:
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1, "ts": s - 5, "dur": 2,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": "void gemm_kernel<float>", "pid": 0, "tid": 7, "ts": s, "dur": e - s,
                   "args": {"stream": 7, "correlation": corr, "device": 0}})
    for s, e in comm:
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1, "ts": s - 5, "dur": 2,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                   "pid": 0, "tid": 20, "ts": s, "dur": e - s, "args": {"stream": 20, "correlation": corr, "device": 0}})
    ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7, "ts": 380,
               "dur": 10, "args": {"stream": 7, "correlation": 999}})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}, "traceEvents": ev}


def test_gpu_trace_overlap_is_hta_definition(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    (d / "b_rank0.json").write_text(json.dumps(_gpu_trace(0, 0)))
    with gzip.open(d / "a_rank1.json.gz", "wt") as f:
        json.dump(_gpu_trace(1, 20), f)
    tl = pa.load(d)
    assert sorted(tl.ranks) == [0, 1]  # from distributedInfo, not file order
    rep = pa.analyze(tl).to_dict()
    rows = {(r["rank"], r["step"]): r for r in rep["breakdown"]}
    # rank 0, step 1: comm (100,160) ∪ (300,350) = 110 µs; comp (10,110) ∪ (120,200) covers 10 + 40 of it
    r = rows[(0, 1)]
    assert (r["communication"], r["overlapped"], r["communication_not_overlapped"]) == (110.0, 50.0, 60.0)
    assert r["overlap_pct"] == pytest.approx(100 * 50 / 110)
    # step 2: comm (590,700) = 110, comp (450,600) covers 10; memcpy is neither compute nor communication
    r = rows[(0, 2)]
    assert (r["communication"], r["overlapped"], r["computing"]) == (110.0, 10.0, 150.0)
    # rank 1's first collective is 20 µs longer: it arrived first and waited; rank 0 made it wait
    assert rows[(1, 1)]["communication"] == 130.0
    assert rep["ranks"]["waited_for_rank"] == 0
    # rank 1: (100,180) is covered 10 + 60 by compute
    assert rows[(1, 1)]["overlapped"] == 70.0
    assert rep["summary"]["overlap_pct"] == pytest.approx(100 * (50 + 10 + 70 + 10) / (110 + 110 + 130 + 110))
    # idle gaps on the compute stream of rank 0: 110..120 (next kernel launched at 115: 5 µs host-bound),
    # 200..380 (ends at a memcpy with no known launch), 390..450 (next kernel launched at 445: 55 µs)
    g = next(x for x in rep["idle_gaps"] if x["rank"] == 0)["per_stream"][0]
    assert (g["gaps"], g["idle_us"], g["host_bound_us"]) == (3, 250.0, 60.0)


def _cpu_dbo_trace() -> dict:
    """Two threads, one per micro-batch, each inside a 'ubatch<N>' range: ubatch0's all_reduce (30..60) runs
    while ubatch1 computes 20..50; ubatch1's all_reduce (70..100) runs while ubatch0 computes 60..90."""
    ev = []

    def x(name, tid, s, e, cat="cpu_op"):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": s, "dur": e - s})

    x("ubatch0", 11, 0, 100, "user_annotation")
    x("aten::mm", 11, 0, 30)
    x("c10d::allreduce_", 11, 30, 60)
    x("aten::copy_", 11, 35, 40)  # the collective's own copy: not compute
    x("aten::mm", 11, 60, 90)
    x("ubatch1", 12, 0, 110, "user_annotation")
    x("aten::mm", 12, 20, 50)
    x("c10d::allreduce_", 12, 70, 100)
    x("aten::add", 12, 100, 110)
    return {"traceEvents": ev}


def test_cpu_trace_dual_batch_markers(tmp_path):
    p = tmp_path / "dbo.json"
    p.write_text(json.dumps(_cpu_dbo_trace()))
    rep = pa.analyze(pa.load(p)).to_dict()
    r = rep["breakdown"][0]
    assert r["communication"] == 60.0 and r["overlapped"] == 40.0  # comp ∪ = 0..50, 60..90, 100..110
    db = rep["dual_batch"][0]
    assert db["detected"] and db["method"] == "markers"
    by_ub = {u["ubatch"]: u for u in db["ubatches"]}
    assert by_ub[0]["covered_us"] == 20.0  # 30..50 under ubatch1's aten::mm
    assert by_ub[1]["covered_us"] == 20.0  # 70..90 under ubatch0's aten::mm
    assert any(w["missing"].startswith("device") for w in rep["warnings"])
    ex = rep["exposed_communication"][0]
    assert ex["exposed_us"] == 20.0  # 50..60 and 90..100
    assert sum(r["exposed_us"] for r in ex["by_operator"]) == ex["exposed_us"]  # nothing charged twice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    a = torch.randn(256, 256)
    path = os.path.join(out, f"rank{rank}.json")
    with profile(activities=[ProfilerActivity.CPU], schedule=torch.profiler.schedule(wait=0, warmup=1, active=2),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(3):
            with record_function("layer"):
                b = a @ a
                t = torch.ones(1 << 16) * rank
                dist.all_reduce(t)
                work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
                c = b @ a
                work.wait()
                del c
            prof.step()
    dist.destroy_process_group()


def _merge(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


@pytest.mark.timeout(120)
def test_real_gloo_trace_overlap_equals_hta_formula(tmp_path):
    torch = pytest.importorskip("torch")
    mp = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [mp.Process(target=_gloo_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("gloo worker did not finish within 90 s")
        assert p.exitcode == 0
    tl = pa.load(tmp_path)
    assert sorted(tl.ranks) == [0, 1]
    rep = pa.analyze(tl).to_dict()
    from profile_analyzer.loaders.kineto import COMM_RANGE

    for rank in (0, 1):
        # independent recomputation from the raw JSON, by the documented rule, in µs floats
        ev = json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]
        xs = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
        comm = [(e["tid"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in xs if COMM_RANGE.search(e["name"])]
        assert comm, "the trace has gloo collectives"
        comp = []
        for e in xs:
            if e["name"].startswith("aten::") and not COMM_RANGE.search(e["name"]):
                s, f = float(e["ts"]), float(e["ts"]) + float(e["dur"])
                if not any(t == e["tid"] and cs <= s and f <= ce for t, cs, ce in comm):
                    comp.append((e["tid"], s, f))
        # a thread with more communication than compute is a backend thread (its aten ops are bookkeeping),
        # except the one carrying the ProfilerStep ranges
        step_tids = {e["tid"] for e in xs if e["name"].startswith("ProfilerStep#")}

        def busy(iv):
            return sum(e - s for s, e in _merge(iv))

        backend = {t for t, _, _ in comm if t not in step_tids
                   and busy([(s, e) for u, s, e in comm if u == t]) > busy([(s, e) for u, s, e in comp if u == t])}
        comp = [(s, f) for t, s, f in comp if t not in backend]
        cm = _merge([(s, e) for _, s, e in comm])
        cp = _merge(comp)
        inter = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in cm for s2, e2 in cp)
        total = sum(e - s for s, e in cm)
        rows = [r for r in rep["breakdown"] if r["rank"] == rank]
        assert len(rows) == 2  # two active ProfilerSteps
        spans = [(r["t0_ns"] / 1000 + r["start_us"], r["t0_ns"] / 1000 + r["end_us"]) for r in rows]
        # merged communication intervals are counted in the step where they start (msprof/torch_npu rule)
        cm_in = [(s, e) for s, e in cm if any(lo <= s < hi for lo, hi in spans)]
        total = sum(e - s for s, e in cm_in)
        inter = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in cm_in for s2, e2 in cp)
        ours_comm = sum(r["communication"] for r in rows)
        ours_ov = sum(r["overlapped"] for r in rows)
        assert total > 0 and ours_comm == pytest.approx(total, abs=0.05)  # JSON µs floats are only ns-accurate
        # HTA: comp_comm_overlap_pctg = 100 · |comm ∩ comp| / |comm|
        assert 100 * ours_ov / ours_comm == pytest.approx(100 * inter / total, abs=0.05)


def test_gpu_dual_batch_from_gpu_annotations(tmp_path):
    """ubatch ranges recorded on the GPU streams (gpu_user_annotation) mark the kernels under them."""
    ev = []

    def k(name, stream, s, e, cat="kernel"):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": s, "dur": e - s, "args": {"stream": stream}})

    for i, (s, e) in enumerate([(0, 50), (50, 100), (100, 150), (150, 200)]):
        k("gemm", 7, s, e)
        k(f"ubatch{i % 2}", 7, s, e, "gpu_user_annotation")
    k("ncclDevKernel_AllGather", 20, 50, 90)
    k("ubatch0", 20, 50, 90, "gpu_user_annotation")
    k("ncclDevKernel_ReduceScatter", 20, 100, 160)
    k("ubatch1", 20, 100, 160, "gpu_user_annotation")
    p = tmp_path / "gpu_dbo.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    rep = pa.analyze(pa.load(p)).to_dict()
    db = rep["dual_batch"][0]
    assert db["detected"] and db["method"] == "markers"
    by_ub = {u["ubatch"]: u for u in db["ubatches"]}
    assert (by_ub[0]["comm_us"], by_ub[0]["covered_us"]) == (40.0, 40.0)
    assert (by_ub[1]["comm_us"], by_ub[1]["covered_us"]) == (60.0, 50.0)  # 150..160 is its own compute
    # annotations are markers, not work: stream 7 is busy exactly its kernels' time
    s7 = next(s for s in rep["streams"] if s["stream"] == "stream 7")
    assert s7["busy_us"] == 200.0 and s7["tasks"] == 4


def test_dual_batch_two_alternating_comm_streams(tmp_path):
    """No markers: collectives alternate between streams 20 and 21 -> one stream per micro-batch."""
    ev = []

    def k(name, stream, s, e):
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": s, "dur": e - s, "args": {"stream": stream}})

    for i in range(4):
        base = i * 100
        k("gemm", 7, base, base + 60)
        k("ncclDevKernel_AllToAll", 20 + i % 2, base + 40, base + 90)  # 20 µs under compute, 30 exposed
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    db = pa.analyze(pa.load(p)).to_dict()["dual_batch"][0]
    assert db["detected"] and db["method"] == "two_comm_streams"
    assert [(u["comm_ops"], u["comm_us"], u["covered_us"]) for u in db["ubatches"]] == [(2, 100.0, 40.0), (2, 100.0, 40.0)]
    assert [x["layer"] for x in db["layers"] if x["ubatch"] == 0] == [0, 1]


def _hta_overlap(events: list[dict], spans: list[tuple[float, float]]) -> tuple[float, float]:
    """HTA's comm/comp overlap from raw events, written independently of the package: NCCL kernels are
    communication (HTA's regex), other non-memory GPU kernels computation; each set merged; communication
    counted in the step where a merged interval starts."""
    import re

    comm_re = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
    gpu = [e for e in events if e.get("ph") == "X" and "stream" in (e.get("args") or {})
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm = _merge([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu if comm_re.match(e["name"])])
    comp = _merge([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu
                   if not comm_re.match(e["name"]) and e["cat"] == "kernel"])
    comm = [(s, e) for s, e in comm if any(lo <= s < hi for lo, hi in spans)]
    inter = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in comp)
    return sum(e - s for s, e in comm), inter


def test_real_cuda_nccl_trace_matches_hta(tmp_path):
    """Two ranks of a real 128-rank NCCL job (HTA's own test data)."""
    from pathlib import Path

    data = Path(__file__).parent / "data" / "hta-kineto"
    tl = pa.load(data)
    assert tl.format == "multi_rank" and sorted(tl.ranks) == [0, 1]
    rep = pa.analyze(tl).to_dict()
    for rank in (0, 1):
        with gzip.open(data / f"sampled_rank-{rank}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        rows = [r for r in rep["breakdown"] if r["rank"] == rank]
        assert [r["step"] for r in rows] == [551, 552]
        spans = [(r["t0_ns"] / 1000 + r["start_us"], r["t0_ns"] / 1000 + r["end_us"]) for r in rows]
        comm, inter = _hta_overlap(events, spans)
        assert sum(r["communication"] for r in rows) == pytest.approx(comm, abs=1e-6)
        assert sum(r["overlapped"] for r in rows) == pytest.approx(inter, abs=1e-6)
    # one collective repeated back to back is not a dual-batch ping-pong
    assert all(not d["detected"] for d in rep["dual_batch"])
    assert {r["operator"] for ex in rep["exposed_communication"] for r in ex["by_operator"]} == {
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"}


def test_cpu_dbo_runtime_span_conventions(tmp_path):
    """The span names dbo-runtime writes (dbo.ubatch<i>.compute.layer<L>, a short launch span on the
    micro-batch thread, the collective's span on a communication thread, gloo's own ranges on its worker
    thread): the launch and transfer of one collective are merged, unmarked backend ranges are left out,
    layers come from the names, and exposed time is attributed to the named compute region before it."""
    ev = []

    def x(name, tid, s, e, cat="user_annotation"):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": s, "dur": e - s})

    x("dbo.ubatch0.compute.layer0", 11, 0, 100)
    x("aten::mm", 11, 0, 100, "cpu_op")
    x("dbo.ubatch0.launch.all_gather.layer0", 11, 100, 105)
    x("c10d::allgather_", 11, 100, 104, "cpu_op")
    x("dbo.ubatch0.compute.layer1", 11, 200, 300)
    x("aten::mm", 11, 200, 300, "cpu_op")
    x("dbo.ubatch1.compute.layer0", 12, 100, 200)
    x("aten::mm", 12, 100, 200, "cpu_op")
    x("dbo.ubatch1.launch.all_gather.layer0", 12, 200, 205)
    x("c10d::allgather_", 12, 200, 204, "cpu_op")
    x("dbo.ubatch0.comm.all_gather.layer0", 20, 105, 190)
    x("dbo.ubatch1.comm.all_gather.layer0", 20, 205, 320)
    x("gloo:all_gather", 30, 106, 185, "cpu_op")
    x("gloo:all_gather", 30, 206, 318, "cpu_op")
    p = tmp_path / "rank0.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    rep = pa.analyze(pa.load(p)).to_dict()
    (r,) = rep["breakdown"]
    assert (r["computing"], r["communication"], r["overlapped"], r["communication_not_overlapped"]) == (300.0, 210.0, 190.0, 20.0)
    db = rep["dual_batch"][0]
    assert db["detected"] and db["method"] == "markers"
    assert [(x["ubatch"], x["layer"], x["comm_us"], x["covered_us"]) for x in db["layers"]] == [(0, 0, 90.0, 90.0), (1, 0, 120.0, 100.0)]
    ex = rep["exposed_communication"][0]
    assert [(g["preceding_compute"], g["exposed_us"]) for g in ex["by_preceding_compute"] if g["exposed_us"]] == [
        ("dbo.ubatch1.compute.layer0", 20.0)]


def test_cpu_compute_spans_win_over_a_thread_that_mostly_waits(tmp_path):
    """A micro-batch thread whose collective ranges outlast its aten ops (it launched a long synchronous
    collective) would count as a communication thread; aten ops inside its explicit
    ``dbo.<ubatch>.compute.*`` spans are compute all the same. Aten ops inside the collective's own range are
    not, span or no span; aten ops on such a thread outside any compute span stay bookkeeping."""
    ev = []

    def x(name, tid, s, e, cat="user_annotation"):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": s, "dur": e - s})

    x("dbo.ubatch0.compute.layer0", 11, 0, 50)
    x("aten::mm", 11, 0, 50, "cpu_op")
    x("c10d::allreduce_", 11, 50, 250, "cpu_op")  # 200 of communication vs 50 of compute on this thread
    x("aten::copy_", 11, 60, 70, "cpu_op")  # the collective's own copy: inside its range
    x("aten::empty", 11, 260, 262, "cpu_op")  # outside any span: bookkeeping
    x("dbo.ubatch1.compute.layer0", 12, 50, 150)
    x("aten::mm", 12, 50, 150, "cpu_op")
    p = tmp_path / "rank0.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    tl = pa.load(p)
    (r,) = pa.analyze(tl).to_dict()["breakdown"]
    # compute = [0, 50) on thread 11 and [50, 150) on thread 12; communication = [50, 250)
    assert (r["computing"], r["communication"], r["overlapped"], r["communication_not_overlapped"]) == (150.0, 200.0, 100.0, 100.0)
    # without the span the first thread's mm would not count: the same trace with the span renamed
    for e in ev:
        if e["name"] == "dbo.ubatch0.compute.layer0":
            e["name"] = "my_region"
    p.write_text(json.dumps({"traceEvents": ev}))
    (r,) = pa.analyze(pa.load(p)).to_dict()["breakdown"]
    assert r["computing"] == 100.0


def test_cpu_main_thread_waiting_long_in_a_collective_keeps_its_compute(tmp_path):
    """A rank that waits for a slower one spends longer in its synchronous all_reduce than in its matmuls (seen in
    CI on the real gloo trace above under load): the thread carrying the ProfilerStep ranges is the model's, so its
    aten ops stay compute. A gloo worker thread that mostly communicates still does not count its aten ops."""
    ev = []

    def x(name, tid, s, e, cat="cpu_op"):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": s, "dur": e - s})

    x("ProfilerStep#1", 1, 0, 1000, "user_annotation")
    x("aten::mm", 1, 0, 100)
    x("c10d::allreduce_", 1, 100, 700)  # blocked waiting for the other rank
    x("aten::mm", 1, 700, 800)
    x("gloo:all_reduce", 2, 650, 900)  # the async collective on gloo's worker thread, under the second mm
    x("aten::empty", 2, 880, 890)  # the collective's own bookkeeping, inside its range
    x("aten::zeros", 2, 950, 960)  # on the worker thread, outside its collective: still not model compute
    p = tmp_path / "rank0.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    (r,) = pa.analyze(pa.load(p)).to_dict()["breakdown"]
    # compute = [0, 100) + [700, 800); communication = [100, 900)
    assert (r["computing"], r["communication"], r["overlapped"]) == (200.0, 800.0, 100.0)
