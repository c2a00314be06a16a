"""A STAND-IN module tree for vLLM-Ascend, generated from the site table, for tests on machines without an NPU.

Every hook site of :data:`dbo_runtime.ascend.sites.SITES` becomes a class method or function with the same module
path, qualified name and parameter names; its body records the call in ``<package>._standin.LOG`` and hands it to a
behaviour the test sets in ``<package>._standin.BEHAVIOR[site]`` (default: return the first argument). The
FlashComm1 impls are also registered as torch custom ops in ``op_namespace`` (CPU kernels), as
``direct_register_custom_op`` does in the real package. Nothing here is used by the plugin itself.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from dbo_runtime.ascend.sites import SITES

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
'''


def standin_sources(package: str = "standin_vllm_ascend", op_namespace: str = "standin_vllm_dbo") -> dict[str, str]:
    """module name -> source of the stand-in tree (sites only; ``package`` replaces ``vllm_ascend``)."""
    modules: dict[str, dict[str, list[str]]] = {}
    for site in SITES:
        if site.hook == "via":
            continue
        mod = site.module.replace("vllm_ascend", package, 1)
        *owner, leaf = site.qualname.split(".")
        # Defaults as in the real signatures where the table relies on an optional parameter.
        params = ", ".join(p + "=False" if p == "is_ep_comm" else p for p in site.params)
        args = ", ".join(p for p in site.params if p != "self")
        self_arg = "self" if "self" in site.params else "None"
        body = f"    return _standin.call({site.name!r}, {self_arg}, ({args},))\n"
        fn = f"def {leaf}({params}, **kwargs):\n{body}"
        modules.setdefault(mod, {}).setdefault(owner[0] if owner else "", []).append(fn)
    files: dict[str, str] = {}
    for mod, owners in modules.items():
        parts = ["import torch", f"from {package} import _standin", ""]
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
        _lib.impl("maybe_all_gather_and_maybe_unpad", _maybe_all_gather_and_maybe_unpad_impl, "CPU")
        _lib.impl("maybe_pad_and_reduce", _maybe_pad_and_reduce_impl, "CPU")
    """)
    files[f"{package}._standin"] = STANDIN_RUNTIME
    return files


def write_standin_tree(root: str | Path, package: str = "standin_vllm_ascend", op_namespace: str = "standin_vllm_dbo",
                       extra: dict[str, str] | None = None) -> Path:
    """Write the stand-in package under ``root`` (put ``root`` on sys.path to import it); ``extra`` adds modules."""
    root = Path(root)
    for mod, src in {**standin_sources(package, op_namespace), **(extra or {})}.items():
        path = (root / Path(*mod.split("."))).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
        for parent in path.relative_to(root).parents:
            if str(parent) != ".":
                init = root / parent / "__init__.py"
                if not init.exists():
                    init.touch()
    return root / package
