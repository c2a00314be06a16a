import subprocess
import sys

import dbo_runtime


def test_every_public_name_resolves():
    for name in dbo_runtime.__all__:
        assert getattr(dbo_runtime, name) is not None, name


def test_import_is_light():
    code = "import sys, dbo_runtime; print('torch' in sys.modules, 'torch_npu' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
