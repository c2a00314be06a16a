"""DBO on vLLM-Ascend: the site table, ``doctor``, and the ``vllm.general_plugins`` entry point.

Importing this package imports neither vLLM, vLLM-Ascend nor torch_npu; the plugin imports them when vLLM calls it.
"""

from dbo_runtime.ascend.sites import (
    MODEL_FAMILY_SITES,
    PATCHED_SYMBOLS,
    SITES,
    VLLM_SYMBOLS,
    HookSite,
    PatchedSymbol,
)

__all__ = ["SITES", "PATCHED_SYMBOLS", "VLLM_SYMBOLS", "MODEL_FAMILY_SITES", "HookSite", "PatchedSymbol"]
