"""Install (and uninstall) the communication-site wrappers of :data:`dbo_runtime.ascend.sites.SITES`.

Each site is resolved by importing its module and walking its qualified name; a site that does not resolve stops
the installation before anything is patched (run ``dbo-runtime doctor`` to see which). The wrappers are the ones in
:mod:`dbo_runtime.hooks` (``wrap_stream_site``), the same functions the reference model uses.

``module_prefix`` maps the real top-level package to another one: tests install into a stand-in module tree that
mirrors vLLM-Ascend's qualified names (``{"vllm_ascend": "standin_vllm_ascend"}``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbo_runtime.ascend.sites import SITES, HookSite, missing_in_order
from dbo_runtime.errors import DBOConfigError

__all__ = ["Installation", "InstalledPatch", "install_sites", "resolve", "default_stream_wrapper"]

logger = logging.getLogger("dbo_runtime.ascend")

StreamWrapper = Callable[[str, Callable[..., Any]], Callable[..., Any]]


def default_stream_wrapper(site: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    from dbo_runtime.ascend.sites import STATE_ONLY_SITES
    from dbo_runtime.hooks import wrap_stream_site

    return fn if site in STATE_ONLY_SITES else wrap_stream_site(site, fn)


@dataclass
class InstalledPatch:
    site: str
    owner: Any  # the class or module that holds the attribute
    attr: str
    original: Any  # exactly what was in owner.__dict__ (function, staticmethod, classmethod)
    undo: Callable[[], None] | None = None


@dataclass
class Installation:
    """The patches in place; :meth:`uninstall` restores every original, in reverse order."""

    patches: list[InstalledPatch] = field(default_factory=list)

    def uninstall(self) -> None:
        while self.patches:
            patch = self.patches.pop()
            if patch.undo is not None:
                patch.undo()
            else:
                setattr(patch.owner, patch.attr, patch.original)

    @property
    def sites(self) -> list[str]:
        return [p.site for p in self.patches]


def _map_module(module: str, module_prefix: Mapping[str, str] | None) -> str:
    if not module_prefix:
        return module
    head, _, rest = module.partition(".")
    if head in module_prefix:
        return module_prefix[head] + ("." + rest if rest else "")
    return module


def resolve(module: str, qualname: str, *, module_prefix: Mapping[str, str] | None = None,
            import_module: Callable[[str], Any] = importlib.import_module) -> tuple[Any, str, Any]:
    """(owner, attribute name, raw attribute from owner.__dict__) of ``module:qualname``.

    The attribute must be defined on its owner itself: wrapping an inherited method would patch the base class.
    """
    mod_name = _map_module(module, module_prefix)
    try:
        owner: Any = import_module(mod_name)
    except ImportError as exc:
        raise DBOConfigError(f"cannot import {mod_name} for DBO hook site {module}:{qualname}: {exc}") from exc
    *path, leaf = qualname.split(".")
    for part in path:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise DBOConfigError(f"DBO hook site {module}:{qualname}: {part} not found in {mod_name}; "
                                 "run `dbo-runtime doctor`") from None
    raw = vars(owner).get(leaf) if hasattr(owner, "__dict__") else None
    if raw is None:
        raise DBOConfigError(f"DBO hook site {module}:{qualname}: {leaf} is not defined on "
                             f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}; "
                             "run `dbo-runtime doctor`")
    return owner, leaf, raw


def check_signature(site: HookSite, raw: Any) -> None:
    """Refuse a site whose live function lost a parameter the table relies on (the release differs from the one
    the table was written for): the wrappers and the runner read those arguments."""
    fn = getattr(raw, "__func__", raw)
    try:
        have = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function: nothing to compare
        return
    missing = missing_in_order(site.params, have)
    if missing:
        raise DBOConfigError(
            f"DBO hook site {site.name} ({site.target}): signature changed: expected parameters "
            f"{', '.join(site.params)} in this order, missing {', '.join(missing)} (has: {', '.join(have)}); this "
            "vLLM-Ascend is not the release the site table was written for: run `dbo-runtime doctor`")


def _wrap_raw(site: str, raw: Any, wrap: StreamWrapper) -> Any:
    """Wrap a function/staticmethod/classmethod as found in a class or module __dict__, keeping its kind."""
    if isinstance(raw, staticmethod):
        return staticmethod(_wrap_function(site, raw.__func__, wrap))
    if isinstance(raw, classmethod):
        return classmethod(_wrap_function(site, raw.__func__, wrap))
    if not callable(raw):
        raise DBOConfigError(f"DBO hook site {site}: target is not callable ({type(raw).__name__})")
    return _wrap_function(site, raw, wrap)


def _wrap_function(site: str, fn: Callable[..., Any], wrap: StreamWrapper) -> Callable[..., Any]:
    wrapped = wrap(site, fn)

    # A plain function (not whatever object `wrap` returns) so that it binds as a method on a class.
    @functools.wraps(fn)
    def site_wrapper(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    site_wrapper.__dbo_site__ = site  # type: ignore[attr-defined]
    return site_wrapper


def install_sites(
    sites: Sequence[HookSite] = SITES,
    *,
    module_prefix: Mapping[str, str] | None = None,
    wrap: StreamWrapper | None = None,
    dispatch_key: str | None = None,
    import_module: Callable[[str], Any] = importlib.import_module,
) -> Installation:
    """Resolve and check every site first, then patch them all; a site that fails a check patches nothing.

    ``custom_op`` sites register nothing with torch: their op must already exist and, when ``dispatch_key`` is given
    (``PrivateUse1`` on NPU, the key vLLM-Ascend's ``direct_register_custom_op`` calls pass), have a kernel for it;
    the collectives its impl calls through its module's globals are then routed through ``wrap``.
    """
    wrap = wrap or default_stream_wrapper
    resolved = []
    for site in sites:
        if site.hook == "via":
            continue
        owner, attr, raw = resolve(site.module, site.qualname, module_prefix=module_prefix,
                                   import_module=import_module)
        if getattr(raw, "__dbo_site__", None) == site.name or getattr(
                getattr(raw, "__func__", None), "__dbo_site__", None) == site.name:
            raise DBOConfigError(f"DBO hook site {site.name} is already installed")
        check_signature(site, raw)
        if site.hook == "custom_op":
            from dbo_runtime.ascend.custom_op import check_op_registered

            if site.op is None or not site.collectives:
                raise DBOConfigError(f"DBO site {site.name}: a custom_op site needs its op and its collectives")
            check_op_registered(site.op, dispatch_key)
        resolved.append((site, owner, attr, raw))

    installation = Installation()
    try:
        for site, owner, attr, raw in resolved:
            if site.hook == "opaque_stream":
                from dbo_runtime.ascend.custom_op import install_opaque_site

                undo = install_opaque_site(site, owner, attr, raw, wrap=wrap)
                installation.patches.append(InstalledPatch(site.name, owner, attr, raw, undo))
                continue
            if site.hook == "custom_op":
                from dbo_runtime.ascend.custom_op import route_collectives

                # The op's kernel is the impl object itself; it stays registered as it is (see custom_op.py for
                # why no kernel is registered again) and only its collectives are routed.
                undo = route_collectives(site.name, owner, raw, site.collectives, wrap)
                installation.patches.append(InstalledPatch(site.name, owner, attr, raw, undo))
                continue
            setattr(owner, attr, _wrap_raw(site.name, raw, wrap))
            installation.patches.append(InstalledPatch(site.name, owner, attr, raw))
    except BaseException:
        installation.uninstall()
        raise
    logger.info("dbo_runtime: DBO hooks installed at %d sites: %s", len(installation.patches),
                ", ".join(installation.sites))
    return installation
