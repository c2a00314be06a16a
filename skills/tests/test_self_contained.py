"""Each skill works when its folder is copied alone into an agent's skills folder.

- The files several skills share (the renderer, job.py, long-runs.md, LICENSE, shared templates and the
  harness) are byte-identical copies of one source (skills/sync.py names them), and the check catches a
  copy that drifted.
- A skill folder copied to a temporary directory outside the repository renders every template of its
  assets/ with the example values, from a working folder elsewhere, and every script in scripts/ answers
  `--help` (a black box an agent can query); every standalone script has a PEP 723 header.
- SKILL.md and references/ send the agent to no file outside the skill folder; every reference is loaded
  with a "Read `references/X` when/before ..." line; each skill carries the LICENSE its front matter names.
- The reference validator, PyPI `skills-ref` (`agentskills validate`), accepts every skill.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SKILLS = REPO / "skills"
SKILL_NAMES = sorted(p.parent.name for p in SKILLS.glob("*/SKILL.md"))
# Paths an agent would resolve against the repository, not the skill: skills/x, docs/x, packages/x.
REPO_PATH_RE = re.compile(r"(?<![\w./-])(?:skills|docs|packages)/[\w.-]+")
READ_WHEN_RE = re.compile(r"Read `(references/[\w.-]+\.md)` (?:when|before) ")


def _sync():
    spec = importlib.util.spec_from_file_location("skills_sync", SKILLS / "sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shared_copies_equal_their_source() -> None:
    sync = _sync()
    pairs = sync.copies()
    assert {dst.parent.parent.name for _, dst in pairs if dst.name == "render.py"} == set(SKILL_NAMES)
    assert sync.stale() == [], "run `make skills-sync`"


def test_the_check_catches_a_drifted_copy(tmp_path: Path) -> None:
    root = tmp_path / "skills"
    shutil.copytree(SKILLS, root, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    shutil.copy(REPO / "LICENSE", tmp_path / "LICENSE")
    sync = _sync()
    assert sync.stale(root) == []
    copy = root / "kv-cache-sizing" / "scripts" / "render.py"
    copy.write_text(copy.read_text() + "# edited here\n")
    (root / "dbo-debug" / "scripts" / "job.py").unlink()
    assert sorted(sync.stale(root)) == ["dbo-debug/scripts/job.py", "kv-cache-sizing/scripts/render.py"]
    assert sorted(sync.write(root)) == ["dbo-debug/scripts/job.py", "kv-cache-sizing/scripts/render.py"]
    assert sync.stale(root) == [] and copy.read_bytes() == (SKILLS / "render.py").read_bytes()


@pytest.fixture(scope="module")
def copied_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every skill folder copied alone into an agent-style skills folder outside the repository."""
    root = tmp_path_factory.mktemp("agent-home") / ".claude" / "skills"
    assert REPO not in root.parents
    for name in SKILL_NAMES:
        shutil.copytree(SKILLS / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return {name: root / name for name in SKILL_NAMES}


def _templates(skill: str) -> list[str]:
    return sorted(p.name[: -len(".j2")] for p in (SKILLS / skill / "assets").glob("*.j2"))


COPIED_TEMPLATES = [(s, t) for s in SKILL_NAMES for t in _templates(s)]


@pytest.mark.parametrize(("skill", "template"), COPIED_TEMPLATES, ids=[f"{s}/{t}" for s, t in COPIED_TEMPLATES])
def test_copied_out_skill_renders_its_templates(tmp_path: Path, copied_out: dict[str, Path], skill: str,
                                                template: str) -> None:
    folder = copied_out[skill]
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(folder / "scripts" / "render.py"), template, "--example", "-o", template],
        capture_output=True, text=True, timeout=60, cwd=work,
    )
    assert proc.returncode == 0, proc.stderr
    text = (work / template).read_text()
    assert text.strip() and "{{" not in text and "{%" not in text
    assert os.listdir(work) == [template]  # written where the agent works, nothing else
    listed = subprocess.run([sys.executable, str(folder / "scripts" / "render.py"), "--list"],
                            capture_output=True, text=True, timeout=60, cwd=work)
    assert listed.returncode == 0 and f"{template}: " in listed.stdout


SCRIPTS = [(s, p.name) for s in SKILL_NAMES for p in sorted((SKILLS / s / "scripts").glob("*.py"))]


@pytest.mark.parametrize(("skill", "script"), SCRIPTS, ids=[f"{s}/{n}" for s, n in SCRIPTS])
def test_copied_out_scripts_answer_help(tmp_path: Path, copied_out: dict[str, Path], skill: str, script: str) -> None:
    path = copied_out[skill] / "scripts" / script
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env python3\n# /// script\n"), "PEP 723 header after the shebang"
    header = text.split("# ///", 2)[1]
    assert "requires-python" in header and "dependencies" in header
    assert os.access(path, os.X_OK)
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) >= 5 and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_a_copied_out_job_runs_and_is_polled(tmp_path: Path, copied_out: dict[str, Path], skill: str) -> None:
    job = [sys.executable, str(copied_out[skill] / "scripts" / "job.py")]
    started = subprocess.run([*job, "start", "quick", "--", sys.executable, "-c", "print('hello from the job')"],
                             capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    waited = subprocess.run([*job, "wait", "quick", "--timeout", "30"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert waited.returncode == 0 and "done, exit code 0" in waited.stdout and "hello from the job" in waited.stdout
    assert (tmp_path / "jobs" / "quick.rc").read_text().strip() == "0"


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_no_path_outside_the_skill(skill: str) -> None:
    folder = SKILLS / skill
    documents = [folder / "SKILL.md", *sorted((folder / "references").glob("*.md"))]
    found = [f"{doc.relative_to(SKILLS)}: {m}" for doc in documents for m in REPO_PATH_RE.findall(doc.read_text())]
    assert found == []


def test_the_repository_path_check_sees_one() -> None:
    assert REPO_PATH_RE.findall("see docs/kv-cache.md or `python skills/render.py x`; not .claude/skills/x") == [
        "docs/kv-cache.md", "skills/render.py",
    ]


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_every_reference_is_loaded_with_read_when(skill: str) -> None:
    folder = SKILLS / skill
    text = (folder / "SKILL.md").read_text()
    loaded = set(READ_WHEN_RE.findall(text))
    present = {f"references/{p.name}" for p in (folder / "references").glob("*.md")}
    assert present, "a skill has at least references/long-runs.md"
    assert loaded == present
    for reference in present:  # a reference starts with a title and says when it applies
        assert (folder / reference).read_text().startswith("# ")


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_license_file_matches_the_front_matter(skill: str) -> None:
    front = yaml.safe_load((SKILLS / skill / "SKILL.md").read_text().split("---", 2)[1])
    assert front["license"] == "Apache-2.0"
    text = (SKILLS / skill / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    assert text == (REPO / "LICENSE").read_text()


def _agentskills() -> str:
    found = shutil.which("agentskills") or str(Path(sys.executable).parent / "agentskills")
    if not os.access(found, os.X_OK):
        pytest.fail("no `agentskills` (PyPI skills-ref): run `make setup`")
    return found


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_skills_ref_validates(copied_out: dict[str, Path], skill: str) -> None:
    proc = subprocess.run([_agentskills(), "validate", str(copied_out[skill])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Valid skill" in proc.stdout


def test_skills_ref_rejects_a_bad_skill(tmp_path: Path) -> None:
    bad = tmp_path / "bad-skill"
    bad.mkdir()
    (bad / "SKILL.md").write_text("---\nname: other-name\ndescription: x\n---\n# x\n")
    proc = subprocess.run([_agentskills(), "validate", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
