"""The plugin's config side, on STAND-INS of vLLM-Ascend's NPUPlatform and vLLM's VllmConfig.

The stand-ins reproduce the two behaviours the plugin works around, as read from the real source:
vllm_ascend 0.23.0.post1 ``NPUPlatform._fix_incompatible_config`` resets ``enable_dbo`` (and the platform picks
``flashinfer_all2allv`` for MoE), and vLLM 0.23.0 ``VllmConfig.__post_init__`` calls the platform check and then
asserts a DeepEP all2all backend whenever ubatching is on. The off-Ascend path is tested on the real vLLM in
test_ascend_vllm.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from dbo_runtime.ascend import plugin
from dbo_runtime.ascend.validate import dbo_requested
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.vllm import plugin as vplugin


class StandinNPUPlatform:
    """Stand-in for vllm_ascend.platform.NPUPlatform (only what the plugin wraps)."""

    @staticmethod
    def _fix_incompatible_config(vllm_config) -> None:
        if getattr(vllm_config.parallel_config, "enable_dbo", False):
            vllm_config.parallel_config.enable_dbo = False

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        vllm_config.parallel_config.all2all_backend = "flashinfer_all2allv"
        cls._fix_incompatible_config(vllm_config)


class StandinVllmConfig:
    """Stand-in for vllm.config.VllmConfig: platform check, then the upstream DBO assert."""

    platform = StandinNPUPlatform

    def __init__(self, **parallel) -> None:
        self.parallel_config = SimpleNamespace(enable_dbo=False, prefill_context_parallel_size=1, ubatch_size=0,
                                               all2all_backend="allgather_reducescatter",
                                               dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512)
        vars(self.parallel_config).update(parallel)
        self.model_config = SimpleNamespace(architectures=["Qwen3MoeForCausalLM"], disable_cascade_attn=False)
        self.speculative_config = None
        self.additional_config = {}
        self.__post_init__()

    def __post_init__(self) -> None:
        self.platform.check_and_update_config(self)
        if self.parallel_config.enable_dbo:
            assert self.parallel_config.all2all_backend in ["deepep_low_latency", "deepep_high_throughput"], (
                "Microbatching currently only supports the deepep_low_latency and deepep_high_throughput")
            self.model_config.disable_cascade_attn = True


def _patch_platform():
    return vplugin.patch_platform_class(StandinNPUPlatform, lambda cfg: plugin.keep_dbo(cfg, env={}), dbo_requested)


@pytest.fixture()
def patched():
    undo_platform = _patch_platform()
    undo_config = vplugin.patch_vllm_config_class(StandinVllmConfig)
    try:
        yield
    finally:
        undo_config()
        undo_platform()


def test_without_plugin_ascend_drops_dbo() -> None:
    cfg = StandinVllmConfig(enable_dbo=True)
    assert cfg.parallel_config.enable_dbo is False


def test_plugin_keeps_dbo_and_restores_backend(patched: None) -> None:
    cfg = StandinVllmConfig(enable_dbo=True)
    assert cfg.parallel_config.enable_dbo is True
    # upstream's assert saw a DeepEP label; afterwards the platform's own choice is back
    assert cfg.parallel_config.all2all_backend == "flashinfer_all2allv"
    assert cfg.model_config.disable_cascade_attn is True
    # the decision lives in the config every process gets, not in a private environment variable
    assert not [k for k in __import__("os").environ if k.startswith("DBO_RUNTIME_ASCEND")]
    assert vplugin._saved_backend == {}


def test_plugin_leaves_dbo_off_when_not_requested(patched: None) -> None:
    cfg = StandinVllmConfig(enable_dbo=False)
    assert cfg.parallel_config.enable_dbo is False
    assert cfg.parallel_config.all2all_backend == "flashinfer_all2allv"
    assert cfg.model_config.disable_cascade_attn is False


def test_refusal_at_startup_names_conflict_and_flag(patched: None) -> None:
    with pytest.raises(DBOConfigError, match=r"prefill context parallel.*--prefill-context-parallel-size 1"):
        StandinVllmConfig(enable_dbo=True, prefill_context_parallel_size=2)
    assert vplugin._saved_backend == {}


def test_undo_restores_the_originals() -> None:
    raw_check = StandinNPUPlatform.__dict__["check_and_update_config"]
    raw_post = StandinVllmConfig.__dict__["__post_init__"]
    undo_p = _patch_platform()
    undo_c = vplugin.patch_vllm_config_class(StandinVllmConfig)
    assert StandinNPUPlatform.__dict__["check_and_update_config"] is not raw_check
    undo_c()
    undo_p()
    assert StandinNPUPlatform.__dict__["check_and_update_config"] is raw_check
    assert StandinVllmConfig.__dict__["__post_init__"] is raw_post


class StandinRunner:
    def __init__(self, vllm_config, device=None) -> None:
        self.vllm_config = vllm_config


def test_runtime_is_installed_by_the_runner_built_with_dbo_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Activation comes from ``parallel_config.enable_dbo`` of the config the runner is built with (every process
    gets that config: multiprocessing, Ray workers, an in-process engine), once per process."""
    monkeypatch.setattr(vplugin, "_state", {"registered": True, "undo": [], "active": False})
    installs = []
    raw_init = StandinRunner.__dict__["__init__"]
    undo = vplugin.activate_on_runner_init(StandinRunner, lambda cfg: installs.append(cfg) or [], "stand-in")
    try:
        off = SimpleNamespace(parallel_config=SimpleNamespace(enable_dbo=False))
        StandinRunner(off)
        assert installs == [] and not vplugin.is_active()
        on = SimpleNamespace(parallel_config=SimpleNamespace(enable_dbo=True))
        runner = StandinRunner(on, device="cpu")
        StandinRunner(on)
        assert installs == [on] and vplugin.is_active() and runner.vllm_config is on
    finally:
        undo()
    assert StandinRunner.__dict__["__init__"] is raw_init


def test_register_off_ascend_logs_one_inactive_line(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """In this virtualenv there is no vLLM at all: register() must say it is inactive and patch nothing."""
    monkeypatch.setattr(vplugin, "_state", {"registered": False, "undo": [], "active": False})
    with caplog.at_level(logging.INFO):
        vplugin.register()
        vplugin.register()  # vLLM may call general plugins more than once per process
    lines = [r.getMessage() for r in caplog.records if "dbo_runtime" in r.getMessage()]
    assert len(lines) == 1 and "inactive" in lines[0] and "vLLM not importable" in lines[0]
    assert vplugin._state["undo"] == []
