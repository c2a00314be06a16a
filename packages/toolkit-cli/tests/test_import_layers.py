"""The packages' layers (import-linter contracts in the root pyproject.toml, `make lint`) hold in `make test` too:
a module that starts importing upward fails CI, not only a lint run someone may skip."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_every_import_linter_contract_is_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed in this interpreter's environment (make setup installs it)")
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    kept = [line for line in proc.stdout.splitlines() if line.endswith("KEPT") or " KEPT (" in line]
    # one layers contract per tool package, plus the forbidden one
    assert {line.split(" layers")[0] for line in kept if " layers" in line} >= {"kv_capacity", "profile_analyzer",
                                                                               "dbo_runtime"}
