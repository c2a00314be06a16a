"""The reference MoE model on 2 real gloo ranks: DBO on == off (bitwise in fp32), both patterns, faults, bad input."""

from __future__ import annotations

import time

import pytest
from dbo_runtime.cli import main
from dbo_runtime.reference.launcher import RanksFailed, run_ranks
from dbo_runtime.reference.run import EQUALITY_CONFIG, FaultSpec, equality_cases

SMALL = EQUALITY_CONFIG
PREFILL = next(c for c in equality_cases() if c.name == "a2-float32-prefill").batches

@pytest.fixture(scope="module", params=["thread", "greenlet"])
def equality(request):
    """DBO on (under each scheduler) vs off on every case; the tests below run once per scheduler."""
    t0 = time.monotonic()
    per_rank = run_ranks("dbo_runtime.reference.run:equality_task", (SMALL, equality_cases(), None, request.param),
                         world_size=2, timeout_s=240)
    return per_rank, time.monotonic() - t0


def _by_name(per_rank):
    return [{case["name"]: case for case in rank_cases} for rank_cases in per_rank]


@pytest.mark.parametrize("pattern", ["a2", "a3"])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_dbo_on_equals_off_bitwise_in_fp32(equality, pattern, kind):
    for rank, cases in enumerate(_by_name(equality[0])):
        case = cases[f"{pattern}-float32-{kind}"]
        assert case["split"], f"rank {rank}: DBO on did not split the batch"
        assert not case["split_off"]
        assert case["finite"]
        assert case["bitwise_equal"], f"rank {rank}: max abs diff {case['max_abs_diff']}"


@pytest.mark.parametrize("pattern", ["a2", "a3"])
def test_bf16_difference_is_reported_and_small(equality, pattern):
    for cases in _by_name(equality[0]):
        for kind in ("prefill", "decode"):
            case = cases[f"{pattern}-bfloat16-{kind}"]
            assert case["split"] and case["finite"]
            assert case["max_abs_diff"] < 0.05, case


def test_each_rank_returns_its_own_token_count(equality):
    rank0, rank1 = _by_name(equality[0])
    assert rank0["a2-float32-prefill"]["rows"] == PREFILL[0].num_tokens
    assert rank1["a2-float32-prefill"]["rows"] == PREFILL[1].num_tokens


def test_patterns_agree_with_each_other(equality):
    """A2 (all-gather/reduce-scatter) and A3 (all-to-all) compute the same MoE through different collectives."""
    for cases in _by_name(equality[0]):
        for kind in ("prefill", "decode"):
            a2, a3 = cases[f"a2-float32-{kind}"], cases[f"a3-float32-{kind}"]
            assert abs(a2["checksum"] - a3["checksum"]) < 1e-3 * max(1.0, abs(a2["checksum"]))
            assert a2["checksum"] != 0.0


def test_below_threshold_is_not_split(equality):
    for cases in _by_name(equality[0]):
        case = cases["a2-below-threshold"]
        assert not case["split"] and case["bitwise_equal"]


@pytest.mark.parametrize("scheduler", ["thread", "greenlet"])
def test_fault_on_one_rank_is_an_error_on_every_rank(scheduler):
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks("dbo_runtime.reference.run:fault_task", FaultSpec(kind="raise", scheduler=scheduler), world_size=2,
                  timeout_s=90, pg_timeout_s=10)  # fmt: skip
    elapsed = time.monotonic() - t0
    errors = {e.rank: e for e in info.value.errors}
    assert set(errors) == {0, 1}, info.value
    assert errors[1].type == "DBOWorkerError" and "micro-batch 1" in errors[1].message
    assert "injected at hook site layer1.moe.prepare" in errors[1].message
    assert errors[0].type in {"DBOWorkerError", "DBOTimeoutError", "DBOError"}, errors[0]
    assert elapsed < 90


@pytest.mark.parametrize("scheduler", ["thread", "greenlet"])
def test_collective_that_does_not_complete_is_a_timeout_naming_it(scheduler):
    """Rank 1's micro-batch 1 computes far past the timeout before its collective: rank 0 waits on a handle that
    does not complete. With greenlets nothing can preempt rank 1's compute, but rank 0's wait is bounded: an error
    naming the collective, not a hang."""
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks("dbo_runtime.reference.run:fault_task",
                  FaultSpec(kind="stall", scheduler=scheduler, timeout_s=2.0), world_size=2, timeout_s=90,
                  pg_timeout_s=10)  # fmt: skip
    assert time.monotonic() - t0 < 60
    errors = {e.rank: e for e in info.value.errors}
    assert 0 in errors, info.value
    if scheduler == "greenlet":  # the bounded wait on the collective's handle ends it
        assert "collective dbo.ubatch1.comm.all_gather.layer1" in errors[0].message, errors[0]
        assert "timed out" in errors[0].message.lower(), errors[0]
    else:  # the thread scheduler's handoff timeout is as long as the collective's: whichever fires first names it
        handoff = errors[0].type == "DBOTimeoutError" and "hook site 'layer1.moe." in errors[0].message
        collective = ("collective dbo.ubatch1.comm.all_gather.layer1" in errors[0].message
                      and "timed out" in errors[0].message.lower())  # seen in a loaded CI run
        assert handoff or collective, errors[0]


def test_rank_configuration_mismatch_is_an_error_on_every_rank():
    with pytest.raises(RanksFailed) as info:
        run_ranks("dbo_runtime.reference.run:fault_task", FaultSpec(kind="mismatch"), world_size=2, timeout_s=90,
                  pg_timeout_s=10)  # fmt: skip
    errors = info.value.errors
    assert sorted(e.rank for e in errors) == [0, 1]
    assert all(e.type == "DBOConfigError" and "ranks disagree" in e.message for e in errors)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ubatch-size", "3"], "--ubatch-size 3"),
        (["--ranks", "3"], "3 ranks"),
        (["--ranks", "9"], "--ranks"),
        (["--link", "20"], "--link"),
        (["--link", "nan,1"], "--link"),
        (["--pattern", "a4"], "--pattern"),
        (["--requests", "9", "--tokens", "4"], "--requests"),
        # issue 11: refused before a rank starts (was: raw per-rank errors, exit 1)
        (["--tokens", "99999999999"], "--tokens"),
        (["--tokens", "9" * 5000], "5,000 characters"),
        (["--trace", "/proc/nope"], "--trace"),
        (["--hidden", "60000", "--intermediate", "200000", "--tokens", "200000"], "GiB"),
        (["--dbo-prefill-token-threshold", "1"], "--dbo-prefill-token-threshold"),
        (["--dbo-decode-token-threshold", "x"], "--dbo-decode-token-threshold"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "-1"], "--timeout"),
        (["--steps", "0"], "--steps"),
        (["--format", "xml"], "--format"),
        (["--dbo", "on"], "--dbo"),  # the old spelling: vLLM's is --enable-dbo / --no-enable-dbo
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, needle, capsys, tmp_path):
    code = main(["reference", *argv, "-o", str(tmp_path / "report.txt")])
    err = capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("signame, status, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_interrupting_the_parent_stops_the_ranks_at_once(signame, status, word):
    """Issue 11: Ctrl-C to the parent only printed "interrupted" and exited 47 s later while the ranks ran on."""
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dbo_runtime", "reference", "--layers", "2", "--tokens", "256", "--hidden", "64",
           "--intermediate", "128", "--steps", "10000", "--timeout", "600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        ranks: list[str] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(0.5)
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            ranks = [c for c in children if _cmdline(c).count("spawn_main")]
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(2)
        started = time.monotonic()
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - started < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status and err.strip().splitlines() == [f"dbo-runtime: {word}"], err
    time.sleep(0.5)
    assert [r for r in ranks if os.path.exists(f"/proc/{r}") and _cmdline(r).count("spawn_main")] == []


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _spawned_children(pid: int) -> list[int]:
    """The rank processes of ``pid`` (spawned interpreters; not its resource tracker)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/stat"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_reference_ranks_do_not_outlive_the_parent(tmp_path, how):
    # before: after a SIGKILL of the parent the ranks lived on (measured: still there 10 s later); torch's own
    # parent-death SIGINT only reaches Python between collectives
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "dbo_runtime.cli", "reference", "--steps", "100000",
                             "--timeout", "600", "-o", str(tmp_path / "ref.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(ranks) < 2 and proc.poll() is None:
            ranks = _spawned_children(proc.pid)
            time.sleep(0.05)
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(1.0)  # into the run: the ranks have their process group
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=30)
        parent_gone = time.monotonic()
        while time.monotonic() < parent_gone + 10 and not all(_gone(r) for r in ranks):
            time.sleep(0.01)
        lag = time.monotonic() - parent_gone
        # The bound is for "killed with the parent", not for how fast the kernel tears a torch process down: a
        # SIGKILLed rank took 0.58 s to exit in a fresh-clone CI run on 2 loaded cores (0.5 s was the bound then).
        # Without the parent-death signal the ranks run on to the end of the run (measured: still there 10 s later).
        assert all(_gone(r) for r in ranks) and lag < 3.0, f"rank processes {ranks} outlived the parent ({how}, {lag:.2f} s)"
        err = proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
        for rank in ranks:
            if not _gone(rank):
                __import__("os").kill(rank, signal.SIGKILL)
    if how == "SIGTERM":
        assert proc.returncode == 143 and err.strip() == "dbo-runtime: terminated", err
    assert not (tmp_path / "ref.txt").exists()
