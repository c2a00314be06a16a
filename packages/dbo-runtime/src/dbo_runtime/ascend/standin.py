"""A STAND-IN module tree for vLLM-Ascend, generated from the site table, for tests on machines without an NPU.

Every hook site of :data:`dbo_runtime.ascend.sites.SITES` becomes a class method or function with the same module
path, qualified name and parameter names; its body records the call in ``<package>._standin.LOG`` and hands it to a
behaviour the test sets in ``<package>._standin.BEHAVIOR[site]`` (default: return the first argument).

A ``custom_op`` site's impl is built like the real one (vllm_ascend/ops/register_custom_ops.py): it communicates only
through the helpers the table lists in ``collectives``, looked up in its module's globals (``tensor_model_parallel_
all_gather(x)``, ``get_ep_group().all_gather(x)``), the one the test picks in ``_standin.PATH[site]``; each helper
records ``(spec, thread)`` in LOG and applies ``_standin.COLLECTIVE[spec]``. Those impls are registered as torch
custom ops in ``op_namespace`` (for each of ``dispatch_keys``) as ``direct_register_custom_op`` does in the real
package. What the stand-in mirrors is what ``dbo-runtime doctor`` checks in the real source (names, parameters,
collectives called through module globals, op registration), so the two cannot drift apart unnoticed. Nothing
here is used by the plugin itself.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from dbo_runtime.ascend.sites import SITES, HookSite, parse_collective

__all__ = ["standin_sources", "write_standin_tree", "STANDIN_RUNTIME"]

STANDIN_RUNTIME = '''"""Stand-in helper: records calls and dispatches to behaviours chosen by the test."""
import threading

LOG = []
BEHAVIOR = {}
INIT = {}


def call(site, obj, args):
    LOG.append((site, threading.current_thread().name))
    fn = BEHAVIOR.get(site)
    if fn is not None:
        return fn(obj, *args)
    return args[0]


def init(obj, *args, **kwargs):
    for key, value in INIT.items():
        setattr(obj, key, value)


PATH = {}
COLLECTIVE = {}


def enter(site, args):
    LOG.append((site, threading.current_thread().name))
    return PATH.get(site, 0)


def collective(spec):
    def run(x, *args, **kwargs):
        LOG.append((spec, threading.current_thread().name))
        fn = COLLECTIVE.get(spec)
        return fn(x) if fn is not None else x

    run.__name__ = run.__qualname__ = spec
    return run


class _Group:
    def __init__(self, getter):
        self._getter = getter

    def __getattr__(self, method):
        return collective(self._getter + "()." + method)


def group_getter(name):
    def get():
        return _Group(name)

    get.__name__ = get.__qualname__ = name
    return get
'''


def _custom_op_body(site: HookSite) -> tuple[str, list[str]]:
    """The impl body of a ``custom_op`` site and the module globals it needs (one per collective helper)."""
    args = ", ".join(p for p in site.params if p != "self")
    first = site.params[0]
    lines = [f"    _path = _standin.enter({site.name!r}, ({args},))\n"]
    helpers: list[str] = []
    for index, spec in enumerate(site.collectives):
        name, method = parse_collective(spec)
        call = f"{name}({first})" if method is None else f"{name}().{method}({first})"
        lines.append(f"    if _path == {index}:\n        return {call}\n")
        helper = (f"{name} = _standin.collective({name!r})" if method is None
                  else f"{name} = _standin.group_getter({name!r})")
        if helper not in helpers:
            helpers.append(helper)
    lines.append(f"    raise ValueError(f'stand-in {site.name}: no collective number {{_path}}')\n")
    return "".join(lines), helpers


def standin_sources(package: str = "standin_vllm_ascend", op_namespace: str = "standin_vllm_dbo",
                    dispatch_keys: Sequence[str] = ("CPU", "PrivateUse1")) -> dict[str, str]:
    """module name -> source of the stand-in tree (sites only; ``package`` replaces ``vllm_ascend``). The FlashComm1
    ops get a kernel for each of ``dispatch_keys``: CPU to run them here, PrivateUse1 as the real package."""
    modules: dict[str, dict[str, list[str]]] = {}
    globals_of: dict[str, list[str]] = {}
    for site in SITES:
        if site.hook == "via":
            continue
        mod = site.module.replace("vllm_ascend", package, 1)
        *owner, leaf = site.qualname.split(".")
        # Defaults as in the real signatures where the table relies on an optional parameter.
        params = ", ".join(p + "=False" if p == "is_ep_comm" else p for p in site.params)
        args = ", ".join(p for p in site.params if p != "self")
        self_arg = "self" if "self" in site.params else "None"
        if site.hook == "custom_op":
            body, helpers = _custom_op_body(site)
            for helper in helpers:
                if helper not in globals_of.setdefault(mod, []):
                    globals_of[mod].append(helper)
            fn = f"def {leaf}({params}):\n{body}"
        else:
            body = f"    return _standin.call({site.name!r}, {self_arg}, ({args},))\n"
            fn = f"def {leaf}({params}, **kwargs):\n{body}"
        modules.setdefault(mod, {}).setdefault(owner[0] if owner else "", []).append(fn)
    files: dict[str, str] = {}
    for mod, owners in modules.items():
        parts = ["import torch", f"from {package} import _standin", "", *globals_of.get(mod, []), ""]
        for owner, fns in owners.items():
            if owner:
                parts.append(f"class {owner}:")
                parts.append("    def __init__(self, *args, **kwargs):\n        _standin.init(self, *args, **kwargs)")
                parts.extend(textwrap.indent(fn, "    ") for fn in fns)
            else:
                parts.extend(fns)
        files[mod] = "\n".join(parts) + "\n"
    ops_mod = f"{package}.ops.register_custom_ops"
    files[ops_mod] += textwrap.dedent(f"""
        _lib = torch.library.Library({op_namespace!r}, "FRAGMENT")
        _lib.define("maybe_all_gather_and_maybe_unpad(Tensor x, bool label, bool is_ep_comm=False) -> Tensor")
        _lib.define("maybe_pad_and_reduce(Tensor x, bool is_ep_comm=False) -> Tensor")
        for _key in {tuple(dispatch_keys)!r}:
            _lib.impl("maybe_all_gather_and_maybe_unpad", _maybe_all_gather_and_maybe_unpad_impl, _key)
            _lib.impl("maybe_pad_and_reduce", _maybe_pad_and_reduce_impl, _key)
    """)
    files[f"{package}._standin"] = STANDIN_RUNTIME
    return files


def write_standin_tree(root: str | Path, package: str = "standin_vllm_ascend", op_namespace: str = "standin_vllm_dbo",
                       extra: dict[str, str] | None = None,
                       dispatch_keys: Sequence[str] = ("CPU", "PrivateUse1")) -> Path:
    """Write the stand-in package under ``root`` (put ``root`` on sys.path to import it); ``extra`` adds modules."""
    root = Path(root)
    for mod, src in {**standin_sources(package, op_namespace, dispatch_keys), **(extra or {})}.items():
        path = (root / Path(*mod.split("."))).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
        for parent in path.relative_to(root).parents:
            if str(parent) != ".":
                init = root / parent / "__init__.py"
                if not init.exists():
                    init.touch()
    return root / package
