"""`-o` over an input, for every command of every tool that writes one (issue 29): refused in one line, exit 2,
the input untouched and the command never run.

The commands and their inputs are found by walking the click groups: every OutputPath parameter against every
parameter that may name an input file (free text or click.Path, as toolkit_cli reads them). Hypothesis picks the
input, the way `-o` spells the same file (as given, through `.` and `..`, a symbolic link, a hard link) and, for a
folder input, a file inside it. The command's callback is replaced by a stub: nothing a refusal missed can start.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolkit_cli import OutputPath, ToolGroup, walk_commands

TOOLS = {
    "kv-capacity": "kv_capacity.cli:cli",
    "profile-analyzer": "profile_analyzer.cli:cli",
    "dbo-runtime": "dbo_runtime.cli:cli",
}
FILLERS = ("1", "8", "0.5", "20,1", "4096", "http://127.0.0.1:9")
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _group(target: str) -> ToolGroup:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _may_name_an_input(param: click.Parameter) -> bool:
    if isinstance(param.type, OutputPath) or (param.name or "").startswith("out"):
        return False
    return isinstance(param.type, click.types.StringParamType | click.Path) and param.nargs == 1


def _cases() -> list[tuple[str, tuple[str, ...], str, str]]:
    """(tool, command path, output parameter, input parameter) for every pair."""
    found = []
    for tool, target in TOOLS.items():
        for path, command in walk_commands(_group(target)):
            outputs = [p.name for p in command.params if isinstance(p.type, OutputPath)]
            inputs = [p.name for p in command.params if _may_name_an_input(p)]
            found += [(tool, path, o, i) for o in outputs for i in inputs]
    return found


CASES = _cases()


def test_the_commands_that_write_are_found():
    pairs = {(tool, " ".join(path), inp) for tool, path, _, inp in CASES}
    for expected in [("kv-capacity", "plan", "model"), ("profile-analyzer", "report", "path"),
                     ("profile-analyzer", "compare", "new"), ("dbo-runtime", "compare diff", "a")]:
        assert expected in pairs
    assert len(CASES) > 20


def _option(param: click.Parameter) -> list[str]:
    return [max(param.opts, key=len)] if isinstance(param, click.Option) else []


def _filler(param: click.Parameter, command: click.Command, spare: Path) -> str:
    """A value that `param`'s type takes: a number, the first choice, or an existing file other than the input."""
    candidates = [*getattr(param.type, "choices", ()), *FILLERS, str(spare), str(spare.parent)]
    for value in candidates:
        try:
            param.type.convert(value, param, click.Context(command))
        except click.BadParameter:
            continue
        return str(value)
    pytest.skip(f"no value found for {param.name}")


def _spell(target: Path, how: str, tmp: Path) -> str:
    if how == "dotted":
        return str(target.parent / "." / ".." / target.parent.name / target.name)
    if how == "symlink":
        link = tmp / "link-to-input"
        link.symlink_to(target)
        return str(link)
    if how == "hardlink":
        link = tmp / "hard-link-to-input"
        os.link(target, link)
        return str(link)
    return str(target)


@pytest.mark.parametrize("tool,path,out_name,in_name", CASES,
                         ids=[f"{t} {' '.join(p)} {o}<-{i}" for t, p, o, i in CASES])
@SETTINGS
@given(how=st.sampled_from(["as-given", "dotted", "symlink", "hardlink"]), folder=st.booleans())
def test_output_over_an_input_is_refused(capsys, monkeypatch, tmp_path_factory, tool, path, out_name, in_name,
                                         how, folder):
    tmp = tmp_path_factory.mktemp("clash")
    group = _group(TOOLS[tool])
    command = dict(walk_commands(group))[path]
    ran: list[object] = []
    monkeypatch.setattr(command, "callback", lambda *a, **k: ran.append(k))
    params = {p.name: p for p in command.params}
    if folder:  # a profile or model folder as the input; -o names a file that is already inside it
        source = tmp / "input-folder"
        source.mkdir()
        victim = source / "config.json"
        victim.write_text('{"x": 1}')
        given_input, spelled = source, _spell(victim, how if how != "hardlink" else "as-given", tmp)
    else:
        victim = tmp / "input.json"
        victim.write_text('{"x": 1}')
        given_input, spelled = victim, _spell(victim, how, tmp)
    spare = tmp / "spare.json"
    spare.write_text("{}")
    argv = [*path]
    for param in command.params:  # the input, the output and every other required parameter, in order
        if param.name == in_name:
            value = str(given_input)
        elif param.name == out_name:
            value = spelled
        elif param.required:
            value = _filler(param, command, spare)
        else:
            continue
        argv += [*_option(param), value]
    if isinstance(params[in_name].type, click.Path) and params[in_name].type.file_okay is False and not folder:
        return  # a folder-only parameter: only the folder case applies
    if isinstance(params[in_name].type, click.Path) and params[in_name].type.dir_okay is False and folder:
        return
    before = victim.read_bytes()
    status = group.run(argv)
    _, err = capsys.readouterr()
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert "input" in err and not ran, (argv, err)
    assert victim.read_bytes() == before
