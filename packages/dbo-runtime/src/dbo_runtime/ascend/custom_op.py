"""The torch.compile side of DBO on vLLM-Ascend.

Two things keep graph modes safe:

* **An opaque boundary.** A yield switches Python threads and streams; Dynamo must never trace into one. Sites
  that already run inside a custom op (``vllm::moe_forward`` for the MoE sites, ``vllm::maybe_all_gather_and_
  maybe_unpad`` / ``vllm::maybe_pad_and_reduce`` / ``vllm::matmul_and_reduce`` for FlashComm1) get their wrapped
  impl re-registered (:func:`override_op_impl`). A site in traced code (FlashComm2's o_proj) is moved behind a
  ``dbo_runtime::`` custom op of its own (:func:`install_opaque_site`), with a fake impl for tracing.
* **No re-entry of a compiled callable.** Micro-batch 0 may be suspended *inside* the compiled model (at a yield in
  an opaque op) when micro-batch 1 starts its forward. Entering the same compiled artifact from a second thread
  while the first is parked in it deadlocked across TP ranks in the field (micropuma/vllm-ascend notes).
  :class:`CompiledReentryGuard` lets one micro-batch at a time use the compiled path; the other runs the eager
  forward (vLLM's ``ForwardContext.skip_compiled``). It never blocks, so it cannot deadlock.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dbo_runtime.errors import DBOConfigError

__all__ = [
    "override_op_impl",
    "install_opaque_site",
    "OpaqueAdapter",
    "OPAQUE_ADAPTERS",
    "CompiledReentryGuard",
    "opaque_op_name",
]

OP_NAMESPACE = "dbo_runtime"


def override_op_impl(op: str, fn: Callable[..., Any], dispatch_key: str) -> Callable[[], None]:
    """Register ``fn`` as the ``dispatch_key`` kernel of the existing op ``ns::name``; return the undo.

    The dispatcher keeps the previous kernel: destroying our Library fragment restores it.
    """
    ns, sep, name = op.partition("::")
    if not sep or not name:
        raise DBOConfigError(f"custom op name {op!r}: expected 'namespace::name'")
    if not hasattr(getattr(torch.ops, ns), name):
        raise DBOConfigError(f"custom op {op} is not registered; is its module imported?")
    lib = torch.library.Library(ns, "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel" is the point here
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        lib.impl(name, fn, dispatch_key)
    return lib._destroy


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
    """At most one micro-batch thread inside one compiled callable at a time; the others go eager.

    ``with guard.enter() as compiled_ok:`` never blocks: ``compiled_ok`` is False when another thread is already
    inside (parked at a yield), and the caller then runs the eager forward (in vLLM: set the micro-batch's
    ``ForwardContext.skip_compiled``).
    """

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.compiled_entries = 0
        self.eager_fallbacks = 0

    @contextmanager
    def enter(self) -> Iterator[bool]:
        me = threading.get_ident()
        if self._owner == me:  # re-entry from the same thread (nested call): that is ordinary recursion
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
