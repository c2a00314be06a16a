"""kv-capacity verify: log parsing, bad input, a missing vLLM, timeouts and Ctrl-C (no capacity run needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from kv_capacity.verify import (
    VerifyError,
    VLLMUnavailableError,
    parse_capacity,
    parse_startup_error,
    require_vllm_python,
    run_vllm,
)

# Lines as vLLM 0.32 (one line) and vLLM <= 0.26 (two lines) print them.
LOG_0_32 = [
    "(EngineCore pid=1) INFO 11-30 07:37:12 [kv_cache_utils.py:2327] CPU KV cache size: 32,768 tokens, "
    "Maximum concurrency for 2,048 tokens per request: 16.00x",
]
LOG_OLD = [
    "INFO 09-12 10:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 58,240 tokens",
    "INFO 09-12 10:00:00 [kv_cache_utils.py:1091] Maximum concurrency for 40,960 tokens per request: 1.42x",
]


def test_parse_capacity_one_line_and_two_line_formats():
    new = parse_capacity(["unrelated", *LOG_0_32])
    assert (new.device, new.kv_cache_tokens, new.max_model_len, new.max_concurrency_text) == ("CPU", 32768, 2048, "16.00")
    old = parse_capacity(LOG_OLD)
    assert (old.device, old.kv_cache_tokens, old.max_model_len, old.max_concurrency) == ("GPU", 58240, 40960, 1.42)
    assert parse_capacity(["INFO Loading weights took 0.01 seconds"]) is None


def test_parse_startup_error_prefers_the_kv_cache_error():
    lines = [
        "ValueError: something unrelated first",
        "(EngineCore pid=3) ERROR ... ValueError: To serve at least one request with the model's max seq len (8192), "
        "(0.02 GiB KV cache is needed, which is larger than the available KV cache memory (0.01 GiB). ...",
    ]
    assert parse_startup_error(lines).startswith("To serve at least one request")
    assert parse_startup_error(lines[:1]) == "something unrelated first"
    assert parse_startup_error(["all fine"]) is None


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_capacity", "verify", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_missing_vllm_is_an_error_naming_make_vllm_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DBO_TOOLKIT_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMUnavailableError, match="make vllm-env"):
        require_vllm_python()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, '
                                                 '"num_attention_heads": 4, "hidden_size": 256}')
    proc = _cli("--model", str(tmp_path / "m"), "--kv-cache-memory-bytes", "1G",
                env={"DBO_TOOLKIT_VLLM_PYTHON": str(tmp_path / "nope" / "python")})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "make vllm-env" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "args,named",
    [
        (["--model", "/does/not/exist", "--kv-cache-memory-bytes", "1G"], "--model"),
        (["--model", ".", "--kv-cache-memory-bytes", "8GiBs"], "8GiBs"),
        (["--model", ".", "--kv-cache-memory-bytes", "1G", "--max-model-len", "-5"], "max model len"),
        (["--model", ".", "--kv-cache-memory-bytes", "1G", "--timeout", "soon"], "timeout"),
        (["--model", ".", "--cases", "all"], "--cases"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, named):
    proc = _cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.vllm
def test_timeout_is_an_error_with_the_time_waited_and_leaves_no_process(tmp_path):
    python = require_vllm_python()
    started: list[int] = []
    begin = time.monotonic()
    with pytest.raises(VerifyError, match=r"within \d+ s \(timeout 2 s\)"):
        run_vllm(["--model", str(tmp_path)], python=python, timeout_s=2, on_start=started.append)
    assert time.monotonic() - begin < 30
    assert started and _group_gone(started[0])


@pytest.mark.vllm
def test_ctrl_c_stops_vllm_and_its_process_group(tmp_path):
    python = require_vllm_python()
    script = tmp_path / "drive.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from kv_capacity.verify import run_vllm
        try:
            run_vllm(["--model", {str(tmp_path)!r}], python={python!r}, timeout_s=300,
                     on_start=lambda pid: print("CHILD", pid, flush=True))
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(130)
    """))
    # SIGINT at its default in the driver: a test run started in the background of a non-interactive shell
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler (the driver would not see ^C).
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = driver.stdout.readline()
        assert line.startswith("CHILD "), line
        child = int(line.split()[1])
        # Interrupt while the child is still importing torch/vLLM (well over a second). After 1.5 s a fast
        # machine had already seen vLLM reject the empty model dir, so run_vllm returned before the signal (CI).
        time.sleep(0.3)
        assert not _group_gone(child)
        driver.send_signal(signal.SIGINT)
        rest = driver.communicate(timeout=60)[0]
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130 and "INTERRUPTED" in rest
    assert _group_gone(child)


def test_module_entry_point_without_child_flag_refuses():
    proc = subprocess.run([sys.executable, "-m", "kv_capacity.verify"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "kv-capacity verify" in proc.stderr

