"""STAND-IN ``acl`` (tests only): CANN's Python runtime bindings (pyACL), which vllm-ascend's worker imports at
module top. Nothing in it works on the CPU: every call raises naming itself."""

from __future__ import annotations


def _not_emulated(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"acl.{name} is not emulated (CANN's runtime; no NPU here)")

    call.__name__ = name.rsplit(".", 1)[-1]
    return call


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_emulated(name)
