"""The msprof / torch_npu DB export (export_type=db), read with sqlite3: the same report as the JSON export of the
same profile, picked by ``detect``, and a table layout it does not know is one line naming the table or column.

The DBs here are written by ``profile-analyzer synth --export db|both`` (``profile_analyzer.synth.db_export``),
from the same simulated run as the JSON export; real torch_npu DBs are checked in test_msprof_db_real.py."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import profile_analyzer as pa
import pytest
from profile_analyzer.cli import main
from profile_analyzer.loaders import detect
from profile_analyzer.synth import write_profile


def _report(capsys, path: Path) -> dict:
    status = main(["report", str(path), "--format", "json", "--jobs", "1"])
    out, err = capsys.readouterr()
    assert status == 0, err
    d = json.loads(out)
    d.pop("source")  # the path and the format name are the only things that may differ
    return d


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    params = dict(ranks=2, steps=2, layers=3, dbo=True, exposed_layers=(1,), pp_receive_us=20.0)
    return {e: write_profile(root / e, export=e, **params).root for e in ("json", "db", "both")}


def test_db_and_json_exports_give_the_same_report(capsys, exports):
    json_rep = _report(capsys, exports["json"])
    db_rep = _report(capsys, exports["db"])
    assert json_rep["breakdown"] and json_rep["dual_batch"][0]["detected"]
    # the profiler's own figures are read from the DB too (OVERLAP_ANALYSIS, analysis.db), and labelled by the table
    assert {a["source"] for a in db_rep["profiler_agreement"]} == {"overlap_analysis_track", "analysis.db:StepTraceTime",
                                                                   "analysis.db:CommAnalyzerTime"}
    assert {a["source"] for a in json_rep["profiler_agreement"]} == {"overlap_analysis_track", "step_trace_time.csv",
                                                                     "communication.json"}
    as_text = {"analysis.db:StepTraceTime": "step_trace_time.csv", "analysis.db:CommAnalyzerTime": "communication.json"}
    for a in db_rep["profiler_agreement"]:
        a["source"] = as_text.get(a["source"], a["source"])
    assert db_rep == json_rep


def test_each_rank_of_both_exports_gives_the_same_timeline(exports):
    for rank_dir in sorted(p for p in exports["both"].iterdir() if p.name.endswith("_ascend_pt")):
        from_json = pa.load(rank_dir)  # both exports present: the JSON one is read
        db_file = next((rank_dir / "ASCEND_PROFILER_OUTPUT").glob("ascend_pytorch_profiler_*.db"))
        from_db = pa.load(db_file)
        assert from_json.format == "torch_npu" and from_db.format == "torch_npu_db"
        (a,), (b,) = from_json.ranks.values(), from_db.ranks.values()
        assert a.rank == b.rank and a.device_id == b.device_id
        assert [(s.label, s.kind) for s in a.streams] == [(s.label, s.kind) for s in b.streams]

        def tasks(rt):
            return sorted(zip(rt.start_ns.tolist(), rt.end_ns.tolist(), [rt.streams[i].label for i in rt.stream],
                              rt.kind.tolist(), [rt.names[i] for i in rt.name_id], strict=True))

        assert tasks(a) == tasks(b)
        assert a.steps.ids.tolist() == b.steps.ids.tolist()
        assert a.steps.start_ns.tolist() == b.steps.start_ns.tolist()
        assert a.steps.end_ns.tolist() == b.steps.end_ns.tolist()
        assert sorted(a.launch_ns.tolist()) == sorted(b.launch_ns.tolist())
        assert (a.launch_ns >= 0).sum() > 0


def test_detect_picks_the_db_export(exports):
    rank_dirs = sorted(p for p in exports["db"].iterdir() if p.name.endswith("_ascend_pt"))
    assert [detect(p) for p in rank_dirs] == ["torch_npu_db", "torch_npu_db"]
    assert detect(rank_dirs[0] / "ASCEND_PROFILER_OUTPUT") == "torch_npu_db"
    assert detect(exports["db"]) == "multi_rank"
    assert detect(next((rank_dirs[1] / "ASCEND_PROFILER_OUTPUT").glob("*.db"))) == "torch_npu_db"
    tl = pa.load(exports["db"])
    assert sorted(tl.ranks) == [0, 1]
    # with both exports side by side the JSON one is read
    both = sorted(p for p in exports["both"].iterdir() if p.name.endswith("_ascend_pt"))
    assert detect(both[0]) == "torch_npu"


def _copy_db(exports: dict[str, Path], tmp_path: Path) -> Path:
    src = next(exports["db"].glob("*_ascend_pt/ASCEND_PROFILER_OUTPUT/ascend_pytorch_profiler_0.db"))
    dst = tmp_path / "ascend_pytorch_profiler_0.db"
    dst.write_bytes(src.read_bytes())
    return dst


def _one_line_error(capsys, path: Path) -> str:
    status = main(["report", str(path), "--format", "json"])
    out, err = capsys.readouterr()
    assert status == 2, err
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("sql", "expected"), [
    ("ALTER TABLE TASK RENAME COLUMN streamId TO stream_id", "table TASK has no column streamId"),
    ("DROP TABLE STRING_IDS", "no table STRING_IDS"),
    ("ALTER TABLE COMMUNICATION_OP RENAME COLUMN opName TO name", "table COMMUNICATION_OP has no column opName"),
    ("ALTER TABLE PYTORCH_API RENAME COLUMN globalTid TO tid", "table PYTORCH_API has no column globalTid"),
])
def test_an_unknown_table_layout_is_one_line_naming_what_was_expected(capsys, exports, tmp_path, sql, expected):
    db_path = _copy_db(exports, tmp_path)
    con = sqlite3.connect(db_path)
    con.execute(sql)
    con.commit()
    con.close()
    err = _one_line_error(capsys, db_path)
    assert expected in err and "DB export layout" in err


def test_a_db_file_that_is_not_sqlite_is_one_line(capsys, tmp_path):
    bad = tmp_path / "ascend_pytorch_profiler_0.db"
    bad.write_bytes(b"this is not a database at all" * 10)
    assert "not an SQLite database" in _one_line_error(capsys, bad)


def test_a_truncated_db_is_one_line(capsys, exports, tmp_path):
    db_path = _copy_db(exports, tmp_path)
    db_path.write_bytes(db_path.read_bytes()[:6000])
    _one_line_error(capsys, db_path)


def _set(db_path: Path, sql: str, *args: object) -> None:
    con = sqlite3.connect(db_path)
    con.execute(sql, args)
    con.commit()
    con.close()


FIRST_TASK = "(SELECT rowid FROM TASK ORDER BY startNs LIMIT 1)"


@pytest.mark.parametrize(("sql", "reason"), [
    (f"UPDATE TASK SET startNs = 'abc' WHERE rowid = {FIRST_TASK}", "with a ts that is not a number in range"),
    (f"UPDATE TASK SET endNs = '12x' WHERE rowid = {FIRST_TASK}", "with a dur that is not a number in range"),
    (f"UPDATE TASK SET endNs = startNs - 5 WHERE rowid = {FIRST_TASK}", "with a negative dur"),
    (f"UPDATE TASK SET startNs = NULL WHERE rowid = {FIRST_TASK}", "without ts"),
    (f"UPDATE TASK SET startNs = 1.5 WHERE rowid = {FIRST_TASK}", "with a ts that is not a number in range"),
    (f"UPDATE TASK SET endNs = 99999999999999999999 WHERE rowid = {FIRST_TASK}",
     "with a dur that is not a number in range"),
    ("UPDATE COMMUNICATION_OP SET endNs = startNs - 1 WHERE rowid = 1", "with a negative dur"),
    ("UPDATE COMMUNICATION_OP SET startNs = x'ff00' WHERE rowid = 1", "with a ts that is not a number in range"),
])
@pytest.mark.parametrize("command", ["report", "compare", "whatif"])
def test_a_device_task_time_that_is_not_a_time_is_one_line(capsys, exports, tmp_path, sql, reason, command):
    db_path = _copy_db(exports, tmp_path)
    _set(db_path, sql)
    args = [command, str(db_path)] + ([str(db_path)] if command == "compare" else [])
    status = main(args)
    out, err = capsys.readouterr()
    assert status == 2, err
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "cannot be placed" in err and reason in err and db_path.name in err, err


def test_a_host_event_time_that_is_not_a_time_is_skipped_with_a_warning(capsys, exports, tmp_path):
    # the JSON export's rule: a host event that cannot be placed is left out and counted in a warning
    db_path = _copy_db(exports, tmp_path)
    _set(db_path, "UPDATE PYTORCH_API SET endNs = 'soon' WHERE rowid = (SELECT rowid FROM PYTORCH_API "
                  "WHERE name IN (SELECT id FROM STRING_IDS WHERE value LIKE 'ProfilerStep#%') LIMIT 1)")
    status = main(["report", str(db_path), "--format", "json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "with a dur that is not a number in range" in err


def test_text_times_in_ascii_digits_are_read_as_numbers(capsys, exports, tmp_path):
    # torch_npu writes PYTORCH_API times as TEXT: digits in text are times, as before
    db_path = _copy_db(exports, tmp_path)
    before = _report(capsys, db_path)
    _set(db_path, "UPDATE TASK SET startNs = CAST(startNs AS TEXT), endNs = ' ' || CAST(endNs AS TEXT)")
    assert _report(capsys, db_path) == before
