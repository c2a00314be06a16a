"""The benchmark's code path on a tiny generated profile (seconds; msprof-analyze is not run here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from profile_analyzer import bench


def test_bench_measures_report_on_a_cached_profile(tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    lines: list[str] = []
    res = bench.run_bench(out, cache=cache, ranks=2, target_bytes=400_000, with_msprof=False, timeout_s=300,
                          log=lines.append, layers=4, phases=True, jobs=2)
    written = json.loads((out / "profile_analyzer.json").read_text())
    assert written == res
    inp, ours = res["input"], res["ours"]
    assert inp["ranks"] == 2 and inp["trace_view_bytes"] >= 400_000
    assert inp["largest_file_bytes"] <= inp["trace_view_bytes"]
    assert ours["wall_s"] > 0
    assert ours["events_per_s"] == pytest.approx(inp["events"] / ours["wall_s"], rel=0.01)
    # a real child process of a Python interpreter has a peak RSS of megabytes, not zero
    assert 5e6 < ours["peak_rss_bytes"] < 4e9
    # the report it timed is right: its Computing equals the generator's ground truth
    check = ours["check_computing_us"]
    assert check["report"] == pytest.approx(check["ground_truth"], abs=0.01)
    assert ours["matches_ground_truth"] is True
    assert "msprof_analyze" not in res and isinstance(res["meets_memory_target"], bool)
    assert res["ours"]["jobs"] == 2 and "--jobs 2" in res["ours"]["command"]
    assert res["ours_jobs1"]["wall_s"] > 0 and res["ours_jobs1"]["tree_peak_rss_bytes"] > 5e6
    assert 0 < ours["tree_peak_pss_bytes"] <= ours["tree_peak_rss_bytes"]
    assert ours["peak_memory_vs_largest_file"] == round(ours["tree_peak_pss_bytes"] / inp["largest_file_bytes"], 3)
    assert res["targets"]["memory_measure"] == "sum of PSS over the process tree"
    ph = res["ours_phases"]
    assert ph["load_s"] > 0 and ph["analyze_s"] > 0 and ph["report_json_bytes"] > 1000
    assert ph["rss_hwm_after_import"] <= ph["rss_hwm_after_load"] <= ph["rss_hwm_after_render"]
    table = bench.format_table(res)
    assert "events/s" in table and "skipped" in table
    # second run: the profile comes from the cache
    lines.clear()
    bench.run_bench(out, cache=cache, ranks=2, target_bytes=400_000, with_msprof=False, timeout_s=300,
                    log=lines.append, layers=4)
    assert any("cached" in line for line in lines)


def test_measure_reports_peak_rss_of_the_child(tmp_path: Path) -> None:
    grab = "x = bytearray(200 * 1024 * 1024); x[::4096] = b'1' * len(x[::4096])"
    run = bench.measure([sys.executable, "-c", grab], timeout_s=60, log=tmp_path / "m.log")
    assert run.returncode == 0 and run.peak_rss_bytes > 200 * 1024 * 1024
    # a parent holding ~120 MB while its child holds ~160 MB: the tree peak is their sum, ru_maxrss the larger
    two = ("import subprocess, sys, time; x = bytearray(120 << 20); x[::4096] = b'1' * len(x[::4096]); "
           "subprocess.run([sys.executable, '-c', \"import time; y = bytearray(160 << 20); "
           "y[::4096] = b'1' * len(y[::4096]); time.sleep(1.0)\"])")
    run = bench.measure([sys.executable, "-c", two], timeout_s=60, log=tmp_path / "two.log")
    assert run.returncode == 0, run.output_tail
    # ru_maxrss covers the larger of the two (no upper bound: copy-on-write pages of the fork before the
    # exec can be charged to the child on a busy machine, seen at 412 MiB in one CI-like run)
    assert run.peak_rss_bytes > 160 << 20
    assert run.tree_peak_rss_bytes > 280 << 20
    assert run.tree_peak_pss_bytes > 280 << 20  # two private allocations: PSS adds them up too
    with pytest.raises(TimeoutError):
        bench.measure([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5, log=tmp_path / "t.log")


def test_pss_counts_the_pages_a_forked_worker_shares_with_its_parent_once(tmp_path: Path) -> None:
    # the parent touches 200 MiB, then forks a child that only sleeps: both show ~200 MiB resident, but the
    # machine holds it once. The RSS sum counts it twice; the PSS sum once (what the memory target uses).
    shared = ("import os, time; x = bytearray(200 << 20); x[::4096] = b'1' * len(x[::4096]); pid = os.fork()\n"
              "if pid == 0:\n    time.sleep(1.5); os._exit(0)\nos.waitpid(pid, 0)")
    run = bench.measure([sys.executable, "-c", shared], timeout_s=60, log=tmp_path / "fork.log")
    assert run.returncode == 0, run.output_tail
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("this kernel has no /proc/PID/smaps_rollup (PSS)")
    assert run.tree_peak_rss_bytes > 380 << 20
    assert 190 << 20 < run.tree_peak_pss_bytes < 300 << 20
    assert run.tree_peak_bytes == run.tree_peak_pss_bytes


def test_bench_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--ranks", "0"]) == 2
    assert "--ranks" in capsys.readouterr().err
