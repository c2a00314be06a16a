"""STAND-IN ``torchvision`` (tests only, in ``.venv-ascend``): importable, nothing works.

Why it exists: vllm-ascend's worker patches import vLLM's Qwen3-VL model file, which imports transformers' Qwen2-VL
image and video processors, which import ``torchvision.transforms.v2`` at module top. No model the emulation tests
run is a vision model. PyPI's torchvision for this torch is a CUDA build whose operators do not load beside the CPU
torch (``operator torchvision::nms does not exist``) and whose dependencies would replace the CPU torch. Every name
resolves to a placeholder that raises when it is called.
"""

from __future__ import annotations

import sys
import types

__version__ = "0.0.0+emulation-placeholder"


class _Placeholder:
    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._path} is a placeholder of the torchvision stand-in (tests only)")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


def _install(name: str) -> _Module:
    module = _Module(name)
    module.__path__ = []  # a package, so that submodules import
    sys.modules[name] = module
    return module


for _name in ("torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional",
              "torchvision.transforms.functional", "torchvision.io", "torchvision.ops", "torchvision.models"):
    _install(_name)
transforms = sys.modules["torchvision.transforms"]
