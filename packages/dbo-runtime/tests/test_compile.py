"""torch.compile (CPU inductor) on the reference model under both schedulers: does DBO on still give the compiled
DBO-off output, and does anything hang when two micro-batches enter one compiled callable? Slow (inductor compiles
the whole-batch and both micro-batch shapes on 2 ranks: minutes on 2 cores), so marked ``slow``."""

from __future__ import annotations

import pytest
from dbo_runtime.reference.launcher import run_ranks

pytestmark = pytest.mark.slow


def test_compiled_reference_model_under_both_schedulers():
    per_rank = run_ranks("dbo_runtime.reference.run:compile_task", ("greenlet", "thread"), world_size=2,
                         timeout_s=1200, pg_timeout_s=300)
    for result in per_rank:
        assert result["compiled_off_max_abs_diff_vs_eager"] < 1e-4, result
        for scheduler in ("greenlet", "thread"):
            found = result[scheduler]
            assert found["ran"], found
            assert found["equal_to_compiled_off"] and found["repeat_equal"], (scheduler, found)
