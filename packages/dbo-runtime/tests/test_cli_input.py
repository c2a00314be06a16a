"""dbo-runtime's command line given bad input (issue 11): one line naming the input and what is accepted, exit 2,
nothing written; the entry points (`dbo-runtime`, `python -m dbo_runtime`, `python -m dbo_runtime.cli`,
`python -m dbo_runtime.bench`) all run the same click group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dbo_runtime.cli import build_parser, cli, main


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err
    assert len(lines) == 1 and needle in lines[0], captured.err
    assert "Traceback" not in captured.err and "Usage:" not in captured.err
    return lines[0]


def _collect_result(texts: list[str], logprobs: list[list[float]] | None = None) -> dict:
    logprobs = logprobs or [[-0.5] for _ in texts]
    return {"results": [{"prompt": f"p{i}", "text": t, "tokens": [t], "logprobs": lp}
                        for i, (t, lp) in enumerate(zip(texts, logprobs, strict=True))]}


@pytest.fixture
def good_pair(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_collect_result(["x", "y"])))
    b.write_text(json.dumps(_collect_result(["x", "y"])))
    return a, b


@pytest.mark.parametrize("content, needle", [
    ({"results": [{"prompt": "p0", "tokens": [], "logprobs": []}]}, "results[0].text is missing"),
    ({"results": [1, 2]}, "results[0] is a int"),
    ({"results": [{"prompt": "p0", "text": "x", "tokens": ["x"], "logprobs": ["-0.5"]}]}, "logprobs[0]"),
    ({"results": []}, "no completions"),
    ({"a": 1}, "no 'results' list"),
    ([1, 2], "no 'results' list"),
    (b"\x00\xff\xfe binary", "not JSON"),
    ("[" * 100_000, "not JSON"),
])
def test_diff_of_a_broken_collect_result(tmp_path, capsys, good_pair, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content if isinstance(content, bytes) else
                    (content if isinstance(content, str) else json.dumps(content)).encode())
    _one_line_exit_2(capsys, ["compare", "diff", str(good_pair[0]), str(bad)], needle)


def test_diff_of_a_directory_or_missing_file(tmp_path, capsys, good_pair):
    _one_line_exit_2(capsys, ["compare", "diff", str(good_pair[0]), str(tmp_path)], "not a regular file")
    _one_line_exit_2(capsys, ["compare", "diff", str(good_pair[0]), str(tmp_path / "nope.json")], "cannot read")


@pytest.mark.parametrize("option, value", [
    ("--min-identical", "2"), ("--min-identical", "nan"), ("--min-identical", "-0.1"),
    ("--max-logprob-diff", "-1"), ("--max-logprob-diff", "nan"), ("--max-logprob-diff", "-inf"),
    ("--format", "xml"),
])
def test_diff_gates_that_cannot_pass_are_refused(capsys, good_pair, tmp_path, option, value):
    out = tmp_path / "out" / "report.json"
    out.parent.mkdir()
    _one_line_exit_2(capsys, ["compare", "diff", *map(str, good_pair), option, value, "-o", str(out)], option)
    assert list(out.parent.iterdir()) == []


def test_diff_verdicts_and_output(capsys, good_pair, tmp_path):
    out = tmp_path / "report.json"
    assert main(["compare", "diff", *map(str, good_pair), "--min-identical", "1", "--max-logprob-diff", "0",
                 "--format", "json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["identical"] == 2
    assert main(["ascend-compare", "diff", *map(str, good_pair), "--max-logprob-diff", "inf"]) == 0
    assert "identical text: 2/2 (100.0%)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--url", "not a url"], "--url"),
    (["--url", "ftp://host/"], "--url"),
    (["--url", "http://host:99999"], "--url"),
    (["--url", "http://127.0.0.1:9", "--num-prompts", "0"], "--num-prompts"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency"),
    (["--url", "http://127.0.0.1:9", "--max-tokens", "-3"], "--max-tokens"),
])
def test_collect_bad_input(tmp_path, capsys, argv, needle):
    out = tmp_path / "run.json"
    _one_line_exit_2(capsys, ["compare", "collect", "--model", "m", "--out", str(out), *argv], needle)
    assert not out.exists()


def test_collect_refuses_an_empty_prompts_file_and_an_unwritable_output(tmp_path, capsys):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    out = tmp_path / "run.json"
    _one_line_exit_2(capsys, ["compare", "collect", "--url", "http://127.0.0.1:9", "--model", "m", "--prompts",
                              str(empty), "--out", str(out)], "has no prompt")
    _one_line_exit_2(capsys, ["compare", "collect", "--url", "http://127.0.0.1:9", "--model", "m", "--prompts",
                              str(tmp_path), "--out", str(out)], "not a regular file")
    _one_line_exit_2(capsys, ["compare", "collect", "--url", "http://127.0.0.1:9", "--model", "m",
                              "--out", str(tmp_path)], "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]


def test_collect_from_a_server_that_is_not_there(tmp_path, capsys):
    from dbo_runtime.reference.launcher import free_port

    out = tmp_path / "run.json"
    _one_line_exit_2(capsys, ["compare", "collect", "--url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                              "--num-prompts", "1", "--out", str(out)], "is the server up?")
    assert not out.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--min-identical-pct", "101"], "--min-identical-pct"),
    (["--min-identical-pct", "nan"], "--min-identical-pct"),
    (["--max-logprob-diff", "-1"], "--max-logprob-diff"),
    (["-tp", "0"], "--tensor-parallel-size"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--prompts", "x"], "--num-prompts"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--timeout", "0"], "--timeout"),
    (["--workdir", "/proc/nope"], "--workdir"),
    (["--vllm-python", "/nonexistent/python"], "no such interpreter"),
    (["--format", "md"], "--format"),
])
def test_compare_run_bad_input_before_any_engine_starts(tmp_path, capsys, argv, needle):
    out = tmp_path / "report.json"
    _one_line_exit_2(capsys, ["compare", "run", "--model", str(tmp_path), "-o", str(out), *argv], needle)
    assert not out.exists()


def test_compare_run_output_place_is_checked_first(tmp_path, capsys):
    _one_line_exit_2(capsys, ["compare", "run", "--model", str(tmp_path), "-o", str(tmp_path / "no" / "r.json")],
                     "does not exist")


@pytest.mark.parametrize("out, needle", [("/proc/nope", "cannot write"), ("", "empty")])
def test_bench_out_is_checked_before_the_benchmark(capsys, out, needle):
    _one_line_exit_2(capsys, ["bench", "--out", out], needle)


@pytest.mark.parametrize("argv, needle", [
    (["nope"], "No such command 'nope'"),
    (["reference", "--nope"], "--nope"),
    (["doctor", "--format", "table"], "--format"),
    (["ascend-sites", "--format", "html"], "--format"),
])
def test_usage_errors_are_one_line(capsys, argv, needle):
    _one_line_exit_2(capsys, argv, needle)


def test_ascend_sites_writes_its_output_atomically(tmp_path, capsys):
    out = tmp_path / "sites.md"
    assert main(["ascend-sites", "--format", "md", "-o", str(out)]) == 0
    assert out.read_text().startswith("| site |") and capsys.readouterr().out == ""


def test_reference_choices_match_the_model():
    from dbo_runtime.commands.reference import DTYPE_CHOICES, PATTERN_CHOICES
    from dbo_runtime.reference.model import DTYPES, PATTERNS

    assert PATTERN_CHOICES == PATTERNS and DTYPE_CHOICES == tuple(DTYPES)


def test_reference_takes_vllms_flag_names():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "dbo-runtime_command")  # noqa: SLF001
    options = {s for a in sub.choices["reference"]._actions for s in a.option_strings}  # noqa: SLF001
    assert {"--enable-dbo", "--no-enable-dbo", "--dbo-prefill-token-threshold", "--dbo-decode-token-threshold",
            "--ubatch-size"} <= options


@pytest.mark.parametrize("entry", [["-m", "dbo_runtime"], ["-m", "dbo_runtime.cli"]])
def test_entry_points(entry):
    out = subprocess.run([sys.executable, *entry, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("Usage: dbo-runtime"), out.stderr
    for name in ("reference", "bench", "compare", "doctor", "ascend-sites"):
        assert f"  {name} " in out.stdout


def test_python_m_bench_is_the_bench_subcommand(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    out = subprocess.run([sys.executable, "-m", "dbo_runtime.bench", "--out", str(target)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("dbo-runtime bench: error:") and "--out" in out.stderr


def test_the_group_loads_no_subcommand_at_start():
    code = ("import sys; from dbo_runtime.cli import cli; "
            "print(sorted(m for m in sys.modules if m.startswith('dbo_runtime.commands.')), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "False"]
    assert cli.name == "dbo-runtime"
