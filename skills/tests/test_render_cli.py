"""The renderer's command line: good renders, and bad input -> exit 2, one line on stderr, no file written.

Run as an agent runs it: the copy in a skill's scripts/, which renders that skill's assets/.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SKILLS = Path(__file__).resolve().parents[1]
RENDER = SKILLS / "dbo-debug" / "scripts" / "render.py"
LAUNCH_VALUES = SKILLS / "dbo-debug" / "assets" / "launch_server.values.yaml"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_renders_to_stdout_and_to_an_executable_file(tmp_path: Path) -> None:
    proc = run("launch_server", "--example", "--set", "dbo=false", "--set", "port=8123")
    assert proc.returncode == 0, proc.stderr
    assert "--port 8123" in proc.stdout and "--enable-dbo" not in proc.stdout
    out = tmp_path / "launch.sh"
    proc = run("launch_server.sh.j2", "--values", str(LAUNCH_VALUES), "--output", str(out))
    assert proc.returncode == 0 and proc.stdout == ""
    assert out.read_text().startswith("#!/usr/bin/env bash") and out.stat().st_mode & stat.S_IXUSR
    assert [p.name for p in tmp_path.iterdir()] == ["launch.sh"]  # no temporary file left behind


def test_set_str_set_file_and_dotted_keys(tmp_path: Path) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text("max-num-seqs: 7\nenforce-eager: true\n")
    proc = run("launch_server", "--values", str(LAUNCH_VALUES), "--set-file", f"extra_args={extra}",
               "--set-str", "hccl_op_expansion_mode=AIV", "--set", "extra_env.MY_FLAG=on")
    assert proc.returncode == 0, proc.stderr
    assert "--max-num-seqs 7 --enforce-eager" in proc.stdout
    assert "export HCCL_OP_EXPANSION_MODE=AIV" in proc.stdout
    assert "export MY_FLAG=True" in proc.stdout  # --set parses YAML: `on` is a boolean; --set-str keeps text
    assert "export ASCEND_RT_VISIBLE_DEVICES=0,1" in proc.stdout  # the rest of the mapping is kept


def test_list_names_templates_and_variables() -> None:
    proc = run("--skill", str(SKILLS / "kv-cache-sizing"), "--list")
    assert proc.returncode == 0
    assert proc.stdout.startswith("launch_with_budget.sh: ") and "kv_cache_memory_bytes" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--skill", "/nonexistent/skill", "x"], "--skill /nonexistent/skill: no SKILL.md there"),
        (["--skill", str(SKILLS / "tests"), "x"], "no SKILL.md there"),
        (["nope"], "unknown template 'nope' of skill dbo-debug; accepted: capture_profile.sh"),
        (["nope", "--example"], "unknown template 'nope' of skill dbo-debug"),
        (["launch_server"], "needs values for: data_parallel_size, dbo, dbo_decode_threshold"),
        (["launch_server", "--values", str(LAUNCH_VALUES), "--set", "noequals"], "--set 'noequals': expected KEY=VALUE"),
        (["launch_server", "--values", str(LAUNCH_VALUES), "--set", "a..b=1"], "expected KEY=VALUE"),
        (["launch_server", "--values", "/nonexistent/v.yaml"], "--values /nonexistent/v.yaml: cannot read"),
        (["launch_server", "--values", str(LAUNCH_VALUES), "--set", "serve_cmd=vllm serve ("],
         "rendered launch_server.sh is not valid bash"),
        (["launch_server", "--values", str(LAUNCH_VALUES), "--set", "extra_env=[1, 2]"], "wrong shape"),
        (["launch_server", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "out.sh"
    proc = run(*args, "--output", str(out))
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert message in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_values_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    bad_json = tmp_path / "r.json"
    bad_json.write_text("{not json")
    for args, message in (
        (["--values", str(broken)], "not valid YAML"),
        (["--values", str(listing)], "expected a mapping of variable names"),
        (["--values", str(LAUNCH_VALUES), "--set-file", f"extra_args={bad_json}"], "not valid JSON"),
    ):
        proc = run("launch_server", *args)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_failed_render_keeps_an_existing_output_unchanged(tmp_path: Path) -> None:
    out = tmp_path / "launch.sh"
    out.write_text("previous\n")
    proc = run("launch_server", "--values", str(LAUNCH_VALUES), "--set", "serve_cmd=vllm serve (",
               "--output", str(out))
    assert proc.returncode == 2 and out.read_text() == "previous\n"
    missing_dir = tmp_path / "no" / "such" / "dir" / "x.sh"
    proc = run("launch_server", "--values", str(LAUNCH_VALUES), "--output", str(missing_dir))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and not missing_dir.parent.exists()


def test_runs_from_any_directory(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SKILLS / "vllm-serve-bench/scripts/render.py"), "matrix", "--example"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and "variants:" in proc.stdout
    assert os.listdir(tmp_path) == []
