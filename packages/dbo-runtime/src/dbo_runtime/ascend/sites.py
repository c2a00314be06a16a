"""The declarative table of everything the vLLM-Ascend adapter touches.

Two kinds of rows:

* :class:`HookSite` — a communication site: where a collective of a micro-batch is launched, and so where the
  other micro-batch may run. ``hook`` says how the site is wrapped (see :data:`HOOK_KINDS`).
* :class:`PatchedSymbol` — a symbol the plugin replaces or relies on that is not a communication site (the
  platform config check that resets ``enable_dbo``, the model-runner methods, upstream vLLM helpers).

Every name below was read from the vllm-ascend 0.23.0.post1 sdist on PyPI (and the vLLM v0.23.0 wheel it pairs
with); ``dbo-runtime doctor`` re-checks them against any other release before anything is patched. ``params`` are
the parameter names the wrapper relies on (in order, a subsequence of the real signature); ``calls`` are names the
body must still call, for sites whose collective is reached through another site.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "HOOK_KINDS",
    "HookSite",
    "PatchedSymbol",
    "SITES",
    "PATCHED_SYMBOLS",
    "VLLM_SYMBOLS",
    "MODEL_FAMILY_SITES",
    "SupportedModel",
    "SUPPORTED_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "DENSE_ARCHITECTURES",
    "REFUSED_MODELS",
    "STATEFUL_MODEL_INTERFACES",
    "OpRegistration",
    "OP_REGISTRATIONS",
    "BuilderFact",
    "BUILDERS_PER_GROUP",
    "AttnStateFact",
    "ATTN_STATE",
    "GlobalBufferFact",
    "ROTARY_MLA_BUFFER",
    "UbatchStateFact",
    "UBATCH_STATE_FACTS",
    "BackendFact",
    "DEFAULT_GROUP_BACKEND",
    "ModelForwardFact",
    "MODEL_FORWARD",
    "ForwardContextCallFact",
    "FORWARD_CONTEXT_CALL",
    "TORCH_PAIR",
    "parse_collective",
    "site_by_name",
    "STATE_ONLY_SITES",
]

Package = Literal["vllm_ascend", "vllm"]

HOOK_KINDS: dict[str, str] = {
    "stream": "dbo_runtime.hooks.wrap_stream_site around the method (collectives enqueued on the current stream)",
    "custom_op": "the op (already opaque to Dynamo) keeps its kernel: the collective helpers its registered impl "
    "calls through its module's globals are wrapped in wrap_stream_site for calls from that impl only",
    "opaque_stream": "wrap_stream_site behind a dbo_runtime torch.library custom op, because the method is traced "
    "by torch.compile",
    "via": "no wrapper of its own: its collectives go through the custom op of the site named in `via`",
    "state": "no yield and no stream switch: the method's instance state is swapped per micro-batch "
    "(PER_UBATCH_STATE), because the micro-batches interleave between it and its partner method",
}


def missing_in_order(wanted: Sequence[str], have: Sequence[str]) -> list[str]:
    """Names of ``wanted`` that are not found as an in-order subsequence of ``have`` (the check of a site's
    parameters, in the doctor from the source and at install time from the live function)."""
    missing, pos = [], 0
    for name in wanted:
        try:
            pos = list(have).index(name, pos) + 1
        except ValueError:
            missing.append(name)
    return missing


@dataclass(frozen=True)
class HookSite:
    """One communication site of vLLM-Ascend."""

    name: str
    module: str
    qualname: str
    hook: Literal["stream", "custom_op", "opaque_stream", "via", "state"]
    params: tuple[str, ...]
    family: str
    what: str
    calls: tuple[str, ...] = ()
    op: str | None = None
    via: str | None = None
    package: Package = "vllm_ascend"
    # custom_op sites: what the impl calls through its module's globals to communicate, as ``name`` (a function)
    # or ``name().method`` (a method of what ``name()`` returns, e.g. ``get_ep_group().all_gather``).
    collectives: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return f"{self.module}:{self.qualname}"


def parse_collective(spec: str) -> tuple[str, str | None]:
    """``"name"`` -> (name, None); ``"name().method"`` -> (name, method)."""
    name, sep, method = spec.partition("().")
    if not name.isidentifier() or (sep and not method.isidentifier()) or (not sep and "(" in spec):
        raise ValueError(f"collective {spec!r}: expected 'name' or 'name().method'")
    return name, (method if sep else None)


@dataclass(frozen=True)
class PatchedSymbol:
    """A symbol the adapter patches (``patched=True``) or relies on (``patched=False``)."""

    name: str
    module: str
    qualname: str
    kind: Literal["function", "class"]
    why: str
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    resets: tuple[str, ...] = ()
    patched: bool = True
    package: Package = "vllm_ascend"
    optional_attrs: tuple[str, ...] = field(default=())
    # The exact decorators (dotted name, call parentheses dropped) the wrapper was written for; None: not checked.
    # A decorator can change how a method is called (a different signature, a cache, a compiled callable).
    decorators: tuple[str, ...] | None = None
    # The wrapper forwards extra keyword arguments: the real function must take **kwargs.
    varkw: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}:{self.qualname}"


_PF = "vllm_ascend.ops.fused_moe.prepare_finalize"
_TD = "vllm_ascend.ops.fused_moe.token_dispatcher"
_OPS = "vllm_ascend.ops.register_custom_ops"
_LIN = "vllm_ascend.ops.linear_op"

SITES: tuple[HookSite, ...] = (
    HookSite(
        name="a2.moe_prepare",
        module=_PF,
        qualname="PrepareAndFinalizeWithAllGather.prepare",
        hook="stream",
        params=("self", "hidden_states", "router_logits"),
        family="MoE A2 (all-gather / reduce-scatter)",
        what="EP (or DP) all-gather of hidden states and router logits before the experts",
    ),
    HookSite(
        name="a2.moe_finalize",
        module=_PF,
        qualname="PrepareAndFinalizeWithAllGather.finalize",
        hook="stream",
        params=("self", "hidden_states", "reduce_results"),
        family="MoE A2 (all-gather / reduce-scatter)",
        what="EP (or DP) reduce-scatter of the expert output",
    ),
    HookSite(
        name="a3.moe_prepare",
        module=_PF,
        qualname="PrepareAndFinalizeWithAll2All.prepare",
        hook="state",
        params=("self", "hidden_states", "router_logits"),
        family="MoE A3 (all-to-all-v)",
        what="no communication: stores num_tokens / replace_allreduce / enable_shared_expert_dp on the shared "
        "instance for finalize, with the micro-batches' dispatch and combine yields in between",
    ),
    HookSite(
        name="a3.moe_finalize",
        module=_PF,
        qualname="PrepareAndFinalizeWithAll2All.finalize",
        hook="state",
        params=("self", "hidden_states", "reduce_results"),
        family="MoE A3 (all-to-all-v)",
        what="reads what its micro-batch's prepare stored (the TP all-gather and unpad of the expert output)",
    ),
    HookSite(
        name="a3.moe_dispatch",
        module=_TD,
        qualname="TokenDispatcherWithAll2AllV.token_dispatch",
        hook="stream",
        params=("self", "token_dispatch_input"),
        family="MoE A3 (all-to-all-v)",
        what="all-to-all-v dispatch of permuted tokens to their experts' ranks",
        calls=("async_all_to_all",),
    ),
    HookSite(
        name="a3.moe_combine",
        module=_TD,
        qualname="TokenDispatcherWithAll2AllV.token_combine",
        hook="stream",
        params=("self", "hidden_states", "combine_metadata"),
        family="MoE A3 (all-to-all-v)",
        what="all-to-all-v combine of the expert output back to the tokens' ranks",
        calls=("async_all_to_all",),
    ),
    HookSite(
        name="fc1.all_gather",
        module=_OPS,
        qualname="_maybe_all_gather_and_maybe_unpad_impl",
        hook="custom_op",
        op="vllm::maybe_all_gather_and_maybe_unpad",
        params=("x", "label", "is_ep_comm"),
        collectives=("tensor_model_parallel_all_gather", "get_ep_group().all_gather"),
        family="FlashComm1 (sequence-parallel linear)",
        what="TP (or EP) all-gather of token-sharded activations before a column-parallel linear",
    ),
    HookSite(
        name="fc1.reduce_scatter",
        module=_OPS,
        qualname="_maybe_pad_and_reduce_impl",
        hook="custom_op",
        op="vllm::maybe_pad_and_reduce",
        params=("x", "is_ep_comm"),
        collectives=("tensor_model_parallel_all_reduce", "tensor_model_parallel_reduce_scatter",
                     "get_ep_group().reduce_scatter"),
        family="FlashComm1 (sequence-parallel linear)",
        what="TP (or EP) reduce-scatter (all-reduce without FlashComm1) after a row-parallel linear",
    ),
    HookSite(
        name="fc1.row_matmul_reduce",
        module=_LIN,
        qualname="SequenceRowParallelOp.matmul_and_reduce",
        hook="stream",
        params=("self", "input_parallel", "bias_"),
        family="FlashComm1 (sequence-parallel linear)",
        what="row-parallel matmul + reduce-scatter (or fused MatmulReduceScatter), run inside the opaque "
        "vllm::matmul_and_reduce op",
        calls=("tensor_model_parallel_reduce_scatter",),
    ),
    HookSite(
        name="fc1.column_all_gather",
        module=_LIN,
        qualname="SequenceColumnParallelOp.apply_impl",
        hook="via",
        via="fc1.all_gather",
        params=("self", "input_"),
        family="FlashComm1 (sequence-parallel linear)",
        what="column-parallel linear; its all-gather is the fc1.all_gather op",
        calls=("maybe_all_gather_and_maybe_unpad",),
    ),
    HookSite(
        name="fc2.o_proj_all_to_all",
        module=_LIN,
        qualname="Flashcomm2OProjRowParallelOp.apply_impl",
        hook="opaque_stream",
        params=("self", "input_"),
        family="FlashComm2 (o_proj all-to-all)",
        what="o_proj all-to-all over the ODP group, then reduce-scatter / all-gather",
        calls=("all_to_all_single",),
    ),
    HookSite(
        name="mla.preprocess",
        module="vllm_ascend.attention.mla_v1",
        qualname="AscendMLAImpl._mla_preprocess",
        hook="via",
        via="fc1.all_gather",
        params=("self", "layer_name", "hidden_states", "kv_cache", "attn_metadata", "need_gather_q_kv"),
        family="MLA attention (DeepSeek, GLM MoE DSA)",
        what="q_c / kv_no_split all-gather of the MLA preprocess; goes through the fc1.all_gather op",
        calls=("maybe_all_gather_and_maybe_unpad",),
    ),
)

# Sites that only keep per-micro-batch instance state (no communication, no yield).
STATE_ONLY_SITES: frozenset[str] = frozenset(site.name for site in SITES if site.hook == "state")

_MR = "vllm_ascend.worker.model_runner_v1"

PATCHED_SYMBOLS: tuple[PatchedSymbol, ...] = (
    PatchedSymbol(
        name="platform.config_check",
        module="vllm_ascend.platform",
        qualname="NPUPlatform.check_and_update_config",
        kind="function",
        why="calls _fix_incompatible_config, which resets enable_dbo; wrapped to keep it and to validate",
        params=("cls", "vllm_config"),
        calls=("_fix_incompatible_config",),
    ),
    PatchedSymbol(
        name="platform.dbo_reset",
        module="vllm_ascend.platform",
        qualname="NPUPlatform._fix_incompatible_config",
        kind="function",
        why="relied on: where vLLM-Ascend resets enable_dbo (and ubatch_size) today",
        params=("vllm_config",),
        resets=("enable_dbo",),
        patched=False,
    ),
    PatchedSymbol(
        name="runner.batch_decision",
        module=_MR,
        qualname="NPUModelRunner._determine_batch_execution_and_padding",
        kind="function",
        why="always returns should_ubatch=False; wrapped to take the DP-agreed decision of dp_sync",
        params=("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens",
                "use_cascade_attn", "force_uniform_decode"),
        decorators=(),
    ),
    PatchedSymbol(
        name="runner.dummy_run",
        module=_MR,
        qualname="NPUModelRunner._dummy_run",
        kind="function",
        why="idle-rank and warm-up batches; wrapped so that they vote 'no split' in the DP-wide decision",
        params=("self", "num_tokens"),
        calls=("_determine_batch_execution_and_padding", "_model_forward"),
        decorators=("torch.inference_mode",),
    ),
    PatchedSymbol(
        name="runner.attn_metadata",
        module=_MR,
        qualname="NPUModelRunner._build_attention_metadata",
        kind="function",
        why="given ubatch_slices it builds one dict per micro-batch; wrapped to split the Ascend common metadata",
        params=("self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
                "ubatch_slices"),
        decorators=(),
    ),
    PatchedSymbol(
        name="runner.model_forward",
        module=_MR,
        qualname="NPUModelRunner._model_forward",
        kind="function",
        why="the model call; wrapped to run the two micro-batches through dbo_runtime.context.run_ubatches",
        params=("self", "num_tokens_padded", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
        varkw=True,
        decorators=(),
    ),
    PatchedSymbol(
        name="runner.execute_model",
        module=_MR,
        qualname="NPUModelRunner.execute_model",
        kind="function",
        why="relied on: it already calls upstream maybe_create_ubatch_slices with the runner's decision; it runs "
        "under torch.inference_mode, which the micro-batch threads must carry",
        params=("self", "scheduler_output"),
        calls=("maybe_create_ubatch_slices", "_determine_batch_execution_and_padding", "_build_attention_metadata",
               "_model_forward"),
        decorators=("torch.inference_mode",),
        patched=False,
    ),
    PatchedSymbol(
        name="attn.common_metadata",
        module="vllm_ascend.attention.utils",
        qualname="AscendCommonAttentionMetadata",
        kind="class",
        why="relied on: the Ascend fields the split must carry (attn_state, num_input_tokens, positions, ...)",
        attrs=("seq_lens_cpu", "num_computed_tokens_cpu", "actual_seq_lengths_q", "positions", "attn_state",
               "graph_pad_size", "num_input_tokens", "prefill_context_parallel_metadata"),
        patched=False,
    ),
    PatchedSymbol(
        name="forward_context.ascend",
        module="vllm_ascend.ascend_forward_context",
        qualname="set_ascend_forward_context",
        kind="function",
        why="relied on: builds each micro-batch's forward context (MoE comm type, FlashComm pad size, DP sizes, "
        "sinks, the micro-batch's input ids, the EPLB flag); AscendIntegration.ascend_context passes these by name "
        "(forward_context.ascend_call checks each one it passes)",
        params=("attn_metadata", "vllm_config", "num_tokens", "num_tokens_across_dp", "in_profile_run",
                "num_actual_tokens", "aclgraph_runtime_mode", "batch_descriptor", "model_instance",
                "is_draft_model", "skip_compiled", "has_sinks", "input_ids", "eplb_heat_collection_status"),
        patched=False,
    ),
    PatchedSymbol(
        name="moe.comm_select",
        module="vllm_ascend.ascend_forward_context",
        qualname="select_moe_comm_method",
        kind="function",
        why="relied on: picks the MoE communication per batch; MC2 / FUSED_MC2 batches are not split",
        params=("num_tokens", "vllm_config"),
        patched=False,
    ),
)

VLLM_SYMBOLS: tuple[PatchedSymbol, ...] = (
    PatchedSymbol(
        name="vllm.parallel_config",
        module="vllm.config.parallel",
        qualname="ParallelConfig",
        kind="class",
        why="relied on: the DBO flags and thresholds",
        attrs=("enable_dbo", "dbo_decode_token_threshold", "dbo_prefill_token_threshold", "ubatch_size"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.config_post_init",
        module="vllm.config.vllm",
        qualname="VllmConfig.__post_init__",
        kind="function",
        why="asserts a DeepEP all2all backend when ubatching; wrapped to restore the platform's backend after it",
        params=("self",),
        calls=("check_and_update_config",),
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.ubatch_slices",
        module="vllm.v1.worker.ubatch_utils",
        qualname="maybe_create_ubatch_slices",
        kind="function",
        why="relied on: the token-level split the NPU runner already calls",
        params=("should_ubatch", "num_scheduled_tokens", "num_tokens_padded", "num_reqs_padded", "num_ubatches"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.ubatch_slice",
        module="vllm.v1.worker.ubatch_utils",
        qualname="UBatchSlice",
        kind="class",
        why="relied on: request_slice / token_slice of one micro-batch",
        attrs=("request_slice", "token_slice"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.forward_context",
        module="vllm.forward_context",
        qualname="ForwardContext",
        kind="class",
        why="relied on: ubatch_slices and per-micro-batch attn_metadata / slot_mapping lists",
        attrs=("attn_metadata", "slot_mapping", "dp_metadata", "ubatch_slices", "skip_compiled"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.attention_group",
        module="vllm.v1.worker.utils",
        qualname="AttentionGroup",
        kind="class",
        why="relied on: the runner builds the second micro-batch's metadata builder from the group's backend, "
        "kv_cache_spec and layer_names and appends it to metadata_builders (vLLM-Ascend creates one per group)",
        attrs=("backend", "layer_names", "kv_cache_spec", "kv_cache_group_id", "metadata_builders",
               "create_metadata_builders", "get_metadata_builder"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.create_metadata_builders",
        module="vllm.v1.worker.utils",
        qualname="AttentionGroup.create_metadata_builders",
        kind="function",
        why="relied on: upstream's way to make one builder per micro-batch (num_metadata_builders)",
        params=("self", "vllm_config", "device", "kernel_block_size", "num_metadata_builders"),
        calls=("get_builder_cls",),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.get_metadata_builder",
        module="vllm.v1.worker.utils",
        qualname="AttentionGroup.get_metadata_builder",
        kind="function",
        why="relied on: the micro-batch's builder by index (asserts that many builders exist)",
        params=("self", "ubatch_id"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.metadata_builder_init",
        module="vllm.v1.attention.backend",
        qualname="AttentionMetadataBuilder.__init__",
        kind="function",
        why="relied on: the runner makes a micro-batch's second builder as type(b0)(kv_cache_spec, layer_names, "
        "vllm_config, device) from the first builder's attributes of those names",
        params=("self", "kv_cache_spec", "layer_names", "vllm_config", "device"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.direct_register_custom_op",
        module="vllm.utils.torch_utils",
        qualname="direct_register_custom_op",
        kind="function",
        why="relied on: how the ops around the sites are registered (define + impl of op_func under dispatch_key)",
        params=("op_name", "op_func", "mutates_args", "fake_impl", "target_lib", "dispatch_key"),
        calls=("define", "impl"),
        patched=False,
        package="vllm",
    ),
    PatchedSymbol(
        name="vllm.moe_forward_op",
        module="vllm.model_executor.layers.fused_moe.runner.moe_runner",
        qualname="_moe_forward",
        kind="function",
        why="relied on: the opaque vllm::moe_forward op that keeps the A2/A3 sites out of Dynamo's trace",
        patched=False,
        package="vllm",
    ),
)

@dataclass(frozen=True)
class OpRegistration:
    """A torch custom op that holds hook sites: how its source registers it (``direct_register_custom_op``).

    The sites inside rely on it: the op keeps them out of Dynamo's trace, and the ``custom_op`` sites wrap what its
    ``op_func`` calls through its module's globals, so ``op_func`` must be the function the table names.
    ``dispatch_key`` None: the call passes none and vLLM uses ``current_platform.dispatch_key`` (PrivateUse1 on
    vLLM-Ascend).
    """

    op: str
    module: str
    op_func: str
    dispatch_key: str | None
    sites: tuple[str, ...]
    package: Package = "vllm_ascend"

    @property
    def target(self) -> str:
        return f"{self.module}:{self.op_func}"


OP_REGISTRATIONS: tuple[OpRegistration, ...] = (
    OpRegistration("vllm::maybe_all_gather_and_maybe_unpad", _OPS, "_maybe_all_gather_and_maybe_unpad_impl",
                   "PrivateUse1", ("fc1.all_gather", "fc1.column_all_gather", "mla.preprocess")),
    OpRegistration("vllm::maybe_pad_and_reduce", _OPS, "_maybe_pad_and_reduce_impl", "PrivateUse1",
                   ("fc1.reduce_scatter",)),
    OpRegistration("vllm::matmul_and_reduce", _OPS, "_matmul_and_reduce_impl", "PrivateUse1",
                   ("fc1.row_matmul_reduce",)),
    OpRegistration("vllm::moe_forward", "vllm.model_executor.layers.fused_moe.runner.moe_runner", "_moe_forward",
                   None, ("a2.moe_prepare", "a2.moe_finalize", "a3.moe_dispatch", "a3.moe_combine"), package="vllm"),
)


@dataclass(frozen=True)
class BuilderFact:
    """How many attention-metadata builders vLLM-Ascend's runner gives each attention group (the runner needs one
    per micro-batch; ``count`` is what the release does, read from ``function``, and what the runner adapts to)."""

    module: str
    function: str
    count: int


# vllm-ascend 0.23.0.post1 overrides initialize_attn_backend and appends exactly one builder per AttentionGroup
# (worker/model_runner_v1.py:4851-4867); it never calls AttentionGroup.create_metadata_builders, so
# parallel_config.num_ubatches does not reach it (worker.py:511 also fixes num_ubatches = 1 for the workspace).
BUILDERS_PER_GROUP = BuilderFact(_MR, "NPUModelRunner.initialize_attn_backend", 1)


# --------------------------------------------------------------------------------------------------------------
# Semantic facts the DBO fixes rely on (read from vllm-ascend 0.23.0.post1; the doctor re-checks each one).
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnStateFact:
    """The attn_state rule. ``rule_function`` sets ``no_cache_state`` when no request of the batch has computed
    tokens (``computed_tokens`` == 0), and the attention kernel (``kernel_function``) then attends only to the
    forward's own key/value, reading none of ``cache_names``. The runtime gives each micro-batch its own attn_state
    among ``members``: the micro-batch that holds the tail of a request cut at the split point has computed tokens
    and must be ChunkedPrefill, not PrefillNoCache."""

    enum_module: str
    enum_class: str
    members: tuple[str, ...]
    rule_module: str
    rule_function: str
    no_cache_state: str
    computed_tokens: str
    kernel_module: str
    kernel_function: str
    cache_names: tuple[str, ...]


# attention/attention_v1.py:147 (the enum; not in attention/utils.py), worker/model_runner_v1.py:1477-1479,
# attention/attention_v1.py:1194-1199 (_get_fia_params: PrefillNoCache takes key/value as given, no block table).
ATTN_STATE = AttnStateFact(
    enum_module="vllm_ascend.attention.attention_v1",
    enum_class="AscendAttentionState",
    members=("PrefillNoCache", "PrefillCacheHit", "DecodeOnly", "ChunkedPrefill", "SpecDecoding"),
    rule_module=_MR,
    rule_function="NPUModelRunner._build_attn_state",
    no_cache_state="PrefillNoCache",
    computed_tokens="num_computed_tokens_cpu",
    kernel_module="vllm_ascend.attention.attention_v1",
    kernel_function="AscendAttentionBackendImpl._get_fia_params",
    cache_names=("key_cache", "value_cache", "kv_cache", "block_tables"),
)


@dataclass(frozen=True)
class GlobalBufferFact:
    """A function that returns a view of process-global buffers (``buffers``) when called with ``flag`` true, and
    the metadata builders (``callers``: (module, class)) that call it so: two micro-batches would share the view,
    so the runtime copies what it returns per micro-batch."""

    module: str
    function: str
    flag: str
    buffers: tuple[str, ...]
    callers: tuple[tuple[str, str], ...]


# ops/rotary_embedding.py:51-52 (the globals), :89-101 (get_cos_and_sin_mla); attention/mla_v1.py:656
# (AscendMLAMetadataBuilder.build_decode_metadata), attention/sfa_v1.py:392 (AscendSFAMetadataBuilder._build).
ROTARY_MLA_BUFFER = GlobalBufferFact(
    module="vllm_ascend.ops.rotary_embedding",
    function="get_cos_and_sin_mla",
    flag="use_cache",
    buffers=("_cos_mla", "_sin_mla"),
    callers=(("vllm_ascend.attention.mla_v1", "AscendMLAMetadataBuilder"),
             ("vllm_ascend.attention.sfa_v1", "AscendSFAMetadataBuilder")),
)


@dataclass(frozen=True)
class UbatchStateFact:
    """A class whose ``writer`` stores instance attributes that its ``reader`` reads later in the same forward (the
    MoE prepare/finalize pair on the one shared instance). Every such attribute must be kept per micro-batch by
    the runtime's ``PER_UBATCH_STATE`` (dbo_runtime/ascend/runner.py) under the keys ``keys`` (writer, reader), or
    under the names of the sites whose qualname is ``cls.writer`` / ``cls.reader``."""

    module: str
    cls: str
    writer: str
    reader: str
    keys: tuple[str, str]


# ops/fused_moe/prepare_finalize.py:321 (AllGather: num_tokens, num_tokens_pcp, enable_shared_expert_dp), :116
# (All2All: num_tokens, replace_allreduce, enable_shared_expert_dp). MC2 is never split (SPLIT_VETO_MOE_COMM_TYPES).
UBATCH_STATE_FACTS: tuple[UbatchStateFact, ...] = (
    UbatchStateFact(_PF, "PrepareAndFinalizeWithAllGather", "prepare", "finalize",
                    ("a2.moe_prepare", "a2.moe_finalize")),
    UbatchStateFact(_PF, "PrepareAndFinalizeWithAll2All", "prepare", "finalize",
                    ("a3.moe_prepare", "a3.moe_finalize")),
)


@dataclass(frozen=True)
class BackendFact:
    """The backend the worker gives ``function`` (vLLM's init_distributed_environment, parameters ``params`` in
    order) for the default process group. HCCL is registered by torch_npu for npu devices only, so the runtime
    never issues a CPU collective on the default group (no DP coordination at DP=1; ``get_dp_group().cpu_group``
    otherwise)."""

    module: str
    function: str
    params: tuple[str, ...]
    backend: str


# worker/worker.py:992-994 (NPUWorker._init_worker_distributed_environment).
DEFAULT_GROUP_BACKEND = BackendFact(
    module="vllm_ascend.worker.worker",
    function="init_distributed_environment",
    params=("world_size", "rank", "distributed_init_method", "local_rank", "backend"),
    backend="hccl",
)


@dataclass(frozen=True)
class ModelForwardFact:
    """The parts of the runner's ``function`` (``_model_forward``) that the runtime's replacement for one micro-batch
    of a split step (``AscendIntegration.forward_ubatch``, dbo_runtime/ascend/runner.py) redoes or leaves out.

    Redone: the model call (``self.<model>`` called directly or through ``functools.partial``, with the keywords
    ``model_inputs`` and the function's own ``**kwargs``) and, when the forward context's ``gather_flag`` is set,
    ``self.<gather>(hidden_states)`` (FlashComm1's all-gather of the output). Left out (graph replay, which a split
    step does not do: it runs eager): ``self.<graph_update>(...)`` and the ``.<sync>()`` under
    ``CUDAGraphMode.<sync_mode>``. ``function`` may call nothing else on ``self``: a step a newer release adds would be
    skipped for split steps. ``other_calls``: the other callables it calls in 0.23.0.post1 (a new one is a warning)."""

    module: str
    function: str
    model: str
    model_inputs: tuple[str, ...]
    gather: str
    gather_flag: str
    graph_update: str
    sync: str
    sync_mode: str
    other_calls: tuple[str, ...]

    @property
    def cls(self) -> str:
        return self.function.rsplit(".", 1)[0]

    @property
    def self_calls(self) -> tuple[str, ...]:
        """What ``function`` may call on ``self``: the parts above, nothing else."""
        return (self.model, self.graph_update, self.gather)


# worker/model_runner_v1.py:2834-2874 (NPUModelRunner._model_forward: partial(self.model, **model_inputs) at :2854,
# _update_full_graph_params_if_needed at :2858 (enable_enpu) and :2868, the PIECEWISE synchronize at :2866, the
# FlashComm1 gather at :2872-2873), :2801 (the static _all_gather_hidden_states_and_aux).
MODEL_FORWARD = ModelForwardFact(
    module=_MR,
    function="NPUModelRunner._model_forward",
    model="model",
    model_inputs=("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
    gather="_all_gather_hidden_states_and_aux",
    gather_flag="flash_comm_v1_enabled",
    graph_update="_update_full_graph_params_if_needed",
    sync="synchronize",
    sync_mode="PIECEWISE",
    other_calls=("get_forward_context", "partial", "run_model", "torch.npu.current_stream", "isinstance"),
)


@dataclass(frozen=True)
class ForwardContextCallFact:
    """The runtime's call of ``module:function`` (``runtime_function`` of ``runtime_module``) beside the runner's own
    (``runner_function`` of ``runner_module``). The parameters the runtime relies on are the ``params`` of the
    PATCHED_SYMBOLS row ``table`` (positional arguments are those names, in that order); the keywords are read from the
    runtime's source. ``left_to_default``: (parameter, its default in the release, why) for a parameter the runner
    passes and the runtime leaves at that default on purpose."""

    module: str
    function: str
    table: str
    runtime_module: str
    runtime_function: str
    runner_module: str
    runner_function: str
    left_to_default: tuple[tuple[str, str, str], ...] = ()


# ascend_forward_context.py:58-75 (set_ascend_forward_context), worker/model_runner_v1.py:2296-2310 (execute_model's
# call: it also passes max_tokens_across_pcp, 0 unless prefill context parallel, which validate refuses with DBO).
FORWARD_CONTEXT_CALL = ForwardContextCallFact(
    module="vllm_ascend.ascend_forward_context",
    function="set_ascend_forward_context",
    table="forward_context.ascend",
    runtime_module="dbo_runtime.ascend.runner",
    runtime_function="AscendIntegration.ascend_context",
    runner_module=_MR,
    runner_function="NPUModelRunner.execute_model",
    left_to_default=(("max_tokens_across_pcp", "0", "the runner passes 0 unless prefill_context_parallel_size > 1, "
                      "which validate refuses with DBO"),),
)

# The distributions whose pair the release pins (requirements.txt:16-17 of 0.23.0.post1: torch==2.10.0,
# torch-npu==2.10.0.post4; torch_npu 2.10.0.post4 itself requires torch==2.10.0+cpu).
TORCH_PAIR: tuple[str, str] = ("torch", "torch-npu")

# Which sites fire for which model family (the architectures PR #4894 templates cover).
MODEL_FAMILY_SITES: dict[str, tuple[str, ...]] = {
    "DeepSeek-V2/V3 (MLA + MoE)": ("mla.preprocess", "fc1.all_gather", "fc1.reduce_scatter", "a2.moe_prepare",
                                   "a2.moe_finalize", "a3.moe_dispatch", "a3.moe_combine", "fc2.o_proj_all_to_all"),
    "GLM MoE DSA (MLA + MoE)": ("mla.preprocess", "fc1.all_gather", "fc1.reduce_scatter", "a2.moe_prepare",
                                "a2.moe_finalize", "a3.moe_dispatch", "a3.moe_combine"),
    "Qwen3 MoE / GLM-4 MoE (GQA + MoE)": (
        "fc1.column_all_gather", "fc1.all_gather", "fc1.row_matmul_reduce", "fc1.reduce_scatter",
        "a2.moe_prepare", "a2.moe_finalize", "a3.moe_dispatch", "a3.moe_combine", "fc2.o_proj_all_to_all"),
    "Qwen3 dense (GQA + MLP)": ("fc1.column_all_gather", "fc1.all_gather", "fc1.row_matmul_reduce",
                                "fc1.reduce_scatter", "fc2.o_proj_all_to_all"),
}


@dataclass(frozen=True)
class SupportedModel:
    """An HF ``architectures`` name accepted with DBO, the family whose sites it fires, and the (module, class)
    vLLM's model registry maps it to (``vllm/model_executor/models/registry.py``; the doctor checks it)."""

    architecture: str
    family: str
    vllm_module: str
    vllm_class: str


_DS = "DeepSeek-V2/V3 (MLA + MoE)"
_GQA_MOE = "Qwen3 MoE / GLM-4 MoE (GQA + MoE)"

# Read from vLLM 0.23.0's registry.py (lines 98-100, 122, 124, 203-204); vllm-ascend 0.23.0.post1 registers none of
# these itself (its models/__init__.py registers only DeepseekV4ForCausalLM, DeepSeekV4MTPModel and
# LlamaForCausalLMVwnEagle3).
SUPPORTED_MODELS: tuple[SupportedModel, ...] = (
    SupportedModel("DeepseekV2ForCausalLM", _DS, "deepseek_v2", "DeepseekV2ForCausalLM"),
    SupportedModel("DeepseekV3ForCausalLM", _DS, "deepseek_v2", "DeepseekV3ForCausalLM"),
    SupportedModel("DeepseekV32ForCausalLM", _DS, "deepseek_v2", "DeepseekV3ForCausalLM"),
    SupportedModel("GlmMoeDsaForCausalLM", "GLM MoE DSA (MLA + MoE)", "deepseek_v2", "GlmMoeDsaForCausalLM"),
    SupportedModel("Qwen3MoeForCausalLM", _GQA_MOE, "qwen3_moe", "Qwen3MoeForCausalLM"),
    SupportedModel("Glm4MoeForCausalLM", _GQA_MOE, "glm4_moe", "Glm4MoeForCausalLM"),
    SupportedModel("Qwen3ForCausalLM", "Qwen3 dense (GQA + MLP)", "qwen3", "Qwen3ForCausalLM"),
)

# Interfaces of vLLM model classes whose per-request state the micro-batch split does not carry: a class (or a base
# in its module) declaring one of them is not a plain attention model and the doctor refuses it in the list above.
STATEFUL_MODEL_INTERFACES: tuple[str, ...] = ("IsHybrid", "HasInnerState", "IsAttentionFree")

# Architectures once listed, now refused, and why (validate names the reason).
REFUSED_MODELS: dict[str, str] = {
    "BailingMoeV2_5ForCausalLM": "vLLM maps it to bailing_moe_linear.BailingMoeV25ForCausalLM, a linear-attention "
    "hybrid (IsHybrid, HasInnerState: Mamba-style state per request beside MLA layers) whose state metadata the "
    "micro-batch split does not carry",
}

# HF `architectures` names accepted with DBO (the families above).
SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(m.architecture for m in SUPPORTED_MODELS)
# Dense families: every site they fire is a FlashComm1 (or FC2) site; with FlashComm1 off validate refuses DBO.
DENSE_ARCHITECTURES: frozenset[str] = frozenset(m.architecture for m in SUPPORTED_MODELS
                                                if m.family == "Qwen3 dense (GQA + MLP)")


def site_by_name(name: str) -> HookSite:
    for site in SITES:
        if site.name == name:
            return site
    raise KeyError(name)
