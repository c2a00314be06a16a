"""Hostile and careless input (issue 11): one line naming the input and what is accepted, exit 2, nothing
written; a max_model_len vLLM refuses makes `check` fail like vLLM."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from kv_capacity import KVCapacityInputError, load_model, parse_size
from kv_capacity.cli import main

PLAN = ["plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(capsys, *args: str) -> str:
    status, out, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err and out == ""
    assert len(lines[0]) < 600  # never an echo of thousands of characters
    return lines[0]


@pytest.mark.parametrize(
    "size,fragment",
    [
        ("9" * 400 + "g", "400 digits"),
        ("9" * 400 + "G", "400 digits"),
        ("9" * 400 + "GiB", "400 digits"),
        ("9" * 5000, "5,000 digits"),
        ("8388608T", "2^63"),  # exactly 2**63 bytes
        ("9999999999g", "2^63"),
    ],
)
def test_huge_sizes_are_refused_with_the_bound(capsys, size, fragment):
    line = one_line_error(capsys, "plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", size,
                          "--max-model-len", "1024")
    assert fragment in line and "_size" not in line


def test_the_largest_size_below_2_63_is_accepted():
    assert parse_size(str(2**63 - 1)) == 2**63 - 1
    with pytest.raises(KVCapacityInputError, match="2\\^63"):
        parse_size(str(2**63))


def _config(tmp_path, **fields) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    base = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    base.update(fields)
    (folder / "config.json").write_text(json.dumps(base))
    return str(folder)


@pytest.mark.parametrize(
    "field,value,bound",
    [
        ("num_hidden_layers", 10**30, "10,000"),
        ("num_hidden_layers", 2 * 10**9, "10,000"),
        ("num_hidden_layers", 10**8, "10,000"),
        ("num_attention_heads", 10**12, "1,000,000"),
        ("head_dim", 10**9, "65,536"),
        ("max_position_embeddings", 10**40, "1,099,511,627,776"),
        ("sliding_window", 10**40, "1,099,511,627,776"),
    ],
)
def test_config_numbers_beyond_any_model_are_refused_quickly(capsys, tmp_path, field, value, bound):
    model = _config(tmp_path, **{field: value})
    begin = time.monotonic()
    line = one_line_error(capsys, "plan", "--model", model, "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024")
    assert time.monotonic() - begin < 5
    assert field in line and bound in line


def test_a_deeply_nested_config_is_refused(capsys, tmp_path):
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 100_000)
    line = one_line_error(capsys, "plan", "--model", str(folder), "--kv-cache-memory-bytes", "8G",
                          "--max-model-len", "1024")
    assert "config.json" in line


def test_a_config_with_a_5000_digit_number_is_refused(capsys, tmp_path):
    folder = tmp_path / "digits"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    assert "config.json" in one_line_error(capsys, "plan", "--model", str(folder), "--kv-cache-memory-bytes", "8G",
                                           "--max-model-len", "1024")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_not_read(capsys):
    line = one_line_error(capsys, "plan", "--model", "/dev/zero", "--kv-cache-memory-bytes", "8G",
                          "--max-model-len", "1024")
    assert "/dev/zero" in line and "regular file" in line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_config_does_not_block(capsys, tmp_path):
    folder = tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    for model in (str(folder), str(folder / "config.json")):
        begin = time.monotonic()
        line = one_line_error(capsys, "plan", "--model", model, "--kv-cache-memory-bytes", "8G",
                              "--max-model-len", "1024")
        assert time.monotonic() - begin < 5
        assert "FIFO" in line


def test_a_symlink_loop_in_a_model_dir_is_named(capsys, tmp_path):
    folder = tmp_path / "loop"
    folder.mkdir()
    os.symlink(folder / "config.json", folder / "config.json")
    line = one_line_error(capsys, "plan", "--model", str(folder), "--kv-cache-memory-bytes", "8G",
                          "--max-model-len", "1024")
    assert "symbolic link loop" in line and "has no config.json" not in line


def test_an_attention_free_model_is_not_supported(tmp_path):
    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "mamba", "num_hidden_layers": 64, "hidden_size": 2560, "state_size": 16,
         "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(KVCapacityInputError, match="attention-free.*not supported"):
        load_model(str(folder))


def test_check_refuses_a_max_model_len_above_the_models_like_vllm(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    args = ["check", "--model", "qwen3-8b", "--kv-cache-memory-bytes", "8G", "--block-size", "16"]
    status, out, err = run(capsys, *args, "--max-model-len", "40960")
    assert status == 0 and out.startswith("OK")
    status, out, err = run(capsys, *args, "--max-model-len", "40961")
    assert status == 1 and "OK" not in out
    assert "User-specified max_model_len (40961) is greater than the derived max_model_len" in err
    assert "--max-model-len 40960" in err
    status, out, _ = run(capsys, *args, "--max-model-len", "40961", "--format", "json")
    assert status == 1 and json.loads(out)["starts"] is False
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    status, out, err = run(capsys, *args, "--max-model-len", "40961")
    assert status == 0 and out.startswith("OK")


def test_rope_scaling_raises_the_limit_like_vllm(tmp_path):
    from kv_capacity.check import max_model_len_error

    folder = _config(tmp_path, max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0})
    spec = load_model(folder)
    assert max_model_len_error(spec, 16384) is None
    assert "16385" in max_model_len_error(spec, 16385)
    yarn = _config(tmp_path, max_position_embeddings=4096, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert max_model_len_error(load_model(yarn), 4097) is not None


def test_output_to_a_directory_is_refused_before_work_and_a_file_is_written_whole(capsys, tmp_path):
    line = one_line_error(capsys, *PLAN, "-o", str(tmp_path))
    assert "is a directory" in line
    line = one_line_error(capsys, *PLAN, "-o", str(tmp_path / "missing" / "plan.txt"))
    assert "does not exist" in line
    target = tmp_path / "plan.json"
    target.write_text("old")
    status, out, _ = run(capsys, *PLAN, "--format", "json", "-o", str(target))
    assert status == 0 and out == ""
    assert json.loads(target.read_text())["max_model_len"] == 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["plann"], "No such command 'plann'"),
        (["plan", "--model", "qwen3-8b", "--max-model-len", "1024"], "--kv-cache-memory-bytes"),
        ([*PLAN, "--format", "xml"], "'xml'"),
        ([*PLAN, "--max-model-len", str(2**41)], "max model len"),
        ([*PLAN, "--block-size", "1" + "0" * 5000], "block size"),
        (["required", "--model", "qwen3-8b", "--max-model-len", "1024", "--max-num-seqs", "-5"], "concurrency"),
        (["verify", "--model", ".", "--timeout", "nan"], "timeout"),
        (["verify", "--model", ".", "--timeout", "inf"], "timeout"),
    ],
)
def test_usage_errors_are_one_line(capsys, args, fragment):
    line = one_line_error(capsys, *args)
    assert fragment in line and "--help" in line


def test_required_takes_vllms_max_num_seqs_and_the_old_spelling(capsys):
    base = ["required", "--model", "qwen3-8b", "--max-model-len", "4096", "--format", "json"]
    status, new, _ = run(capsys, *base, "--max-num-seqs", "4")
    assert status == 0
    status, old, _ = run(capsys, *base, "--concurrency", "4")
    assert status == 0 and json.loads(new) == json.loads(old) and json.loads(new)["concurrency"] == 4


def test_verify_with_a_python_without_vllm_says_so(capsys, tmp_path):
    # this interpreter has kv_capacity but not vLLM (vLLM lives in .venv-vllm)
    pytest.importorskip("kv_capacity")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this interpreter has vLLM")
    model = _config(tmp_path)
    line = one_line_error(capsys, "verify", "--model", model, "--kv-cache-memory-bytes", "16M",
                          "--vllm-python", sys.executable)
    assert "no vLLM in this interpreter" in line


@pytest.mark.parametrize(
    "command",
    [
        ["plan", "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024"],
        ["required", "--max-model-len", "1024"],
        ["verify", "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024"],
    ],
)
def test_a_config_json_that_is_a_directory_is_refused(capsys, tmp_path, command):
    folder = tmp_path / "model"
    (folder / "config.json").mkdir(parents=True)
    for model in (str(folder), str(folder / "config.json")):
        line = one_line_error(capsys, command[0], "--model", model, *command[1:])
        assert "config.json" in line and "is a directory" in line and "regular file" in line


def test_output_naming_the_input_config_is_refused_and_the_config_kept(capsys, tmp_path):
    config = os.path.join(_config(tmp_path), "config.json")
    before = open(config, "rb").read()
    plan = ["plan", "--model", config, "--kv-cache-memory-bytes", "8G", "--max-model-len", "1024"]
    for output in (config, os.path.join(os.path.dirname(config), ".", "config.json")):
        line = one_line_error(capsys, *plan, "-o", output)
        assert "config.json" in line and "input" in line
        assert open(config, "rb").read() == before
    model_dir = os.path.dirname(config)
    line = one_line_error(capsys, "plan", "--model", model_dir, *plan[3:], "-o", config)
    assert "input" in line and open(config, "rb").read() == before


@pytest.mark.parametrize("size", ["٨G", "８G", "٨٠٠٠٠٠٠٠٠٠", "8٠G", "৮GiB", "8.٥g", "𝟠G"])
def test_sizes_take_ascii_digits_only(capsys, size):
    with pytest.raises(KVCapacityInputError, match="ASCII digits"):
        parse_size(size)
    line = one_line_error(capsys, "plan", "--model", "qwen3-8b", "--kv-cache-memory-bytes", size,
                          "--max-model-len", "1024")
    assert "ASCII digits" in line


@pytest.mark.parametrize("factor", ["x", float("nan"), float("inf"), -2.0, 0, True, [4], 1e7])
def test_a_bad_rope_scaling_factor_is_refused(capsys, tmp_path, factor):
    folder = _config(tmp_path, max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": factor})
    with pytest.raises(KVCapacityInputError, match="rope_scaling.*factor"):
        load_model(folder)
    line = one_line_error(capsys, "check", "--model", folder, "--kv-cache-memory-bytes", "8G",
                          "--max-model-len", "1024")
    assert "factor" in line and "positive" in line
