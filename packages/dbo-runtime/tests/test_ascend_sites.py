"""Installing the hook-site wrappers, on a STAND-IN module tree.

No NPU and no vllm_ascend here: the test writes a package ``standin_vllm_ascend`` whose modules, classes and
functions carry exactly the qualified names and parameter names of the site table (generated from
``dbo_runtime.ascend.sites.SITES`` by ``dbo_runtime.ascend.standin``; the doctor test checks the same table against
the real sdist). Each stand-in
body records its call and hands it to a per-site behaviour the test chooses. The wrappers installed are the real
``dbo_runtime.hooks.wrap_stream_site`` and the real ``run_ubatches`` ping-pong (CPU backend: no streams).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from dbo_runtime.ascend import custom_op
from dbo_runtime.ascend.custom_op import CompiledReentryGuard, OpaqueAdapter
from dbo_runtime.ascend.patching import install_sites
from dbo_runtime.ascend.runner import ForwardContextSwitch, PerUBatchState, ascend_site_wrapper
from dbo_runtime.ascend.sites import SITES, site_by_name
from dbo_runtime.ascend.standin import write_standin_tree
from dbo_runtime.context import dbo_current_ubatch_id, run_ubatches
from dbo_runtime.devices import get_backend
from dbo_runtime.errors import DBOConfigError

STANDIN = "standin_vllm_ascend"
PREFIX = {"vllm_ascend": STANDIN}
OP_NS = "standin_vllm_dbo"


@pytest.fixture(scope="module")
def standin_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("standin")
    write_standin_tree(root, STANDIN, OP_NS)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(f"{STANDIN}._standin")
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == STANDIN or m.startswith(STANDIN + ".")]:
            del sys.modules[name]


@pytest.fixture()
def standin(standin_tree: Any) -> Iterator[Any]:
    standin_tree.LOG.clear()
    standin_tree.BEHAVIOR.clear()
    standin_tree.INIT.clear()
    standin_tree.PATH.clear()
    standin_tree.COLLECTIVE.clear()
    yield standin_tree


def _mod(name: str) -> Any:
    return importlib.import_module(name.replace("vllm_ascend", STANDIN, 1))


def _local(site: Any) -> Any:
    """A custom_op site whose op is the stand-in's (registered in OP_NS, as vLLM registers the real one)."""
    if site.hook != "custom_op":
        return site
    return dataclasses.replace(site, op=f"{OP_NS}::{site.op.split('::')[1]}")


def _stream_sites() -> list:
    return [_local(s) for s in SITES if s.hook in ("stream", "custom_op")]


def test_install_and_uninstall_at_every_table_site(standin: Any) -> None:
    before = {}
    for site in _stream_sites():
        owner = _mod(site.module)
        *path, leaf = site.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        before[site.name] = (owner, leaf, vars(owner)[leaf])
    installation = install_sites(_stream_sites(), module_prefix=PREFIX)
    try:
        assert sorted(installation.sites) == sorted(s.name for s in _stream_sites())
        for name, (owner, leaf, original) in before.items():
            now = vars(owner)[leaf]
            if site_by_name(name).hook == "custom_op":  # the op's kernel object stays; its collectives are routed
                assert now is original and now.__dbo_site__ == name
                for spec in site_by_name(name).collectives:
                    helper = vars(owner)[spec.split("(")[0]]
                    assert isinstance(helper, custom_op.RoutedGlobal) and original.__code__ in helper.routes
            else:
                assert now is not original and now.__dbo_site__ == name and now.__wrapped__ is original
        with pytest.raises(DBOConfigError, match="already installed"):
            install_sites(_stream_sites(), module_prefix=PREFIX)
        # Outside a micro-batch the wrapped site is a plain call.
        pf = _mod("vllm_ascend.ops.fused_moe.prepare_finalize").PrepareAndFinalizeWithAllGather()
        x = torch.ones(3)
        assert pf.prepare(x, x) is x and standin.LOG == [("a2.moe_prepare", "MainThread")]
    finally:
        installation.uninstall()
    for name, (owner, leaf, original) in before.items():
        assert vars(owner)[leaf] is original, name
        assert getattr(original, "__dbo_site__", None) is None, name
    ops = _mod("vllm_ascend.ops.register_custom_ops")
    assert not [k for k, v in vars(ops).items() if isinstance(v, custom_op.RoutedGlobal)]


def _refused_with_nothing_patched(bad_dispatch_site: Any, match: str) -> None:
    """Installing a good site together with ``bad_dispatch_site`` fails with ``match`` and patches neither."""
    cls = _mod("vllm_ascend.ops.fused_moe.prepare_finalize").PrepareAndFinalizeWithAllGather
    original = vars(cls)["prepare"]
    with pytest.raises(DBOConfigError, match=match):
        install_sites([site_by_name("a2.moe_prepare"), bad_dispatch_site], module_prefix=PREFIX)
    assert vars(cls)["prepare"] is original


def test_missing_site_patches_nothing(standin: Any) -> None:
    renamed = dataclasses.replace(site_by_name("a3.moe_dispatch"), qualname="TokenDispatcherWithAll2AllV.gone")
    _refused_with_nothing_patched(renamed, r"gone is not defined on TokenDispatcherWithAll2AllV.*doctor")


def _layer(tag: str, pf: Any, td: Any, log: list, x: torch.Tensor) -> torch.Tensor:
    """A stand-in MoE layer: attention compute, A2 prepare, experts, A3 dispatch/combine, A2 finalize."""
    log.append(f"attn:{tag}")
    h = pf.prepare(x, x)
    log.append(f"experts:{tag}")
    h = td.token_dispatch(h)
    h = td.token_combine(h, None)
    h = pf.finalize(h, True)
    log.append(f"post:{tag}")
    return h


def test_wrapped_sites_ping_pong_under_run_ubatches(standin: Any) -> None:
    pf = _mod("vllm_ascend.ops.fused_moe.prepare_finalize").PrepareAndFinalizeWithAllGather()
    td = _mod("vllm_ascend.ops.fused_moe.token_dispatcher").TokenDispatcherWithAll2AllV()
    log: list[str] = []
    for site in ("a2.moe_prepare", "a3.moe_dispatch", "a3.moe_combine", "a2.moe_finalize"):
        standin.BEHAVIOR[site] = lambda obj, h, *rest, _s=site: (log.append(f"{_s}"), h)[1]
    cpu = get_backend("cpu")

    def run() -> list[str]:
        log.clear()
        fns = [lambda t=t: _layer(str(t), pf, td, log, torch.full((2,), float(t))) for t in range(2)]
        outs = run_ubatches(fns, backend=cpu, timeout_s=20)
        assert [o.tolist() for o in outs] == [[0.0, 0.0], [1.0, 1.0]]
        return list(log)

    unpatched = run()
    installation = install_sites(_stream_sites(), module_prefix=PREFIX)
    try:
        patched = run()
    finally:
        installation.uninstall()
    # Without hooks the micro-batches run one after the other.
    assert unpatched[: len(unpatched) // 2] == ["attn:0", "a2.moe_prepare", "experts:0", "a3.moe_dispatch",
                                                "a3.moe_combine", "a2.moe_finalize", "post:0"]
    # With hooks each site yields before its collective: micro-batch 1 computes while 0 communicates.
    assert patched == [
        "attn:0", "attn:1",                     # 0 yields at prepare, 1 computes attention
        "a2.moe_prepare", "experts:0",          # 0's all-gather, then its experts; yields at dispatch
        "a2.moe_prepare", "experts:1",          # 1's all-gather under 0's dispatch
        "a3.moe_dispatch",                      # 0 dispatches, yields at combine
        "a3.moe_dispatch",
        "a3.moe_combine",
        "a3.moe_combine",
        "a2.moe_finalize", "post:0",
        "a2.moe_finalize", "post:1",
    ]


def test_per_ubatch_state_keeps_prepare_finalize_apart(standin: Any) -> None:
    """A2 prepare stores num_tokens on the shared instance for finalize; the other micro-batch runs in between."""
    pf = _mod("vllm_ascend.ops.fused_moe.prepare_finalize").PrepareAndFinalizeWithAllGather()

    def prepare(obj: Any, h: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        obj.num_tokens = h.shape[0]
        return torch.cat([h, torch.zeros(8 - h.shape[0])])  # stand-in all-gather pads to 8 rows

    def finalize(obj: Any, h: torch.Tensor, reduce_results: bool) -> torch.Tensor:
        return h[: obj.num_tokens]

    standin.BEHAVIOR.update({"a2.moe_prepare": prepare, "a2.moe_finalize": finalize})
    sites = [site_by_name("a2.moe_prepare"), site_by_name("a2.moe_finalize")]
    sizes = (3, 5)

    def run(wrap: Callable | None) -> list[int]:
        inst = install_sites(sites, module_prefix=PREFIX, wrap=wrap)
        try:
            fns = [lambda n=n: pf.finalize(pf.prepare(torch.ones(n), torch.ones(n)), True).shape[0] for n in sizes]
            return run_ubatches(fns, backend=get_backend("cpu"), timeout_s=20)
        finally:
            inst.uninstall()

    assert run(None) == [5, 5]  # plain wrap_stream_site: micro-batch 0 finalizes with 1's count (the bug)
    assert run(ascend_site_wrapper(None, PerUBatchState())) == [3, 5]


def test_forward_context_is_restored_after_each_yield(standin: Any) -> None:
    current: dict[str, Any] = {"ctx": None}
    switch = ForwardContextSwitch(lambda ctx: current.__setitem__("ctx", ctx))
    seen: list[tuple[str, str]] = []
    standin.BEHAVIOR["a2.moe_prepare"] = lambda obj, h, r: (seen.append(("prepare", current["ctx"])), h)[1]
    standin.BEHAVIOR["a2.moe_finalize"] = lambda obj, h, r: (seen.append(("finalize", current["ctx"])), h)[1]
    pf = _mod("vllm_ascend.ops.fused_moe.prepare_finalize").PrepareAndFinalizeWithAllGather()
    inst = install_sites([site_by_name("a2.moe_prepare"), site_by_name("a2.moe_finalize")], module_prefix=PREFIX,
                         wrap=ascend_site_wrapper(switch))

    def ub(name: str) -> Callable[[], None]:
        def run() -> None:
            switch.register(name)
            try:
                pf.finalize(pf.prepare(torch.ones(1), None), True)
            finally:
                switch.unregister()
        return run

    try:
        run_ubatches([ub("ctx-0"), ub("ctx-1")], backend=get_backend("cpu"), timeout_s=20)
    finally:
        inst.uninstall()
    assert seen == [("prepare", "ctx-0"), ("prepare", "ctx-1"), ("finalize", "ctx-0"), ("finalize", "ctx-1")]


@pytest.fixture()
def strict_torch_library(monkeypatch: pytest.MonkeyPatch) -> list:
    """torch 2.10-2.12 refuse a second Python kernel for a key vLLM already registered (``allow_override`` False by
    default; 2.13 only warns): the strictest behaviour is that ANY new kernel registration is an error here."""
    calls: list = []

    def refuse(self: Any, op_name: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(op_name)
        raise RuntimeError(f"This is not allowed since there's already a kernel registered from python overriding "
                           f"{op_name}'s behavior (torch 2.10-2.12)")

    monkeypatch.setattr(torch.library.Library, "impl", refuse)
    monkeypatch.setattr(torch.library, "impl", lambda *a, **k: refuse(None, a[0] if a else "?"))
    return calls


def test_custom_op_sites_route_collectives_without_registering_a_kernel(standin: Any,
                                                                        strict_torch_library: list) -> None:
    """Fault 1 of issue 9: installing the FlashComm1 sites registers nothing with torch (it would kill the engine at
    start-up on vllm-ascend's torch 2.10); the op's kernel stays, and the collectives its impl calls through its
    module's globals (as vllm_ascend/ops/register_custom_ops.py does) go through the site wrapper."""
    fc1 = [_local(site_by_name(n)) for n in ("fc1.all_gather", "fc1.reduce_scatter")]
    standin.COLLECTIVE["tensor_model_parallel_all_gather"] = lambda x: torch.cat([x, x])
    seen: list[str] = []

    def recording_wrap(site: str, fn: Callable) -> Callable:
        def inner(*a: Any, **k: Any) -> Any:
            seen.append(site)
            return fn(*a, **k)
        return inner

    ops = _mod("vllm_ascend.ops.register_custom_ops")
    gather = getattr(torch.ops, OP_NS).maybe_all_gather_and_maybe_unpad
    reduce = getattr(torch.ops, OP_NS).maybe_pad_and_reduce
    x = torch.arange(3.0)
    assert gather(x, True).shape == (6,) and seen == []
    inst = install_sites(fc1, module_prefix=PREFIX, wrap=recording_wrap, dispatch_key="CPU")
    try:
        assert gather(x, True).shape == (6,)                     # through the op and its unchanged kernel
        standin.PATH["fc1.all_gather"] = 1                      # the EP path: get_ep_group().all_gather(x)
        assert gather(x, True).shape == (3,)
        standin.PATH["fc1.reduce_scatter"] = 2                  # get_ep_group().reduce_scatter(x)
        assert reduce(x).shape == (3,)
        assert seen == ["fc1.all_gather", "fc1.all_gather", "fc1.reduce_scatter"]
        # another caller of the same module helper is not a site: it gets the original
        seen.clear()
        assert ops.tensor_model_parallel_all_gather(x).shape == (6,) and seen == []
    finally:
        inst.uninstall()
        standin.PATH.clear()
    gather(x, True)
    assert seen == [] and strict_torch_library == []
    assert not isinstance(ops.tensor_model_parallel_all_gather, custom_op.RoutedGlobal)


def test_custom_op_site_refused_when_the_op_has_no_kernel_for_the_key(standin: Any) -> None:
    site = _local(site_by_name("fc1.all_gather"))
    with pytest.raises(DBOConfigError, match="has no Meta kernel"):
        install_sites([site], module_prefix=PREFIX, dispatch_key="Meta")
    missing = dataclasses.replace(site, op=f"{OP_NS}::gone")
    _refused_with_nothing_patched(missing, "not registered")


def test_custom_op_site_refused_when_the_impl_stops_calling_its_collective(standin: Any) -> None:
    site = dataclasses.replace(_local(site_by_name("fc1.all_gather")), collectives=("some_other_helper",))
    _refused_with_nothing_patched(site, "no longer calls some_other_helper")


def test_opaque_site_compiles_fullgraph_and_yields(standin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashComm2's o_proj sits in traced code: behind a dbo_runtime custom op, torch.compile(fullgraph=True)
    traces around it (a graph break would fail), and at run time the op's impl yields to the other micro-batch."""
    site = site_by_name("fc2.o_proj_all_to_all")
    monkeypatch.setitem(custom_op.OPAQUE_ADAPTERS, site.name, OpaqueAdapter(
        fake=lambda obj, x: x.new_empty((x.shape[0], 4)), tail=lambda obj: (None,)))
    order: list[str] = []
    weight = torch.arange(12.0).reshape(3, 4)

    def apply_impl(obj: Any, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        order.append(f"o_proj:{dbo_current_ubatch_id()}")
        return x @ weight, None  # stand-in for all-to-all + matmul + reduce-scatter

    standin.BEHAVIOR[site.name] = apply_impl
    cls = _mod(site.module).Flashcomm2OProjRowParallelOp
    inst = install_sites([site], module_prefix=PREFIX)
    try:
        op_obj = cls(layer=None)
        assert op_obj._dbo_opaque_key.startswith(site.name + "#")

        def block(x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(x) + 1.0
            out, bias = op_obj.apply_impl(h)
            return out * 2.0

        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        x0, x1 = torch.randn(2, 3), torch.randn(5, 3)
        expected = [(torch.relu(x) + 1.0) @ weight * 2.0 for x in (x0, x1)]
        assert torch.allclose(compiled(x0), expected[0])
        order.clear()
        guard = CompiledReentryGuard("block")

        def ub(x: torch.Tensor) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                order.append(f"start:{dbo_current_ubatch_id()}")
                return guard.call(compiled, block, x)
            return run

        outs = run_ubatches([ub(x0), ub(x1)], backend=get_backend("cpu"), timeout_s=60)
    finally:
        inst.uninstall()
    assert all(torch.allclose(o, e) for o, e in zip(outs, expected, strict=True))
    # 0 yields inside the op before its o_proj; 1 starts while 0 is parked inside the compiled callable.
    assert order == ["start:0", "start:1", "o_proj:0", "o_proj:1"]
    assert guard.compiled_entries == 1 and guard.eager_fallbacks == 1
    assert vars(cls)["apply_impl"].__name__ == "apply_impl" and not hasattr(vars(cls)["apply_impl"], "__dbo_site__")


def test_ascend_sites_command_lists_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    import json as _json

    from dbo_runtime.cli import main as cli_main

    assert cli_main(["ascend-sites", "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert all(f"`{s.name}`" in md and f"{s.module}:{s.qualname}" in md for s in SITES)
    assert cli_main(["ascend-sites", "--format", "json"]) == 0
    payload = _json.loads(capsys.readouterr().out)
    assert [s["name"] for s in payload["sites"]] == [s.name for s in SITES]
    # every site named in the per-family map exists in the table
    assert {n for names in payload["families"].values() for n in names} <= {s.name for s in SITES}


def test_site_outputs_are_marked_for_the_compute_stream(standin: Any) -> None:
    """What a site returns was made on the communication stream and is read on the compute stream: every tensor
    in it (plain, tuple, dataclass like vLLM-Ascend's MoEPrepareOutput) is recorded for the compute stream.
    The stream is a stand-in object and the record function a recorder (CPU tensors have no streams)."""

    @dataclasses.dataclass
    class PrepareOutputStandin:
        hidden_states: torch.Tensor
        router_logits: torch.Tensor
        mc2_mask: torch.Tensor | None = None

    marks: list[tuple[int, str]] = []
    switch = ForwardContextSwitch(lambda ctx: None, record=lambda t, s: marks.append((id(t), s)))
    h, r, out = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    prepared = PrepareOutputStandin(h, r)
    standin.BEHAVIOR["a2.moe_prepare"] = lambda obj, hs, rl: prepared
    standin.BEHAVIOR["a3.moe_combine"] = lambda obj, hs, meta: (out, None)
    pf = _mod("vllm_ascend.ops.fused_moe.prepare_finalize").PrepareAndFinalizeWithAllGather()
    td = _mod("vllm_ascend.ops.fused_moe.token_dispatcher").TokenDispatcherWithAll2AllV()
    inst = install_sites([site_by_name("a2.moe_prepare"), site_by_name("a3.moe_combine")], module_prefix=PREFIX,
                         wrap=ascend_site_wrapper(switch))
    try:
        def ub() -> None:
            pf.prepare(h, r)
            td.token_combine(h, None)

        run_ubatches([ub, ub], backend=get_backend("cpu"), timeout_s=20)
        assert marks == []  # no compute stream known (CPU): nothing to record
        switch.compute_stream = "compute-stream"
        run_ubatches([ub, ub], backend=get_backend("cpu"), timeout_s=20)
    finally:
        inst.uninstall()
    # the micro-batches ping-pong: both prepares complete before either combine
    assert marks == [(id(t), "compute-stream") for t in (h, r, h, r, out, out)]


def test_changed_signature_is_refused_and_patches_nothing(standin: Any) -> None:
    # vllm-ascend main (2026-08) dropped `label` and `is_ep_comm` from the FlashComm1 all-gather impl: the
    # table's site exists there but no longer takes what the wrappers read. Simulated on the stand-in by a site
    # whose table entry expects a parameter the stand-in function does not have.
    changed = dataclasses.replace(site_by_name("a3.moe_dispatch"),
                                  params=(*site_by_name("a3.moe_dispatch").params, "label"))
    _refused_with_nothing_patched(changed, r"a3\.moe_dispatch .*signature changed.*missing label.*doctor")
