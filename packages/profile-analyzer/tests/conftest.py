from __future__ import annotations

from pathlib import Path

import pytest

# Real profiler output copied unchanged from Ascend/msprof-analyze test data (see data/msprof-sample/README.md).
SAMPLES = Path(__file__).resolve().parent / "data" / "msprof-sample"


@pytest.fixture
def msprof_sample() -> Path:
    return SAMPLES
