import subprocess
import sys


def test_cli_prints_help():
    out = subprocess.run([sys.executable, "-m", "profile_analyzer", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "profile-analyzer" in out.stdout
