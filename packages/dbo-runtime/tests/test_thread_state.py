"""Issue 9, fault 3: micro-batch threads run under the caller's thread-local torch state.

Before the fix, run_ubatches started its threads with torch's defaults: a caller under
``torch.inference_mode()`` (as vLLM's ``execute_model`` is) got micro-batches outside it, and an in-place write
to an inference tensor raised there. These tests run the real runtime with two real threads.
"""

from __future__ import annotations

import threading

import pytest
import torch
from dbo_runtime.context import ThreadState, dbo_yield, run_ubatches
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.workers import SCHEDULER_ENV, SCHEDULERS


@pytest.fixture(params=SCHEDULERS, autouse=True)
def scheduler(request, monkeypatch):
    """Each test under both schedulers (thread and greenlet), picked as a user would: the environment variable."""
    monkeypatch.setenv(SCHEDULER_ENV, request.param)
    return request.param


def test_inplace_write_to_inference_tensor_works_in_both_ubatches():
    with torch.inference_mode():
        cache = torch.zeros(4)  # an inference tensor, like vLLM's KV cache made under inference mode

        def write(i: int):
            def run():
                cache[i] += 1.0  # raises "Inplace update to inference tensor outside InferenceMode" without the fix
                dbo_yield("site")
                cache[i + 2] += 1.0
                return torch.is_inference_mode_enabled()
            return run

        flags = run_ubatches([write(0), write(1)])
    assert flags == [True, True]
    assert cache.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_grad_mode_and_autocast_follow_the_caller():
    seen = []

    def probe():
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        dbo_yield("x")

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        run_ubatches([probe, probe])
    assert seen == [(False, True, torch.bfloat16)] * 2
    seen.clear()
    run_ubatches([probe, probe])  # and nothing leaks into the next run of the same (reused) threads
    assert [s[:2] for s in seen] == [(True, False)] * 2


def test_on_resume_runs_in_each_ubatch_thread_at_start_and_after_every_yield():
    installed: list[int] = []
    current = {"ctx": None}
    trace = []

    def resume(i):
        def fn():
            current["ctx"] = i
            installed.append(i)
        return fn

    def body(i):
        def run():
            for step in range(3):
                trace.append((i, step, current["ctx"], threading.current_thread().name))
                dbo_yield(f"s{step}")
            return i
        return run

    assert run_ubatches([body(0), body(1)], on_resume=[resume(0), resume(1)]) == [0, 1]
    # every line of model code saw its own micro-batch's context, never the other's
    assert all(i == ctx for i, _, ctx, _ in trace)
    assert installed.count(0) >= 4 and installed.count(1) >= 4


def test_on_resume_must_match_the_ubatches():
    with pytest.raises(DBOConfigError, match="one each"):
        run_ubatches([lambda: 0, lambda: 1], on_resume=[None])


def test_capture_reads_the_callers_state():
    with torch.inference_mode():
        state = ThreadState.capture()
    assert state.inference_mode and not ThreadState.capture().inference_mode


def test_a_mode_entered_between_two_hook_sites_stays_with_its_micro_batch():
    """Micro-batch 0 yields inside ``no_grad`` / ``inference_mode`` / ``autocast`` blocks: micro-batch 1 must
    run under the caller's modes meanwhile, 0 must find its own modes when it resumes, and the caller gets its
    modes back. Trivial with one OS thread each; with greenlets on one thread it is the switch's job."""
    seen = []

    def zero():
        with torch.no_grad():
            dbo_yield("a")
            seen.append(("0 in no_grad", torch.is_grad_enabled()))
        with torch.inference_mode():
            t = torch.zeros(2)
            dbo_yield("b")
            t += 1  # an in-place write to an inference tensor: only legal inside inference mode
            seen.append(("0 in inference", torch.is_inference_mode_enabled()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dbo_yield("c")
            seen.append(("0 in autocast", torch.is_autocast_enabled("cpu")))
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def one():
        for site in "abc":
            seen.append((f"1 at {site}", torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                         torch.is_autocast_enabled("cpu")))
            dbo_yield(site)
        return "one"

    assert run_ubatches([zero, one]) == [(True, False), "one"]
    assert seen == [
        ("1 at a", True, False, False), ("0 in no_grad", False),
        ("1 at b", True, False, False), ("0 in inference", True),
        ("1 at c", True, False, False), ("0 in autocast", True),
    ]
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and not torch.is_autocast_enabled("cpu")


def test_caller_modes_are_back_after_a_failed_run():
    def bad():
        torch._C._set_grad_enabled(False)  # a mode set without a ``with`` block, then a failure
        raise RuntimeError("boom")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(Exception, match="boom"):
            run_ubatches([bad, lambda: None])
        assert torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def test_caller_modes_are_back_after_a_micro_batch_failed_while_the_other_was_in_inference_mode():
    def waits_in_inference_mode():
        with torch.inference_mode():
            dbo_yield("a")  # aborted here: unwinds from its own (inference) state
            dbo_yield("b")

    def fails():
        dbo_yield("a")
        raise RuntimeError("boom")

    with pytest.raises(Exception, match="boom"):
        run_ubatches([waits_in_inference_mode, fails])
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert not torch.zeros(1).is_inference()
