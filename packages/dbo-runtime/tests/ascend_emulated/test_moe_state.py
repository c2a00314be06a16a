"""Fault 4 (issue 27): the A3 prepare/finalize pair keeps per-micro-batch state.

``PrepareAndFinalizeWithAll2All.prepare`` stores ``num_tokens`` (and ``replace_allreduce``,
``enable_shared_expert_dp``) on the MoE layer's one instance; ``finalize`` unpads the expert output to that count.
With DBO the two micro-batches run their all-to-all dispatch and combine between the two calls, so micro-batch 1's
``prepare`` overwrote micro-batch 0's count: an odd split (5 + 4 tokens) came back with 4 rows in micro-batch 0.

Real: the vllm-ascend class and its methods, every hook site of this project's table installed into the real
vllm_ascend modules with the plugin's wrapper (``install_sites`` + ``ascend_site_wrapper``, as ``plugin.py`` does),
and the micro-batches run by ``run_ubatches`` on the CPU backend. STAND-IN: the instance is made without its
``FusedMoEConfig`` (``tp_size`` 1 set by hand: finalize's TP all-gather does not run), and the dispatch/combine
in between are plain ``dbo_yield`` calls at their site names.
"""

from __future__ import annotations

import _emu  # noqa: F401  (import order)
import pytest
import torch
from dbo_runtime.ascend.patching import install_sites
from dbo_runtime.ascend.runner import PerUBatchState, ascend_site_wrapper
from dbo_runtime.context import dbo_yield
from dbo_runtime.devices import get_backend
from dbo_runtime.workers import run_ubatches
from vllm_ascend.ops.fused_moe.prepare_finalize import PrepareAndFinalizeWithAll2All


@pytest.fixture
def installed():
    installation = install_sites(wrap=ascend_site_wrapper(None, PerUBatchState()), dispatch_key="PrivateUse1")
    try:
        yield installation
    finally:
        installation.uninstall()


def _layer() -> PrepareAndFinalizeWithAll2All:
    layer = object.__new__(PrepareAndFinalizeWithAll2All)
    layer.tp_size, layer.tp_rank = 1, 0
    return layer


def _run(layer, tokens: tuple[int, int]) -> list[torch.Tensor]:
    hidden = [torch.randn(n, 8) for n in tokens]

    def ubatch(i: int):
        def run() -> torch.Tensor:
            prepared = layer.prepare(hidden[i], torch.randn(tokens[i], 4))
            dbo_yield("a3.moe_dispatch")
            expert_out = prepared.hidden_states * 2
            dbo_yield("a3.moe_combine")
            return layer.finalize(expert_out, reduce_results=False,
                                  padded_hidden_states_shape=prepared.padded_hidden_states_shape)
        return run

    outs = run_ubatches([ubatch(0), ubatch(1)], backend=get_backend("cpu"), timeout_s=30)
    for h, out in zip(hidden, outs, strict=True):
        assert out.shape == h.shape, f"micro-batch of {h.shape[0]} tokens came back with {out.shape[0]} rows"
        assert torch.equal(out, h * 2)
    return outs


def test_a3_prepare_state_is_per_micro_batch(installed) -> None:
    assert {"a3.moe_prepare", "a3.moe_finalize"} <= set(installed.sites)
    layer = _layer()
    _run(layer, (5, 4))
    _run(layer, (3, 6))
    # outside DBO the layer is an ordinary one again
    out = layer.finalize(layer.prepare(torch.ones(7, 8), torch.ones(7, 4)).hidden_states, reduce_results=False)
    assert out.shape == (7, 8)


def test_without_the_state_sites_the_second_prepare_overwrites_the_first() -> None:
    """The fault itself, on the real class: what the table's a3 state sites prevent."""
    with pytest.raises(AssertionError, match="came back with 4 rows"):
        _run(_layer(), (5, 4))
