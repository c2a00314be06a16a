"""Property-based fuzzing (hypothesis) of kv-capacity's inputs: sizes, config.json fields and the command
line. The promise under test: any input gives a result or KVCapacityInputError with one short line; the
CLI exits 0, 1 or 2 and a 2 is exactly one line on stderr. A few seconds in all (derandomized, no database).
"""

from __future__ import annotations

import contextlib
import io
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_capacity import KVCapacityError, KVCapacityInputError, parse_size, plan, spec_from_config
from kv_capacity.cli import main
from kv_capacity.sizes import to_vllm_flag_value

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

size_text = st.one_of(
    st.text(max_size=30),
    st.from_regex(r"\s?[0-9]{1,30}(\.[0-9]{1,5})?\s?([kmgtKMGT]|[kKmMgGtT][iI]?[bB]|[kKmMgGtT]i|[bB])?\s?", fullmatch=True),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.text(alphabet="0123456789", min_size=30, max_size=6000),
)


@FUZZ
@given(size_text)
def test_parse_size_returns_a_bounded_count_or_one_line(text):
    try:
        value = parse_size(text)
    except KVCapacityInputError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) < 600
    else:
        assert isinstance(value, int) and 0 < value < 2**63


@FUZZ
@given(st.integers(min_value=1, max_value=2**63 - 1))
def test_every_budget_round_trips_through_the_flag_spelling(value):
    assert parse_size(to_vllm_flag_value(value)) == value


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
              st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELDS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
          "max_position_embeddings", "sliding_window", "kv_lora_rank", "qk_rope_head_dim", "layer_types",
          "torch_dtype", "model_type", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
          "rope_scaling", "text_config", "architectures", "model_max_length"]
REQUIRED = {"num_hidden_layers", "num_attention_heads", "hidden_size"}
plausible = st.one_of(st.integers(min_value=-2, max_value=300), st.sampled_from([2**31, 10**9, 10**30]))
config = st.fixed_dictionaries(
    {"num_hidden_layers": plausible, "num_attention_heads": plausible, "hidden_size": plausible},
    optional={
        **{name: st.one_of(plausible, json_value) for name in FIELDS if name not in REQUIRED},
        "model_type": st.sampled_from(["llama", "qwen3", "gemma2", "gemma3", "deepseek_v3", "mamba", "mistral", "x"]),
        "torch_dtype": st.sampled_from(["bfloat16", "float16", "float32", "int8", "half"]),
    },
)


@FUZZ
@given(config, st.integers(min_value=1, max_value=2**40), st.integers(min_value=1, max_value=2**40))
def test_any_config_gives_a_plan_or_one_line(fields, budget, length):
    try:
        spec = spec_from_config(fields, name="fuzz")
        result = plan(spec, kv_cache_memory_bytes=budget, max_model_len=length)
    except KVCapacityError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 800
    else:
        assert result.num_blocks >= 0 and result.blocks_per_request > 0
        assert spec.num_hidden_layers <= 10_000


token = st.one_of(
    st.sampled_from(["plan", "check", "required", "presets", "--model", "qwen3-8b", "deepseek-v3", "gemma-3-12b",
                     "--kv-cache-memory-bytes", "8G", "--max-model-len", "4096", "--block-size", "16",
                     "--tensor-parallel-size", "-tp", "2", "--kv-cache-dtype", "fp8", "--format", "json",
                     "--max-num-seqs", "--concurrency", "0", "-1", "1e9", "--", "-o"]),
    st.text(max_size=10),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
)


@FUZZ
@given(st.sampled_from(["plan", "check", "required", "presets"]), st.lists(token, max_size=10))
def test_any_command_line_exits_0_1_or_2_with_one_line(command, args):
    if "-o" in args:  # the output option is covered by its own tests; here nothing may be written
        args = [a for a in args if a != "-o"]
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main([command, *args])
    assert status in (0, 1, 2), (status, err.getvalue())
    if status == 2:
        assert err.getvalue().count("\n") == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    if status == 0 and "--format" in args and "json" in args[args.index("--format") + 1:][:1]:
        json.loads(out.getvalue())


# digits of other scripts (Arabic-Indic, Devanagari, full-width, mathematical ...): Python's int() takes them
non_ascii_digit = st.characters(categories=["Nd"]).filter(lambda ch: not ch.isascii())
unicode_digit_size = st.builds(
    lambda head, digit, tail, unit: head + digit + tail + unit,
    st.text(alphabet="0123456789", max_size=4), non_ascii_digit,
    st.text(alphabet=st.one_of(st.sampled_from("0123456789"), non_ascii_digit), max_size=6),
    st.sampled_from(["", "G", "g", "M", "GiB", "GB", "B", ".5g"]),
)


@FUZZ
@given(unicode_digit_size)
def test_a_size_with_any_non_ascii_digit_is_refused_in_one_line(text):
    try:
        parse_size(text)
    except KVCapacityInputError as exc:
        assert "ASCII digits" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError(f"{text!r} was accepted")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", text, "--max-model-len", "1024"])
    assert status == 2 and err.getvalue().count("\n") == 1 and "ASCII digits" in err.getvalue()


# (no dict: {"factor": {...}} reads as vLLM's per-layer-type form of rope_parameters)
bad_factor = st.one_of(
    st.text(max_size=6), st.booleans(), st.lists(st.integers(), max_size=2),
    st.floats(max_value=0), st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e7, 10**30]),
    st.integers(max_value=0),
)


@FUZZ
@given(bad_factor, st.sampled_from(["linear", "dynamic", "yarn", "llama3", "default", None]),
       st.booleans(), st.sampled_from(["rope_scaling", "rope_parameters"]))
def test_a_rope_factor_that_is_no_positive_number_is_refused(factor, rope_type, nested, key):
    params = {"factor": factor, **({"rope_type": rope_type} if rope_type else {})}
    fields = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
              "max_position_embeddings": 4096, key: {"full_attention": params} if nested else params}
    try:
        spec_from_config(fields, name="fuzz")
    except KVCapacityInputError as exc:
        assert "factor" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError(f"factor {factor!r} was accepted")
