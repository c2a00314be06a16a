import subprocess
import sys


def test_cli_prints_help():
    out = subprocess.run([sys.executable, "-m", "kv_capacity", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "kv-capacity" in out.stdout
