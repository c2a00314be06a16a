"""``dbo-runtime reference --trace``: one Kineto trace per rank, compute and communication told apart, overlapping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dbo_runtime.profiling import SPAN_PATTERN


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("trace")
    # A slow modelled link (500 us + bytes / 10 MB/s) so that every collective is still in flight while the
    # other micro-batch computes.
    cmd = [sys.executable, "-m", "dbo_runtime", "reference", "--pattern", "a2", "--dbo", "on", "--ranks", "2",
           "--tokens", "96", "--requests", "3", "--layers", "2", "--hidden", "64", "--experts", "4",
           "--prefill-threshold", "2", "--steps", "1", "--warmup", "1", "--link", "500,0.01", "--trace", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)  # fmt: skip
    return proc, out_dir


def _spans(path: Path) -> list[dict]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and SPAN_PATTERN.match(e.get("name", ""))]


def test_cli_reports_times_and_names_the_link_as_modelled(traced_run):
    proc, _ = traced_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "DBO on (split into 2 micro-batches)" in out
    assert "modelled link: 500 us + bytes / 0.01 GB/s (stand-in for HCCS)" in out
    for label in ("step time", "compute", "communication"):
        assert label in out


def test_one_trace_per_rank(traced_run):
    _, out_dir = traced_run
    files = sorted(out_dir.glob("*.pt.trace.json"))
    assert [f.name.split(".")[0] for f in files] == ["rank0", "rank1"]
    assert not list(out_dir.glob(".tmp-*"))


@pytest.mark.parametrize("rank", [0, 1])
def test_trace_tells_compute_from_comm_per_micro_batch(traced_run, rank):
    _, out_dir = traced_run
    spans = _spans(next(out_dir.glob(f"rank{rank}.*.pt.trace.json")))
    for ub in (0, 1):
        compute = [s for s in spans if s["name"].startswith(f"dbo.ubatch{ub}.compute.layer")]
        comm = [s for s in spans if s["name"].startswith(f"dbo.ubatch{ub}.comm.")]
        assert compute and comm, f"ubatch{ub}: {len(compute)} compute, {len(comm)} comm spans"
        assert {s["name"] for s in comm} >= {f"dbo.ubatch{ub}.comm.all_gather.layer1",
                                              f"dbo.ubatch{ub}.comm.reduce_scatter.layer1"}  # fmt: skip
        # Compute runs on the micro-batch's thread, communication on the rank's communication thread.
        assert {s["tid"] for s in compute}.isdisjoint({s["tid"] for s in comm})


@pytest.mark.parametrize("rank", [0, 1])
def test_communication_of_one_micro_batch_overlaps_compute_of_the_other(traced_run, rank):
    _, out_dir = traced_run
    spans = _spans(next(out_dir.glob(f"rank{rank}.*.pt.trace.json")))

    def overlap(a: dict, b: dict) -> float:
        return max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]))

    comm0 = [s for s in spans if s["name"].startswith("dbo.ubatch0.comm.")]
    compute1 = [s for s in spans if s["name"].startswith("dbo.ubatch1.compute.")]
    assert sum(overlap(a, b) for a in comm0 for b in compute1) > 0


def test_profile_analyzer_reads_the_trace(traced_run):
    profile_analyzer = pytest.importorskip("profile_analyzer")
    _, out_dir = traced_run
    timeline = profile_analyzer.load(str(out_dir))
    report = profile_analyzer.analyze(timeline).to_dict()
    assert report  # the analyzer accepted both ranks' traces
