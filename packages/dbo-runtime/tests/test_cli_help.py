import subprocess
import sys


def test_cli_prints_help():
    out = subprocess.run([sys.executable, "-m", "dbo_runtime", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "dbo-runtime" in out.stdout
