"""load_model: presets, config.json files, model directories, and the errors for bad ones."""

from __future__ import annotations

import json

import pytest
from kv_capacity import KVCapacityInputError, load_model, plan, preset_names
from kv_capacity.model_spec import FULL, MLA, SLIDING

REQUIRED_PRESETS = {
    "qwen3-8b",
    "qwen3-30b-a3b",
    "qwen2.5-7b",
    "llama-3.1-8b",
    "mistral-7b-v0.1",
    "deepseek-v2-lite",
    "deepseek-v3",
    "gemma-2-9b",
    "gemma-3-12b",
}


def test_required_presets_are_bundled():
    assert REQUIRED_PRESETS <= set(preset_names())


@pytest.mark.parametrize("name", sorted(REQUIRED_PRESETS))
def test_every_preset_loads_and_plans(name):
    spec = load_model(name)
    assert len(spec.layer_kinds) == spec.num_hidden_layers > 0
    result = plan(spec, kv_cache_memory_bytes=64 << 30, max_model_len=4096)
    assert result.fits and result.num_blocks > 0 and result.kv_cache_tokens > 0


def test_layer_kinds_follow_vllm():
    assert set(load_model("qwen2.5-7b").layer_kinds) == {FULL}  # use_sliding_window false drops the window
    assert set(load_model("mistral-7b-v0.1").layer_kinds) == {SLIDING}  # no layer_types: every layer SW
    gemma2 = load_model("gemma-2-9b").layer_kinds
    assert gemma2[:4] == (SLIDING, FULL, SLIDING, FULL) and gemma2.count(SLIDING) == 21
    gemma3 = load_model("gemma-3-12b").layer_kinds
    assert gemma3[:6] == (SLIDING,) * 5 + (FULL,) and gemma3.count(FULL) == 8
    v3 = load_model("deepseek-v3")
    assert set(v3.layer_kinds) == {MLA} and v3.head_size == 576 and v3.num_kv_heads == 1
    assert load_model("gemma-2-9b").dtype == "bfloat16"  # float32 checkpoint served as bf16


def test_config_file_and_directory(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "torch_dtype": "float16",
        "max_position_embeddings": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = load_model(str(tmp_path))
    from_file = load_model(str(tmp_path / "config.json"))
    assert from_dir.head_size == from_file.head_size == 64  # hidden_size // heads
    assert from_dir.num_kv_heads == 2 and from_dir.dtype == "float16"
    layer_types = dict(config, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=256)
    (tmp_path / "hybrid.json").write_text(json.dumps(layer_types))
    hybrid = load_model(str(tmp_path / "hybrid.json"))
    assert hybrid.layer_kinds == (SLIDING, FULL, SLIDING, FULL) and hybrid.sliding_window == 256


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"model_type": "llama", "num_attention_heads": 8}), "num_hidden_layers"),
        (
            json.dumps({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 100}),
            "not a multiple",
        ),
        (
            json.dumps(
                {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "torch_dtype": "int3"}
            ),
            "dtype",
        ),
        (
            json.dumps({"model_type": "deepseek_v32", "num_hidden_layers": 2, "num_attention_heads": 8}),
            "indexer",
        ),
        (
            json.dumps(
                {
                    "num_hidden_layers": 2,
                    "num_attention_heads": 8,
                    "head_dim": 64,
                    "layers_block_type": ["mamba"],
                }
            ),
            "Mamba",
        ),
        (
            json.dumps(
                {
                    "model_type": "glm_moe_dsa",
                    "num_hidden_layers": 2,
                    "num_attention_heads": 8,
                    "kv_lora_rank": 512,
                }
            ),
            "indexer",
        ),
        (
            json.dumps(
                {
                    "model_type": "mystery_mla",
                    "num_hidden_layers": 2,
                    "num_attention_heads": 8,
                    "head_dim": 64,
                    "kv_lora_rank": 512,
                }
            ),
            "MLA variant",
        ),
        (json.dumps({"num_hidden_layers": -2, "num_attention_heads": 8, "head_dim": 64}), "positive integer"),
    ],
)
def test_bad_configs(tmp_path, content, fragment):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(KVCapacityInputError, match=fragment) as info:
        load_model(str(path))
    assert "\n" not in str(info.value)


def test_unknown_model_and_empty_directory(tmp_path):
    with pytest.raises(KVCapacityInputError, match="neither a bundled preset"):
        load_model("no-such-model")
    with pytest.raises(KVCapacityInputError, match="no config.json"):
        load_model(str(tmp_path))


def test_tp_that_vllm_rejects():
    with pytest.raises(KVCapacityInputError, match="does not divide the 28 attention heads"):
        plan(
            load_model("qwen2.5-7b"),
            kv_cache_memory_bytes=1 << 30,
            max_model_len=1024,
            tensor_parallel_size=8,
        )
    with pytest.raises(KVCapacityInputError, match="kv cache dtype"):
        plan(load_model("qwen3-8b"), kv_cache_memory_bytes=1 << 30, max_model_len=1024, kv_cache_dtype="int4")
