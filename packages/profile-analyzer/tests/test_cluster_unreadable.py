"""A directory of ranks as a cluster leaves it: one rank still being written (truncated) or unreadable. The ranks
that read are reported, each rank that did not gets one warning line and a row in ``unreadable``, the verdict says
the figures leave it out; ``--strict`` fails as before; no readable rank is one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import profile_analyzer as pa
import pytest
from profile_analyzer.cli import main
from profile_analyzer.synth import write_profile


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, Path]:
    """Three ranks; ``bad`` has rank 1's trace_view.json cut in half, ``good`` has only ranks 0 and 2."""
    root = tmp_path_factory.mktemp("cluster")
    full = write_profile(root / "full", ranks=3, steps=2, layers=2, dbo=True).root
    bad = root / "bad"
    shutil.copytree(full, bad)
    rank_dirs = sorted(p for p in bad.iterdir() if p.name.endswith("_ascend_pt"))
    trace = rank_dirs[1] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
    trace.write_bytes(trace.read_bytes()[: trace.stat().st_size // 2])
    good = root / "good"
    shutil.copytree(full, good)
    shutil.rmtree(sorted(p for p in good.iterdir() if p.name.endswith("_ascend_pt"))[1])
    dead = root / "dead"
    shutil.copytree(bad, dead)
    for d in (p for p in dead.iterdir() if p.name.endswith("_ascend_pt")):
        (d / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").write_text('[{"ph": "X", "name": ')
    return {"full": full, "bad": bad, "good": good, "dead": dead}


def _run(capsys, *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_report_reads_the_ranks_that_read_and_names_the_one_that_did_not(capsys, cluster, jobs):
    status, out, err = _run(capsys, "report", str(cluster["bad"]), "--format", "json", "-j", jobs)
    assert status == 0, err
    rep = json.loads(out)
    lines = [x for x in err.splitlines() if "could not be read" in x]
    assert len(lines) == 1 and "rank 1" in lines[0] and "truncated JSON" in lines[0], err
    (u,) = rep["unreadable"]
    assert u["rank"] == 1 and "trace_view.json" in u["reason"] and "truncated" in u["reason"]
    assert rep["source"]["ranks"] == [0, 2]
    assert "could not be read (1)" in rep["verdict"] and "leaves them out" in rep["verdict"]
    # every figure is the one of the cluster without that rank
    status, out_good, _ = _run(capsys, "report", str(cluster["good"]), "--format", "json", "-j", jobs)
    good = json.loads(out_good)
    assert good["unreadable"] == [] and rep["summary"] == good["summary"] and rep["breakdown"] == good["breakdown"]


def test_strict_fails_on_the_unreadable_rank(capsys, cluster):
    for cmd in (["report", str(cluster["bad"])], ["report", str(cluster["bad"]), "-j", "2"],
                ["compare", str(cluster["full"]), str(cluster["bad"])], ["whatif", str(cluster["bad"])]):
        status, out, err = _run(capsys, *cmd, "--strict")
        assert status == 2 and err.count("\n") == 1 and "truncated JSON" in err and out == "", (cmd, err)


def test_no_readable_rank_is_one_line(capsys, cluster):
    for cmd in (["report", str(cluster["dead"])], ["report", str(cluster["dead"]), "-j", "2"],
                ["whatif", str(cluster["dead"])]):
        status, out, err = _run(capsys, *cmd)
        assert status == 2 and err.count("\n") == 1 and out == "", (cmd, err)
        assert "none of its 3 rank profiles could be read" in err and "Traceback" not in err


def test_compare_and_whatif_leave_the_rank_out_and_say_so(capsys, cluster):
    status, out, err = _run(capsys, "compare", str(cluster["full"]), str(cluster["bad"]), "--format", "json",
                            "--jobs", "2")
    assert status == 0, err
    c = json.loads(out)
    assert [u["rank"] for u in c["new"]["unreadable"]] == [1] and c["base"]["unreadable"] == []
    assert "leave out 1 rank(s)" in c["verdict"]
    assert len([x for x in err.splitlines() if "could not be read" in x]) == 1
    status, out, err = _run(capsys, "compare", str(cluster["full"]), str(cluster["good"]), "-j", "1")
    assert status == 0, err  # compare takes -j/--jobs as report does
    status, out, err = _run(capsys, "whatif", str(cluster["bad"]), "--format", "json")
    assert status == 0, err
    w = json.loads(out)
    assert [u["rank"] for u in w["unreadable"]] == [1] and [r["rank"] for r in w["ranks"]] == [0, 2]
    assert "could not be read" in err and err.count("\n") == 1


def test_the_api_lists_unreadable_ranks(cluster):
    for workers in (1, 2):
        tl = pa.load(cluster["bad"], workers=workers)
        assert sorted(tl.ranks) == [0, 2] and [u.rank for u in tl.unreadable] == [1]
    with pytest.raises(pa.ProfileError, match="truncated"):
        pa.load(cluster["bad"], strict=True)
