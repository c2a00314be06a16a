"""Multi-rank profiles from the repo's generator (profile_analyzer.synth, a stand-in for an NPU run) whose
ground truth is known by construction; the analyzer recomputes everything from raw tasks."""

from __future__ import annotations

import json
import shutil

import profile_analyzer as pa
import pytest

synth = pytest.importorskip("profile_analyzer.synth")

ITEMS = ("computing", "communication", "communication_not_overlapped", "overlapped", "free", "stage", "bubble",
         "communication_not_overlapped_exclude_receive", "preparing")


@pytest.fixture(scope="module")
def dbo_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("dbo")
    gt = synth.write_profile(out, ranks=2, steps=2, layers=4, dbo=True, exposed_layers=(3,))
    return out, json.loads(gt.path.read_text())


@pytest.mark.parametrize("cann", ["new", "old"])
def test_breakdown_matches_ground_truth_and_profiler(tmp_path, cann):
    gt = synth.write_profile(tmp_path, ranks=2, steps=2, layers=3, dbo=False, cann=cann, large_pids=True)
    truth = json.loads(gt.path.read_text())
    tl = pa.load(tmp_path)
    assert tl.format == "multi_rank" and sorted(tl.ranks) == [0, 1]
    rep = pa.analyze(tl).to_dict()
    for row in rep["breakdown"]:
        t = next(s for s in truth["ranks"][str(row["rank"])]["steps"] if s["step"] == row["step"])
        for k in ITEMS:
            assert row[k] == pytest.approx(t[f"{k}_us"], abs=1e-3), (cann, row["rank"], row["step"], k)
    # both profiler-written references agree to 1 µs per step and item
    sources = {a["source"] for a in rep["profiler_agreement"]}
    assert sources == {"overlap_analysis_track", "step_trace_time.csv", "communication.json"}
    assert max(abs(a["delta_us"]) for a in rep["profiler_agreement"]) < 1.0
    assert all(d["detected"] is False and "no ping-pong" in d["reason"] for d in rep["dual_batch"])


def test_numeric_ts_profile_is_exact(tmp_path):
    # ts written as JSON numbers (as Kineto does): decoding them through float64 put items up to ~1 µs off
    gt = synth.write_profile(tmp_path, ranks=2, steps=2, layers=3, dbo=False, ts_as_string=False, large_pids=True)
    truth = json.loads(gt.path.read_text())
    text = (gt.profile_dirs[0] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text()
    assert '"ts":"' not in text.replace(" ", "") and '"ts":' in text.replace(" ", "")
    rep = pa.analyze(pa.load(tmp_path)).to_dict()
    assert len(rep["breakdown"]) == 4
    for row in rep["breakdown"]:
        t = next(s for s in truth["ranks"][str(row["rank"])]["steps"] if s["step"] == row["step"])
        for k in ITEMS:
            assert row[k] == pytest.approx(t[f"{k}_us"], abs=1e-3), (row["rank"], row["step"], k)
    track = [a for a in rep["profiler_agreement"] if a["source"] == "overlap_analysis_track"]
    assert {a["item"] for a in track} >= {"communication_not_overlapped", "free"}
    assert max(abs(a["delta_us"]) for a in track) < 1e-3


def test_dual_batch_per_layer_coverage(dbo_profile):
    root, truth = dbo_profile
    rep = pa.analyze(pa.load(root), step=1).to_dict()
    for db in rep["dual_batch"]:
        assert db["detected"], db["reason"]
        t_layers = next(s for s in truth["ranks"][str(db["rank"])]["steps"] if s["step"] == 1)["layers"]
        for tl in t_layers:
            for u, name in ((0, "A"), (1, "B")):
                ours = [x for x in db["layers"] if x["layer"] == tl["layer"] and x["ubatch"] == u]
                assert sum(x["comm_us"] for x in ours) == pytest.approx(tl["ubatches"][name]["comm_us"], abs=1e-3)
                assert sum(x["covered_us"] for x in ours) == pytest.approx(tl["ubatches"][name]["covered_by_other_us"], abs=1e-3)
    # the deliberately exposed layer is the worst-covered one on the slow-to-hide rank
    db0 = rep["dual_batch"][0]
    per_layer = {}
    for x in db0["layers"]:
        per_layer.setdefault(x["layer"], []).append(x["covered_pct"])
    assert min(per_layer, key=lambda k: min(per_layer[k])) == 3


def test_rank_wait_and_slow_rank(dbo_profile):
    root, truth = dbo_profile
    rep = pa.analyze(pa.load(root)).to_dict()
    rk = rep["ranks"]
    slow = truth["params"]["slow_rank"]
    assert rk["slowest_rank"] == slow and rk["waited_for_rank"] == slow
    for r in rk["per_rank"]:
        t = sum(s["comm_wait_us"] for s in truth["ranks"][str(r["rank"])]["steps"])
        assert r["sync_wait_us"] == pytest.approx(t, abs=1e-3)


def test_exposed_communication_and_streams(dbo_profile):
    root, truth = dbo_profile
    rep = pa.analyze(pa.load(root), rank=0, step=2).to_dict()
    t = next(s for s in truth["ranks"]["0"]["steps"] if s["step"] == 2)
    ex = rep["exposed_communication"][0]
    assert ex["exposed_us"] == pytest.approx(t["communication_not_overlapped_us"], abs=1e-3)
    assert sum(r["exposed_us"] for r in ex["by_operator"]) >= ex["exposed_us"] - 1e-3
    assert ex["worst_gaps"] and ex["worst_gaps"][0]["comm_op"].startswith("hcom_")
    for name, st in t["streams"].items():
        ours = next(s for s in rep["streams"] if s["stream"] == name)
        assert ours["compute_us"] == pytest.approx(st["busy_us"], abs=1e-3)
    assert rep["timeline"] and rep["timeline"][0]["lanes"]


def test_plain_msprof_sliced_files(dbo_profile, tmp_path):
    """The same rank's events as a PROF_* directory with two sliced msprof files: same device figures."""
    root, truth = dbo_profile
    rank_dir = next(p for p in root.iterdir() if p.is_dir() and (p / "profiler_info_0.json").exists())
    events = json.loads((rank_dir / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    out = tmp_path / "PROF_000001_20251130000000_ABC" / "mindstudio_profiler_output"
    out.mkdir(parents=True)
    half = len(events) // 2
    (out / "msprof_slice_0_20251130000000.json").write_text(json.dumps(events[:half]))
    (out / "msprof_slice_1_20251130000000.json").write_text(json.dumps(events[half:]))
    tl = pa.load(out.parent)
    assert tl.format == "msprof"
    rep = pa.analyze(tl).to_dict()
    assert sum(r["computing"] for r in rep["breakdown"]) == pytest.approx(
        sum(s["computing_us"] for s in truth["ranks"]["0"]["steps"]), abs=1e-3)


def test_mixed_formats_refused(dbo_profile, tmp_path):
    root, _ = dbo_profile
    mixed = tmp_path / "mixed"
    shutil.copytree(root, mixed)
    (mixed / "rank9.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1, "pid": 0, "tid": 7,
                                                                    "cat": "kernel", "args": {"stream": 7}}]}))
    with pytest.raises(pa.ProfileError, match="mixed formats"):
        pa.load(mixed)


def test_plain_msprof_without_framework_events(dbo_profile, tmp_path):
    """msprof output has no torch host events: one pseudo-step over the capture, with a warning; an
    *_ascend_pt directory that was never post-processed (no ASCEND_PROFILER_OUTPUT) falls back to its PROF_*."""
    root, truth = dbo_profile
    rank_dir = next(p for p in root.iterdir() if p.is_dir() and (p / "profiler_info_0.json").exists())
    events = json.loads((rank_dir / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    cpu_pids = {e["pid"] for e in events if e.get("name") == "process_labels" and e["args"]["labels"] == "CPU"}
    device_only = [e for e in events if e.get("pid") not in cpu_pids]
    out = tmp_path / "w_ascend_pt" / "PROF_000001_20251130000000_ABC" / "mindstudio_profiler_output"
    out.mkdir(parents=True)
    (out / "msprof_20251130000000.json").write_text(json.dumps(device_only))
    for path, fmt in ((out.parent, "msprof"), (out.parent.parent, "torch_npu")):
        tl = pa.load(path)
        assert tl.format == fmt
        rep = pa.analyze(tl).to_dict()
        assert [r["step"] for r in rep["breakdown"]] == [None]
        steps = truth["ranks"]["0"]["steps"]
        assert rep["breakdown"][0]["computing"] == pytest.approx(sum(s["computing_us"] for s in steps), abs=1e-3)
        assert rep["breakdown"][0]["communication"] == pytest.approx(sum(s["communication_us"] for s in steps), abs=1e-3)
        assert any("ProfilerStep" in w["missing"] or "trace_view" in w["missing"] for w in rep["warnings"])


def test_parallel_load_equals_sequential(dbo_profile):
    root, _ = dbo_profile
    a = pa.load(root)
    b = pa.load(root, workers=2)
    assert sorted(a.ranks) == sorted(b.ranks) == [0, 1]
    for r in a.ranks:
        assert a.ranks[r].start_ns.tolist() == b.ranks[r].start_ns.tolist()
        assert a.ranks[r].kind.tolist() == b.ranks[r].kind.tolist()
    assert pa.analyze(a).to_dict()["breakdown"] == pa.analyze(b).to_dict()["breakdown"]


def test_load_and_analyze_in_workers_equals_load_then_analyze(dbo_profile):
    """The api's pool loads each rank and analyses it in the worker; the loader itself only loads (its Timeline
    carries no analysis results)."""
    root, _ = dbo_profile
    whole = pa.analyze(pa.load(root)).to_dict()
    tl, rep = pa.load_and_analyze(root, jobs=2)
    assert not hasattr(tl, "per_rank_results")
    got = rep.to_dict()
    assert got["breakdown"] == whole["breakdown"] and got["dual_batch"] == whole["dual_batch"]
    assert got["summary"] == whole["summary"]
    _, one = pa.load_and_analyze(root, jobs=2, rank=1)
    assert [r["rank"] for r in one.to_dict()["breakdown"]] == [1] * len([r for r in whole["breakdown"] if r["rank"] == 1])


def test_ranks_one_level_down(dbo_profile, tmp_path):
    """A folder per node, each holding its ranks' *_ascend_pt directories."""
    root, _ = dbo_profile
    for i, d in enumerate(sorted(p for p in root.iterdir() if p.is_dir())):
        shutil.copytree(d, tmp_path / f"node{i}" / d.name)
    tl = pa.load(tmp_path)
    assert sorted(tl.ranks) == [0, 1] and tl.format == "multi_rank"


def test_exposed_grouping_matches_ground_truth(dbo_profile):
    """Per operator kind and per preceding compute operator, exposed time equals the generator's per-op truth."""
    root, truth = dbo_profile
    rep = pa.analyze(pa.load(root), rank=1, step=1).to_dict()
    ops = next(s for s in truth["ranks"]["1"]["steps"] if s["step"] == 1)["comm_ops"]
    ex = rep["exposed_communication"][0]
    by_kind: dict[str, float] = {}
    by_prev: dict[str, float] = {}
    for o in ops:
        by_kind[o["type"].rstrip("_")] = by_kind.get(o["type"].rstrip("_"), 0.0) + o["exposed_us"]
        by_prev[o["compute_before"]] = by_prev.get(o["compute_before"], 0.0) + o["exposed_us"]
    assert {r["operator"]: pytest.approx(r["exposed_us"], abs=1e-3) for r in ex["by_operator"]} == by_kind
    ours_prev = {}
    for r in ex["by_preceding_compute"]:
        name = r["preceding_compute"].split(" (")[-1].rstrip(")")  # "Type (kernel name)" when typed
        ours_prev[name] = ours_prev.get(name, 0.0) + r["exposed_us"]
    assert ours_prev == {k: pytest.approx(v, abs=1e-3) for k, v in by_prev.items()}


def test_progress_callback(dbo_profile):
    root, _ = dbo_profile
    ranks_seen: list[tuple[int, int, str]] = []
    pa.load(root, progress=lambda d, t, label: ranks_seen.append((d, t, label)))
    assert [(d, t) for d, t, _ in ranks_seen] == [(1, 2), (2, 2)]
    one = next(p for p in root.iterdir() if p.is_dir())
    bytes_seen: list[tuple[int, int, str]] = []
    pa.load(one, progress=lambda d, t, label: bytes_seen.append((d, t, label)))
    size = (one / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").stat().st_size
    assert (size, size, "trace_view.json") in bytes_seen  # bytes read, then one rank done


def _device_events(rank_dir):
    events = json.loads((rank_dir / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    cpu_pids = {e["pid"] for e in events if e.get("name") == "process_labels" and e["args"]["labels"] == "CPU"}
    return [e for e in events if e.get("pid") not in cpu_pids]


@pytest.mark.parametrize("fmt", ["msprof", "torch_npu"])
def test_one_trace_holding_two_npus_is_two_ranks(dbo_profile, tmp_path, fmt):
    """One process driving two NPUs writes both devices' processes into one trace, told apart by their
    'NPU <id>' labels: each device is analysed on its own, with the figures of that device alone."""
    root, truth = dbo_profile
    rank_dirs = sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith("_ascend_pt"))
    per_device = [_device_events(d) for d in rank_dirs]
    labels = {e["args"]["labels"] for ev in per_device for e in ev if e.get("name") == "process_labels"}
    assert labels == {"NPU 0", "NPU 1"}
    if fmt == "msprof":
        out = tmp_path / "PROF_000001_20251130000000_ABC" / "mindstudio_profiler_output"
        out.mkdir(parents=True)
        (out / "msprof_20251130000000.json").write_text(json.dumps(per_device[0] + per_device[1]))
        path = out.parent
    else:  # a trace_view.json with the host events of the first process and both devices
        events = json.loads((rank_dirs[0] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
        path = tmp_path / "two_npu_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
        path.mkdir(parents=True)
        (path / "trace_view.json").write_text(json.dumps(events + per_device[1]))
    tl = pa.load(path)
    assert sorted(tl.ranks) == [0, 1] and tl.format == "multi_rank"
    rep = pa.analyze(tl).to_dict()
    for r in (0, 1):
        steps = truth["ranks"][str(r)]["steps"]
        rows = [x for x in rep["breakdown"] if x["rank"] == r]
        for k in ("computing", "communication", "communication_not_overlapped"):
            assert sum(x[k] for x in rows) == pytest.approx(sum(s[f"{k}_us"] for s in steps), abs=1e-3), (fmt, r, k)
        assert tl.ranks[r].device_id == r
        # only its own device's streams
        assert {s.label for s in tl.ranks[r].streams if s.kind != "host"} == {
            s.label for s in pa.load(rank_dirs[r]).ranks[r].streams if s.kind != "host"}
    # the profiler's own Overlap Analysis track of each device agrees with ours
    track = [a for a in rep["profiler_agreement"] if a["source"] == "overlap_analysis_track"]
    assert {a["rank"] for a in track} == {0, 1} and max(abs(a["delta_us"]) for a in track) < 1.0


def test_two_hardware_processes_without_device_ids_warn(tmp_path):
    """Older CANN labels device processes with a bare 'NPU': two devices cannot be told apart, so they are
    analysed as one, and the report says so."""
    src = tmp_path / "src"
    synth.write_profile(src, ranks=2, steps=1, layers=2, dbo=False, cann="old")
    rank_dirs = sorted(p for p in src.iterdir() if p.is_dir() and p.name.endswith("_ascend_pt"))
    both = _device_events(rank_dirs[0]) + _device_events(rank_dirs[1])
    hw = {e["pid"] for e in both if e.get("name") == "process_name" and e["args"]["name"] == "Ascend Hardware"}
    assert len(hw) == 2
    out = tmp_path / "PROF_000001_20251130000000_ABC" / "mindstudio_profiler_output"
    out.mkdir(parents=True)
    (out / "msprof_20251130000000.json").write_text(json.dumps(both))
    tl = pa.load(out.parent)
    assert list(tl.ranks) == [0]
    msgs = [w.message() for w in tl.all_warnings()]
    assert any("2 Ascend Hardware processes are analysed as one device" in m for m in msgs), msgs
