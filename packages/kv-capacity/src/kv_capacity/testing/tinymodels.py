"""Generate small local models with random weights, for running a real vLLM where no real model fits.

Each architecture below is one that vLLM sizes its KV cache differently for (plain GQA, MLA, sliding
window + full attention). The weights are random (the capacity arithmetic never looks at them), the
tokenizer is a byte-level BPE trained with `tokenizers` on a built-in text, and every head size is one
the CPU attention kernels accept (CPU_ATTN: 32, 64, 80, ..., 256, 512; CPU MLA: 576 = 512 + 64 only).

The generator needs torch, transformers, safetensors and tokenizers, i.e. the vllm virtualenv:

    .venv-vllm/bin/python -m kv_capacity.testing.tinymodels qwen3 deepseek_v2 gemma2 [--out .cache/kv-capacity/models]

(`python -m kv_capacity.tinymodels` is the same command, kept for the other packages' tests and skills.)

Models are written into a temporary folder and renamed into place, and are keyed by a hash of their
configuration, so a cached model is never half written and a changed recipe gives a new folder.
Nothing generated here belongs in git (the repository ignores `.cache/`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

GENERATOR_VERSION = 1
VOCAB_SIZE = 1024

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
}

# name -> config.json content (before _COMMON is merged in)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Qwen3-like dense GQA: 4 query heads share 2 KV heads of 64.
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
    },
    # DeepSeek-V2-like MLA with the CPU MLA kernel's only latent size (kv_lora_rank 512 + rope 64),
    # all MLPs dense (first_k_dense_replace = number of layers) to keep it small.
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 256,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    },
    # Gemma-2-like: layers alternate sliding window (256) and full attention.
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 256,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 8192,
        "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # A Qwen3-like model of about 1.1 B parameters (2.2 GB of bf16), for timing how long vLLM loads
    # before its own capacity check fires. Not used by the tests.
    "qwen3_large": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
    },
}

_CORPUS_WORDS = (
    "the a of to and in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there one all we their can has been if more when will would who so "
    "no cache block token memory budget layer head attention model request length batch window latent "
    "vllm kv capacity page size group sliding full tensor parallel rank device engine start error"
).split()


def model_config(arch: str) -> dict[str, Any]:
    """The config.json content of the tiny model `arch` (a key of ARCHITECTURES)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny model {arch!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    config = dict(_COMMON)
    config.update(ARCHITECTURES[arch])
    return config


def model_key(arch: str) -> str:
    """Folder name of `arch` in the cache: the name plus a hash of its recipe."""
    recipe = json.dumps({"v": GENERATOR_VERSION, "config": model_config(arch)}, sort_keys=True)
    return f"{arch}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"


def default_cache_dir() -> Path:
    """`<repo>/.cache/kv-capacity/models` when run from a checkout, else under the user's cache."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "packages").is_dir():
            return parent / ".cache" / "kv-capacity" / "models"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kv-capacity" / "models"


def _corpus(lines: int = 400, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(lines)]


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 16,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(out))


def _write_weights(out: Path, config_dict: dict[str, Any], seed: int, shard_bytes: int = 2 << 30) -> int:
    """Random weights with the parameter names and shapes transformers gives this config; returns bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(out))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config_dict.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)

    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, Any]] = [{}]
    shard_size = 0
    total = 0
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight") or "layernorm" in name:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
            if config_dict["model_type"] == "gemma2":  # Gemma's RMSNorm multiplies by (1 + weight)
                tensor.zero_()
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * tensor.element_size()
        if shard_size and shard_size + nbytes > shard_bytes:
            shards.append({})
            shard_size = 0
        shards[-1][name] = tensor
        shard_size += nbytes
        total += nbytes

    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return total
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=1))
    return total


def publish_model_folder(target: Path, config: dict[str, Any], fill: Callable[[Path], None]) -> Path:
    """Write the model folder ``target`` whole or not at all: ``config.json``, ``generation_config.json`` and what
    ``fill(folder)`` writes (tokenizer, weights) go into a temporary folder beside it that is renamed into place
    at the end; another process that finished the same model first wins. Returns ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        fill(tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=1)
        )
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same model first
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_model(arch: str, cache_dir: Path | None = None, *, seed: int = 0) -> Path:
    """Return the folder of tiny model `arch`, generating it first if the cache does not hold it."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / model_key(arch)
    if (target / "config.json").is_file():
        return target
    config = model_config(arch)

    def fill(folder: Path) -> None:
        _write_tokenizer(folder)
        _write_weights(folder, config, seed)

    return publish_model_folder(target, config, fill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kv_capacity.testing.tinymodels",
        description="Generate tiny random-weight models (run with the vllm virtualenv's python).",
    )
    parser.add_argument("arch", nargs="+", help=f"one or more of: {', '.join(ARCHITECTURES)}")
    parser.add_argument("--out", type=Path, default=None, help="cache folder (default: <repo>/.cache/kv-capacity/models)")
    args = parser.parse_args(argv)
    unknown = [a for a in args.arch if a not in ARCHITECTURES]
    if unknown:
        print(f"tinymodels: unknown architecture {unknown[0]!r}; accepted: {', '.join(ARCHITECTURES)}", file=sys.stderr)
        return 2
    for arch in args.arch:
        print(ensure_model(arch, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
