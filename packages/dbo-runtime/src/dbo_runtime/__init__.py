"""Dual batch overlap (DBO) runtime for vLLM-Ascend."""

__version__ = "0.1.0"
