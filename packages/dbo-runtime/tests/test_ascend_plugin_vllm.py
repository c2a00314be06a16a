"""The plugin's activation path, in the vLLM virtualenv, on a STAND-IN ``vllm_ascend`` package.

In a subprocess (so the stand-in never leaks into other tests) the script writes a package named ``vllm_ascend``
generated from the site table (``dbo_runtime.ascend.standin``) plus stand-ins of ``platform.NPUPlatform``,
``worker.model_runner_v1.NPUModelRunner`` and ``ascend_forward_context``, declares the platform to be Ascend, and calls
the real entry point ``register()``:

* every process: the platform config check and the real ``vllm.config.VllmConfig.__post_init__`` are wrapped, and
  the runner's ``__init__`` once the runner module is imported; nothing else.
* a runner built with ``parallel_config.enable_dbo`` off installs nothing; the first one built with it on installs
  every hook site (the FlashComm1 ops keep their ``PrivateUse1`` kernel: no kernel is registered, their
  collectives are routed) and the runner patches; ``unregister()`` restores everything. Activation comes from
  the config each process is handed, never from an environment variable.

It also constructs the real ``VllmConfig`` with ``enable_dbo=True`` through the wrapped platform check (the CPU
platform's, which resets DBO as vLLM-Ascend's does): DBO stays on, upstream's DeepEP assert passes, and the backend
is restored afterwards; without a supported model the same construction fails with the plugin's one-line refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

PLATFORM_SRC = '''
class NPUPlatform:
    @staticmethod
    def _fix_incompatible_config(vllm_config):
        if getattr(vllm_config.parallel_config, "enable_dbo", False):
            vllm_config.parallel_config.enable_dbo = False

    @classmethod
    def check_and_update_config(cls, vllm_config):
        cls._fix_incompatible_config(vllm_config)
'''

RUNNER_SRC = '''
class NPUModelRunner:
    def __init__(self, vllm_config, device=None):
        self.vllm_config = vllm_config
    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, use_cascade_attn, **kwargs):
        raise NotImplementedError
    def _dummy_run(self, num_tokens, **kwargs):
        raise NotImplementedError
    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, num_tokens_padded=None,
                                  num_reqs_padded=None, ubatch_slices=None, **kwargs):
        raise NotImplementedError
    def _model_forward(self, num_tokens_padded, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **kwargs):
        raise NotImplementedError
'''

AFC_SRC = '''
def select_moe_comm_method(num_tokens, vllm_config, is_draft_model=False):
    return None

def set_ascend_forward_context(*args, **kwargs):
    raise NotImplementedError
'''

SCRIPT = r'''
import json, os, sys
from types import SimpleNamespace
import torch
root, platform_src, runner_src, afc_src = sys.argv[1:5]
from dbo_runtime.ascend.standin import write_standin_tree
write_standin_tree(root, "vllm_ascend", "vllm", {
    "vllm_ascend.platform": platform_src,
    "vllm_ascend.worker.model_runner_v1": runner_src,
    "vllm_ascend.ascend_forward_context": afc_src,
})
sys.path.insert(0, root)
import importlib
import vllm.config
from dbo_runtime.ascend import plugin
from dbo_runtime.ascend.sites import SITES
from dbo_runtime.vllm import plugin as vplugin

vplugin.current_platform_kind = lambda: ("ascend", "NPUPlatform (stand-in)")
report = {}
NPUPlatform = importlib.import_module("vllm_ascend.platform").NPUPlatform
importlib.import_module("vllm_ascend.ops.register_custom_ops")
raw = {
    "check": NPUPlatform.__dict__["check_and_update_config"],
    "post": vllm.config.VllmConfig.__dict__["__post_init__"],
}

def site_attr(site):
    owner = importlib.import_module(site.module)
    *path, leaf = site.qualname.split(".")
    for p in path:
        owner = getattr(owner, p)
    return vars(owner)[leaf]

def pu1(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1")

def wrapped_sites():
    return sorted(s.name for s in SITES if s.hook != "via" and getattr(site_attr(s), "__dbo_site__", None) == s.name)

def ops_globals():
    ops = importlib.import_module("vllm_ascend.ops.register_custom_ops")
    return sorted(k for k, v in vars(ops).items() if type(v).__name__ == "RoutedGlobal")

# 1. register() in any process: config side; the runner module is not imported by it
vplugin.register()
report["runner_imported_by_register"] = "vllm_ascend.worker.model_runner_v1" in sys.modules
report["platform_patched"] = NPUPlatform.__dict__["check_and_update_config"] is not raw["check"]
report["post_init_patched"] = vllm.config.VllmConfig.__dict__["__post_init__"] is not raw["post"]
cfg = SimpleNamespace(parallel_config=SimpleNamespace(enable_dbo=True, prefill_context_parallel_size=1,
                                                      ubatch_size=0, all2all_backend="flashinfer_all2allv",
                                                      dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512,
                                                      data_parallel_size=1),
                      model_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], disable_cascade_attn=False),
                      speculative_config=None, additional_config={})
NPUPlatform.check_and_update_config(cfg)
report["kept"] = cfg.parallel_config.enable_dbo
report["env_vars"] = sorted(k for k in os.environ if k.startswith("DBO_RUNTIME"))
vplugin._saved_backend.clear()

# 2. the runner module is imported (the worker): a runner with DBO off installs nothing, with DBO on everything
Runner = importlib.import_module("vllm_ascend.worker.model_runner_v1").NPUModelRunner
raw["runner"] = {k: v for k, v in vars(Runner).items() if k != "__init__"}
off = SimpleNamespace(parallel_config=SimpleNamespace(enable_dbo=False))
Runner(off)
report["sites_after_off"] = wrapped_sites()
Runner(cfg)
report["worker_sites"] = wrapped_sites()
report["routed_globals"] = ops_globals()
report["pu1_kernels"] = [pu1("vllm::maybe_all_gather_and_maybe_unpad"), pu1("vllm::maybe_pad_and_reduce")]
report["runner_patched"] = sorted(k for k in ("_determine_batch_execution_and_padding", "_dummy_run",
                                              "_build_attention_metadata", "_model_forward")
                                  if vars(Runner)[k] is not raw["runner"][k])
vplugin.unregister()
report["worker_sites_after"] = wrapped_sites()
report["routed_after"] = ops_globals()
report["runner_restored"] = all(vars(Runner)[k] is v for k, v in raw["runner"].items() if not k.startswith("__"))
report["restored"] = (NPUPlatform.__dict__["check_and_update_config"] is raw["check"]
                      and vllm.config.VllmConfig.__dict__["__post_init__"] is raw["post"])

# 3. the real VllmConfig.__post_init__ (CPU platform resets DBO like vLLM-Ascend; its check is wrapped here)
from vllm.platforms import current_platform
from dbo_runtime.ascend.validate import dbo_requested
undo_platform = vplugin.patch_platform_class(type(current_platform), lambda c: plugin.keep_dbo(c, env={}),
                                             dbo_requested)
undo_post = vplugin.patch_vllm_config_class(vllm.config.VllmConfig)
try:
    try:
        vllm.config.VllmConfig(parallel_config=vllm.config.ParallelConfig(enable_dbo=True))
        report["refusal"] = None
    except ValueError as exc:  # pydantic re-raises a ValueError from __post_init__ as its ValidationError
        report["refusal"] = str(exc)
        report["refusal_type"] = type(exc).__name__
    import dbo_runtime.ascend.validate as validate
    validate_real = validate.find_conflicts
    validate.find_conflicts = lambda *a, **k: []  # the refusals are tested in test_ascend_validate.py
    try:
        c = vllm.config.VllmConfig(parallel_config=vllm.config.ParallelConfig(enable_dbo=True))
    finally:
        validate.find_conflicts = validate_real
    report["real_enable_dbo"] = c.parallel_config.enable_dbo
    report["real_backend"] = c.parallel_config.all2all_backend
    report["saved_left"] = len(vplugin._saved_backend)
finally:
    undo_post()
    undo_platform()
print("REPORT " + json.dumps(report))
'''




@pytest.mark.vllm
def test_register_on_standin_ascend_installs_and_uninstalls_everything(tmp_path: Path, vllm_python: Path) -> None:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([str(vllm_python), "-c", SCRIPT, str(tmp_path), PLATFORM_SRC, RUNNER_SRC, AFC_SRC],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("REPORT "):])
    stream_sites = sorted(["a2.moe_prepare", "a2.moe_finalize", "a3.moe_dispatch", "a3.moe_combine", "fc1.all_gather",
                           "fc1.reduce_scatter", "fc1.row_matmul_reduce", "fc2.o_proj_all_to_all",
                           "a3.moe_prepare", "a3.moe_finalize"])  # the last two: per-micro-batch state only
    # register(): config side only, the heavy runner module untouched, no private environment variable
    assert not r["runner_imported_by_register"] and r["platform_patched"] and r["post_init_patched"]
    assert r["kept"] is True and r["env_vars"] == []
    # a runner built with DBO off installs nothing; one built with DBO on: every site and the runner
    assert r["sites_after_off"] == []
    assert r["worker_sites"] == stream_sites
    assert r["routed_globals"] == ["get_ep_group", "tensor_model_parallel_all_gather",
                                   "tensor_model_parallel_all_reduce", "tensor_model_parallel_reduce_scatter"]
    assert r["pu1_kernels"] == [True, True]  # the stand-in package's own kernels, untouched
    assert r["runner_patched"] == ["_build_attention_metadata", "_determine_batch_execution_and_padding",
                                   "_dummy_run", "_model_forward"]
    assert r["worker_sites_after"] == [] and r["routed_after"] == [] and r["runner_restored"] and r["restored"]
    # real VllmConfig: refusal without a supported model, else DBO kept and the backend restored after the assert
    assert r["refusal"] and "--enable-dbo on vLLM-Ascend cannot be combined with: model architecture" in r["refusal"]
    assert "change: serve a supported model or drop --enable-dbo" in r["refusal"]
    assert r["real_enable_dbo"] is True and r["real_backend"] == "allgather_reducescatter" and r["saved_left"] == 0
