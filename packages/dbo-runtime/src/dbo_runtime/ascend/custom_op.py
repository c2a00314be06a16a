"""The torch.compile side of DBO on vLLM-Ascend.

Two things keep graph modes safe:

* **An opaque boundary.** A yield switches Python threads and streams; Dynamo must never trace into one. Sites
  that already run inside a custom op (``vllm::moe_forward`` for the MoE sites, ``vllm::maybe_all_gather_and_
  maybe_unpad`` / ``vllm::maybe_pad_and_reduce`` / ``vllm::matmul_and_reduce`` for FlashComm1) keep that op and its
  kernel untouched. For the FlashComm1 ops the collective helpers their registered impl calls through its module's
  globals are routed through the site wrapper, for calls from that impl only (:func:`route_collectives`). A site in
  traced code (FlashComm2's o_proj) is moved behind a ``dbo_runtime::`` custom op of its own
  (:func:`install_opaque_site`), with a fake impl for tracing.

  Why not register a wrapped kernel for the op: vLLM's ``direct_register_custom_op`` registers ``op_func`` from
  Python (``my_lib.impl(op_name, op_func, dispatch_key=dispatch_key)``, vllm/utils/torch_utils.py:967 at v0.23.0),
  so torch's ``torch.library._impls`` already holds ``vllm/<op>/PrivateUse1``. A second ``Library.impl`` for the
  same key raises ``RuntimeError("This is not allowed since there's already a kernel registered from python
  overriding ...")`` unless ``allow_override`` is true, and its default is False in torch 2.10.0
  (torch/library.py:280-281 the signature, :326-335 the check), 2.11.0 (:285-286, :331-340) and 2.12.0
  (:283-284, :329-338); only 2.13.0 flips it to True (:438-439, check :473-482; pytorch PR #182293), where the C++
  OperatorEntry only warns "Overriding a previously registered kernel". vllm-ascend 0.23.0.post1 runs torch 2.10, so
  the old override killed the engine at start-up. The routing here registers nothing with torch: the dispatcher keeps calling the same
  Python kernel object, whose body looks its globals up at call time (LOAD_GLOBAL), so it behaves the same on every
  torch. The only torch call is the read-only ``torch._C._dispatch_has_kernel_for_dispatch_key`` check, which
  torch/library.py itself calls in all four releases (2.10.0:346, 2.11.0:351, 2.12.0:349, 2.13.0:493).
* **No re-entry of a compiled callable.** Micro-batch 0 may be suspended *inside* the compiled model (at a yield in
  an opaque op) when micro-batch 1 starts its forward. Entering the same compiled artifact from a second thread
  while the first is parked in it deadlocked across TP ranks in the field (micropuma/vllm-ascend notes).
  :class:`CompiledReentryGuard` lets one micro-batch at a time use the compiled path; the other runs the eager
  forward (vLLM's ``ForwardContext.skip_compiled``). It never blocks, so it cannot deadlock.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dbo_runtime.context import dbo_current_ubatch_key
from dbo_runtime.errors import DBOConfigError

__all__ = [
    "check_op_registered",
    "route_collectives",
    "RoutedGlobal",
    "install_opaque_site",
    "OpaqueAdapter",
    "OPAQUE_ADAPTERS",
    "CompiledReentryGuard",
    "opaque_op_name",
]

OP_NAMESPACE = "dbo_runtime"


def check_op_registered(op: str, dispatch_key: str | None) -> None:
    """The op exists (its module is imported) and, when ``dispatch_key`` is given, has a kernel for that key: the
    precondition of routing its impl's collectives (the op stays the opaque boundary; nothing is registered)."""
    ns, sep, name = op.partition("::")
    if not sep or not name:
        raise DBOConfigError(f"custom op name {op!r}: expected 'namespace::name'")
    if not hasattr(getattr(torch.ops, ns), name):
        raise DBOConfigError(f"custom op {op} is not registered; is its module imported?")
    if dispatch_key is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key):
        raise DBOConfigError(f"custom op {op} has no {dispatch_key} kernel; the site table expects the impl it names "
                             f"registered for {dispatch_key} (run `dbo-runtime doctor`)")


class _MethodRoute:
    """What ``name()`` returned, seen by a routed impl: the listed methods go through their site wrapper."""

    __slots__ = ("_target", "_methods")

    def __init__(self, target: Any, methods: dict[str, Callable[..., Any]]) -> None:
        self._target = target
        self._methods = methods

    def __getattr__(self, attr: str) -> Any:
        wrapped = self._methods.get(attr)
        if wrapped is None:
            return getattr(self._target, attr)
        return functools.partial(wrapped, self._target)


class RoutedGlobal:
    """Stands in a module global (a collective helper, or a getter of a group object) for the impls of DBO sites.

    A call whose caller's code object is a routed impl's runs through that impl's site wrapper; any other caller gets
    the original unchanged, so other functions of the module that use the same helper are not turned into sites.
    """

    def __init__(self, name: str, original: Callable[..., Any]) -> None:
        self.name = name
        self.original = original
        # impl code -> (site, wrapped direct call or None, {method: wrapped method call})
        self.routes: dict[types.CodeType, tuple[str, Callable[..., Any] | None, dict[str, Callable[..., Any]]]] = {}
        functools.update_wrapper(self, original)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        route = self.routes.get(sys._getframe(1).f_code)
        if route is None:
            return self.original(*args, **kwargs)
        _, direct, methods = route
        if direct is not None:
            return direct(*args, **kwargs)
        return _MethodRoute(self.original(*args, **kwargs), methods)


def _call_method(method: str) -> Callable[..., Any]:
    def call(target: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(target, method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = method
    return call


def route_collectives(site: str, module: types.ModuleType, impl: Callable[..., Any], collectives: Sequence[str],
                      wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Route what ``impl`` (a function defined in ``module``) calls through ``module``'s globals for ``collectives``
    (``name`` or ``name().method``) through ``wrap(site, ...)``; return the undo. Checks first, changes nothing
    when a check fails."""
    from dbo_runtime.ascend.sites import parse_collective

    code = getattr(impl, "__code__", None)
    if code is None or getattr(impl, "__globals__", None) is not vars(module):
        raise DBOConfigError(f"DBO site {site}: {getattr(impl, '__qualname__', impl)!r} is not a Python function of "
                             f"{module.__name__}; its collectives cannot be routed")
    plan: dict[str, tuple[Callable[..., Any] | None, dict[str, Callable[..., Any]]]] = {}
    for spec in collectives:
        name, method = parse_collective(spec)
        # A global the impl loads by name (not a parameter or local of the same name).
        if name not in code.co_names or name in code.co_varnames:
            raise DBOConfigError(f"DBO site {site}: {impl.__qualname__} no longer calls {name} from its module's "
                                 "globals (run `dbo-runtime doctor`)")
        current = vars(module).get(name)
        if current is None or not callable(current):
            raise DBOConfigError(f"DBO site {site}: {module.__name__}.{name} is missing or not callable")
        if isinstance(current, RoutedGlobal) and code in current.routes:
            raise DBOConfigError(f"DBO hook site {site} is already installed")
        direct, methods = plan.setdefault(name, (None, {}))
        if method is None:
            plan[name] = (wrap(site, current.original if isinstance(current, RoutedGlobal) else current), methods)
        else:
            methods[method] = wrap(site, _call_method(method))
    for name, (direct, methods) in plan.items():
        if direct is not None and methods:
            raise DBOConfigError(f"DBO site {site}: {name} is listed both as a collective and as a group getter")

    installed: list[RoutedGlobal] = []
    for name, (direct, methods) in plan.items():
        current = vars(module)[name]
        routed = current if isinstance(current, RoutedGlobal) else RoutedGlobal(name, current)
        routed.routes[code] = (site, direct, methods)
        setattr(module, name, routed)
        installed.append(routed)
    impl.__dbo_site__ = site  # type: ignore[attr-defined]

    def undo() -> None:
        for routed in installed:
            routed.routes.pop(code, None)
            if not routed.routes and vars(module).get(routed.name) is routed:
                setattr(module, routed.name, routed.original)
        if getattr(impl, "__dbo_site__", None) == site:
            del impl.__dbo_site__  # type: ignore[attr-defined]

    return undo


@dataclass(frozen=True)
class OpaqueAdapter:
    """How a traced method becomes ``out = op(x, key)``: ``fake(obj, x)`` gives the output's shape for tracing,
    ``tail(obj)`` rebuilds the rest of the method's tuple result (e.g. the bias) outside the op."""

    fake: Callable[[Any, torch.Tensor], torch.Tensor]
    tail: Callable[[Any], tuple[Any, ...]]


def _fc2_oproj_fake(obj: Any, x: torch.Tensor) -> torch.Tensor:
    """Output shape of Flashcomm2OProjRowParallelOp.apply_impl (vllm-ascend 0.23.0.post1), read from its code:
    pad by the forward context's pad_size, all-to-all over the ODP group (rows / odp_size), matmul to the
    layer's output size, reduce-scatter over the OTP group when tp_size > 1, then all-gather over TP and unpad
    unless FlashComm1 is on. Written against the real source; not run on an NPU here."""
    from vllm.distributed import get_tp_group  # type: ignore[import-not-found]
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX  # type: ignore[import-not-found]

    pad = int(_EXTRA_CTX.pad_size)
    rows = (x.shape[0] + pad) // int(obj.odp_size)
    if obj.tp_size > 1:
        rows //= int(obj.tp_size)
    if not _EXTRA_CTX.flash_comm_v1_enabled:
        rows = rows * get_tp_group().world_size - pad
    return x.new_empty((rows, int(obj.layer.output_size)))


def _bias_tail(obj: Any) -> tuple[Any, ...]:
    return (obj.bias if obj.skip_bias_add else None,)


OPAQUE_ADAPTERS: dict[str, OpaqueAdapter] = {
    "fc2.o_proj_all_to_all": OpaqueAdapter(fake=_fc2_oproj_fake, tail=_bias_tail),
}

_OBJECTS: dict[str, Any] = {}
_KEYS = itertools.count()
_DEFINED_OPS: dict[str, Any] = {}
_ACTIVE_CALLS: dict[str, Callable[..., Any]] = {}


def opaque_op_name(site: str) -> str:
    return "site_" + site.replace(".", "_")


def _define_op(site: str, adapter: OpaqueAdapter) -> Any:
    name = opaque_op_name(site)
    if name in _DEFINED_OPS:
        return _DEFINED_OPS[name]

    @torch.library.custom_op(f"{OP_NAMESPACE}::{name}", mutates_args=())
    def site_op(x: torch.Tensor, key: str) -> torch.Tensor:
        call = _ACTIVE_CALLS.get(site)
        if call is None:
            raise DBOConfigError(f"dbo_runtime::{name} called while DBO site {site} is not installed")
        result = call(_OBJECTS[key], x)
        out = result[0] if isinstance(result, tuple) else result
        # A custom op may not return its input (or a view of it).
        return out.clone() if out is x or out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out

    @site_op.register_fake
    def _(x: torch.Tensor, key: str) -> torch.Tensor:
        return adapter.fake(_OBJECTS[key], x)

    _DEFINED_OPS[name] = getattr(getattr(torch.ops, OP_NAMESPACE), name)
    return _DEFINED_OPS[name]


def install_opaque_site(site: Any, owner: type, attr: str, raw: Any,
                        *, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace ``owner.attr`` (a method ``(self, x) -> (out, *rest)``) by a call to a ``dbo_runtime::`` custom op
    whose eager impl runs the original through ``wrap`` (wrap_stream_site). Objects are registered by a patched
    ``__init__`` (outside traced code), keyed by a string attribute Dynamo treats as a constant."""
    adapter = OPAQUE_ADAPTERS.get(site.name)
    if adapter is None:
        raise DBOConfigError(f"DBO site {site.name}: no opaque adapter (fake shape) is defined for it")
    if not isinstance(owner, type):
        raise DBOConfigError(f"DBO site {site.name}: opaque sites must be methods, got {owner!r}")
    op = _define_op(site.name, adapter)
    original_method = raw
    original_init = owner.__dict__.get("__init__")
    init_to_call = original_init if original_init is not None else super(owner, owner).__init__  # type: ignore[misc]
    wrapped = wrap(site.name, original_method)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init_to_call(self, *args, **kwargs)
        key = f"{site.name}#{next(_KEYS)}"
        self._dbo_opaque_key = key
        _OBJECTS[key] = self

    def opaque_method(self: Any, x: torch.Tensor) -> Any:
        out = op(x, self._dbo_opaque_key)
        return (out, *adapter.tail(self))

    opaque_method.__dbo_site__ = site.name  # type: ignore[attr-defined]
    opaque_method.__wrapped__ = original_method  # type: ignore[attr-defined]
    _ACTIVE_CALLS[site.name] = wrapped
    owner.__init__ = __init__  # type: ignore[misc]
    setattr(owner, attr, opaque_method)

    def undo() -> None:
        setattr(owner, attr, original_method)
        if original_init is not None:
            owner.__init__ = original_init  # type: ignore[misc]
        else:
            del owner.__init__
        _ACTIVE_CALLS.pop(site.name, None)
        for key in [k for k in _OBJECTS if k.startswith(site.name + "#")]:
            del _OBJECTS[key]

    return undo


class CompiledReentryGuard:
    """At most one micro-batch inside one compiled callable at a time; the others go eager.

    ``with guard.enter() as compiled_ok:`` never blocks: ``compiled_ok`` is False when another micro-batch is
    already inside (parked at a yield), and the caller then runs the eager forward (in vLLM: set the micro-batch's
    ``ForwardContext.skip_compiled``). The owner is the micro-batch
    (:func:`~dbo_runtime.context.dbo_current_ubatch_key`), not the thread: under the greenlet scheduler both
    micro-batches share one thread, and a thread owner let the second one in as if it were a nested call of the first.
    """

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._owner: Hashable | None = None
        self.compiled_entries = 0
        self.eager_fallbacks = 0

    @contextmanager
    def enter(self) -> Iterator[bool]:
        me = dbo_current_ubatch_key()
        if self._owner == me:  # re-entry from the same micro-batch (nested call): that is ordinary recursion
            yield True
            return
        acquired = self._lock.acquire(blocking=False)
        if not acquired:
            self.eager_fallbacks += 1
            yield False
            return
        self._owner = me
        self.compiled_entries += 1
        try:
            yield True
        finally:
            self._owner = None
            self._lock.release()

    def call(self, compiled: Callable[..., Any], eager: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.enter() as compiled_ok:
            return (compiled if compiled_ok else eager)(*args, **kwargs)
