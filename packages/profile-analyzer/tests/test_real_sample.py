"""The real Ascend profiler sample: recompute the breakdown from raw tasks and match the profiler's own
``Overlap Analysis`` track; read both kernel_details.csv header generations."""

from __future__ import annotations

import csv
import shutil

import numpy as np
import profile_analyzer as pa
import pytest
from profile_analyzer.analyses.breakdown import (
    derived_columns,
    overlap_sets,
    profiler_agreement,
    step_breakdown,
)
from profile_analyzer.loaders.ascend import read_kernel_details
from profile_analyzer.timeline import Kind


def test_overlap_analysis_track_matched_to_1us(msprof_sample):
    tl = pa.load(msprof_sample / "single_card_ascend_pt")
    assert tl.format == "torch_npu"
    rt = tl.ranks[0]
    rows = step_breakdown(rt)
    assert [r["step"] for r in rows] == [1]
    agree = profiler_agreement(rt, rows)
    items = {a["item"]: a for a in agree if a["source"] == "overlap_analysis_track"}
    assert set(items) == {"computing", "communication", "communication_not_overlapped", "free"}
    for a in items.values():
        assert abs(a["delta_us"]) < 1.0, a
    # the reference note's sanity figures: Σ Computing 1788.25, Σ Free 9481.67, span 11270 µs
    assert items["computing"]["ours_us"] == pytest.approx(1788.25, abs=0.05)
    assert items["free"]["ours_us"] == pytest.approx(9481.67, abs=0.05)
    sets = overlap_sets(rt)
    assert (sets.end - sets.begin) / 1000 == pytest.approx(11270, abs=0.5)
    # the two MEMCPY_ASYNC tasks are device tasks but not Computing (msprof's compute-task rule)
    other = [rt.names[i] for i in rt.name_id[rt.kind == int(Kind.OTHER)]]
    assert other == ["MEMCPY_ASYNC", "MEMCPY_ASYNC"]


def test_profiler_overlap_events_are_disjoint_and_ours_equal_per_interval(msprof_sample):
    rt = pa.load(msprof_sample / "single_card_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").ranks[0]
    ps, pe = rt.profiler_overlap["Computing"]
    ours = overlap_sets(rt).comp
    assert ps.size == ours[0].size == 274
    # interval by interval to within 1 ns (the profiler prints dur rounded to the ns)
    assert np.abs(ps - ours[0]).max() <= 1 and np.abs(pe - ours[1]).max() <= 1


def test_partial_profile_warns_about_kernel_details(msprof_sample):
    rep = pa.analyze(pa.load(msprof_sample / "single_card_ascend_pt")).to_dict()
    assert any(w["missing"] == "kernel_details.csv" and w["affects"] for w in rep["warnings"])
    assert rep["dual_batch"][0]["detected"] is False
    assert "no communication" in rep["verdict"]
    # this small single-card run is host-bound: the stream waits for CANN launches (HostToDevice flows)
    g = rep["idle_gaps"][0]["per_stream"][0]
    assert g["host_bound_us"] > 0.9 * g["idle_us"] and g["launch_known_pct"] > 95


@pytest.mark.parametrize("name, rows, comm", [("kernel_details_old_header.csv", 591, 19),
                                              ("kernel_details_pmu_header.csv", 29, 0)])
def test_kernel_details_both_headers(msprof_sample, name, rows, comm):
    kd = read_kernel_details(msprof_sample / "kernel_details" / name)
    assert kd["rows"] == rows
    assert len(kd["comm_names"]) == len({n for n in kd["comm_names"]})
    with open(msprof_sample / "kernel_details" / name, newline="") as f:
        hcom = {r["Name"] for r in csv.DictReader(f) if r["Accelerator Core"] in ("HCCL", "COMMUNICATION")}
    assert kd["comm_names"] == hcom and (len(hcom) > 0) == (comm > 0)
    assert all(t for t in kd["types"].values())


def test_kernel_details_feeds_operator_types(msprof_sample, tmp_path):
    """With a kernel_details.csv next to the trace, the warning disappears and its Type column is used."""
    root = tmp_path / "x_ascend_pt"
    shutil.copytree(msprof_sample / "single_card_ascend_pt", root)
    out = root / "ASCEND_PROFILER_OUTPUT"
    with open(out / "kernel_details.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Step Id", "Model ID", "Task ID", "Stream ID", "Name", "Type", "Accelerator Core", "Start Time(us)", "Duration(us)"])
        w.writerow([1, 4294967295, 279, 3, "aclnnMm_MatMulCommon_MatMulV2", "MatMulV2", "AI_CORE", "1704161511422904.204\t", 1.35])
    rt = pa.load(root).ranks[0]
    assert not any(w.missing == "kernel_details.csv" for w in rt.warnings)
    assert "MatMulV2" in rt.op_types.values()


def test_cluster_step_trace_time_derived_columns(msprof_sample):
    """The columns torch_npu derives (Overlapped, Not Overlapped and Exclude Receive) by our formulas equal
    the ones in a profiler-written cluster_step_trace_time.csv, row by row."""
    with open(msprof_sample / "cluster_analysis_output" / "cluster_step_trace_time.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["Type"] == "rank"]
    assert len(rows) == 8
    for r in rows:
        d = derived_columns(float(r["Computing"]), float(r["Communication"]), float(r["Communication(Not Overlapped)"]),
                            float(r["Bubble"]))
        assert d["overlapped"] == pytest.approx(float(r["Overlapped"]), abs=1e-6)
        assert d["communication_not_overlapped_exclude_receive"] == pytest.approx(
            float(r["Communication(Not Overlapped and Exclude Receive)"]), abs=1e-6)
