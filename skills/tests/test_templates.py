"""Every template renders with its example values, and the result is valid for its kind of file.

Validity is checked here independently of the renderer's own check: `bash -n` for shell scripts,
py_compile for Python, yaml.safe_load for YAML, and for each template some content assertions that
would fail if a variable were ignored. The issue-report template is also filled from real
profile-analyzer output (reports of synthetic multi-rank profiles written by `profile-analyzer synth`,
a stand-in for an NPU capture), and the precision script is run against a stand-in OpenAI-compatible
server (a local http.server) to prove that it tells identical from diverging answers.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

SKILLS = Path(__file__).resolve().parents[1]
TEMPLATES = sorted((p.parent.parent.name, p.name[: -len(".j2")]) for p in SKILLS.glob("*/assets/*.j2"))


def example_values(skill: str, template: str) -> dict[str, Any]:
    return yaml.safe_load((SKILLS / skill / "assets" / f"{template.split('.', 1)[0]}.values.yaml").read_text())


def check_file(path: Path) -> None:
    """Independent validity check of a rendered file by its extension."""
    if path.suffix == ".sh":
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    elif path.suffix == ".py":
        py_compile.compile(str(path), doraise=True, cfile=str(path.with_suffix(".pyc")))
    elif path.suffix in (".yaml", ".yml"):
        assert isinstance(yaml.safe_load(path.read_text()), dict)
    elif path.suffix == ".md":
        assert path.read_text().lstrip().startswith("#")
    else:  # a template of a kind this test does not know how to check
        raise AssertionError(f"no validity check for {path.name}")


def test_templates_are_found() -> None:
    assert {skill for skill, _ in TEMPLATES} == {
        "dbo-debug", "vllm-serve-bench", "kv-cache-sizing", "profile-overlap-analysis", "dbo-benchmark",
    }
    assert len(TEMPLATES) >= 10


@pytest.mark.parametrize(("skill", "template"), TEMPLATES, ids=[f"{s}/{t}" for s, t in TEMPLATES])
def test_template_renders_valid_file(tmp_path: Path, render_mod, skill: str, template: str) -> None:
    values = example_values(skill, template)
    assert render_mod.required_variables(SKILLS / skill, template) == set(values), "example values must give exactly what the template uses"
    out = tmp_path / template
    render_mod.write_atomically(out, render_mod.render(SKILLS / skill, template, values))
    check_file(out)
    text = out.read_text()
    assert "{{" not in text and "{%" not in text
    if text.startswith("#!"):
        assert os.access(out, os.X_OK)


def test_launch_server_switches_dbo_and_profiler(tmp_path: Path, render_mod) -> None:
    values = example_values("dbo-debug", "launch_server.sh")
    on = render_mod.render(SKILLS / "dbo-debug", "launch_server.sh", values)
    assert "--enable-dbo" in on and "--dbo-prefill-token-threshold 512" in on
    assert "export HCCL_OP_EXPANSION_MODE=AI_CPU" in on and "--profiler-config" in on
    off = render_mod.render(
        SKILLS / "dbo-debug", "launch_server.sh",
        {**values, "dbo": False, "hccl_op_expansion_mode": "", "profile_dir": "", "extra_args": {}},
    )
    assert "--enable-dbo" not in off and "unset HCCL_OP_EXPANSION_MODE" in off and "profil" not in off.lower()
    env_style = render_mod.render(SKILLS / "dbo-debug", "launch_server.sh", {**values, "profiler_style": "env"})
    assert 'export VLLM_TORCH_PROFILER_DIR="$PROFILE_DIR"' in env_style and "--profiler-config" not in env_style
    # A value with shell metacharacters stays one quoted word.
    tricky = render_mod.render(SKILLS / "dbo-debug", "launch_server.sh", {**values, "model": "/m/a b;rm -rf x"})
    assert "'/m/a b;rm -rf x'" in tricky


def test_matrix_template_gives_a_matrix_the_harness_accepts(render_mod, serve_bench) -> None:
    values = example_values("vllm-serve-bench", "matrix.yaml")
    matrix = serve_bench.parse_matrix(yaml.safe_load(render_mod.render(SKILLS / "vllm-serve-bench", "matrix.yaml", values)))
    assert [v.name for v in matrix.variants] == ["dbo-off", "dbo-on-prefill256", "dbo-on-prefill512"]
    assert matrix.variants[0].server_args == {}
    assert matrix.variants[2].server_args == {
        "enable-dbo": True, "dbo-prefill-token-threshold": 512, "dbo-decode-token-threshold": 32,
    }
    assert matrix.server_env == {"HCCL_OP_EXPANSION_MODE": "AI_CPU"}
    assert matrix.baseline == "dbo-off" and len(matrix.points()) == 2 and matrix.repeats == 3
    assert matrix.bench_args["temperature"] == 0 and matrix.bench_args["random-input-len"] == 4096


def test_issue_report_from_real_profile_analyzer_output(tmp_path: Path, render_mod) -> None:
    analyzer = [sys.executable, "-m", "profile_analyzer"]
    off, on = tmp_path / "prof-off", tmp_path / "prof-on"
    common = ["--ranks", "2", "--steps", "2", "--layers", "4"]
    subprocess.run([*analyzer, "synth", str(off), *common], check=True, capture_output=True, timeout=120)
    subprocess.run([*analyzer, "synth", str(on), *common, "--dbo", "--exposed-layers", "2"], check=True,
                   capture_output=True, timeout=120)
    for name, prof in (("off", off), ("on", on)):
        subprocess.run([*analyzer, "report", str(prof), "--format", "json", "-o", str(tmp_path / f"{name}.json")],
                       check=True, capture_output=True, timeout=120)
    subprocess.run([*analyzer, "compare", str(off), str(on), "--format", "json", "-o", str(tmp_path / "cmp.json")],
                   check=True, capture_output=True, timeout=120)
    out = tmp_path / "ISSUE.md"
    proc = subprocess.run(
        [sys.executable, str(SKILLS / "dbo-debug/scripts/render.py"), "issue_report", "--example",
         "--set-file", f"report_off={tmp_path / 'off.json'}", "--set-file", f"report_on={tmp_path / 'on.json'}",
         "--set-file", f"compare={tmp_path / 'cmp.json'}", "--set", "bench={}", "--set", "precision={}",
         "--set-str", "title=synthetic A2 profile", "--output", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    report_on = json.loads((tmp_path / "on.json").read_text())
    compare = json.loads((tmp_path / "cmp.json").read_text())
    assert text.startswith("# [DBO] synthetic A2 profile")
    assert report_on["verdict"] in text
    assert "Rank 0: ping-pong found" in text and "Rank 1: ping-pong found" in text
    overlapped = next(i for i in compare["items"] if i["item"] == "overlapped")
    assert f"| Overlapped | {overlapped['base_us']:.1f} | {overlapped['new_us']:.1f} |" in text
    assert text.count("Not run.") == 2  # bench and precision were given empty


class _StandInCompletions(BaseHTTPRequestHandler):
    """A stand-in for an OpenAI-compatible /v1/completions endpoint with canned greedy answers."""

    answers: dict[str, tuple[list[str], list[float]]] = {}

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens, logprobs = self.answers[body["prompt"]]
        data = {"choices": [{"text": "".join(tokens), "logprobs": {"tokens": tokens, "token_logprobs": logprobs}}]}
        payload = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture()
def stand_in_servers() -> Iterator[tuple[str, str, type]]:
    handlers = []
    servers = []
    for answers in (
        {"p1": (["a", "b", "c"], [-0.1, -0.2, -0.3]), "p2": (["x", "y"], [-1.0, -2.0])},
        {"p1": (["a", "b", "c"], [-0.1, -0.2, -0.3]), "p2": (["x", "z"], [-1.0, -2.5])},
    ):
        handler = type("Handler", (_StandInCompletions,), {"answers": answers})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        handlers.append(handler)
        servers.append(server)
    try:
        yield f"http://127.0.0.1:{servers[0].server_port}", f"http://127.0.0.1:{servers[1].server_port}", handlers[1]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_precision_script_detects_divergence(tmp_path: Path, render_mod, stand_in_servers) -> None:
    reference_url, other_url, other_handler = stand_in_servers
    values = {**example_values("dbo-debug", "precision_compare.py"), "prompts": ["p1", "p2"],
              "out_dir": str(tmp_path / "precision"), "request_timeout_s": 10}
    script = tmp_path / "precision_compare.py"

    def run(servers: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        render_mod.write_atomically(script, render_mod.render(SKILLS / "dbo-debug", "precision_compare.py", {**values, "servers": servers}))
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)

    same = run({"dbo-off": reference_url, "dbo-on": reference_url})
    assert same.returncode == 0, same.stdout + same.stderr
    result = json.loads((tmp_path / "precision" / "compare.json").read_text())
    assert result["ok"] and result["servers"]["dbo-on"]["tokens_identical"] == 2

    diff = run({"dbo-off": reference_url, "dbo-on": other_url})
    assert diff.returncode == 1, diff.stdout + diff.stderr
    summary = json.loads((tmp_path / "precision" / "compare.json").read_text())["servers"]["dbo-on"]
    assert summary["tokens_identical"] == 1 and summary["text_identical"] == 1
    row = summary["rows"][1]
    assert row["first_divergence"] == 1 and row["max_logprob_diff"] == pytest.approx(0.0)
    assert "MISMATCH" in diff.stdout

    # One server at a time (--only), then --compare-only from the saved answers.
    shutil.rmtree(tmp_path / "precision")
    assert run({"dbo-off": reference_url, "dbo-on": other_url}, "--only", "dbo-off").returncode == 0
    assert not (tmp_path / "precision" / "compare.json").exists()
    other_handler.answers = {"p1": (["a", "b", "c"], [-0.1, -0.2, -0.35]), "p2": (["x", "y"], [-1.0, -2.0])}
    assert run({"dbo-off": reference_url, "dbo-on": other_url}, "--only", "dbo-on").returncode == 0
    tolerant = run({"dbo-off": reference_url, "dbo-on": other_url}, "--compare-only")
    assert tolerant.returncode == 1  # same tokens, but a logprob differs by 0.05 > tolerance 0.001
    assert json.loads((tmp_path / "precision" / "compare.json").read_text())["servers"]["dbo-on"]["max_logprob_diff"] == pytest.approx(0.05)

    unreachable = run({"dbo-off": "http://127.0.0.1:9", "dbo-on": other_url})
    assert unreachable.returncode == 2 and "dbo-off" in unreachable.stderr
