"""msprof-analyze's option names (-d/--profiling_path, --output_path DIR, compare -d/--bp) and the usage
errors of every option: one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
from profile_analyzer.cli import main

synth = pytest.importorskip("profile_analyzer.synth")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    synth.write_profile(root / "off", ranks=2, steps=1, layers=2, dbo=False)
    synth.write_profile(root / "on", ranks=2, steps=1, layers=2, dbo=True)
    return root / "off", root / "on"


def run(capsys, *args):
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def test_profiling_path_is_the_argument(capsys, pair):
    off, _ = pair
    a = run(capsys, "report", off, "--format", "json")
    b = run(capsys, "report", "-d", off, "--format", "json")
    c = run(capsys, "report", "--profiling_path", off, "--format", "json")
    assert a[0] == b[0] == c[0] == 0
    assert json.loads(a[1])["summary"] == json.loads(b[1])["summary"] == json.loads(c[1])["summary"]


def test_output_path_writes_the_default_name(capsys, pair, tmp_path):
    off, _ = pair
    target = tmp_path / "reports"
    for fmt, name in (("json", "profile_analysis.json"), ("md", "profile_analysis.md")):
        status, out, _ = run(capsys, "report", "-d", off, "--format", fmt, "--output_path", target)
        assert status == 0 and out == ""
        assert (target / name).stat().st_size > 0
    json.loads((target / "profile_analysis.json").read_text())
    assert sorted(p.name for p in target.iterdir()) == ["profile_analysis.json", "profile_analysis.md"]


def test_compare_takes_bp_and_d(capsys, pair):
    off, on = pair
    plain = run(capsys, "compare", off, on, "--format", "json")
    named = run(capsys, "compare", "--bp", off, "-d", on, "--format", "json")
    mixed = run(capsys, "compare", off, "-d", on, "--format", "json")
    assert plain[0] == named[0] == mixed[0] == 0
    assert json.loads(plain[1])["items"] == json.loads(named[1])["items"] == json.loads(mixed[1])["items"]
    assert json.loads(named[1])["base"]["path"] == str(off)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["report"], "missing the profile"),
        (["report", "A", "-d", "B"], "given twice"),
        (["report", "X", "--top", "0"], "rows per ranked table"),
        (["report", "X", "--top", "-5"], "rows per ranked table"),
        (["report", "X", "--jobs", "0"], "number of processes"),
        (["report", "X", "--format", "xml"], "'xml'"),
        (["report", "X", "--rank", "-1"], "rank"),
        (["report", "X", "-o", "OUT", "--output_path", "DIR"], "not both"),
        (["compare", "A"], "missing the new profile"),
        (["compare", "A", "B", "--format", "html"], "'html'"),
        (["synth", "OUT", "--workers", "0"], "number of processes"),
        (["synth", "OUT", "--exposed-layers", "x"], "layer indices"),
        (["reprot"], "No such command"),
    ],
)
def test_usage_errors_are_one_line_and_write_nothing(capsys, tmp_path, args, fragment):
    args = [str(tmp_path / a) if a in ("A", "B", "X", "OUT", "DIR") else a for a in args]
    status, out, err = run(capsys, *args)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and fragment in err, err
    assert list(tmp_path.iterdir()) == []


def test_output_to_a_directory_is_refused_before_loading(capsys, tmp_path):
    status, _, err = run(capsys, "report", tmp_path / "does-not-matter", "-o", tmp_path)
    assert status == 2 and "is a directory" in err and err.count("\n") == 1
