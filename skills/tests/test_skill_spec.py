"""Every skill folder is a valid Agent Skill (agentskills.io specification, skills-ref's rules).

The checks follow the reference validator `skills-ref` (agentskills/agentskills) and Anthropic's
quick_validate.py: front matter between `---` lines split the way skills-ref splits it, only the six
allowed keys, the name rules, name == folder name, description and compatibility lengths, no angle
brackets in the description, string-only metadata, a body under 500 lines, and every file the
SKILL.md names exists.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

SKILLS = Path(__file__).resolve().parents[1]
NOT_SKILLS = {"tests", "__pycache__"}
ALLOWED_FIELDS = {"name", "description", "license", "allowed-tools", "metadata", "compatibility"}
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
# Relative file references: markdown links and backticked paths under the conventional folders.
LINK_RE = re.compile(r"\]\(([^)#\s]+)\)")
PATH_RE = re.compile(r"`((?:templates|scripts|references|values|assets)/[A-Za-z0-9_./-]+)`")


def validate_skill(folder: Path) -> list[str]:
    """Problems of the skill in `folder` (empty when it is valid)."""
    skill_md = folder / "SKILL.md"
    if not skill_md.is_file():
        return [f"{folder.name}: no SKILL.md"]
    content = skill_md.read_text(encoding="utf-8")
    if not content.startswith("---"):
        return ["SKILL.md must start with '---' front matter"]
    parts = content.split("---", 2)  # as skills-ref does: a '---' inside the front matter breaks it
    if len(parts) < 3:
        return ["front matter is not closed with '---'"]
    front, body = parts[1], parts[2]
    try:
        meta = yaml.safe_load(front)
    except yaml.YAMLError as exc:
        return [f"front matter is not YAML: {exc}"]
    if not isinstance(meta, dict):
        return ["front matter must be a mapping"]
    errors: list[str] = []
    unexpected = sorted(set(meta) - ALLOWED_FIELDS)
    if unexpected:
        errors.append(f"Unexpected fields in frontmatter: {', '.join(unexpected)}")
    # strictyaml (used by skills-ref) rejects flow style and reads every value as a string.
    for line in front.splitlines():
        value = line.split(":", 1)[1].strip() if ":" in line else ""
        if value[:1] in ("[", "{"):
            errors.append(f"flow-style value (strictyaml rejects it): {line.strip()}")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        errors.append("name is required")
    else:
        if unicodedata.normalize("NFKC", name) != name:
            errors.append("name is not NFKC-normalised")
        if len(name) > 64:
            errors.append("name longer than 64 characters")
        if not NAME_RE.match(name):
            errors.append(f"name {name!r}: lowercase letters, digits and single inner hyphens only")
        if name != folder.name:
            errors.append(f"Directory name {folder.name!r} must match skill name {name!r}")
        if "anthropic" in name or "claude" in name:
            errors.append("name uses a reserved word")
    description = meta.get("description")
    if not isinstance(description, str) or not description.strip():
        errors.append("description is required and must be non-empty")
    else:
        if len(description) > 1024:
            errors.append(f"description is {len(description)} characters (max 1024)")
        if "<" in description or ">" in description:
            errors.append("description must not contain angle brackets")
    compatibility = meta.get("compatibility")
    if compatibility is not None and (not isinstance(compatibility, str) or len(compatibility) > 500):
        errors.append("compatibility must be a string of at most 500 characters")
    for key in ("license", "allowed-tools"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f"{key} must be a string")
    metadata = meta.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        errors.append("metadata must map strings to strings")
    if len(content.splitlines()) >= 500:
        errors.append("SKILL.md should stay under 500 lines")
    for ref in LINK_RE.findall(body) + PATH_RE.findall(body):
        if "://" in ref or ref.startswith(("/", "docs/")):
            continue
        if not (folder / ref).exists():
            errors.append(f"referenced file {ref} does not exist")
    return errors


def skill_folders() -> list[Path]:
    return sorted(p for p in SKILLS.iterdir() if p.is_dir() and p.name not in NOT_SKILLS and not p.name.startswith("."))


def test_there_are_the_three_skills() -> None:
    names = {p.name for p in skill_folders()}
    assert {"dbo-debug", "vllm-serve-bench", "kv-cache-sizing"} <= names


@pytest.mark.parametrize("folder", skill_folders(), ids=lambda p: p.name)
def test_skill_is_valid(folder: Path) -> None:
    assert validate_skill(folder) == []


@pytest.mark.parametrize("folder", skill_folders(), ids=lambda p: p.name)
def test_every_template_is_documented_and_has_example_values(folder: Path) -> None:
    text = (folder / "SKILL.md").read_text(encoding="utf-8")
    for template in sorted((folder / "assets").glob("*.j2")):
        assert f"assets/{template.name}" in text, f"{template.name} not mentioned in SKILL.md"
        stem = template.name.split(".", 1)[0]
        assert (folder / "assets" / f"{stem}.values.yaml").is_file(), f"no assets/{stem}.values.yaml for {template.name}"


@pytest.mark.parametrize("folder", skill_folders(), ids=lambda p: p.name)
def test_codex_display_metadata(folder: Path) -> None:
    """agents/openai.yaml (Codex's display data), as vLLM's own skills carry it."""
    interface = yaml.safe_load((folder / "agents" / "openai.yaml").read_text())["interface"]
    assert set(interface) == {"display_name", "short_description", "default_prompt"}
    assert all(isinstance(v, str) and v for v in interface.values())
    assert folder.name in interface["default_prompt"]


def _write_skill(root: Path, folder: str, front: str, body: str = "# Title\n") -> Path:
    path = root / folder
    path.mkdir()
    (path / "SKILL.md").write_text(f"---\n{front}---\n{body}")
    return path


@pytest.mark.parametrize(
    ("folder", "front", "body", "expected"),
    [
        ("Bad-Name", "name: Bad-Name\ndescription: x\n", "", "lowercase letters"),
        ("a--b", "name: a--b\ndescription: x\n", "", "single inner hyphens"),
        ("other", "name: good\ndescription: x\n", "", "must match skill name"),
        ("good", "name: good\n", "", "description is required"),
        ("good", f"name: good\ndescription: {'x' * 1025}\n", "", "max 1024"),
        ("good", "name: good\ndescription: use <this>\n", "", "angle brackets"),
        ("good", "name: good\ndescription: x\nuser-invocable: true\n", "", "Unexpected fields"),
        ("good", "name: good\ndescription: x\nmetadata:\n  version: 1\n", "", "strings to strings"),
        ("good", "name: good\ndescription: x\nmetadata: {a: b}\n", "", "flow-style"),
        ("good", "name: good\ndescription: x\n", "See [ref](references/missing.md).\n", "does not exist"),
        ("good", "name: good\ndescription: x\n", "Run `scripts/nope.py`.\n", "does not exist"),
    ],
)
def test_validator_rejects_bad_skills(tmp_path: Path, folder: str, front: str, body: str, expected: str) -> None:
    errors = validate_skill(_write_skill(tmp_path, folder, front, body))
    assert any(expected in e for e in errors), errors


def test_validator_accepts_a_minimal_skill(tmp_path: Path) -> None:
    assert validate_skill(_write_skill(tmp_path, "template-skill", "name: template-skill\ndescription: Does x.\n")) == []
