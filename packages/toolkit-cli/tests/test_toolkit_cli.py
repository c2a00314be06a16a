"""toolkit_cli: the one error path, the shared parameter types, atomic output, the argparse mirror."""

from __future__ import annotations

import os
import stat

import click
import pytest
from toolkit_cli import (
    NON_NEGATIVE_INT,
    ByteSize,
    CLIError,
    OutputError,
    PositiveInt,
    ToolGroup,
    argparse_mirror,
    format_option,
    output_option,
    write_output,
)


class Broken(Exception):
    pass


@click.command("work")
@click.option("--n", type=PositiveInt(100, what="count"), default=1)
@click.option("--size", type=ByteSize(lambda t: int(t.rstrip("B")) if t.rstrip("B").isdigit() else (_ for _ in ()).throw(
    ValueError(f"size {t!r}: expected digits then B"))), default="1B")
@format_option("text", "json")
@output_option()
@click.option("--fail", type=click.Choice(["domain", "cli", "bug", "interrupt", "status"]))
def work(n, size, format, output, fail):
    if fail == "domain":
        raise Broken("the input is wrong; expected a better one")
    if fail == "cli":
        raise CLIError("refused\nover two lines")
    if fail == "bug":
        raise RuntimeError("a bug")
    if fail == "interrupt":
        raise KeyboardInterrupt
    if fail == "status":
        return 7
    write_output(output, f"{n} {size} {format}\n")
    return None


TOOL = ToolGroup("tool", lazy_subcommands={"work": f"{__name__}:work"}, domain_errors=(Broken,), help="a test tool")


def run(capsys, *args):
    status = TOOL.run(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["work", "--n", "0"], "'0' is out of range; expected a positive integer up to 100 (count)"),
        (["work", "--n", "x"], "is not an integer"),
        (["work", "--n", "9" * 5000], "(5,000 characters)"),
        (["work", "--size", "12K"], "expected digits then B"),
        (["work", "--format", "xml"], "'xml'"),
        (["work", "--nope"], "No such option"),
        (["wrok"], "No such command"),
    ],
)
def test_usage_errors_are_one_line_with_the_hint(capsys, args, fragment):
    status, out, err = run(capsys, *args)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and fragment in err and "--help')" in err and len(err) < 400


def test_domain_and_cli_errors_are_one_line(capsys):
    assert run(capsys, "work", "--fail", "domain") == (2, "", "tool: error: the input is wrong; expected a better one\n")
    assert run(capsys, "work", "--fail", "cli") == (2, "", "tool: error: refused over two lines\n")
    assert run(capsys, "work", "--fail", "interrupt") == (130, "", "tool: interrupted\n")
    assert run(capsys, "work", "--fail", "status")[0] == 7
    with pytest.raises(RuntimeError):  # a bug keeps its traceback
        TOOL.run(["work", "--fail", "bug"])


def test_a_subcommand_is_imported_only_when_it_runs(capsys):
    group = ToolGroup("lazy", lazy_subcommands={"work": f"{__name__}:work", "x": "no_such_module_anywhere:x"})
    assert group.run(["work", "--n", "3"]) == 0  # "x" is never imported
    assert capsys.readouterr().out == "3 1 text\n"
    with pytest.raises(ModuleNotFoundError):
        group.run(["x"])


def test_output_is_atomic_and_keeps_the_mode(capsys, tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    os.chmod(target, 0o640)
    assert run(capsys, "work", "-o", str(target)) == (0, "", "")
    assert target.read_text() == "1 1 text\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    status, _, err = run(capsys, "work", "-o", str(tmp_path))
    assert status == 2 and "is a directory" in err
    with pytest.raises(OutputError, match="does not exist"):
        write_output(tmp_path / "no" / "file", "x")
    assert run(capsys, "work", "-o", "-")[1] == "1 1 text\n"


def test_non_negative_int_accepts_zero_and_underscores():
    assert NON_NEGATIVE_INT.convert("0", None, None) == 0
    assert PositiveInt().convert("40_960", None, None) == 40960


def test_argparse_mirror_has_the_subcommands_and_options():
    parser = argparse_mirror(TOOL)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    options = {s for a in sub.choices["work"]._actions for s in a.option_strings}
    assert {"--n", "--size", "--format", "-o", "--output", "--fail"} <= options


@pytest.mark.parametrize("digits", ["٤٠٩٦", "４０９６", "4٠96", "৪", "𝟜"])
def test_numbers_take_ascii_digits_only(capsys, digits):
    status, _, err = run(capsys, "work", "--n", digits)
    assert status == 2 and err.count("\n") == 1 and "ASCII digits" in err and "--n" in err
    status, _, err = run(capsys, "work", "--size", digits + "B")  # the tool's own parser would take them
    assert status == 2 and err.count("\n") == 1 and "ASCII digits" in err and "--size" in err


@click.command("read")
@click.argument("source")
@click.option("--other", default=None)
@click.option("--level", type=click.Choice(["a", "b"]), default="a")
@output_option()
def read(source, other, level, output):
    text = open(source).read() if os.path.isfile(source) else "folder\n"
    write_output(output, text.upper())


READER = ToolGroup("reader", lazy_subcommands={"read": f"{__name__}:read"})


def test_output_naming_an_input_is_refused_and_the_input_kept(capsys, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("keep")
    os.symlink(source, tmp_path / "link.txt")
    for output in (source, tmp_path / "." / "in.txt", tmp_path / "link.txt"):
        status = READER.run(["read", str(source), "-o", str(output)])
        _, err = capsys.readouterr()
        assert status == 2 and err.count("\n") == 1 and "input" in err and "in.txt" in err, err
        assert source.read_text() == "keep"
    # an input given through an option counts too; the choice of a --level never does
    (tmp_path / "elsewhere").mkdir()
    assert READER.run(["read", str(tmp_path / "elsewhere"), "--other", str(source), "-o", str(source)]) == 2
    assert "--other" in capsys.readouterr().err
    assert source.read_text() == "keep"
    assert READER.run(["read", str(source), "-o", str(tmp_path / "out.txt")]) == 0
    assert (tmp_path / "out.txt").read_text() == "KEEP"


def test_output_inside_an_input_folder_is_refused(capsys, tmp_path):
    profile = tmp_path / "prof_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    profile.mkdir(parents=True)
    (profile / "trace_view.json").write_text("[]")
    (profile / "kernel_details.csv").write_text("x")
    os.symlink(profile / "kernel_details.csv", tmp_path / "elsewhere.csv")
    for output in (profile / "trace_view.json", profile / ".." / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"):
        status = READER.run(["read", str(tmp_path / "prof_ascend_pt"), "-o", str(output)])
        _, err = capsys.readouterr()
        assert status == 2 and err.count("\n") == 1 and "inside the input folder" in err, err
    assert READER.run(["read", str(tmp_path / "prof_ascend_pt"), "-o", str(tmp_path / "elsewhere.csv")]) == 2
    assert "inside the input folder" in capsys.readouterr().err
    assert (profile / "trace_view.json").read_text() == "[]" and (profile / "kernel_details.csv").read_text() == "x"
    # a new file in the folder is the msprof-analyze habit (its reports go into the profile) and changes no input
    assert READER.run(["read", str(tmp_path / "prof_ascend_pt"), "-o", str(profile / "report.txt")]) == 0
    assert READER.run(["read", str(tmp_path / "prof_ascend_pt"), "-o", str(tmp_path / "r.txt")]) == 0


def test_write_output_refuses_an_input_file_even_without_the_early_check(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("keep")

    @click.command("late")
    @click.argument("source")
    @output_option(check_early=False)
    def late(source, output):
        write_output(output, "new")

    with pytest.raises(OutputError, match="input"):
        late.main([str(source), "-o", str(source)], standalone_mode=False)
    assert source.read_text() == "keep"
