"""Tests that run the real vllm-ascend 0.23.0.post1 / vLLM 0.23.0 Python over the torch_npu emulation (a STAND-IN
for the NPU: tests/ascend_emulation/). They run in ``.venv-ascend`` only (``make ascend-env``; ``make test`` runs
them there); in any other environment this folder is not collected.

What the emulation cannot show: timing and overlap on an NPU, HCCS/RoCE links, the real kernels (the emulated
operators follow torch_npu's documentation, on the CPU), ACL graphs, and behaviour that differs between torch 2.10
(vllm-ascend 0.23's) and the torch here.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm_ascend") is None or importlib.util.find_spec("torch_npu") is None:
    collect_ignore_glob = ["*.py"]
else:
    import torch_npu

    if not getattr(torch_npu, "EMULATED", False):  # a real torch_npu: these tests are for the emulation
        collect_ignore_glob = ["*.py"]
    else:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared _emu module (importmode=importlib)
