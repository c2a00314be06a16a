"""The commands the skills tell an agent to run exist: every `kv-capacity`, `profile-analyzer`,
`dbo-runtime`, `skills/render.py` and `serve_bench.py` line in a SKILL.md (and docs/skills.md) code
block names a real subcommand and only options its argparse parser defines, and every
`render.py SKILL TEMPLATE` names a real skill and template. The parsers are the packages' own
`build_parser()`, so a renamed option in a CLI fails here instead of misleading an agent.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKILLS = REPO / "skills"
DOCUMENTS = sorted(SKILLS.glob("*/SKILL.md")) + [REPO / "docs" / "skills.md"]
PACKAGE_CLIS = {"kv-capacity": "kv_capacity.cli", "profile-analyzer": "profile_analyzer.cli", "dbo-runtime": "dbo_runtime.cli"}
CODE_BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)


def shell_commands(text: str) -> list[list[str]]:
    """Token lists of the simple commands in the bash code blocks of `text` (variables of the block expanded)."""
    found: list[list[str]] = []
    for block in CODE_BLOCK.findall(text):
        block = block.replace("\\\n", " ")
        variables = dict(re.findall(r'^\s*(\w+)="([^"]*)"\s*$', block, re.M))
        for line in block.splitlines():
            line = re.sub(r"\s#.*$", "", line)
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            for part in re.split(r"\s*(?:&&|\|\||;|\||&)\s*", line):
                try:
                    tokens = shlex.split(part)
                except ValueError:
                    continue
                if tokens:
                    found.append(tokens)
    return found


def tool_invocations(document: Path) -> list[tuple[str, list[str]]]:
    """(tool, arguments) for each command of a known tool in `document`."""
    calls = []
    for tokens in shell_commands(document.read_text(encoding="utf-8")):
        if tokens[0] == "python" and len(tokens) > 1:
            tokens = tokens[1:]
        head = tokens[0]
        if head in PACKAGE_CLIS:
            calls.append((head, tokens[1:]))
        elif head.endswith("skills/render.py"):
            calls.append(("render.py", tokens[1:]))
        elif head.endswith("scripts/serve_bench.py"):
            calls.append(("serve_bench.py", tokens[1:]))
    return calls


def check_against_parser(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Descend into subcommands, then check every option token; returns the problems found."""
    problems = []
    index = 0
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)  # noqa: SLF001
        if sub is None or index >= len(args) or args[index].startswith("-"):
            break
        if args[index] not in sub.choices:
            return [f"unknown subcommand {args[index]!r} (known: {', '.join(sub.choices)})"]
        parser = sub.choices[args[index]]
        index += 1
    options = {s for action in parser._actions for s in action.option_strings}  # noqa: SLF001
    for token in args[index:]:
        token = token.strip("[]")
        if token == "--":  # the rest goes to vLLM unchanged
            break
        if token.startswith("-") and token not in ("-", "..."):
            name = token.split("=", 1)[0]
            if name not in options:
                problems.append(f"unknown option {name} of {parser.prog}")
    return problems


def test_the_skills_name_the_package_clis() -> None:
    tools = {tool for document in DOCUMENTS for tool, _ in tool_invocations(document)}
    assert {"kv-capacity", "profile-analyzer", "dbo-runtime", "render.py", "serve_bench.py"} <= tools


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_match_the_real_parsers(document: Path, render_mod, serve_bench) -> None:
    parsers = {tool: importlib.import_module(module).build_parser for tool, module in PACKAGE_CLIS.items()}
    parsers["render.py"] = render_mod.build_parser
    parsers["serve_bench.py"] = serve_bench.build_parser
    problems = []
    for tool, args in tool_invocations(document):
        line = f"{tool} {' '.join(args)}"
        problems += [f"{line}: {p}" for p in check_against_parser(parsers[tool](), args)]
        if tool == "render.py":
            positional = [a for a in args if not a.startswith("-")]
            skill = positional[0] if positional else None
            if skill is None or skill.isupper():  # a usage line with placeholders (SKILL TEMPLATE)
                continue
            if skill not in render_mod.skill_names():
                problems.append(f"{line}: unknown skill {skill!r}")
            elif "--list" not in args and len(positional) > 1:
                try:
                    render_mod._template_path(skill, positional[1])  # noqa: SLF001
                except render_mod.RenderError as exc:
                    problems.append(f"{line}: {exc}")
    assert problems == []


def test_the_checker_catches_a_wrong_option() -> None:
    parser = importlib.import_module("kv_capacity.cli").build_parser()
    assert check_against_parser(parser, ["plan", "--model", "x", "--kv-budget", "8G"]) == [
        "unknown option --kv-budget of kv-capacity plan"
    ]
    assert check_against_parser(parser, ["plann"])[0].startswith("unknown subcommand 'plann'")
    commands = shell_commands('```bash\nR="kv-capacity plan"\n$R --model m \\\n  --max-model-len 8 # note\n```\n')
    assert commands == [["R=kv-capacity plan"], ["kv-capacity", "plan", "--model", "m", "--max-model-len", "8"]]
