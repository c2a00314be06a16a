"""The reference MoE model that proves the DBO runtime on CPU: model, patterns A2/A3, local gloo ranks, CLI."""

from dbo_runtime.reference.model import PATTERNS, Batch, MoEConfig, ReferenceMoE

__all__ = ["PATTERNS", "Batch", "MoEConfig", "ReferenceMoE"]
