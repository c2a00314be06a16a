"""dbo-runtime's declared dependencies: installed into an Ascend environment, it must not replace the torch that
torch_npu was built against (vllm-ascend 0.23.0.post1 runs torch 2.10; this machine runs 2.13)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _requirement(name: str) -> str:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    found = [d for d in deps if re.match(rf"{name}\s*([<>=!~;\[]|$)", d)]
    assert len(found) == 1, f"{name} must be listed once in {PYPROJECT}: {deps}"
    return found[0]


def test_torch_is_a_lower_bound_without_pin_or_cap() -> None:
    spec = _requirement("torch")
    clauses = [c.strip() for c in spec[len("torch"):].split(",") if c.strip()]
    assert not any(c.startswith(("==", "===", "~=", "<")) for c in clauses), (
        f"{spec!r}: pinning or capping torch would make pip replace an Ascend host's torch (and break torch_npu)")
    lower = [c for c in clauses if c.startswith(">=")]
    assert len(lower) == 1, f"{spec!r}: expected one lower bound"
    major, minor = (int(v) for v in lower[0][2:].split(".")[:2])
    # vllm-ascend 0.23.0.post1's torch (2.10) must satisfy it.
    assert (major, minor) <= (2, 10), spec
