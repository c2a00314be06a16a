"""STAND-IN for ``torch_npu`` (tests only): an emulated Ascend NPU on the CPU, so that the real vllm-ascend 0.23 and
vLLM 0.23 Python trees run here. It is installed into ``.venv-ascend`` only (``make ascend-env``), never into ``.venv``
or a user's environment, and it is not torch_npu: it has no kernels, no HCCS, no timing.

How "npu" devices resolve to CPU tensors: PyTorch's PrivateUse1 backend is renamed ``npu``
(``torch.utils.rename_privateuse1_backend``), its two allocation kernels (``aten::empty.memory_format``,
``aten::empty_strided``) are registered to allocate CPU memory, and a no-op device guard (``_device_guard.cpp``,
compiled on first import) lets ``torch.device("npu:N")`` pass through the dispatcher. So ``torch.zeros(...,
device="npu")``, ``tensor.npu()`` and ``tensor.to("npu:1")`` all return CPU tensors (``tensor.device.type == "cpu"``)
and every other operator runs on its CPU kernel.

What it provides: the ``torch.npu`` device/stream/event/graph API (:mod:`torch_npu.npu`; streams are labels, work runs
in order on the CPU), ``get_soc_version`` (A2 by default; :func:`torch_npu.npu.set_emulated_soc` switches to A3), the
HCCL process-group backend as gloo (:mod:`torch_npu.distributed`), and the torch_npu / ``torch.ops._C_ascend``
operators the DBO paths reach (:mod:`torch_npu.ops`, each written from the operator documentation shipped in the
torch-npu 2.10.0.post4 wheel and checked against a plain-torch reference). Any other ``torch_npu.npu_*`` operator
raises :class:`NotEmulatedError` naming itself when called.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

__version__ = "2.10.0.post4+emulated"
EMULATED = True


class NotEmulatedError(NotImplementedError):
    """A torch_npu operator or API the emulation does not provide (the DBO paths were not seen to reach it)."""


def _build_dir() -> Path:
    path = Path(os.environ.get("TORCH_NPU_EMULATION_BUILD") or Path(sys.prefix) / "torch-npu-emulation-build")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_device_guard() -> None:
    """Load the compiled guard; compile it first when it is missing or older than its source (make ascend-env
    does that once). A lock left by a killed compile would make torch's builder wait forever: it is removed."""
    import importlib.machinery
    import importlib.util

    name = "torch_npu_emulated_device_guard"
    source = Path(__file__).with_name("_device_guard.cpp")
    build = _build_dir()
    built = build / f"{name}.so"
    if not built.exists() or built.stat().st_mtime < source.stat().st_mtime:
        from torch.utils.cpp_extension import load

        (build / "lock").unlink(missing_ok=True)
        load(name=name, sources=[str(source)], build_directory=str(build), verbose=False)
        return
    spec = importlib.util.spec_from_file_location(name, built,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(built)))
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _register_npu_device() -> None:
    torch.utils.rename_privateuse1_backend("npu")
    _load_device_guard()
    lib = torch.library.Library("aten", "IMPL")  # noqa: TID251 - kept alive in _LIBS below

    def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return torch.empty(size, dtype=dtype, layout=layout, device="cpu", memory_format=memory_format)

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="cpu")

    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    _LIBS.append(lib)


# vLLM's and vllm-ascend's op namespaces; torch's own PrivateUse1 registrations (e.g. FSDP's) keep their CPU kernels.
_MIRRORED_NAMESPACES = frozenset({"vllm", "_C_ascend", "_C"})


def _npu_kernels_serve_cpu_tensors() -> None:
    """A kernel registered for the NPU (``PrivateUse1``) is registered for ``CPU`` as well: the emulation's "npu"
    tensors are CPU tensors, so the dispatcher picks the CPU key where torch_npu's tensors pick PrivateUse1.
    vLLM's ``direct_register_custom_op`` (which vllm-ascend uses with ``dispatch_key="PrivateUse1"``) goes through
    ``Library.impl``; an op that already has a CPU kernel keeps it."""
    original = torch.library.Library.impl

    def impl(self, op_name, fn=None, dispatch_key="", *args, **kwargs):
        result = original(self, op_name, fn, dispatch_key, *args, **kwargs)
        if dispatch_key == "PrivateUse1" and fn is not None and self.ns in _MIRRORED_NAMESPACES:
            name = op_name if isinstance(op_name, str) else getattr(op_name, "__name__", str(op_name))
            qualified = name if "::" in name else f"{self.ns}::{name}"
            if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"):
                original(self, op_name, fn, "CPU", *args, **kwargs)
        return result

    torch.library.Library.impl = impl


_LIBS: list[torch.library.Library] = []
_register_npu_device()
_npu_kernels_serve_cpu_tensors()

from torch_npu import npu  # noqa: E402  (needs the renamed backend)

torch._register_device_module("npu", npu)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=False,
                                                     unsupported_dtype=None)

from torch_npu import (  # noqa: E402,F401
    _C,
    atb,
    distributed,
    ops,
    triton_kernels,  # noqa: E402
)
from torch_npu._runner_ops import *  # noqa: E402,F401,F403
from torch_npu.ops import *  # noqa: E402,F401,F403

triton_kernels.install()

float = torch.float  # noqa: A001 - vllm-ascend spells dtypes as torch_npu.float in a few places


def __getattr__(name: str):
    if name.startswith(("npu_", "_npu_")):
        def not_emulated(*args, **kwargs):
            raise NotEmulatedError(f"torch_npu.{name} is not emulated (the DBO paths were not seen to reach it); "
                                   "the emulated operators are listed in docs/dbo-vllm-ascend.md")

        not_emulated.__name__ = name
        return not_emulated
    raise AttributeError(f"module 'torch_npu' (emulation) has no attribute {name!r}")
