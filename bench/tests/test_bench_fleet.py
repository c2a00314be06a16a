"""The opt-in fleet step (issue 28): off by default, and its REPORT.md section from a result file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_fleet_runs_only_when_named() -> None:
    driver = _load(BENCH / "driver.py", "bench_driver_fleet")
    assert "fleet" in driver.OPT_IN and "fleet" not in driver.select_steps(None, None)
    assert driver.select_steps("fleet", None) == ["fleet"]


def test_fleet_section(tmp_path: Path) -> None:
    report = _load(BENCH / "report.py", "bench_report_fleet")
    assert report.section_fleet(tmp_path, {"steps": {}}) == []  # not selected, not run: no section
    assert "step failed" in "\n".join(report.section_fleet(tmp_path, {"steps": {"fleet": {"status": "failed"}}}))
    ours = {"wall_s": 2.0, "peak_rss_bytes": 100e6}
    fleet = {
        "profile": {"command": "profile-analyzer synth X --ranks 64", "ranks": 64, "steps": 26, "trace_view_bytes": 8.49e9,
                    "disk_bytes": 9.65e9, "events": 38_390_096, "seconds": 871.1, "workers": 2, "reused": True},
        "msprof_analyze_version": "26.2.0", "msprof_limit_s": 1200, "ours_command": "profile-analyzer report",
        "msprof_command": "msprof-analyze cluster", "targets": {"peak_rss_max_bytes": 1.5e9,
                                                                "growth_per_rank_max_bytes": 1e6},
        "rows": [{"ranks": 8, "trace_view_bytes": 1.06e9, "ours": ours, "speed_ratio": 3.5,
                  "msprof_analyze": {"finished": True, "wall_s": 7.0, "tree_peak_rss_bytes": 900e6}},
                 {"ranks": 64, "trace_view_bytes": 8.49e9, "ours": ours,
                  "msprof_analyze": {"finished": False, "wall_s": None}}],
        "meets_memory_target": True, "peak_rss_growth": 1.0, "peak_rss_growth_per_rank_bytes": 0,
    }
    (tmp_path / "profile_analyzer_fleet.json").write_text(json.dumps(fleet))
    text = "\n".join(report.section_fleet(tmp_path, {"steps": {"fleet": {"status": "ok"}}}))
    assert "| 8 | 1.06 | 2.0 s | 100 MB | 7.0 s, peak RSS 900 MB (all processes) | 3.5x | 9.0x |" in text
    assert "| 64 | 8.49 | 2.0 s | 100 MB | did not finish in 20 min | - | - |" in text
    assert "generated in 871 s" in text and "9.65 GB on disk" in text and ": met (" in text
