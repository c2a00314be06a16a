"""kv_capacity.testing: the tiny-model generator's two command names, and its refusal of unknown models."""

from __future__ import annotations

import subprocess
import sys

import kv_capacity.testing.tinymodels as generator
import kv_capacity.tinymodels as shim
import pytest


def test_the_old_module_name_is_the_same_generator():
    assert shim.ensure_model is generator.ensure_model and shim.main is generator.main
    assert shim.model_key("qwen3") == generator.model_key("qwen3")


@pytest.mark.parametrize("module", ["kv_capacity.tinymodels", "kv_capacity.testing.tinymodels"])
def test_unknown_architecture_is_one_line_exit_2(module):
    proc = subprocess.run([sys.executable, "-m", module, "llama9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("tinymodels: unknown architecture 'llama9'; accepted: "
                                   + ", ".join(generator.ARCHITECTURES))
    assert proc.stdout == ""
