"""Real torch_npu profiles of a two-card job (MindStudio Insight's samples, tests/data/msinsight): the DB export
at Level1 and Level2, and the text export at Level1.

What this checks against the real thing: the analyzer's figures recomputed from the raw tasks equal torch_npu's
own answers written beside them (analysis.db StepTraceTime and CommAnalyzerTime and OVERLAP_ANALYSIS, read here
with sqlite3 independently of the loader; step_trace_time.csv, communication.json and the Overlap Analysis track
of the text export); and reading a profile writes nothing beside it. What it cannot catch: layouts of CANN
versions other than the one that wrote these samples (the synthetic profiles of test_db_export.py cover the
msprof-documented columns), MC2 or AI CPU communication, more than one step (these samples have none of them).
"""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from pathlib import Path

import profile_analyzer as pa
import pytest
from profile_analyzer.analyses.breakdown import profiler_agreement, step_breakdown
from profile_analyzer.cli import main

SAMPLES = Path(__file__).parent / "data" / "msinsight"
DATA = SAMPLES / "db"
LEVELS = ("level1", "level2")


def _analysis(level: str, rank: int, sql: str) -> list[tuple]:
    path = DATA / level / f"rank{rank}_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "analysis.db"
    with sqlite3.connect(path.resolve().as_uri() + "?immutable=1", uri=True) as db:
        return db.execute(sql).fetchall()


@pytest.fixture(scope="module", params=LEVELS)
def loaded(request):
    tl = pa.load(DATA / request.param)
    per_rank = {}
    for r, rt in tl.ranks.items():
        rows = step_breakdown(rt)
        per_rank[r] = (rt, rows, profiler_agreement(rt, rows))
    return request.param, tl, per_rank


def test_both_ranks_load_with_their_hccl_planes(loaded):
    level, tl, _ = loaded
    assert tl.format == "multi_rank" and sorted(tl.ranks) == [0, 1]
    for rt in tl.ranks.values():
        planes = [s.label for s in rt.streams if s.label.startswith("Plane ")]
        assert len(planes) == 8
        names = {rt.names[i] for i in rt.name_id}
        # plane tasks carry the HCCL task type as their name, as in msprof's JSON timeline
        assert {"Notify_Wait", "Notify_Record", "Reduce_Inline", "Memcpy"} <= names


def test_step_breakdown_equals_torch_npus_step_trace_time(loaded):
    level, _, per_rank = loaded
    cols = ("computing", "communication_not_overlapped", "overlapped", "communication", "free", "stage", "bubble",
            "communication_not_overlapped_exclude_receive", "preparing")
    for rank, (_, (row,), _) in per_rank.items():
        (theirs,) = _analysis(level, rank, "SELECT step, computing, communication_not_overlapped, overlapped, "
                                                 "communication, free, stage, bubble, "
                                                 "communication_not_overlapped_and_exclude_receive, preparing "
                                                 "FROM StepTraceTime")
        assert int(theirs[0]) == row["step"] == 50
        for col, value in zip(cols, theirs[1:], strict=True):
            assert row[col] / 1000.0 == pytest.approx(value, abs=0.01), (level, rank, col)


def test_synchronization_wait_and_elapse_equal_torch_npus_comm_analyzer_time(loaded):
    level, _, per_rank = loaded
    rows = [a for _, _, agree in per_rank.values() for a in agree if a["source"] == "analysis.db:CommAnalyzerTime"]
    assert {(a["rank"], a["item"]) for a in rows} == {(r, i) for r in (0, 1)
                                                      for i in ("communication_elapse", "synchronization_wait")}
    for a in rows:
        (total_sync, total_elapse), = _analysis(level, a["rank"], "SELECT sum(synchronization_time), sum(elapse_time) "
                                                                 "FROM CommAnalyzerTime")
        theirs_ms = total_sync if a["item"] == "synchronization_wait" else total_elapse
        assert a["ours_us"] == pytest.approx(theirs_ms * 1000.0, abs=0.01), (level, a)
    # the one operator whose wait is large: ours names it as torch_npu does (plane 1 is the master plane there)
    assert max(a["ours_us"] for a in rows if a["item"] == "synchronization_wait") > 1000.0


def test_every_figure_of_the_report_agrees_with_the_profilers_own_to_a_microsecond(capsys):
    for level in LEVELS:
        assert main(["report", str(DATA / level), "--format", "json"]) == 0
        agree = json.loads(capsys.readouterr().out)["profiler_agreement"]
        assert len(agree) >= 2 * (9 + 2)  # StepTraceTime's 9 items and CommAnalyzerTime's 2, per rank
        # read from the DB export's analysis.db, and labelled so (not as the text export's files)
        assert {a["source"] for a in agree} - {"overlap_analysis_track"} == {"analysis.db:StepTraceTime",
                                                                             "analysis.db:CommAnalyzerTime"}
        assert all(abs(a["delta_us"]) < 1.0 for a in agree), [a for a in agree if abs(a["delta_us"]) >= 1.0]
        if level == "level1":  # rank 0's DB also holds CANN's OVERLAP_ANALYSIS intervals
            assert any(a["source"] == "overlap_analysis_track" and a["rank"] == 0 for a in agree)


def test_reading_a_profile_writes_nothing_beside_it(tmp_path):
    copy = tmp_path / "level1"
    shutil.copytree(DATA / "level1", copy)
    before = sorted(p.relative_to(copy) for p in copy.rglob("*"))
    pa.analyze(pa.load(copy))
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == before  # no -wal / -shm from a WAL-mode DB


def test_data_still_in_the_wal_is_read(tmp_path):
    """A writer that has not checkpointed yet: its rows live in <db>-wal, and they must be read too."""
    copy = tmp_path / "level1"
    shutil.copytree(DATA / "level1", copy)
    db_path = copy / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_0.db"
    writer = sqlite3.connect(db_path)
    try:
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute("DELETE FROM COMMUNICATION_OP WHERE opId = (SELECT min(opId) FROM COMMUNICATION_OP)")
        writer.commit()
        assert db_path.with_name(db_path.name + "-wal").stat().st_size > 0
        rt = pa.load(db_path).ranks[0]
        ops = [i for i in range(rt.start_ns.size) if rt.streams[rt.stream[i]].label.startswith("Group ")]
        assert len(ops) == 3  # of 4: the deleted one is not there
    finally:
        writer.close()


@pytest.fixture(scope="module")
def text_export(tmp_path_factory) -> Path:
    """The text export with its trace_view.json unpacked (it is stored gzipped)."""
    root = tmp_path_factory.mktemp("msinsight-text") / "level1"
    shutil.copytree(SAMPLES / "text" / "level1", root)
    for gz in root.rglob("trace_view.json.gz"):
        gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
        gz.unlink()
    return root


def test_text_export_every_figure_agrees_with_the_profilers_own(capsys, text_export):
    assert main(["report", str(text_export), "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    agree = rep["profiler_agreement"]
    assert {(a["rank"], a["source"]) for a in agree} == {(r, s) for r in (0, 1) for s in (
        "overlap_analysis_track", "step_trace_time.csv", "communication.json")}
    # µs floats in the JSON: a fraction of a µs of rounding, nothing more
    assert all(abs(a["delta_us"]) < 1.0 for a in agree), [a for a in agree if abs(a["delta_us"]) >= 1.0]
    # communication is mostly exposed here (the all-reduce waits for the other card): 96 % of it, not 4 %
    for row in rep["breakdown"]:
        assert row["communication_not_overlapped"] > 0.9 * row["communication"]


def test_hccl_tasks_on_the_hardware_stream_are_not_compute(text_export):
    rt = pa.load(text_export / "rank0_ascend_pt").ranks[0]
    from profile_analyzer.timeline import Kind

    kinds = {}
    for name_id, kind in zip(rt.name_id.tolist(), rt.kind.tolist(), strict=True):
        kinds.setdefault(rt.names[name_id], set()).add(kind)
    for name in ("Notify Wait", "SDMA", "Write Value"):  # named after their task type on HCCL's stream
        assert kinds[name] == {int(Kind.OTHER)}, name
    assert int(Kind.COMPUTE) in kinds["aclnnMm_MatMulCommon_MatMulV2"]


def test_without_overlap_analysis_the_warning_says_what_is_still_checked():
    rt = pa.load(DATA / "level2").ranks[0]  # Level2 DBs have no OVERLAP_ANALYSIS table, analysis.db is there
    (w,) = [w for w in rt.warnings if w.missing == "the 'Overlap Analysis' track"]
    assert "still checked" in w.affects[0]
