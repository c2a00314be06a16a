"""Refusals of DBO on vLLM-Ascend, on stand-in config objects that carry VllmConfig's attribute names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dbo_runtime.ascend.sites import MODEL_FAMILY_SITES, SUPPORTED_MODELS
from dbo_runtime.ascend.validate import batch_may_split, dbo_requested, find_conflicts, validate_dbo_config
from dbo_runtime.errors import DBOConfigError


def standin_config(**over):
    """A stand-in for vllm.config.VllmConfig with only the attributes the validator reads."""
    parallel = SimpleNamespace(enable_dbo=True, prefill_context_parallel_size=1, ubatch_size=0)
    model = SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], disable_cascade_attn=True)
    cfg = SimpleNamespace(parallel_config=parallel, model_config=model, speculative_config=None,
                          additional_config={})
    for key, value in over.items():
        section, _, attr = key.partition("__")
        if attr:
            setattr(getattr(cfg, section), attr, value)
        else:
            setattr(cfg, section, value)
    return cfg


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                  "Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "Glm4MoeForCausalLM",
                                  "GlmMoeDsaForCausalLM"])
def test_supported_models_pass(arch: str) -> None:
    # a dense model needs FlashComm1 (test_dense_model_without_flashcomm1_is_refused); the others pass as they are
    extra = {"enable_flashcomm1": True} if arch == "Qwen3ForCausalLM" else {}
    cfg = standin_config(model_config__architectures=[arch], additional_config=extra)
    assert find_conflicts(cfg, env={}) == []
    validate_dbo_config(cfg, env={})


def test_dense_model_without_flashcomm1_is_refused() -> None:
    """Issue 27, fault 5: with FlashComm1 off a dense model's TP all-reduces are unhooked; DBO could only cost."""
    cfg = standin_config(model_config__architectures=["Qwen3ForCausalLM"])
    with pytest.raises(DBOConfigError) as info:
        validate_dbo_config(cfg, env={})
    assert "without FlashComm1" in str(info.value) and '"enable_flashcomm1": true' in str(info.value)
    assert find_conflicts(cfg, env={"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}) == []
    # the additional_config value wins over the deprecated variable, as in vllm-ascend's ascend_config
    off = standin_config(model_config__architectures=["Qwen3ForCausalLM"],
                         additional_config={"enable_flashcomm1": False})
    assert len(find_conflicts(off, env={"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"})) == 1
    # MoE models keep their MoE sites without FlashComm1
    assert find_conflicts(standin_config(model_config__architectures=["Qwen3MoeForCausalLM"]), env={}) == []


def test_linear_attention_hybrid_is_refused_with_the_reason() -> None:
    # vLLM 0.23.0's registry maps BailingMoeV2_5ForCausalLM to bailing_moe_linear (linear attention + MLA + MoE,
    # IsHybrid): its per-request state is not split per micro-batch, so it is no GQA + MoE model to accept.
    cfg = standin_config(model_config__architectures=["BailingMoeV2_5ForCausalLM"])
    (conflict,) = find_conflicts(cfg, env={})
    assert "model architecture BailingMoeV2_5ForCausalLM" in conflict.what
    assert "linear-attention hybrid" in conflict.why and "bailing_moe_linear" in conflict.why
    assert not any("Bailing" in family for family in MODEL_FAMILY_SITES)


def test_every_supported_model_names_a_family_of_the_site_map() -> None:
    assert {m.family for m in SUPPORTED_MODELS} == set(MODEL_FAMILY_SITES)
    assert len({m.architecture for m in SUPPORTED_MODELS}) == len(SUPPORTED_MODELS)


CASES = {
    "fused_mc2": (dict(additional_config={"enable_fused_mc2": 1}), "fused MC2", '"enable_fused_mc2": 0'),
    "prefill_mc2": (dict(additional_config={"enable_prefill_mc2": True}), "MC2 for prefill",
                    '"enable_prefill_mc2": false'),
    "pcp": (dict(parallel_config__prefill_context_parallel_size=2), "prefill context parallel",
            "--prefill-context-parallel-size 1"),
    "eagle3": (dict(speculative_config=SimpleNamespace(method="eagle3")), "eagle3 speculative drafting",
               "remove --speculative-config"),
    "mtp": (dict(speculative_config=SimpleNamespace(method="deepseek_mtp")), "deepseek_mtp speculative drafting",
            "remove --speculative-config"),
    "cascade": (dict(model_config__disable_cascade_attn=False), "cascade attention", "--disable-cascade-attn"),
    "model": (dict(model_config__architectures=["LlamaForCausalLM"]), "model architecture LlamaForCausalLM",
              "drop --enable-dbo"),
    "xbo": (dict(parallel_config__ubatch_size=3), "more than two micro-batches", "--ubatch-size 0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_refusal_names_conflict_and_flag(case: str) -> None:
    over, what, flag = CASES[case]
    cfg = standin_config(**over)
    conflicts = find_conflicts(cfg, env={})
    assert len(conflicts) == 1, conflicts
    with pytest.raises(DBOConfigError) as info:
        validate_dbo_config(cfg, env={})
    message = str(info.value)
    assert "\n" not in message
    assert what in message and flag in message


def test_fused_mc2_from_environment_and_config_precedence() -> None:
    cfg = standin_config()
    assert [c.what for c in find_conflicts(cfg, env={"VLLM_ASCEND_ENABLE_FUSED_MC2": "1"})] == [
        "fused MC2 (enable_fused_mc2)"]
    assert find_conflicts(cfg, env={"VLLM_ASCEND_ENABLE_FUSED_MC2": "0"}) == []
    # additional_config wins over the deprecated environment variable, as AscendConfig._get_config_value does
    cfg = standin_config(additional_config={"enable_fused_mc2": 0})
    assert find_conflicts(cfg, env={"VLLM_ASCEND_ENABLE_FUSED_MC2": "2"}) == []


def test_speculative_ngram_is_allowed_and_several_conflicts_in_one_message() -> None:
    assert find_conflicts(standin_config(speculative_config=SimpleNamespace(method="ngram")), env={}) == []
    cfg = standin_config(parallel_config__prefill_context_parallel_size=2,
                         model_config__architectures=["MixtralForCausalLM"])
    with pytest.raises(DBOConfigError) as info:
        validate_dbo_config(cfg, env={})
    assert "prefill context parallel" in str(info.value) and "MixtralForCausalLM" in str(info.value)


def test_architectures_from_hf_config_and_missing() -> None:
    cfg = standin_config(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3ForCausalLM"]),
                                                      disable_cascade_attn=True),
                         additional_config={"enable_flashcomm1": True})
    assert find_conflicts(cfg, env={}) == []
    cfg = standin_config(model_config=SimpleNamespace(disable_cascade_attn=True))
    assert "<unknown architecture>" in str(find_conflicts(cfg, env={})[0])


def test_dbo_requested_and_batch_veto() -> None:
    assert dbo_requested(standin_config())
    assert not dbo_requested(standin_config(parallel_config__enable_dbo=False))
    assert batch_may_split(moe_comm_type="ALLGATHER")
    assert batch_may_split(moe_comm_type="MoECommType.ALLTOALL")
    assert batch_may_split(moe_comm_type=None)  # dense model
    assert not batch_may_split(moe_comm_type="MoECommType.MC2")
    assert not batch_may_split(moe_comm_type="FUSED_MC2")
    assert not batch_may_split(moe_comm_type="ALLGATHER", use_cascade_attn=True)
    assert not batch_may_split(moe_comm_type="ALLGATHER", num_reqs=0)


def test_greenlet_scheduler_is_refused_on_ascend() -> None:
    """Its sites run inside custom ops' Python kernels, where a greenlet switch aborts the process (the emulated
    engine, tests/ascend_emulated/test_plugin_config.py); the thread scheduler is the one that works."""
    cfg = standin_config()
    (conflict,) = find_conflicts(cfg, env={"DBO_RUNTIME_SCHEDULER": "greenlet"})
    assert "greenlet" in conflict.what and "unset DBO_RUNTIME_SCHEDULER" in conflict.flag
    assert find_conflicts(cfg, env={"DBO_RUNTIME_SCHEDULER": "thread"}) == []
