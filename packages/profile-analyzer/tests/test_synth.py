"""The synthetic profile generator: format fidelity and a ground truth that independent arithmetic confirms.

The checks here re-derive every figure from the written files with their own code (numpy sweeps over the
raw Ascend Hardware and Communication tasks), so a bug in the generator's own interval code shows up as a
mismatch between the profiler tracks it wrote and the raw tasks.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
from profile_analyzer.cli import main as cli_main
from profile_analyzer.synth import GroundTruth, write_profile


def _ns(ts: str | Decimal) -> int:
    """µs (a string with 3 decimals, or a number read as Decimal) -> integer ns, exactly.

    float64 cannot hold absolute µs with ns precision (about 0.25 µs resolution at 1.7e15 µs)."""
    if isinstance(ts, str):
        whole, _, frac = ts.partition(".")
        return int(whole) * 1000 + int((frac + "000")[:3])
    return int(Decimal(ts) * 1000)


def _load(rank_dir: Path) -> list[dict]:
    text = (rank_dir / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text()
    return json.loads(text, parse_float=Decimal)


def _tracks(events: list[dict]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


def _union(iv: np.ndarray) -> np.ndarray:
    """Merge an (n, 2) array of intervals with a cumulative-max sweep (independent of the generator)."""
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends = np.maximum.accumulate(iv[:, 1])
    new = np.r_[True, iv[1:, 0] > ends[:-1]]
    starts = iv[new, 0]
    idx = np.flatnonzero(new)
    return np.c_[starts, ends[np.r_[idx[1:] - 1, len(iv) - 1]]]


def _minus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a − b by a per-nanosecond-free boundary sweep: +1 inside a, −2 inside b; keep where the sum is 1."""
    pts = np.r_[a[:, 0], a[:, 1], b[:, 0], b[:, 1]]
    delta = np.r_[np.ones(len(a)), -np.ones(len(a)), -2 * np.ones(len(b)), 2 * np.ones(len(b))]
    order = np.lexsort((delta, pts))
    pts, level = pts[order], np.cumsum(delta[order])
    out = []
    for i in range(len(pts) - 1):
        if level[i] == 1 and pts[i + 1] > pts[i]:
            if out and out[-1][1] == pts[i]:
                out[-1][1] = pts[i + 1]
            else:
                out.append([pts[i], pts[i + 1]])
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _raw_sets(events: list[dict]) -> dict[str, np.ndarray]:
    """Computing / Communication / Not Overlapped / Free recomputed from the raw tasks, msprof's way."""
    procs, threads = _tracks(events)
    comp, comm, hw_all = [], [], []
    for e in events:
        if e["ph"] != "X":
            continue
        pname = procs.get(e["pid"])
        iv = (_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]))
        if pname == "Ascend Hardware":
            hw_all.append(iv)
            if not e["args"]["Task Type"].startswith("EVENT_"):
                comp.append(iv)
        elif pname in ("Communication", "HCCL") and threads[(e["pid"], e["tid"])].endswith("Communication"):
            comm.append(iv)
            hw_all.append(iv)
    comp_u = _union(np.array(comp, dtype=np.int64))
    comm_u = _union(np.array(comm, dtype=np.int64))
    busy = _union(np.r_[comp_u, comm_u])
    span = np.array([[min(s for s, _ in hw_all), max(e for _, e in hw_all)]], dtype=np.int64)
    return {"Computing": comp_u, "Communication": comm_u, "Communication(Not Overlapped)": _minus(comm_u, comp_u),
            "Free": _minus(span, busy)}


def _overlap_track(events: list[dict]) -> dict[str, np.ndarray]:
    procs, threads = _tracks(events)
    out = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and procs.get(e["pid"]) == "Overlap Analysis":
            assert e["name"] == threads[(e["pid"], e["tid"])]
            out[e["name"]].append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])))
    return {k: np.array(sorted(v), dtype=np.int64) for k, v in out.items()}


@pytest.fixture(scope="module")
def dbo_profile(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return write_profile(tmp_path_factory.mktemp("dbo"), ranks=2, steps=3, layers=4, dbo=True, exposed_layers=[2],
                         seed=3)


@pytest.fixture(scope="module")
def plain_profile(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return write_profile(tmp_path_factory.mktemp("plain"), ranks=3, steps=2, layers=3, pattern="a3", seed=1)


@pytest.mark.parametrize("which", ["dbo_profile", "plain_profile"])
def test_overlap_track_equals_recomputation_from_raw_tasks(which: str, request: pytest.FixtureRequest) -> None:
    truth: GroundTruth = request.getfixturevalue(which)
    for rank, rank_dir in truth.profile_dirs.items():
        events = _load(rank_dir)
        track, raw = _overlap_track(events), _raw_sets(events)
        for name in ("Computing", "Communication", "Communication(Not Overlapped)", "Free"):
            assert np.array_equal(track[name], raw[name]), f"rank {rank} {name}"
            # merged intervals: never overlapping or touching within a track
            assert np.all(track[name][1:, 0] > track[name][:-1, 1])
        assert len(track["Communication(Not Overlapped)"]) > 0


def _step_ranges(events: list[dict]) -> dict[int, tuple[int, int, int]]:
    """torch_npu's step range: first device task launched in ProfilerStep#N .. max(device end, step end)."""
    procs, _ = _tracks(events)
    steps = {int(e["name"].split("#")[1]): (_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]))
             for e in events if e["ph"] == "X" and e["name"].startswith("ProfilerStep#")}
    flows_s = {e["id"]: _ns(e["ts"]) for e in events if e["ph"] == "s" and e.get("cat") == "async_npu"}
    flows_f = {e["id"]: _ns(e["ts"]) for e in events if e["ph"] == "f" and e.get("cat") == "async_npu"}
    out = {}
    for n, (hs, he) in steps.items():
        dev = [flows_f[i] for i, t in flows_s.items() if hs <= t <= he]
        out[n] = (min(dev), max(he, max(dev)), hs)
    return out


@pytest.fixture(scope="module")
def pp_profile(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return write_profile(tmp_path_factory.mktemp("pp"), ranks=2, steps=2, layers=2, pp_receive_us=150, seed=4)


@pytest.mark.parametrize("which", ["dbo_profile", "pp_profile"])
def test_step_trace_time_follows_torch_npu_rules(which: str, request: pytest.FixtureRequest) -> None:
    truth: GroundTruth = request.getfixturevalue(which)
    procs_seen_receive = 0
    for rank, rank_dir in truth.profile_dirs.items():
        events = _load(rank_dir)
        ranges = _step_ranges(events)
        sums: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        first_cc: dict[int, int] = {}
        span: dict[int, list[int]] = {}
        counted = [(name, s, e) for name, iv in _overlap_track(events).items() for s, e in iv]
        counted += [("hcom_receive", _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in events
                    if e["ph"] == "X" and e["name"].startswith("hcom_receive")]
        procs_seen_receive += sum(1 for c in counted if c[0] == "hcom_receive")
        for name, s, e in counted:
            owner = [n for n, (lo, hi, _) in ranges.items() if lo <= s < hi]
            assert len(owner) == 1, f"event at {s} belongs to {owner}"
            n = owner[0]
            sums[n][name] += int(e - s)
            lo_hi = span.setdefault(n, [int(s), int(e)])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], int(s)), max(lo_hi[1], int(e))
            if name in ("Computing", "Communication"):
                first_cc[n] = min(first_cc.get(n, s), int(s))
        with open(rank_dir / "ASCEND_PROFILER_OUTPUT" / "step_trace_time.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["Step"]) for r in rows] == sorted(ranges)
        for r in rows:
            n = int(r["Step"])
            assert int(r["Device_id"]) == rank
            s = sums[n]
            assert float(r["Computing"]) == pytest.approx(s["Computing"] / 1000, abs=1e-3)
            assert float(r["Communication"]) == pytest.approx(s["Communication"] / 1000, abs=1e-3)
            assert float(r["Communication(Not Overlapped)"]) == pytest.approx(
                s["Communication(Not Overlapped)"] / 1000, abs=1e-3)
            assert float(r["Overlapped"]) == pytest.approx(
                (s["Communication"] - s["Communication(Not Overlapped)"]) / 1000, abs=1e-3)
            assert float(r["Free"]) == pytest.approx(s["Free"] / 1000, abs=1e-3)
            assert float(r["Preparing"]) == pytest.approx((first_cc[n] - ranges[n][2]) / 1000, abs=1e-3)
            bubble = s["hcom_receive"]
            assert float(r["Bubble"]) == pytest.approx(bubble / 1000, abs=1e-3)
            assert float(r["Stage"]) == pytest.approx((span[n][1] - span[n][0] - bubble) / 1000, abs=1e-3)
            assert float(r["Communication(Not Overlapped and Exclude Receive)"]) == pytest.approx(
                (s["Communication(Not Overlapped)"] - bubble) / 1000, abs=1e-3)
            gt = truth.step(rank, n)
            for key, col in (("computing_us", "Computing"), ("free_us", "Free"), ("bubble_us", "Bubble"),
                             ("stage_us", "Stage")):
                assert gt[key] == pytest.approx(float(r[col]), abs=1e-3)
    assert (procs_seen_receive > 0) == (which == "pp_profile")


def test_ground_truth_is_self_consistent(dbo_profile: GroundTruth, plain_profile: GroundTruth,
                                        pp_profile: GroundTruth) -> None:
    for truth in (dbo_profile, plain_profile, pp_profile):
        for rank in truth.ranks:
            for st in truth.steps(rank):
                exposed = sum(layer["exposed_comm_us"] for layer in st["layers"]) + sum(
                    op["exposed_us"] for op in st["comm_ops"] if op["role"] == "receive")
                # a single communication stream: per-layer exposure adds up to Communication(Not Overlapped)
                assert exposed == pytest.approx(st["communication_not_overlapped_us"], abs=0.01)
                assert st["overlapped_us"] == pytest.approx(
                    st["communication_us"] - st["communication_not_overlapped_us"], abs=1e-3)
                busy = sum(s["busy_us"] for s in st["streams"].values())
                assert busy >= st["computing_us"] - 1e-3  # streams may overlap each other, never less
    loaded = GroundTruth.load(dbo_profile.root)
    assert loaded.to_dict() == dbo_profile.to_dict()
    assert loaded.slowest_rank == 1  # the last rank is made slow by default; it waits least


def test_dbo_ping_pong_and_exposed_layer_knob(dbo_profile: GroundTruth) -> None:
    slow = dbo_profile.slowest_rank
    for st in dbo_profile.steps(slow):
        layers = {layer["layer"]: layer for layer in st["layers"]}
        assert set(layers[0]["ubatches"]) == {"A", "B"}
        # every op alternates micro-batches: A's dispatch is followed by B's
        ubs = [op["ubatch"] for op in st["comm_ops"]]
        assert ubs[:4] == ["A", "B", "A", "B"]
        # the slow rank never waits for others, so normal layers are (almost) fully hidden by the other
        # micro-batch, and the knob's layer is clearly exposed
        hidden = [min(u["covered_fraction"] for u in layers[i]["ubatches"].values()) for i in (0, 1)]
        assert min(hidden) > 0.85, hidden
        assert layers[2]["exposed_comm_us"] > 3 * max(layers[0]["exposed_comm_us"], layers[1]["exposed_comm_us"])
        assert min(u["covered_fraction"] for u in layers[2]["ubatches"].values()) < min(hidden) - 0.05


def test_plain_profile_tracks_and_files(plain_profile: GroundTruth) -> None:
    assert plain_profile.slowest_rank == 2
    for rank, rank_dir in plain_profile.profile_dirs.items():
        assert rank_dir.name.endswith("_ascend_pt")
        assert (rank_dir / f"profiler_info_{rank}.json").is_file()
        events = _load(rank_dir)
        procs, threads = _tracks(events)
        assert sorted(procs.values()) == sorted(["Python", "CANN", "Ascend Hardware", "Communication",
                                                 "Overlap Analysis"])
        names = set(threads.values())
        assert {"Stream 2", "Stream 3", "Plane 0", "Plane 1", "Computing", "Free"} <= names
        assert any(n.startswith("Group ") and n.endswith(" Communication") for n in names)
        hw = [e for e in events if e["ph"] == "X" and procs[e["pid"]] == "Ascend Hardware"]
        # the argument keys of a real Ascend Hardware task (current CANN)
        assert set(hw[0]["args"]) == {"Model Id", "Task Type", "Physic Stream Id", "Task Id", "Batch Id",
                                      "Subtask Id", "connection_id"}
        assert all(isinstance(e["ts"], str) and len(e["ts"].split(".")[1]) == 3 for e in events if "ts" in e)
        big = [e["name"] for e in events if e["ph"] == "X" and procs[e["pid"]] == "Communication"
               and threads[(e["pid"], e["tid"])].endswith("Communication")]
        assert big and all(n.startswith("hcom_alltoallv__") for n in big)
        comm_json = json.loads((rank_dir / "ASCEND_PROFILER_OUTPUT" / "communication.json").read_text())
        assert sorted(comm_json) == ["step1", "step2"]
        assert comm_json["step1"]["p2p"] == {}  # no send/receive in this profile
        ops = [k for k in comm_json["step1"]["collective"] if k != "Total Op Info"]
        assert len(ops) == len(plain_profile.step(rank, 1)["comm_ops"])
        info = comm_json["step1"]["collective"][ops[0]]["Communication Time Info"]
        assert info["Elapse Time(ms)"] == pytest.approx(
            info["Transit Time(ms)"] + info["Wait Time(ms)"] + info["Idle Time(ms)"])
        with open(rank_dir / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        n_kernels = sum(1 for e in hw if not e["args"]["Task Type"].startswith("EVENT_"))
        assert len(rows) == n_kernels + len(big)
        assert {r["Accelerator Core"] for r in rows if r["Stream ID"] == "N/A"} == {"COMMUNICATION"}
        assert rows[0]["Start Time(us)"].endswith("\t")


def test_old_cann_generation_and_format_options(tmp_path: Path) -> None:
    truth = write_profile(tmp_path, ranks=1, steps=1, layers=2, cann="old", ts_as_string=False, large_pids=True)
    rank_dir = truth.profile_dirs[0]
    events = _load(rank_dir)
    procs, _ = _tracks(events)
    assert "HCCL" in procs.values() and "Communication" not in procs.values()
    assert any(pid > 2**32 for pid in procs)
    hw = [e for e in events if e["ph"] == "X" and procs[e["pid"]] == "Ascend Hardware"]
    assert "Stream Id" in hw[0]["args"] and "Physic Stream Id" not in hw[0]["args"]
    assert all(not isinstance(e["ts"], str) for e in events if "ts" in e)
    labels = {e["args"]["labels"] for e in events if e["ph"] == "M" and e["name"] == "process_labels"}
    assert labels == {"CPU", "NPU"}
    header = (rank_dir / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv").read_text().splitlines()[0]
    assert header.startswith("Step Id,Model ID,Task ID,Stream ID,Name,Type,Accelerator Core,Start Time(us)")
    step_trace = (rank_dir / "ASCEND_PROFILER_OUTPUT" / "step_trace_time.csv").read_text().splitlines()
    assert step_trace[0].startswith("Step,Computing,") and "Preparing" not in step_trace[0]
    # numeric ts parse to the same recomputation
    track, raw = _overlap_track(events), _raw_sets(events)
    assert np.array_equal(track["Communication(Not Overlapped)"], raw["Communication(Not Overlapped)"])


def test_deterministic_and_parallel_equals_serial(tmp_path: Path) -> None:
    a = write_profile(tmp_path / "a", ranks=2, steps=1, layers=2, dbo=True, seed=7, workers=1)
    b = write_profile(tmp_path / "b", ranks=2, steps=1, layers=2, dbo=True, seed=7, workers=2)

    def digest(t: GroundTruth) -> list[str]:
        return [hashlib.sha256((t.profile_dirs[r] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_bytes())
                .hexdigest() for r in sorted(t.profile_dirs)]

    assert digest(a) == digest(b)
    c = write_profile(tmp_path / "c", ranks=2, steps=1, layers=2, dbo=True, seed=8)
    assert digest(c) != digest(a)


def test_cli_writes_profile_and_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p"
    assert cli_main(["synth", str(out), "--ranks", "2", "--steps", "1", "--layers", "2", "--dbo",
                     "--exposed-layers", "1", "--cann", "old"]) == 0
    truth = GroundTruth.load(out)
    assert truth.params["exposed_layers"] == [1] and truth.params["comm_process_name"] == "HCCL"
    assert len(list(out.glob("*_ascend_pt"))) == 2
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert cli_main(["synth", str(bad), "--ranks", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ranks" in err[0]
    assert not bad.exists() or not any(bad.iterdir())


def test_pipeline_receive_goes_to_p2p_and_bubble(pp_profile: GroundTruth) -> None:
    for rank, rank_dir in pp_profile.profile_dirs.items():
        comm_json = json.loads((rank_dir / "ASCEND_PROFILER_OUTPUT" / "communication.json").read_text())
        p2p = [k for k in comm_json["step1"]["p2p"] if k != "Total Op Info"]
        assert len(p2p) == 1 and p2p[0].startswith("hcom_receive__")
        assert not any(k.startswith("hcom_receive") for k in comm_json["step1"]["collective"])
        st = pp_profile.step(rank, 1)
        assert st["bubble_us"] >= 150 * 0.9
        assert st["communication_not_overlapped_exclude_receive_us"] == pytest.approx(
            st["communication_not_overlapped_us"] - st["bubble_us"], abs=1e-3)
