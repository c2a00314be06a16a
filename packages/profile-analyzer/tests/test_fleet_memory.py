"""Fleet scale (issue 28): ``report`` on a directory of ranks reduces each rank to what the report needs before the
next rank's events are held (in the worker that loaded it with ``--jobs N``). The report is the same as that of the
whole timeline, and peak memory does not grow with the rank count."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict

import numpy as np
import profile_analyzer as pa
import pytest
from profile_analyzer.analyses.exposed import op_kind
from profile_analyzer.analyses.ranks import compare_ranks, op_instances, sync_wait_ns
from profile_analyzer.cli import main
from profile_analyzer.timeline import COMM_KINDS
from toolkit_cli.testing import run_module_measured

synth = pytest.importorskip("profile_analyzer.synth")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """4 ranks, DBO on with exposed layers, rank 2 slow (the others wait for it)."""
    out = tmp_path_factory.mktemp("fleet4")
    synth.write_profile(out, ranks=4, steps=3, layers=6, pattern="a3", dbo=True, exposed_layers=(1, 4), seed=7,
                        slow_rank=2)
    return out


def _reference_rank_comparison(ranks, per_rank, windows):
    """The rank comparison as it was written before the reduction (a dict per instance, every timeline held)."""
    inst = {}
    for r, rt in ranks.items():
        lo, hi = windows[r]
        ops = np.flatnonzero(rt.of_kind(*COMM_KINDS))
        ops = ops[(rt.start_ns[ops] >= lo) & (rt.start_ns[ops] < hi)]
        ops = ops[np.argsort(rt.start_ns[ops], kind="stable")]
        seen: dict[str, int] = defaultdict(int)
        d = {}
        for i in ops.tolist():
            k = op_kind(rt.names[int(rt.name_id[i])])
            d[(k, seen[k])] = int(rt.end_ns[i] - rt.start_ns[i])
            seen[k] += 1
        inst[r] = d
    wait: dict[int, int] = defaultdict(int)
    caused: dict[int, int] = defaultdict(int)
    last: dict[int, int] = defaultdict(int)
    matched = 0
    for k in sorted({k for d in inst.values() for k in d}):
        have = {r: d[k] for r, d in inst.items() if k in d}
        if len(have) < 2:
            continue
        matched += 1
        shortest = min(have.values())
        late = min(have, key=lambda r: (have[r], r))
        last[late] += 1
        for r, v in have.items():
            wait[r] += v - shortest
            caused[late] += v - shortest
    waited_for = max(caused, key=lambda r: caused[r]) if matched and any(caused.values()) else None
    return matched, {r: (wait.get(r, 0), caused.get(r, 0), last.get(r, 0)) for r in ranks}, waited_for


def test_reduced_report_equals_the_whole_timelines(cluster, tmp_path):
    whole = pa.analyze(pa.load(cluster)).to_dict()
    assert whole["ranks"]["waited_for_rank"] == 2 and whole["timeline"]  # the figures under test are there
    for jobs in (1, 2):
        tl, rep = pa.load_and_analyze(cluster, jobs=jobs, keep_timeline=False)
        assert tl is None
        assert rep.to_dict() == whole, jobs
    # the command line takes the reduced path: the same JSON, byte for byte, for any --jobs
    for jobs in ("1", "2"):
        out = tmp_path / f"j{jobs}.json"
        assert main(["report", str(cluster), "--format", "json", "-o", str(out), "--jobs", jobs]) == 0
        assert json.loads(out.read_text()) == json.loads(json.dumps(whole)), jobs
    # a rank and a step selected (only that rank is loaded, with its timeline kept or not)
    one = pa.load_and_analyze(cluster, rank=1, step=2, jobs=1)[1].to_dict()
    assert one["source"]["ranks"] == [1] and one["breakdown"]
    assert pa.load_and_analyze(cluster, rank=1, step=2, jobs=1, keep_timeline=False)[1].to_dict() == one


def test_rank_comparison_from_reduced_instances_equals_the_dict_sweep(cluster):
    tl = pa.load(cluster)
    windows = {r: (int(rt.steps.start_ns.min()), int(rt.steps.end_ns.max())) for r, rt in tl.ranks.items()}
    matched, per, waited_for = _reference_rank_comparison(tl.ranks, {}, windows)
    got = compare_ranks(list(tl.ranks), {r: op_instances(rt, *windows[r]) for r, rt in tl.ranks.items()}, {},
                        {r: sync_wait_ns(rt, *windows[r]) for r, rt in tl.ranks.items()})
    assert got["matched_collectives"] == matched > 0 and got["waited_for_rank"] == waited_for == 2
    for row in got["per_rank"]:
        w, c, n = per[row["rank"]]
        assert (row["comm_wait_us"], row["caused_wait_us"], row["arrived_last"]) == (w / 1000.0, c / 1000.0, n)
    # synthetic instances: unequal counts per rank, ties, a kind on one rank only
    rng = np.random.default_rng(3)
    inst = {r: {"allreduce": rng.integers(5, 9, size=rng.integers(3, 40)), "alltoall": rng.integers(1, 4, size=20),
                **({"send": np.array([4, 5])} if r == 1 else {})} for r in range(5)}
    fake = {r: {(k, i): int(v) for k, a in d.items() for i, v in enumerate(a)} for r, d in inst.items()}
    matched_ref = sum(1 for k in {k for d in fake.values() for k in d} if sum(k in d for d in fake.values()) >= 2)
    got = compare_ranks(list(range(5)), inst, {}, {})
    assert got["matched_collectives"] == matched_ref
    caused: dict[int, int] = defaultdict(int)
    for k in sorted({k for d in fake.values() for k in d}):
        have = {r: d[k] for r, d in fake.items() if k in d}
        if len(have) >= 2:
            late = min(have, key=lambda r: (have[r], r))
            caused[late] += sum(v - have[late] for v in have.values())
    assert got["waited_for_rank"] == max(caused, key=lambda r: caused[r])
    assert [row["caused_wait_us"] for row in got["per_rank"]] == [caused.get(r, 0) / 1000.0 for r in range(5)]


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory):
    """16 ranks of ~13 MB of trace_view.json each (device tasks only: 30k tasks a rank), and a folder of the first 4
    of them (hard links)."""
    out = tmp_path_factory.mktemp("fleet16")
    root = out / "r16"
    gt = synth.write_profile(root, ranks=16, steps=16, layers=20, pattern="a3", dbo=True, exposed_layers=(3,),
                             seed=5, workers=2, host_tracks=False)
    four = out / "r4"
    for r in sorted(gt.profile_dirs)[:4]:
        shutil.copytree(gt.profile_dirs[r], four / gt.profile_dirs[r].name, copy_function=os.link)
    return four, root, gt


def test_peak_memory_does_not_grow_with_the_rank_count(sixteen, tmp_path):
    four, root, gt = sixteen
    peaks = {}
    for name, folder in (("4", four), ("16", root)):
        code, err, _, peak = run_module_measured("profile_analyzer", "report", str(folder), "--format", "json",
                                                 "-o", str(tmp_path / f"{name}.json"), "--jobs", "1")
        assert code == 0, err
        assert json.loads((tmp_path / f"{name}.json").read_text())["summary"]["ranks"] == int(name)
        peaks[name] = peak
    if not peaks["4"]:
        pytest.skip("no /proc/self/status here: the child's peak is not known")
    rt = next(iter(pa.load(gt.profile_dirs[0]).ranks.values()))
    timeline_bytes = sum(v.nbytes for v in vars(rt).values() if isinstance(v, np.ndarray))
    # Holding every rank's timeline (as before), 12 more ranks cost more than 12 x its arrays (measured: +18 MB
    # against 12 x 1.0 MB); reduced one rank at a time they cost their results and the longer report (+0.7 MB)
    assert peaks["16"] - peaks["4"] < 0.4 * 12 * timeline_bytes, (peaks, timeline_bytes)


def test_fleet_bench_code_path(tmp_path, monkeypatch):
    """The fleet step on 2 small ranks (msprof-analyze replaced by a stand-in that never ends: "did not finish",
    its process group stopped); the generation record is kept beside the profile and reused."""
    from profile_analyzer import fleet

    fake = tmp_path / "msprof-analyze"
    pidfile = tmp_path / "child.pid"
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(fleet, "ensure_msprof_analyze", lambda cache, log=print: fake)
    res = fleet.run_fleet(tmp_path / "out", tmp_path / "cache", rank_counts=(1, 2), ranks=2, target_bytes=1,
                          msprof_limit_s=2, log=lambda *_: None)
    assert json.loads((tmp_path / "out" / "profile_analyzer_fleet.json").read_text()) == res
    assert res["profile"]["reused"] is False and res["profile"]["disk_bytes"] > res["profile"]["trace_view_bytes"] > 0
    assert [r["ranks"] for r in res["rows"]] == [1, 2]
    assert [r["ours"]["ranks_in_report"] for r in res["rows"]] == [1, 2]
    assert all(r["ours"]["peak_rss_bytes"] > 5e6 for r in res["rows"])
    assert all(r["msprof_analyze"]["finished"] is False and r["msprof_analyze"]["wall_s"] is None for r in res["rows"])
    child = int(pidfile.read_text())
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]
    assert "did not finish" in fleet.format_table(res)
    again = fleet.run_fleet(tmp_path / "out", tmp_path / "cache", rank_counts=(2,), ranks=2, target_bytes=1,
                            with_msprof=False, log=lambda *_: None)
    assert again["profile"]["reused"] is True and again["profile"]["seconds"] == res["profile"]["seconds"]
