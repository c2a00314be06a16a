"""The kv-capacity CLI, run as a subprocess: exit codes, one-line errors, JSON and table output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kv_capacity import load_model, parse_size, plan, required_bytes


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kv_capacity", *args], capture_output=True, text=True, timeout=60
    )


def test_plan_json_has_the_contract_keys():
    out = run(
        "plan",
        "--model",
        "qwen3-8b",
        "--kv-cache-memory-bytes",
        "8G",
        "--max-model-len",
        "40960",
        "--block-size",
        "16",
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    expected = plan(load_model("qwen3-8b"), kv_cache_memory_bytes=8 << 30, max_model_len=40960, block_size=16)
    for key in (
        "num_blocks",
        "kv_cache_tokens",
        "max_concurrency",
        "bytes_per_token",
        "fits",
        "page_size_bytes",
        "estimated_max_model_len",
        "min_kv_cache_memory_bytes",
    ):
        assert key in data
    assert (
        (data["num_blocks"], data["kv_cache_tokens"], data["fits"])
        == (expected.num_blocks, expected.kv_cache_tokens, True)
        == (3640, 58240, True)
    )
    assert data["bytes_per_token"] == 147456 and data["page_size_bytes"] == [65536]


def test_plan_text_is_a_table_and_default_block_is_128():
    out = run(
        "plan", "--model", "deepseek-v2-lite", "--kv-cache-memory-bytes", "8GiB", "--max-model-len", "163840"
    )
    assert out.returncode == 0, out.stderr
    assert "num_blocks" in out.stdout and "2,157" in out.stdout and "276,096" in out.stdout  # §5, block 128
    assert "KV cache size: 276,096 tokens" in out.stdout


@pytest.mark.parametrize("device", ["npu", "CPU"])
def test_plan_quotes_the_log_line_as_the_named_device_prints_it(device):
    # vLLM-Ascend's start-up line says "NPU KV cache size", the CPU backend "CPU": a user grepping the server log
    # for the quoted line must find it.
    args = ("plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "16G", "--max-model-len", "32768",
            "--log-device", device)
    text, js = run(*args), run(*args, "--format", "json")
    assert text.returncode == 0 and js.returncode == 0, text.stderr + js.stderr
    line = f"{device.upper()} KV cache size: 116,480 tokens"
    assert f"vLLM logs: {line}" in text.stdout and "GPU KV cache" not in text.stdout
    assert json.loads(js.stdout)["vllm_log"].startswith(line)


def test_plan_that_does_not_fit_prints_vllms_failure_and_exits_1():
    out = run(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--kv-cache-memory-bytes",
        "8G",
        "--max-model-len",
        "131072",
        "--block-size",
        "16",
        "--format",
        "json",
    )
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["fits"] is False and data["estimated_max_model_len"] == 65520
    assert data["min_kv_cache_memory_bytes"] == 32 * 65536 * (8192 + 1)
    assert "To serve at least one request with the model's max seq len (131072)" in out.stderr
    assert "--kv-cache-memory-bytes" in out.stderr and "--max-model-len 65520" in out.stderr


def test_check_exit_codes():
    ok = run(
        "check",
        "--model",
        "qwen3-8b",
        "--kv-cache-memory-bytes",
        "8G",
        "--max-model-len",
        "40960",
        "--block-size",
        "16",
    )
    assert ok.returncode == 0 and "OK" in ok.stdout
    bad = run(
        "check",
        "--model",
        "gemma-3-12b",
        "--kv-cache-memory-bytes",
        "8G",
        "--max-model-len",
        "131072",
        "--block-size",
        "16",
    )
    assert bad.returncode == 1
    assert "estimated maximum model length is" in bad.stderr and "smallest sufficient budget" in bad.stderr


def test_required_matches_the_api():
    out = run(
        "required",
        "--model",
        "qwen2.5-7b",
        "--max-model-len",
        "32768",
        "--concurrency",
        "4",
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["required_bytes"] == required_bytes(
        load_model("qwen2.5-7b"), max_model_len=32768, concurrency=4
    )
    assert parse_size(data["kv_cache_memory_bytes_flag"]) == data["required_bytes"]
    text = run("required", "--model", "qwen2.5-7b", "--max-model-len", "32768", "--concurrency", "4")
    assert text.returncode == 0 and f"{data['required_bytes']:,}" in text.stdout


def test_presets_lists_every_model():
    out = run("presets")
    assert out.returncode == 0
    for name in ("qwen3-8b", "deepseek-v3", "gemma-3-12b", "mistral-7b-v0.1"):
        assert name in out.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["plan", "--model", "no-such-model", "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024"],
            "no-such-model",
        ),
        (
            ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8.5G", "--max-model-len", "1024"],
            "8.5G",
        ),
        (
            ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "lots", "--max-model-len", "1024"],
            "lots",
        ),
        (
            ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "0", "--max-model-len", "1024"],
            "positive",
        ),
        (
            ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8G", "--max-model-len", "0"],
            "max model len",
        ),
        (
            ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8G", "--max-model-len", "-5"],
            "max model len",
        ),
        (
            ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8G", "--max-model-len", "1k"],
            "max model len",
        ),
        (
            [
                "plan",
                "--model",
                "qwen3-8b",
                "--kv-cache-memory-bytes",
                "8G",
                "--max-model-len",
                "1024",
                "--block-size",
                "0",
            ],
            "block size",
        ),
        (
            [
                "plan",
                "--model",
                "qwen3-8b",
                "--kv-cache-memory-bytes",
                "8G",
                "--max-model-len",
                "1024",
                "--tensor-parallel-size",
                "3",
            ],
            "tensor parallel size 3",
        ),
        (
            [
                "plan",
                "--model",
                "qwen3-8b",
                "--kv-cache-memory-bytes",
                "8G",
                "--max-model-len",
                "1024",
                "--kv-cache-dtype",
                "int4",
            ],
            "kv cache dtype",
        ),
        (
            [
                "plan",
                "--model",
                "qwen3-8b",
                "--kv-cache-memory-bytes",
                "8G",
                "--max-model-len",
                "1024",
                "--format",
                "xml",
            ],
            "format",
        ),
        (["plan", "--model", "qwen3-8b", "--max-model-len", "1024"], "--kv-cache-memory-bytes"),
        (["required", "--model", "qwen3-8b", "--max-model-len", "1024", "--concurrency", "0"], "concurrency"),
        (
            ["check", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8GB!", "--max-model-len", "1024"],
            "8GB!",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    out = run(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert fragment in lines[0]
    assert out.stdout == ""


def test_bad_config_files_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{oops")
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "head_dim": 64,
                "layers_block_type": ["mamba", "attention"],
            }
        )
    )
    (tmp_path / "empty").mkdir()
    for model, fragment in (
        (tmp_path / "broken", "not valid JSON"),
        (tmp_path / "mamba", "cannot be sized"),
        (tmp_path / "empty", "no config.json"),
    ):
        out = run("plan", "--model", str(model), "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024")
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0]
