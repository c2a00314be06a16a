"""The benchmark: its formula, the handoff measurement, and a quick end-to-end run that writes the JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from dbo_runtime.bench import efficiency, main, measure_handoff


def test_efficiency_formula():
    # T_off = compute + comm; perfect overlap leaves max(compute, comm).
    assert efficiency(100.0, 60.0, 60.0, 40.0) == 1.0
    assert efficiency(100.0, 100.0, 60.0, 40.0) == 0.0
    assert efficiency(100.0, 80.0, 60.0, 40.0) == 0.5
    assert math.isnan(efficiency(50.0, 40.0, 60.0, 40.0))


def test_handoff_cost_is_measured():
    h = measure_handoff(200)
    assert h["samples"] == 200
    assert 0 < h["median_us"] <= h["p99_us"]
    assert h["median_us"] < 50_000  # a handoff is a thread wake-up, not a sleep


def test_bad_out_is_one_line_exit_2(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0]


def test_quick_bench_writes_results(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dbo_runtime.bench", "--out", str(tmp_path), "--quick"],
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "dbo_runtime.json").read_text())
    assert "stand-in for HCCS" in data["link_note"]
    assert {r["pattern"] for r in data["rows"]} == {"a2", "a3"}
    for row in data["rows"]:
        assert row["split_on"] and not row["split_off"]
        assert row["t_off_ms"] > 0 and row["t_on_ms"] > 0 and row["t_comm_ms"] > 0 and row["t_compute_ms"] > 0
        assert "modelled link" in row["link_text"]
    assert {r["link"] for r in data["rows"]} == {"default", "bw x2"}
    for row in data["no_split"]:
        assert row["split_on"] is False  # below the threshold DBO takes the plain path
    assert data["handoff_us"]["median_us"] > 0
    assert "effic" in out.stdout and "yield handoff" in out.stdout
    assert not list(tmp_path.glob(".tmp-*"))
