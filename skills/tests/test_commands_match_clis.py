"""The commands the skills tell an agent to run exist: every `kv-capacity`, `profile-analyzer`,
`dbo-runtime`, `render.py`, `job.py` and `serve_bench.py` line in a SKILL.md, a skill's references/
(and docs/skills.md) code block names a real subcommand and only options its argparse parser defines,
every `scripts/render.py TEMPLATE` in a skill names a template in that skill's assets/, and every
`scripts/X` a skill runs is in that skill's folder. A command run through `job.py start NAME -- ...`
is checked too. The parsers are the tools' own `build_parser()`, so a renamed option in a CLI fails
here instead of misleading an agent.
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
DOCUMENTS = sorted(SKILLS.glob("*/SKILL.md")) + sorted(SKILLS.glob("*/references/*.md")) + [REPO / "docs" / "skills.md"]
PACKAGE_CLIS = {"kv-capacity": "kv_capacity.cli", "profile-analyzer": "profile_analyzer.cli", "dbo-runtime": "dbo_runtime.cli"}
CODE_BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)
# Subcommands that another issue is adding while the skills already document them: skipped only while the
# CLI lacks the subcommand, checked in full as soon as it exists.
PENDING: dict[tuple[str, str], str] = {}  # (tool, subcommand) a skill names before the CLI has it


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


SCRIPTS = ("render.py", "job.py", "serve_bench.py", "device_fit.py")


def _invocation(tokens: list[str]) -> list[tuple[str, str, list[str]]]:
    """(tool, path as written, arguments) of one command, and of the command a `job.py start` runs."""
    if tokens[0] in ("python", "python3") and len(tokens) > 1:
        tokens = tokens[1:]
    head = tokens[0]
    if head in PACKAGE_CLIS:
        return [(head, head, tokens[1:])]
    tool = next((name for name in SCRIPTS if head == name or head.endswith("/" + name)), None)
    if tool is None:
        return []
    found = [(tool, head, tokens[1:])]
    if tool == "job.py" and "--" in tokens:
        rest = tokens[tokens.index("--") + 1:]
        if rest:
            found += _invocation(rest)
    return found


def tool_invocations(document: Path) -> list[tuple[str, list[str]]]:
    """(tool, arguments) for each command of a known tool in `document`."""
    return [(tool, args) for tool, _, args in _located_invocations(document)]


def _located_invocations(document: Path) -> list[tuple[str, str, list[str]]]:
    calls = []
    for tokens in shell_commands(document.read_text(encoding="utf-8")):
        calls += _invocation(tokens)
    return calls


def _skill_of(document: Path) -> Path | None:
    """The skill folder a document belongs to (None for docs/)."""
    for parent in document.parents:
        if (parent / "SKILL.md").is_file():
            return parent
    return None


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
    assert {"kv-capacity", "profile-analyzer", "dbo-runtime", "render.py", "serve_bench.py", "job.py"} <= tools


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_match_the_real_parsers(document: Path, render_mod, serve_bench, job_mod, device_fit_mod) -> None:
    parsers = {tool: importlib.import_module(module).build_parser for tool, module in PACKAGE_CLIS.items()}
    parsers["render.py"] = render_mod.build_parser
    parsers["serve_bench.py"] = serve_bench.build_parser
    parsers["job.py"] = job_mod.build_parser
    parsers["device_fit.py"] = device_fit_mod.build_parser
    skill = _skill_of(document)
    problems = []
    for tool, path, args in _located_invocations(document):
        line = f"{path} {' '.join(args)}"
        own = args[: args.index("--")] if tool == "job.py" and "--" in args else args
        if tool in PACKAGE_CLIS and own and (tool, own[0]) in PENDING and _pending(parsers[tool](), own[0]):
            continue
        problems += [f"{line}: {p}" for p in check_against_parser(parsers[tool](), own)]
        if skill is None or tool in PACKAGE_CLIS:
            continue
        if path != f"scripts/{tool}" or not (skill / path).is_file():
            problems.append(f"{line}: a skill runs its own copy, scripts/{tool} (relative to the skill folder)")
        if tool == "render.py":
            template = own[0] if own and not own[0].startswith("-") else None
            if template is not None and not template.isupper():
                try:
                    render_mod.template_path(skill, template)
                except render_mod.RenderError as exc:
                    problems.append(f"{line}: {exc}")
    assert problems == []


def _pending(parser: argparse.ArgumentParser, subcommand: str) -> bool:
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)  # noqa: SLF001
    return sub is not None and subcommand not in sub.choices


def test_pending_subcommands_are_only_the_listed_ones() -> None:
    """The skip applies to the listed subcommands alone: any other unknown subcommand is still reported."""
    parser = importlib.import_module("dbo_runtime.cli").build_parser()
    assert check_against_parser(parser, ["comparee", "run"])[0].startswith("unknown subcommand 'comparee'")
    assert PENDING == {}


def test_the_checker_catches_a_wrong_option() -> None:
    parser = importlib.import_module("kv_capacity.cli").build_parser()
    assert check_against_parser(parser, ["plan", "--model", "x", "--kv-budget", "8G"]) == [
        "unknown option --kv-budget of kv-capacity plan"
    ]
    assert check_against_parser(parser, ["plann"])[0].startswith("unknown subcommand 'plann'")
    commands = shell_commands('```bash\nR="kv-capacity plan"\n$R --model m \\\n  --max-model-len 8 # note\n```\n')
    assert commands == [["R=kv-capacity plan"], ["kv-capacity", "plan", "--model", "m", "--max-model-len", "8"]]
