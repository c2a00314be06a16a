"""A model's KV-cache shape: read from a config.json (a file, a model directory or a bundled preset).

Only the fields that size the KV cache are kept. Layer kinds follow how vLLM 0.32 builds its per-layer
KV cache specs:

* MLA (DeepSeek-V2/V3, Kimi-K2 ...): one latent "head" of `kv_lora_rank + qk_rope_head_dim` values per
  token, no separate V, the same on every tensor-parallel rank.
* Sliding window: with `layer_types` in the config, exactly the layers marked `sliding_attention` use
  the window; without `layer_types`, a model-level `sliding_window` applies to every layer (vLLM sets
  `CacheConfig.sliding_window` only when no layer is a global one, see `EngineArgs.create_engine_config`).
* Everything else: full attention with `num_key_value_heads` heads (MHA when absent) of `head_dim`
  (`hidden_size // num_attention_heads` when absent).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kv_capacity.errors import KVCapacityInputError

FULL = "full_attention"
SLIDING = "sliding_window"
MLA = "mla"

# Model types vLLM 0.32 runs as plain MLA when the config has a kv_lora_rank (ModelArchConfigConvertor.
# is_deepseek_mla): one latent cache of kv_lora_rank + qk_rope_head_dim per layer.
_MLA_MODEL_TYPES = frozenset(
    {
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_mtp",
        "kimi_k2",
        "longcat_flash",
        "pangu_ultra_moe",
        "glm4_moe_lite",
        "axk1",
    }
)
# MLA relatives with extra caches (sparse-attention indexers, compressed or linear-attention state).
_UNSUPPORTED_MODEL_TYPES = {
    "deepseek_v32": "DeepSeek-V3.2 adds a sparse-attention indexer cache",
    "glm_moe_dsa": "it adds a sparse-attention indexer cache",
    "glm5_next": "it adds a sparse-attention indexer cache",
    "glm5_next_text": "it adds a sparse-attention indexer cache",
    "deepseek_v4": "DeepSeek-V4 uses compressed sparse MLA caches",
    "deepseek_v41": "DeepSeek-V4 uses compressed sparse MLA caches",
    "kimi_linear": "it mixes MLA with linear-attention state",
    "bailing_hybrid": "it mixes MLA with linear-attention state",
}
# transformers' Qwen2/Qwen3 configs drop `sliding_window` unless `use_sliding_window` is true.
_QWEN_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}

# The largest value each field can have in a real model (today's largest have ~128 layers, 128 heads of
# 256, windows and positions of a few million). Beyond these a config is a typo or an attack: a number of
# layers of 1e8 would build a list of 1e8 layer specs. Each bound is said in the refusal.
FIELD_LIMITS: dict[str, int] = {
    "num_hidden_layers": 10_000,
    "num_attention_heads": 1_000_000,
    "num_key_value_heads": 1_000_000,
    "head_dim": 65_536,
    "hidden_size": 1 << 26,
    "kv_lora_rank": 65_536,
    "qk_rope_head_dim": 65_536,
    "sliding_window": 1 << 40,
    "max_position_embeddings": 1 << 40,
    "sliding_window_pattern": 10_000,
    "max_window_layers": 10_000,
}
# A config.json is a few KiB; a model directory's is read only when it is a regular file of at most this.
MAX_CONFIG_BYTES = 16 << 20
# Attention-free model types: their state is not a KV cache (vLLM sizes it with Mamba specs).
_ATTENTION_FREE_MODEL_TYPES = frozenset(
    {"mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv5", "rwkv6", "rwkv7", "xlstm", "retnet", "hyena"}
)
_SSM_FIELDS = ("state_size", "ssm_state_size", "d_state", "mamba_d_state", "conv_kernel", "ssm_cfg")

ACCEPTED_MODELS = (
    "a bundled preset name (see `kv-capacity presets`), a config.json file, or a model directory holding one"
)


@dataclass(frozen=True)
class ModelSpec:
    """What sizes a model's KV cache in vLLM. `layer_kinds[i]` is FULL, SLIDING or MLA for layer i."""

    name: str
    model_type: str
    architecture: str
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    max_position_embeddings: int | None
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's derived max_model_len is max_position_embeddings times this (RoPE scaling types that stretch it)
    rope_scaling_factor: float = 1.0
    # config.json's model_max_length: vLLM lets a max_model_len up to it pass the derived limit
    model_max_length: int | None = None

    @property
    def is_mla(self) -> bool:
        return MLA in self.layer_kinds

    @property
    def num_sliding_layers(self) -> int:
        return sum(kind == SLIDING for kind in self.layer_kinds)

    @property
    def attention_summary(self) -> str:
        """A short description such as `GQA 8 KV heads x 128`, `MLA 512+64`, `20 SW(1024) + 8 full`."""
        if self.is_mla:
            return f"MLA {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        heads = f"{self.num_kv_heads} KV heads x {self.head_size}"
        kind = "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA"
        sliding = self.num_sliding_layers
        if sliding == 0:
            return f"{kind} {heads}"
        if sliding == self.num_hidden_layers:
            return f"{kind} {heads}, all SW({self.sliding_window})"
        return (
            f"{kind} {heads}, {sliding} SW({self.sliding_window}) + {self.num_hidden_layers - sliding} full"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_kinds"] = list(self.layer_kinds)
        data["notes"] = list(self.notes)
        return data


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a model dtype name as written in config.json."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise KVCapacityInputError(
            f"model dtype {dtype!r} is not supported; expected one of {', '.join(sorted(_DTYPE_BYTES))}"
        ) from None


def preset_names() -> list[str]:
    """Names of the bundled presets, sorted."""
    folder = resources.files("kv_capacity") / "presets"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_preset_config(name: str) -> dict[str, Any]:
    """The bundled config.json fields of a preset (with its `_source` provenance entry)."""
    resource = resources.files("kv_capacity") / "presets" / f"{name}.json"
    if not resource.is_file():
        raise KVCapacityInputError(f"model {name!r} is not a bundled preset; expected {ACCEPTED_MODELS}")
    return json.loads(resource.read_text(encoding="utf-8"))


def load_model(name_or_path: str) -> ModelSpec:
    """Load a model's KV-cache shape from a preset name, a config.json path, or a model directory."""
    config, name, source = load_config(name_or_path)
    return spec_from_config(config, name=name, source=source)


def load_config(name_or_path: str) -> tuple[dict[str, Any], str, str]:
    """A model's config.json fields, its name and where they came from (a preset, a file, a directory)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise KVCapacityInputError(f"model {_short(name_or_path, 80)} is empty; expected {ACCEPTED_MODELS}")
    text = name_or_path.strip()
    if text.lower() in preset_names():
        name = text.lower()
        return load_preset_config(name), name, f"preset {name}"

    path = Path(text).expanduser()
    info = _stat(path, text, what="model")
    if info is not None and stat.S_ISDIR(info.st_mode):
        path = path / "config.json"
        info = _stat(path, text, what="config.json of model directory")
        if info is None and text.endswith(".json"):
            raise KVCapacityInputError(
                f"config {_short(text, 80)} is a directory; expected a model's config.json (a regular file)"
            )
        if info is None:
            raise KVCapacityInputError(
                f"model directory {_short(text, 80)} has no config.json; expected {ACCEPTED_MODELS}"
            )
    elif info is None:
        raise KVCapacityInputError(
            f"model {_short(text, 80)} is neither a bundled preset ({', '.join(preset_names())}) nor an existing path; "
            f"expected {ACCEPTED_MODELS}"
        )
    config = _parse_config(path, _read_config(path))
    name = path.parent.name if path.name == "config.json" else path.stem
    return config, name or str(path), str(path)


def _stat(path: Path, text: str, *, what: str) -> os.stat_result | None:
    """`path`'s status (following links); None when nothing is there; KVCapacityInputError when it cannot
    be examined (a symlink loop, a component that is not a directory, no permission ...)."""
    try:
        return path.stat()
    except ValueError:  # an embedded NUL byte
        raise KVCapacityInputError(
            f"{what} {_short(text, 80)} is not a usable path (it holds a NUL byte); expected {ACCEPTED_MODELS}"
        ) from None
    except FileNotFoundError:
        try:
            path.lstat()
        except OSError:
            return None
        raise KVCapacityInputError(
            f"{what} {str(path)!r} is a dangling symbolic link; expected {ACCEPTED_MODELS}"
        ) from None
    except OSError as exc:
        reason = "a symbolic link loop" if exc.errno == errno.ELOOP else exc.strerror
        raise KVCapacityInputError(
            f"{what} {str(path)!r} cannot be examined ({reason}); expected {ACCEPTED_MODELS}"
        ) from None


def _read_config(path: Path) -> str:
    """The text of a config file: a regular file of at most MAX_CONFIG_BYTES, UTF-8.

    Opened without blocking (a FIFO would wait for a writer forever) and checked on the open descriptor,
    so a device such as /dev/zero or a FIFO is refused, not read until memory runs out.
    """
    shown = repr(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise KVCapacityInputError(
            f"config {shown} cannot be read ({exc.strerror}); expected {ACCEPTED_MODELS}"
        ) from None
    # Checked before os.fdopen, which raises IsADirectoryError itself for a directory's descriptor.
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = (
            "a directory" if stat.S_ISDIR(info.st_mode)
            else "a FIFO" if stat.S_ISFIFO(info.st_mode)
            else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
            else "a socket" if stat.S_ISSOCK(info.st_mode)
            else "not a regular file"
        )
        raise KVCapacityInputError(
            f"config {shown} is {kind}; expected a model's config.json (a regular file)"
        )
    with os.fdopen(fd, "rb") as handle:
        try:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise KVCapacityInputError(
                f"config {shown} cannot be read ({exc.strerror}); expected {ACCEPTED_MODELS}"
            ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise KVCapacityInputError(
            f"config {shown} is larger than {MAX_CONFIG_BYTES >> 20} MiB; expected a model's config.json "
            "(a few KiB)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KVCapacityInputError(
            f"config {shown} is not UTF-8 text; expected a model's config.json"
        ) from None


def _parse_config(path: Path, raw: str) -> dict[str, Any]:
    shown = repr(str(path))
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise KVCapacityInputError(
            f"config {shown} is not valid JSON (line {exc.lineno}: {exc.msg}); expected a model's config.json"
        ) from None
    except ValueError as exc:  # Python refuses integers of more than 4,300 digits
        raise KVCapacityInputError(
            f"config {shown} is not a usable config ({str(exc).splitlines()[0][:80]}); expected a model's config.json"
        ) from None
    except RecursionError:
        raise KVCapacityInputError(
            f"config {shown} nests arrays or objects too deeply to be a config; expected a model's config.json"
        ) from None
    if not isinstance(config, dict):
        raise KVCapacityInputError(
            f"config {shown} is not a JSON object; expected a model's config.json"
        )
    return config


def _int_field(
    config: dict[str, Any], key: str, where: str, *, required: bool = True, default: int | None = None
) -> int | None:
    value = config.get(key, default)
    if value is None:
        if required:
            raise KVCapacityInputError(
                f"{where}: field {key!r} is missing; a positive integer is needed to size the KV cache"
            )
        return None
    limit = FIELD_LIMITS.get(key)
    expected = "a positive integer" + (f" up to {limit:,}" if limit else "")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVCapacityInputError(f"{where}: field {key!r} is {_short(value)}; expected {expected}")
    if limit is not None and value > limit:
        raise KVCapacityInputError(
            f"{where}: field {key!r} is {_short(value)}, more than any real model has; expected {expected}"
        )
    return value


def _short(value: object, limit: int = 40) -> str:
    if isinstance(value, int) and value.bit_length() > 128:  # str() of a huge int is slow, or refused
        return f"a number of about {int(value.bit_length() * 0.30103):,} digits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 10]}... ({len(text):,} characters)"


def spec_from_config(config: dict[str, Any], *, name: str, source: str = "") -> ModelSpec:
    """Build a ModelSpec from config.json fields (multimodal configs: their `text_config`)."""
    where = f"config of {name!r}"
    architectures = config.get("architectures") or ["?"]
    architecture = str(architectures[0]) if isinstance(architectures, list) and architectures else "?"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "?")
    notes: list[str] = []

    if model_type in _UNSUPPORTED_MODEL_TYPES:
        raise KVCapacityInputError(
            f"{where}: model_type {model_type!r} cannot be sized ({_UNSUPPORTED_MODEL_TYPES[model_type]}); "
            "supported: full attention (MHA/GQA), MLA, sliding-window and hybrid mixes of those"
        )
    for marker in ("layers_block_type", "attn_type_list", "linear_attn_config", "ssm_cfg"):
        if marker in text:
            raise KVCapacityInputError(
                f"{where}: field {marker!r} marks a Mamba/linear-attention hybrid, which cannot be sized; "
                "supported: full attention (MHA/GQA), MLA, sliding-window and hybrid mixes of those"
            )

    if model_type in _ATTENTION_FREE_MODEL_TYPES or (
        "num_attention_heads" not in text and any(f in text for f in _SSM_FIELDS)
    ):
        raise KVCapacityInputError(
            f"{where}: model_type {model_type!r} is an attention-free (Mamba/SSM/RNN) model, which has no KV cache "
            "to size and is not supported; supported: full attention (MHA/GQA), MLA, sliding-window and hybrid "
            "mixes of those"
        )
    num_layers = _int_field(text, "num_hidden_layers", where)
    num_heads = _int_field(text, "num_attention_heads", where)
    assert num_layers is not None and num_heads is not None
    num_kv_heads = _int_field(text, "num_key_value_heads", where, required=False) or num_heads

    dtype = (
        text.get("torch_dtype")
        or text.get("dtype")
        or config.get("torch_dtype")
        or config.get("dtype")
        or "bfloat16"
    )
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise KVCapacityInputError(
            f"{where}: dtype {dtype!r} is not supported; expected one of {', '.join(sorted(_DTYPE_BYTES))}"
        )
    if dtype in ("float32", "float"):
        # vLLM's _resolve_auto_dtype downcasts float32 checkpoints to the platform's preferred dtype,
        # which is bfloat16 on CUDA GPUs and Ascend NPUs.
        notes.append("config dtype float32 is served as bfloat16 (vLLM downcasts float32 checkpoints)")
        dtype = "bfloat16"
    elif dtype == "half":
        dtype = "float16"

    max_pos = _int_field(text, "max_position_embeddings", where, required=False)
    rope_factor = _rope_scaling_factor(text, model_type, where)
    model_max_length = text.get("model_max_length")
    if isinstance(model_max_length, bool) or not isinstance(model_max_length, int):
        model_max_length = None

    kv_lora_rank = text.get("kv_lora_rank")
    if kv_lora_rank is not None and (model_type not in _MLA_MODEL_TYPES or "compress_ratios" in text):
        raise KVCapacityInputError(
            f"{where}: model_type {model_type!r} has an MLA variant (kv_lora_rank) this planner does not know; "
            f"supported MLA model types: {', '.join(sorted(_MLA_MODEL_TYPES))}"
        )
    if model_type in _MLA_MODEL_TYPES and kv_lora_rank is not None:
        kv_lora_rank = _int_field(text, "kv_lora_rank", where)
        rope = _int_field(text, "qk_rope_head_dim", where)
        assert kv_lora_rank is not None and rope is not None
        return ModelSpec(
            name=name,
            model_type=model_type,
            architecture=architecture,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=1,
            head_size=kv_lora_rank + rope,
            head_size_v=0,
            dtype=dtype,
            max_position_embeddings=max_pos,
            rope_scaling_factor=rope_factor,
            model_max_length=model_max_length,
            layer_kinds=(MLA,) * num_layers,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope,
            source=source,
            notes=tuple(notes),
        )

    head_dim = text.get("head_dim")
    if head_dim is None:
        hidden = _int_field(text, "hidden_size", where)
        assert hidden is not None
        if hidden % num_heads:
            raise KVCapacityInputError(
                f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {num_heads} and there is "
                "no head_dim; expected a config with head_dim or divisible sizes"
            )
        head_dim = hidden // num_heads
    else:
        head_dim = _int_field(text, "head_dim", where)
    assert isinstance(head_dim, int)

    sliding_window = text.get("sliding_window")
    if model_type in _QWEN_MODEL_TYPES and not text.get("use_sliding_window", False):
        sliding_window = None
    if sliding_window is not None:
        if (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or not 0 <= sliding_window <= FIELD_LIMITS["sliding_window"]
        ):
            raise KVCapacityInputError(
                f"{where}: field 'sliding_window' is {_short(sliding_window)}; expected a positive integer "
                f"up to {FIELD_LIMITS['sliding_window']:,} or null"
            )
        if sliding_window == 0:  # vLLM: a window of 0 means no sliding window
            sliding_window = None

    layer_types = _layer_types(text, model_type, num_layers, sliding_window, where)
    if layer_types is None:
        kinds = (SLIDING if sliding_window is not None else FULL,) * num_layers
    else:
        kinds = tuple(
            SLIDING if (t == "sliding_attention" and sliding_window is not None) else FULL
            for t in layer_types
        )

    return ModelSpec(
        name=name,
        model_type=model_type,
        architecture=architecture,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_dim,
        head_size_v=head_dim,
        dtype=dtype,
        max_position_embeddings=max_pos,
        rope_scaling_factor=rope_factor,
        model_max_length=model_max_length,
        layer_kinds=kinds,
        sliding_window=sliding_window if SLIDING in kinds else None,
        source=source,
        notes=tuple(notes),
    )


# RoPE types whose max_position_embeddings is already the scaled length (vLLM's _get_and_verify_max_len).
_ROPE_TYPES_NOT_SCALING = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)


MAX_ROPE_FACTOR = 1e6


def _rope_scaling_factor(text: dict[str, Any], model_type: str, where: str) -> float:
    """The factor vLLM multiplies max_position_embeddings by to derive the longest max_model_len.

    A factor that is there but no positive finite number is refused whatever the RoPE type: vLLM would
    multiply by it (or fail on it) at start-up, so a plan or a check that ignored it would not hold."""
    key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    raw = text.get(key)
    if not isinstance(raw, dict):
        return 1.0
    nested = bool(raw) and all(isinstance(v, dict) for v in raw.values())
    params = [(f"{key}.{name}", rp) for name, rp in raw.items()] if nested else [(key, raw)]
    factor = 1.0
    for place, rp in params:
        value = rp.get("factor")
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= MAX_ROPE_FACTOR  # also false for NaN
        ):
            raise KVCapacityInputError(
                f"{where}: field {place}.factor is {_short(value)}; expected a positive number up to "
                f"{MAX_ROPE_FACTOR:,.0f}"
            )
        rope_type = rp.get("rope_type") or rp.get("type") or "default"
        if value is not None and rope_type not in _ROPE_TYPES_NOT_SCALING and "gemma3" not in model_type:
            factor = float(value)
    return factor


def _layer_types(
    text: dict[str, Any], model_type: str, num_layers: int, sliding_window: int | None, where: str
) -> list[str] | None:
    """`layer_types` as transformers would fill it in for this config (None when the config has none)."""
    layer_types = text.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise KVCapacityInputError(
                f"{where}: field 'layer_types' must be a list of {num_layers} entries (one per layer)"
            )
        allowed = {"full_attention", "sliding_attention", "attention"}
        unknown = sorted({str(t) for t in layer_types} - allowed)
        if unknown:
            raise KVCapacityInputError(
                f"{where}: layer type(s) {', '.join(unknown)} cannot be sized; supported: full_attention, sliding_attention"
            )
        return [str(t) for t in layer_types]
    if sliding_window is None:
        return None
    # Defaults of transformers' config classes for hybrid models that may omit layer_types.
    if model_type == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = _int_field(text, "sliding_window_pattern", where, required=False, default=6)
        assert pattern is not None
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if model_type in _QWEN_MODEL_TYPES:
        start = text.get("max_window_layers", num_layers)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= FIELD_LIMITS["max_window_layers"]:
            raise KVCapacityInputError(
                f"{where}: field 'max_window_layers' is {_short(start)}; expected an integer from 0 to "
                f"{FIELD_LIMITS['max_window_layers']:,}"
            )
        return ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    return None


# ------------------------------------------------------------------------------------------------ compute shape
# What a forward pass computes, beside what its KV cache holds: the sizes a cost model needs (dbo-runtime
# estimate). Field names follow the Hugging Face configs of each family:
#   DeepSeek-V2/V3 (modeling_deepseek.py): n_routed_experts, n_shared_experts (each moe_intermediate_size wide),
#     moe_intermediate_size, num_experts_per_tok, first_k_dense_replace, moe_layer_freq (layer i is MoE when
#     i >= first_k_dense_replace and i % moe_layer_freq == 0), q_lora_rank, kv_lora_rank, qk_nope_head_dim,
#     qk_rope_head_dim, v_head_dim;
#   Qwen2-MoE/Qwen3-MoE (transformers Qwen3MoeConfig): num_experts, moe_intermediate_size, num_experts_per_tok,
#     decoder_sparse_step and mlp_only_layers (layer i is MoE when i not in mlp_only_layers and
#     (i + 1) % decoder_sparse_step == 0), shared_expert_intermediate_size (Qwen2-MoE's one shared expert);
#   Mixtral (transformers MixtralConfig): num_local_experts, num_experts_per_tok, intermediate_size is the
#     expert's width;
#   dense models: intermediate_size.
COMPUTE_FIELD_LIMITS: dict[str, int] = {
    "intermediate_size": 1 << 24,
    "moe_intermediate_size": 1 << 24,
    "shared_expert_intermediate_size": 1 << 24,
    "n_routed_experts": 1 << 16,
    "num_experts": 1 << 16,
    "num_local_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16,
    "n_shared_experts": 1 << 10,
    "first_k_dense_replace": 10_000,
    "moe_layer_freq": 10_000,
    "decoder_sparse_step": 10_000,
    "vocab_size": 1 << 24,
    "q_lora_rank": 65_536,
    "qk_nope_head_dim": 65_536,
    "v_head_dim": 65_536,
}


@dataclass(frozen=True)
class ComputeSpec:
    """The per-layer compute shape of a decoder: attention (MHA/GQA or MLA), dense MLP, routed and shared experts.

    ``moe_layers[i]`` says whether layer i's MLP is a mixture of experts (else a dense MLP of
    ``intermediate_size``). ``dtype`` is the checkpoint's as written (``float32`` kept: a CPU model runs it).
    """

    name: str
    model_type: str
    dtype: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate_size: int | None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    vocab_size: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["moe_layers"] = list(self.moe_layers)
        return data


def load_compute_spec(name_or_path: str) -> ComputeSpec:
    """A model's compute shape from a preset name, a config.json path, or a model directory."""
    config, name, source = load_config(name_or_path)
    return compute_spec_from_config(config, name=name, source=source)


def _compute_int(text: dict[str, Any], key: str, where: str, *, required: bool = False, zero_ok: bool = False,
                 need: str = "to estimate compute") -> int | None:
    value = text.get(key)
    if value is None:
        if required:
            raise KVCapacityInputError(f"{where}: field {key!r} is missing; a positive integer is needed {need}")
        return None
    limit = COMPUTE_FIELD_LIMITS.get(key) or FIELD_LIMITS.get(key)
    low = 0 if zero_ok else 1
    expected = ("a non-negative" if zero_ok else "a positive") + " integer" + (f" up to {limit:,}" if limit else "")
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (limit and value > limit):
        raise KVCapacityInputError(f"{where}: field {key!r} is {_short(value)}; expected {expected}")
    return value


def compute_spec_from_config(config: dict[str, Any], *, name: str, source: str = "") -> ComputeSpec:
    """Build a ComputeSpec from config.json fields (multimodal configs: their ``text_config``).

    The attention shape comes from :func:`spec_from_config` (the same checks and defaults as the KV planner), so
    the two never disagree about heads and head sizes.
    """
    kv = spec_from_config(config, name=name, source=source)
    where = f"config of {name!r}"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = _compute_int(text, "hidden_size", where, required=True)
    assert hidden is not None
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    dtype = "bfloat16" if not isinstance(dtype, str) else ("float16" if dtype == "half" else dtype)
    dtype_bytes(dtype)  # refuses an unknown dtype
    layers = kv.num_hidden_layers
    experts = (_compute_int(text, "n_routed_experts", where) or _compute_int(text, "num_experts", where)
               or _compute_int(text, "num_local_experts", where) or 0)
    intermediate = _compute_int(text, "intermediate_size", where)
    top_k = expert_width = None
    shared = 0
    moe_layers = (False,) * layers
    if experts:
        top_k = _compute_int(text, "num_experts_per_tok", where, required=True, need="for a mixture of experts")
        assert top_k is not None
        if top_k > experts:
            raise KVCapacityInputError(f"{where}: num_experts_per_tok {top_k} exceeds the {experts} experts; "
                                       "expected at most the number of experts")
        expert_width = _compute_int(text, "moe_intermediate_size", where)
        if expert_width is None and "num_local_experts" in text:  # Mixtral: intermediate_size is the expert's
            expert_width, intermediate = intermediate, None
        if expert_width is None:
            raise KVCapacityInputError(f"{where}: field 'moe_intermediate_size' is missing; a positive integer is "
                                       "needed for a mixture of experts")
        n_shared = _compute_int(text, "n_shared_experts", where, zero_ok=True) or 0
        shared = n_shared * expert_width + (_compute_int(text, "shared_expert_intermediate_size", where,
                                                         zero_ok=True) or 0)
        if "first_k_dense_replace" in text or "moe_layer_freq" in text:
            first = _compute_int(text, "first_k_dense_replace", where, zero_ok=True) or 0
            freq = _compute_int(text, "moe_layer_freq", where) or 1
            moe_layers = tuple(i >= first and i % freq == 0 for i in range(layers))
        else:
            step = _compute_int(text, "decoder_sparse_step", where) or 1
            only = text.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
                raise KVCapacityInputError(f"{where}: field 'mlp_only_layers' is {_short(only)}; expected a list of "
                                           "layer indices")
            moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    if intermediate is None and not all(moe_layers):
        raise KVCapacityInputError(f"{where}: field 'intermediate_size' is missing; a positive integer is needed "
                                   "to estimate compute (the dense MLP's width)")
    if kv.is_mla:
        heads = kv.num_attention_heads
        nope = _compute_int(text, "qk_nope_head_dim", where, required=True, need="for MLA attention")
        v_dim = _compute_int(text, "v_head_dim", where, required=True, need="for MLA attention")
        assert nope is not None and v_dim is not None and kv.qk_rope_head_dim is not None
        head_dim, kv_heads = nope + kv.qk_rope_head_dim, heads
    else:
        heads, kv_heads, head_dim, v_dim = kv.num_attention_heads, kv.num_kv_heads, kv.head_size, kv.head_size_v
    return ComputeSpec(
        name=name, model_type=kv.model_type, dtype=dtype, num_hidden_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_dim,
        intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=top_k or 0,
        moe_intermediate_size=expert_width, shared_intermediate_size=shared, moe_layers=moe_layers,
        vocab_size=_compute_int(text, "vocab_size", where),
        q_lora_rank=_compute_int(text, "q_lora_rank", where) if kv.is_mla else None,
        kv_lora_rank=kv.kv_lora_rank, qk_rope_head_dim=kv.qk_rope_head_dim, source=source,
    )
