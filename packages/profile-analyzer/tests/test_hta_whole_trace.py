"""The whole-trace overlap figure equals HTA 0.5.0's own get_comm_comp_overlap on three of HTA's public traces
(tests/data/hta-kineto: the traces, their MIT license, and HTA's answers with the command that produced them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import profile_analyzer as pa
import pytest

DATA = Path(__file__).resolve().parent / "data" / "hta-kineto"
ANSWERS = json.loads((DATA / "hta_answers.json").read_text())["answers"]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_whole_trace_overlap_equals_hta(name: str, tmp_path: Path) -> None:
    src = DATA / name if (DATA / name).exists() else DATA / "single-rank" / name
    shutil.copy(src, tmp_path / name)
    rep = pa.analyze(pa.load(tmp_path / name)).to_dict()
    (w,) = rep["summary"]["whole_trace_overlap"]
    assert w["rank"] == ANSWERS[name]["rank"]
    assert w["overlap_pct"] == pytest.approx(ANSWERS[name]["comp_comm_overlap_pctg"], abs=0.01)
    assert rep["summary"]["whole_trace_overlap_pct"] == pytest.approx(w["overlap_pct"])
    assert f"{w['overlap_pct']:.2f}% of communication overlapped" in rep["verdict"]


def test_whole_trace_and_per_step_figures_differ_where_hta_drops_the_last_step() -> None:
    # HTA drops the kernels of the last ProfilerStep (include_last_profiler_step=False); the per-step figure keeps
    # every step: on sampled_rank-0 they are 11.81 % and 14.95 %
    s = pa.analyze(pa.load(DATA / "sampled_rank-0.json.gz")).to_dict()["summary"]
    assert s["whole_trace_overlap_pct"] == pytest.approx(11.81, abs=0.01)
    assert s["overlap_pct"] == pytest.approx(14.95, abs=0.01)
