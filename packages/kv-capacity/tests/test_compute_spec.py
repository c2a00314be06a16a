"""load_compute_spec / compute_spec_from_config: the compute shape beside the KV shape, read from one config."""

from __future__ import annotations

import json

import pytest
from kv_capacity import (
    KVCapacityInputError,
    compute_spec_from_config,
    load_compute_spec,
    load_config,
    load_model,
    preset_names,
)


def _deepseek(**over):
    config = {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 256, "moe_intermediate_size": 32,
              "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
              "moe_layer_freq": 2, "vocab_size": 1000, "torch_dtype": "float32"}
    config.update(over)
    return config


def test_deepseek_fields_and_dense_layers():
    spec = compute_spec_from_config(_deepseek(), name="t")
    # first_k_dense_replace=2, moe_layer_freq=2: layers 2 and 4 are MoE (i >= 2 and i % 2 == 0)
    assert spec.moe_layers == (False, False, True, False, True, False)
    assert (spec.num_moe_layers, spec.num_dense_layers) == (2, 4)
    assert spec.shared_intermediate_size == 2 * 32
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 32)
    assert spec.dtype == "float32" and spec.dtype_bytes == 4  # kept as written (the KV planner serves it as bf16)
    assert spec.vocab_size == 1000 and not spec.is_mla


def test_qwen_moe_sparse_step_and_mlp_only_layers():
    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 16,
              "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    spec = compute_spec_from_config(config, name="q")
    assert spec.moe_layers == (True, False, True, True)
    assert spec.num_kv_heads == 2 and spec.shared_intermediate_size == 0


def test_mixtral_intermediate_size_is_the_experts():
    config = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 224, "num_local_experts": 8, "num_experts_per_tok": 2}
    spec = compute_spec_from_config(config, name="m")
    assert spec.moe_intermediate_size == 224 and spec.intermediate_size is None and all(spec.moe_layers)


def test_mla_head_sizes_from_ranks():
    spec = load_compute_spec("deepseek-v3")
    assert spec.is_mla and spec.kv_lora_rank == 512 and spec.q_lora_rank == 1536
    assert spec.head_dim == 128 + 64 and spec.v_head_dim == 128
    assert spec.num_dense_layers == 3 and spec.num_moe_layers == 58


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_has_a_compute_shape_and_the_same_attention(name):
    spec, kv = load_compute_spec(name), load_model(name)
    assert spec.num_hidden_layers == kv.num_hidden_layers
    assert spec.num_attention_heads == kv.num_attention_heads
    assert spec.hidden_size > 0 and (spec.intermediate_size or spec.moe_intermediate_size)


def test_load_config_reads_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_deepseek()))
    config, name, source = load_config(str(tmp_path))
    assert config["n_routed_experts"] == 8 and name == tmp_path.name and source.endswith("config.json")
    assert load_compute_spec(str(tmp_path)).num_moe_layers == 2


@pytest.mark.parametrize("over, match", [
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"num_experts_per_tok": 9}, "exceeds"),
    ({"n_routed_experts": -1}, "n_routed_experts"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
])
def test_bad_fields_are_named(over, match):
    config = {k: v for k, v in _deepseek(**over).items() if v is not None}
    with pytest.raises(KVCapacityInputError, match=match):
        compute_spec_from_config(config, name="bad")
