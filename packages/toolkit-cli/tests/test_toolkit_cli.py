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
