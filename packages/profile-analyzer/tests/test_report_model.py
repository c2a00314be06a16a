"""The typed report model: the analyses' rows become dataclasses strictly, and the JSON form is schema 1."""

from __future__ import annotations

import json

import profile_analyzer as pa
import pytest
from profile_analyzer.report.model import BreakdownRow, DualBatchRank, Report, record


def test_records_are_strict_about_their_keys() -> None:
    row = {"rank": 0, "detected": False, "method": None, "reason": "", "ubatches": [], "layers": []}
    assert record(DualBatchRank, row) == DualBatchRank(0, False, None, "", [], [])
    with pytest.raises(TypeError, match=r"unexpected keys \['period'\], missing keys \[\]"):
        record(DualBatchRank, {**row, "period": 2})
    with pytest.raises(TypeError, match=r"missing keys \['reason'\]"):
        record(DualBatchRank, {k: v for k, v in row.items() if k != "reason"})
    with pytest.raises(TypeError, match="expected a dict for BreakdownRow"):
        record(BreakdownRow, [1, 2])


def test_a_report_is_typed_and_its_json_is_schema_1(tmp_path) -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10, "dur": 40, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "pid": 0, "tid": 20, "ts": 30, "dur": 40,
         "args": {"stream": 20}},
    ]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    rep = pa.analyze(pa.load(tmp_path / "t.json"))
    assert isinstance(rep, Report) and isinstance(rep.breakdown[0], BreakdownRow)
    assert rep.summary.communication_us == pytest.approx(40) and rep.summary.overlapped_us == pytest.approx(20)
    d = rep.to_dict()
    assert d["schema_version"] == 1 and d["breakdown"][0]["overlap_pct"] == pytest.approx(50)
    assert json.loads(json.dumps(d)) == d
