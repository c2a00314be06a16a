"""`--help` of every tool built on toolkit_cli lists every subcommand, and each subcommand's help works.

One parametrized test over all of them (each tool used to carry its own copy of a help test).
"""

from __future__ import annotations

import importlib

import click
import pytest

# tool name -> "module:attribute" of its ToolGroup
TOOLS = {
    "kv-capacity": "kv_capacity.cli:cli",
    "profile-analyzer": "profile_analyzer.cli:cli",
    "dbo-runtime": "dbo_runtime.cli:cli",
}


def _group(target: str) -> click.Group:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _every_command() -> list[tuple[str, list[str]]]:
    found = []
    for tool, target in TOOLS.items():
        group = _group(target)
        found.append((tool, []))
        stack: list[tuple[click.Command, list[str]]] = [(group, [])]
        while stack:
            command, path = stack.pop()
            if isinstance(command, click.Group):
                ctx = click.Context(command, info_name=tool)
                for name in command.list_commands(ctx):
                    sub = command.get_command(ctx, name)
                    assert sub is not None, f"{tool} {' '.join(path)} lists {name} but cannot load it"
                    found.append((tool, [*path, name]))
                    stack.append((sub, [*path, name]))
    return found


@pytest.mark.parametrize("tool,path", _every_command(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_help(tool, path, capsys):
    group = _group(TOOLS[tool])
    assert group.run([*path, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: {' '.join([tool, *path])}")
    command: click.Command = group
    for name in path:
        command = command.get_command(click.Context(command), name)  # type: ignore[attr-defined]
    if isinstance(command, click.Group):  # a group's help names each of its subcommands
        for name in command.list_commands(click.Context(command)):
            assert f"  {name} " in out or out.rstrip().endswith(f"  {name}"), name


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_the_bare_tool_name_prints_its_help(tool, capsys):
    assert _group(TOOLS[tool]).run([]) == 0
    assert capsys.readouterr().out.startswith(f"Usage: {tool}")
