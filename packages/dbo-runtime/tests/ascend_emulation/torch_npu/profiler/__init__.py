"""STAND-IN torch_npu.profiler (tests only): importable; profiling is not emulated."""

from torch_npu.profiler import dynamic_profile  # noqa: F401
