"""`make skills-install` links every skill where agents look (.agents/skills and .claude/skills).

Run on a scratch copy of the Makefile whose skills/ points at this repository's skills, so the test
does not touch the checkout's own .agents/ and .claude/ folders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKILL_NAMES = sorted(p.parent.name for p in (REPO / "skills").glob("*/SKILL.md"))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_skills_install_links_every_skill(tmp_path: Path) -> None:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "skills").symlink_to(REPO / "skills")
    for _ in range(2):  # idempotent: a second run replaces the links instead of nesting them
        proc = subprocess.run(["make", "-s", "-C", str(tmp_path), "skills-install"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    for name in SKILL_NAMES:
        assert f"linked {name}" in proc.stdout
        for agent_dir in (".agents/skills", ".claude/skills"):
            link = tmp_path / agent_dir / name
            assert link.is_symlink() and os.readlink(link) == f"../../skills/{name}"  # relative: survives a moved checkout
            text = (link / "SKILL.md").read_text()
            assert text.startswith("---\nname: " + name + "\n")
            assert not (link / name).exists()
