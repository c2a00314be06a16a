"""kv-cache-sizing's scripts/device_fit.py: weights per device, the fit verdict, and one-line bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "packages" / "kv-capacity" / "src" / "kv_capacity" / "presets"
SCRIPT = REPO / "skills" / "kv-cache-sizing" / "scripts" / "device_fit.py"
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def fit(device_fit_mod):
    return device_fit_mod


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=ENV)


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b-v0.1"])
def test_parameter_count_from_config_matches_the_published_count(fit, name: str) -> None:
    """The config formula and the table of published counts agree (untied embeddings: these models' real configs)."""
    config = json.loads((PRESETS / f"{name}.json").read_text())
    counted = fit.parameters_from_config({**config, "tie_word_embeddings": False})
    assert counted == pytest.approx(fit.PRESET_PARAMETERS[name][0], rel=0.02)


def test_moe_and_mla_counts_are_in_the_published_range(fit) -> None:
    for name in ("qwen3-30b-a3b", "deepseek-v2-lite"):
        config = json.loads((PRESETS / f"{name}.json").read_text())
        assert fit.parameters_from_config(config) == pytest.approx(fit.PRESET_PARAMETERS[name][0], rel=0.06), name


def test_every_bundled_preset_has_a_parameter_count(fit) -> None:
    assert {p.stem for p in PRESETS.glob("*.json")} == set(fit.PRESET_PARAMETERS)


def test_model_folder_weights_are_the_safetensors_sizes(fit, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 8}))
    for i in range(2):
        with open(tmp_path / f"model-{i}.safetensors", "wb") as handle:
            handle.truncate(3 * 1024**3)
    gib, how = fit.weights_per_device(str(tmp_path), 2, None, None)
    assert gib == 3.0 and "2 weight file(s)" in how


def test_a_budget_that_fits_exits_0(tmp_path: Path) -> None:
    proc = _run("--model", "qwen3-8b", "--device", "910B3", "--max-model-len", "32768", "--kv-cache-memory-bytes", "8G",
                "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["fits"] and result["alternatives"] == [] and result["vllm_log"].startswith("NPU KV cache size")
    # the largest budget leaves exactly the weights and the headroom
    largest = int(result["largest_budget_flag"].rstrip("M")) * 2**20
    assert 0 <= 64 * 0.9 * 1024**3 - result["weights_per_device_gib"] * 1024**3 - 2 * 1024**3 - largest < 2**20


def test_a_small_device_does_not_fit(tmp_path: Path) -> None:
    """910B4 (32 GB): 8 requests of 32K at TP 1 need 36 GiB of KV beside 15 GiB of weights."""
    proc = _run("--model", "qwen3-8b", "--device", "910B4", "--max-model-len", "32768", "--max-num-seqs", "8",
                cwd=tmp_path)
    assert proc.returncode == 1
    assert "does NOT fit on 910B4" in proc.stdout and "tensor parallel size 2" in proc.stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["--device", "910X"], "--device 910X: accepted: 910B1"),
    (["--device", "910B3", "--device-memory", "lots"], "--device-memory 'lots': expected a size"),
    (["--device", "910B3", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
    (["--device", "910B3", "-tp", "0"], "--tensor-parallel-size 0: must be 1 or more"),
    (["--device", "910B3", "--kv-capacity-cmd", "no-such-kv-capacity"], "no `no-such-kv-capacity` command"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    proc = _run("--model", "qwen3-8b", "--max-model-len", "32768", "--max-num-seqs", "4", *args, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []


def test_unknown_model_says_what_is_accepted(tmp_path: Path) -> None:
    proc = _run("--model", "no-such-model", "--device", "910B3", "--max-model-len", "4096", "--max-num-seqs", "1",
                cwd=tmp_path)
    assert proc.returncode == 2 and "qwen3-8b" in proc.stderr and "--weights-gib" in proc.stderr
