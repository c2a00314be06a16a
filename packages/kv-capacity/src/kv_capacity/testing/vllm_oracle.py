"""vLLM's own capacity code as an oracle: KV cache configs for any config.json, without weights or a server.

Runs inside the vllm virtualenv (it imports vLLM). For each model config it builds the engine config vLLM
would build (`EngineArgs(...).create_engine_config()` on a folder holding only that config.json), the
per-layer KV cache specs the model's attention layers would report (FullAttentionSpec,
SlidingWindowSpec or MLAAttentionSpec, read off vLLM's ModelConfig: layer count, KV heads per TP rank,
head size, sliding window), and hands them to vLLM's `get_kv_cache_configs` with each budget, one spec
dict per tensor-parallel worker, as `EngineCore._initialize_kv_caches` does. It reports the numbers the
engine would log (blocks, "KV cache size" tokens, maximum concurrency) or the start-up ValueError.

All cases go through one process so vLLM is imported once (vLLM logs to stdout, hence files):

    python -m kv_capacity.testing.vllm_oracle cases.json results.json

A multimodal config (one with a `text_config`, e.g. Gemma-3) is sized through its language model: the
text config under the matching `...ForCausalLM` architecture, which has the same attention layers.

Input: {"cases": [{"id": str, "config": {config.json}, "tensor_parallel_size": int,
"kv_cache_dtype": str, "block_size": int, "max_model_len": int, "budgets": [int, ...],
"max_num_batched_tokens": int, "async_scheduling": bool}]}.
Output: {"vllm_version": str, "results": [{"id", "budget", "num_blocks", "kv_cache_tokens",
"max_concurrency", "num_groups", "error"}], "failures": [{"id", "error"}]}.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# Keep vLLM quiet and offline; the plugin of this package must not judge the oracle's own configs.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["KV_CAPACITY_PLUGIN"] = "off"


def _layer_is_sliding(hf_text_config: Any, index: int, model_sliding_window: int | None) -> bool:
    """Whether layer `index` attends through a sliding window, as vLLM's model code decides it."""
    layer_types = getattr(hf_text_config, "layer_types", None)
    if layer_types:
        return layer_types[index] == "sliding_attention" and model_sliding_window is not None
    return model_sliding_window is not None


def build_specs(vllm_config: Any, block_size: int, kv_cache_dtype: str) -> dict[str, Any]:
    """{layer_name: spec} for one worker, as the attention layers' get_kv_cache_spec would return."""
    import torch
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    num_layers = model_config.get_num_layers(parallel_config)
    head_size = model_config.get_head_size()
    dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, model_config)
    assert isinstance(dtype, torch.dtype)
    specs: dict[str, Any] = {}
    if model_config.use_mla:
        for i in range(num_layers):
            specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=head_size,
                dtype=dtype,
                cache_dtype_str=kv_cache_dtype,
            )
        return specs
    num_kv_heads = model_config.get_num_kv_heads(parallel_config)
    text_config = model_config.hf_text_config
    window = getattr(text_config, "sliding_window", None) or None
    if getattr(text_config, "use_sliding_window", True) is False:
        window = None
    for i in range(num_layers):
        name = f"model.layers.{i}.self_attn.attn"
        if _layer_is_sliding(text_config, i, window):
            specs[name] = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                head_size_v=head_size,
                dtype=dtype,
                sliding_window=window,
            )
        else:
            specs[name] = FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                head_size_v=head_size,
                dtype=dtype,
            )
    return specs


def _engine_config(model_dir: Path, tensor_parallel_size: int, max_model_len: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
    )
    return args.create_engine_config()


def run_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Evaluate every case with vLLM's get_kv_cache_configs; see the module docstring for the shapes."""
    import vllm
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
    )

    results: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    configs: dict[tuple[str, int], Any] = {}
    refused: dict[tuple[str, int], str] = {}  # engine configs vLLM itself rejects
    with tempfile.TemporaryDirectory(prefix="kvcap-oracle-") as tmp:
        for case in cases:
            config_text = json.dumps(language_model_config(case["config"]), sort_keys=True)
            key = (config_text, int(case["tensor_parallel_size"]))
            if key in refused:
                failures.append({"id": case["id"], "error": refused[key]})
                continue
            try:
                if key not in configs:
                    model_dir = Path(tempfile.mkdtemp(dir=tmp))
                    (model_dir / "config.json").write_text(config_text)
                    max_len = max(c["max_model_len"] for c in cases if c["config"] == case["config"])
                    vllm_config = _engine_config(model_dir, key[1], max_len)
                    record_kv_cache_layout(vllm_config.cache_config, "LBHNC")
                    configs[key] = vllm_config
                vllm_config = configs[key]
                vllm_config.model_config.max_model_len = int(case["max_model_len"])
                vllm_config.cache_config.block_size = int(case["block_size"])
                vllm_config.cache_config.cache_dtype = case["kv_cache_dtype"]
                vllm_config.scheduler_config.max_num_batched_tokens = int(case["max_num_batched_tokens"])
                vllm_config.scheduler_config.async_scheduling = bool(case["async_scheduling"])
                specs = build_specs(vllm_config, int(case["block_size"]), case["kv_cache_dtype"])
            except Exception as exc:  # one bad case must not hide the others
                message = f"{type(exc).__name__}: {exc}"
                if key not in configs:
                    refused[key] = message
                failures.append({"id": case["id"], "error": message})
                continue
            tp = key[1]
            for budget in case["budgets"]:
                row: dict[str, Any] = {"id": case["id"], "budget": budget}
                try:
                    kv_configs = get_kv_cache_configs(vllm_config, [dict(specs) for _ in range(tp)], [budget] * tp)
                    scheduler_config = generate_scheduler_kv_cache_config(kv_configs)
                    tokens, concurrency = get_kv_cache_capacity(vllm_config, scheduler_config)
                    row.update(
                        num_blocks=scheduler_config.num_blocks,
                        kv_cache_tokens=tokens,
                        max_concurrency=concurrency,
                        num_groups=len(scheduler_config.kv_cache_groups),
                        error=None,
                    )
                except ValueError as exc:
                    row.update(num_blocks=None, kv_cache_tokens=None, max_concurrency=None, num_groups=None,
                               error=str(exc))
                results.append(row)
    return {"vllm_version": vllm.__version__, "results": results, "failures": failures}


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM is given: `config` itself, or for a multimodal one its text model's config."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    out = dict(text)
    architectures = config.get("architectures") or []
    out["architectures"] = [a.replace("ForConditionalGeneration", "ForCausalLM") for a in architectures]
    for key in ("torch_dtype", "dtype"):
        if key in config and key not in out:
            out[key] = config[key]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kv_capacity.testing.vllm_oracle CASES.json RESULTS.json", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)
    cases = json.loads(Path(args[0]).read_text())["cases"]
    result = run_cases(cases)
    tmp = Path(args[1]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
