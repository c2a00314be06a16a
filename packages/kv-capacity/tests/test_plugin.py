"""The vLLM general plugin, driven through vLLM's own EngineArgs in the vllm virtualenv (no engine start).

One subprocess runs every scenario against the real `vllm.engine.arg_utils.EngineArgs` and prints JSON; the
full start-up behaviour (stops before weights load; installed but idle, vLLM serves) is in test_vllm_runs.py.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
from kv_capacity import InsufficientKVCacheError, check, load_model
from kv_capacity.verify import require_vllm_python

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["KV_CAPACITY_PLUGIN"] = "on"
    model = sys.argv[1]
    out = {}

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())

    collect = Collect()

    def listen():
        # vLLM (re)configures logging while it builds configs, which drops handlers of its child loggers
        target = logging.getLogger("vllm.kv_capacity_plugin")
        if collect not in target.handlers:
            target.addHandler(collect)
        collect.messages.clear()

    from vllm.engine.arg_utils import EngineArgs
    import kv_capacity.plugin as plugin
    plugin.unregister()  # vLLM may have loaded it already while importing
    original = EngineArgs.create_engine_config

    def args(**kw):
        base = dict(model=model, enforce_eager=True, skip_tokenizer_init=True)
        base.update(kw)
        return EngineArgs(**base)

    # 1. the plugin's own import fails: one warning, nothing patched, vLLM works
    saved = sys.modules.get("kv_capacity.check")
    sys.modules["kv_capacity.check"] = None
    plugin._warned.clear()
    listen()
    plugin.register(); plugin.register()
    out["import_failure_warnings"] = [m for m in collect.messages if "kv_capacity plugin" in m]
    out["import_failure_patched"] = EngineArgs.create_engine_config is not original
    if saved is not None:
        sys.modules["kv_capacity.check"] = saved
    else:
        del sys.modules["kv_capacity.check"]
    collect.messages.clear()

    # 2. installed (twice: idempotent)
    plugin.register(); plugin.register()
    out["patched"] = EngineArgs.create_engine_config is not original
    out["patched_once"] = EngineArgs.create_engine_config.__wrapped_original__ is original

    # 3. budget too small for one request at max_model_len
    try:
        args(kv_cache_memory_bytes=8 << 20, max_model_len=8192).create_engine_config()
        out["too_small"] = None
    except Exception as exc:
        out["too_small"] = {"type": type(exc).__name__, "is_value_error": isinstance(exc, ValueError),
                            "message": str(exc), "vllm_message": getattr(exc, "vllm_message", None),
                            "min_budget": getattr(exc, "min_kv_cache_memory_bytes", None)}

    # 4. budget that fits, and no budget at all: the config comes back untouched
    cfg = args(kv_cache_memory_bytes=16 << 20, max_model_len=1024).create_engine_config()
    out["fits"] = [cfg.cache_config.kv_cache_memory_bytes, cfg.model_config.max_model_len, cfg.cache_config.block_size]
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cfg = args(max_model_len=8192).create_engine_config()
    out["no_budget"] = cfg.cache_config.kv_cache_memory_bytes

    # 5. switched off by environment
    os.environ["KV_CAPACITY_PLUGIN"] = "off"
    cfg = args(kv_cache_memory_bytes=8 << 20, max_model_len=8192).create_engine_config()
    out["switched_off"] = cfg.cache_config.kv_cache_memory_bytes
    os.environ["KV_CAPACITY_PLUGIN"] = "on"

    # 6. a config that does not look as expected: one warning, vLLM continues
    plugin._warned.clear()
    listen()
    cfg = original(args(kv_cache_memory_bytes=8 << 20, max_model_len=8192))  # vLLM's own, unchecked
    cfg.cache_config.block_size = None
    listen()
    out["odd_config_result"] = repr(plugin.early_check(cfg))
    plugin.early_check(cfg)
    out["odd_config_warnings"] = [m for m in collect.messages if "kv_capacity plugin" in m]
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    python = require_vllm_python()
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "drive.py").write_text(SCRIPT)
    model = folder / "qwen3"
    proc = subprocess.run([python, "-c", "from kv_capacity.testing.tinymodels import model_config; import json, sys; "
                           "sys.stdout.write(json.dumps(model_config('qwen3')))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model.mkdir()
    (model / "config.json").write_text(proc.stdout)  # a config.json is all EngineArgs needs here
    proc = subprocess.run([python, str(folder / "drive.py"), str(model)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(lines[-1][len("RESULT "):])
    data["model"] = str(model)
    return data


def test_import_failure_gives_one_warning_and_patches_nothing(outcome):
    assert len(outcome["import_failure_warnings"]) == 1
    assert "import failed" in outcome["import_failure_warnings"][0]
    assert outcome["import_failure_patched"] is False


def test_register_wraps_create_engine_config_once(outcome):
    assert outcome["patched"] is True and outcome["patched_once"] is True


def test_too_small_budget_is_refused_with_the_check_message(outcome):
    refused = outcome["too_small"]
    assert refused is not None, "the plugin let an impossible budget through"
    assert refused["type"] == "EarlyKVCacheCheckError" and refused["is_value_error"]
    with pytest.raises(InsufficientKVCacheError) as predicted:
        check(load_model(outcome["model"]), kv_cache_memory_bytes=8 << 20, max_model_len=8192, block_size=128)
    assert refused["vllm_message"] == predicted.value.vllm_message
    assert refused["message"].startswith(str(predicted.value))
    assert refused["min_budget"] == predicted.value.min_kv_cache_memory_bytes
    assert f"--max-model-len {predicted.value.estimated_max_model_len}" in refused["message"]


def test_untriggered_plugin_returns_vllms_config_unchanged(outcome):
    assert outcome["fits"] == [16 << 20, 1024, 128]
    assert outcome["no_budget"] in (None, 0)
    assert outcome["switched_off"] == 8 << 20


def test_unexpected_config_gives_one_warning_and_lets_vllm_continue(outcome):
    assert outcome["odd_config_result"] == "None"
    assert len(outcome["odd_config_warnings"]) == 1
    assert "looks unexpected" in outcome["odd_config_warnings"][0]
