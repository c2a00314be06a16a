"""Every example a skill script's `--help` shows runs, as shown, in that skill.

Each script in a skill's scripts/ prints an "Examples" block in its --help: lines `python scripts/X ...`
meant to be run from the skill's folder (or from elsewhere with scripts/ and assets/ prefixed with that
folder). The skill is copied alone outside the repository, and every example line is run from a separate
working folder, with its paths prefixed the way SKILL.md tells an agent to, with the interpreter the skills
name (the toolkit's, which has jinja2, pyyaml and the toolkit CLIs). An example must exit 0, except one
that says it needs vLLM: without vLLM in this interpreter it must end with one line and exit 2.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SKILLS = Path(__file__).resolve().parents[1]
SKILL_NAMES = sorted(p.parent.name for p in SKILLS.glob("*/SKILL.md"))
SCRIPTS = [(s, p.name) for s in SKILL_NAMES for p in sorted((SKILLS / s / "scripts").glob("*.py"))]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def examples_of(help_text: str) -> list[str]:
    """The command lines of the "Examples" block of a --help text."""
    lines = help_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Examples")), None)
    if start is None:
        return []
    found = []
    for line in lines[start + 1:]:
        if not line.startswith("  python "):
            break
        found.append(line.strip())
    return found


def as_run_elsewhere(line: str, skill: Path) -> list[str]:
    """An example line as an agent runs it from its working folder: the skill's paths prefixed, `python`
    the skills' interpreter."""
    tokens = shlex.split(line)
    assert tokens[0] == "python"
    out = [sys.executable]
    for token in tokens[1:]:
        if re.match(r"^(scripts|assets)/", token):
            token = str(skill / token)
        out.append(token)
    return out


def tool_env() -> dict[str, str]:
    """PATH with this interpreter's folder first (kv-capacity, profile-analyzer: the toolkit's CLIs)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _help(path: Path, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_examples_block_is_parsed() -> None:
    text = "usage: x\n\nExamples (from the skill's folder):\n  python scripts/a.py --list\n  python scripts/a.py b\n\nmore\n"
    assert examples_of(text) == ["python scripts/a.py --list", "python scripts/a.py b"]
    assert examples_of("usage: x\n  python scripts/a.py\n") == []


@pytest.mark.parametrize(("skill", "script"), SCRIPTS, ids=[f"{s}/{n}" for s, n in SCRIPTS])
def test_help_examples_run_in_the_copied_skill(tmp_path: Path, skill: str, script: str) -> None:
    folder = tmp_path / "agent-skills" / skill
    shutil.copytree(SKILLS / skill, folder, ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    text = _help(folder / "scripts" / script, work)
    examples = examples_of(text)
    assert examples, f"{skill}/scripts/{script} --help shows no Examples block"
    for line in examples:
        assert line.startswith(f"python scripts/{script} "), line
        needs_vllm = "need vLLM" in text.split("Examples", 1)[1].splitlines()[0]
        proc = subprocess.run(as_run_elsewhere(line, folder), capture_output=True, text=True, timeout=120, cwd=work,
                              env=tool_env())
        if needs_vllm and not HAVE_VLLM:
            assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (line, proc.stderr)
            assert "no vLLM" in proc.stderr
            continue
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-1000:]}\n{proc.stderr[-1000:]}"
        assert "Traceback" not in proc.stderr
    # examples write into the working folder, never into the skill
    assert sorted(p.name for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts) == sorted(
        p.name for p in (SKILLS / skill).rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_render_help_examples_name_only_this_skills_templates() -> None:
    """The renderer is one file copied into every skill, yet its --help examples are each skill's own."""
    for skill in SKILL_NAMES:
        text = _help(SKILLS / skill / "scripts" / "render.py", SKILLS)
        names = {shlex.split(line)[2] for line in examples_of(text) if not line.endswith("--list")}
        own = {p.name.split(".", 1)[0] for p in (SKILLS / skill / "assets").glob("*.j2")}
        assert names == own, skill
        assert "extra_args.max-num-seqs=24" in text  # the override syntax is in every skill's help


def test_uv_run_reads_the_pep723_header(tmp_path: Path) -> None:
    """The other interpreter the skills name: `uv run scripts/render.py` installs jinja2 and pyyaml from the
    script's PEP 723 header (offline here: from uv's cache; skipped where uv or its cache lacks them)."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    folder = tmp_path / "kv-cache-sizing"
    shutil.copytree(SKILLS / "kv-cache-sizing", folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    proc = subprocess.run([uv, "run", "--offline", "--no-project", "--quiet", str(folder / "scripts" / "render.py"),
                           "launch_with_budget", "--example", "--set", "tensor_parallel_size=2"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    if "jinja2" in proc.stderr and ("offline" in proc.stderr.lower() or "not found in the cache" in proc.stderr):
        pytest.skip("uv's cache has no jinja2/pyyaml and the network is off")
    assert proc.returncode == 2 and "needs 2" in proc.stderr, proc.stderr  # the renderer ran, and checked the values
