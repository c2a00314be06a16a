"""Scripted agent trials: each skill, copied alone out of the repository, followed through one realistic request.

A trial plays the agent of issue 31: it has the skill folder (copied to tmp_path, nothing else of the
repository), the toolkit's CLIs on PATH and the interpreter the skills name (the toolkit's Python, with
jinja2 and pyyaml), and it runs only commands its SKILL.md documents - a script of the skill
(`python scripts/X.py`, paths prefixed with the skill folder as SKILL.md says) or a toolkit command
SKILL.md names - with options that SKILL.md or that command's --help shows. It works in its own folder,
and the test checks the figures of the answer it would give (against independent arithmetic or the
inputs' ground truth), not only exit codes. Devices are not needed: the kv-cache-sizing launch runs
against a stub server that logs what vLLM-Ascend logs, and profiles are the real single-card torch_npu
sample and synthetic multi-rank ones with a known ground truth.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SKILLS = REPO / "skills"
SINGLE_CARD = REPO / "packages" / "profile-analyzer" / "tests" / "data" / "msprof-sample" / "single_card_ascend_pt"
GIB = 1024**3
TOOLS = ("kv-capacity", "profile-analyzer", "dbo-runtime")

pytestmark = pytest.mark.timeout(300)


class Agent:
    """One skill installed alone, a working folder, and a command runner that only runs documented commands."""

    def __init__(self, tmp_path: Path, skill: str) -> None:
        self.skill = tmp_path / "agent-home" / ".agents" / "skills" / skill
        shutil.copytree(SKILLS / skill, self.skill, ignore=shutil.ignore_patterns("__pycache__"))
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.text = (self.skill / "SKILL.md").read_text(encoding="utf-8")
        self.text += "".join(p.read_text(encoding="utf-8") for p in sorted((self.skill / "references").glob("*.md")))
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self._helps: dict[tuple[str, ...], str] = {}

    def _help(self, argv: list[str]) -> str:
        key = tuple(argv)
        if key not in self._helps:
            proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60, env=self.env,
                                  cwd=self.work)
            self._helps[key] = proc.stdout
        return self._helps[key]

    def argv(self, line: str) -> list[str]:
        """The command as the agent runs it, after checking that the skill documents it."""
        tokens = shlex.split(line)
        if tokens[0] == "python":
            script = tokens[1]
            assert script.startswith("scripts/") and f"python {script}" in self.text, f"not in SKILL.md: {line}"
            argv = [sys.executable, str(self.skill / script)]
            head = argv if script.endswith("render.py") or script.endswith("device_fit.py") else argv + tokens[2:3]
            rest = tokens[2:]
        else:
            assert tokens[0] in TOOLS, line
            assert f"{tokens[0]} {tokens[1]}" in self.text, f"not in SKILL.md: {tokens[0]} {tokens[1]}"
            argv = [tokens[0]]
            head = [tokens[0], tokens[1]]
            rest = tokens[1:]
        documented = self.text + self._help(head)
        for token in rest:
            if token.startswith("--") and token != "--":
                name = token.split("=", 1)[0]
                assert name in documented, f"{name} is in neither SKILL.md nor {' '.join(head[-2:])} --help"
            if token == "--":
                break
        return argv + [str(self.skill / t) if re.match(r"^(scripts|assets)/", t) else t for t in rest]

    def mkdir(self, folder: str) -> None:
        assert f"mkdir -p {folder}" in self.text, f"SKILL.md does not create {folder}/"
        (self.work / folder).mkdir(parents=True, exist_ok=True)

    def run(self, line: str, expect: int = 0, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.argv(line), capture_output=True, text=True, timeout=timeout, cwd=self.work,
                              env=self.env)
        assert proc.returncode == expect, f"{line}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr
        return proc

    def json(self, line: str, expect: int = 0) -> dict:
        return json.loads(self.run(line, expect).stdout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A stand-in for `vllm serve` on an NPU: it records its arguments, logs the two lines vLLM-Ascend logs for a
# fixed budget (the token count it is given), and answers /health.
STUB_SERVER = r'''
import http.server, json, os, sys
args = sys.argv[1:]
with open(os.environ["STUB_ARGV"], "w") as f:
    json.dump(args, f)
port = int(args[args.index("--port") + 1])
print("INFO Initial free memory 60.10 GiB, reserved 16.00 GiB for KV Cache as specified by kv_cache_memory_bytes config "
      "and skipped memory profiling.", flush=True)
print(f"INFO NPU KV cache size: {int(os.environ['STUB_TOKENS']):,} tokens, Maximum concurrency for 32,768 tokens "
      "per request: 7.11x", flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def _stop_group(pid_file: Path) -> None:
    if pid_file.is_file():
        try:
            os.killpg(int(pid_file.read_text().strip()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_kv_cache_sizing_trial(tmp_path: Path) -> None:
    """"Qwen3-8B at TP=2 on 910B3 NPUs with 16G: how many 32k requests fit, what budget do 24 need, and give me
    the launch script." """
    agent = Agent(tmp_path, "kv-cache-sizing")
    plan = agent.json("kv-capacity plan --model qwen3-8b --kv-cache-memory-bytes 16G --max-model-len 32768 "
                      "--tensor-parallel-size 2 --format json")
    # Qwen3-8B: 36 layers, 8 KV heads x 128 -> 4 per rank at TP 2; bf16; block 128
    bytes_per_block = 36 * 128 * 4 * 128 * 2 * 2
    blocks = 16 * GIB // bytes_per_block
    assert plan["num_blocks"] == blocks == 1820
    concurrency = blocks / (32768 // 128)
    whole = math.floor(concurrency)
    assert (plan["max_concurrency"], whole) == (concurrency, 7)  # 7.11x is read as 7 whole requests
    assert "7 whole requests" in agent.text.replace("**", "")  # the skill says how to read it
    tokens = int(concurrency * 32768)
    assert plan["kv_cache_tokens"] == tokens == 232_960
    npu_line = plan["vllm_log"].replace("GPU KV cache size", "NPU KV cache size")
    assert "NPU KV cache size" in agent.text and npu_line.startswith("NPU KV cache size: 232,960 tokens")

    need = agent.json("kv-capacity required --model qwen3-8b --max-model-len 32768 --max-num-seqs 24 "
                      "--tensor-parallel-size 2 --format json")
    assert need["required_bytes"] == bytes_per_block * (24 * 256 + 1)  # one null block held back
    assert need["kv_cache_memory_bytes_flag"] == "55305M"

    # 24 requests: 54 GiB of KV + ~7.6 GiB of weights per rank is more than a 64 GB 910B3 allows
    fit = agent.json("python scripts/device_fit.py --model qwen3-8b --device 910B3 -tp 2 --max-model-len 32768 "
                     "--max-num-seqs 24 --format json", expect=1)
    weights = 8.19e9 * 2 / 2 / GIB
    assert fit["fits"] is False and fit["weights_per_device_gib"] == pytest.approx(weights)
    assert fit["total_gib"] == pytest.approx(weights + need["required_bytes"] / GIB + 2.0)
    assert fit["usable_gib"] == pytest.approx(64 * 0.9)
    options = {a["change"].split(" (")[0]: a for a in fit["alternatives"]}
    fp8 = options["fp8 KV cache"]
    assert fp8["fits"] and fp8["kv_cache_gib"] == pytest.approx(bytes_per_block / 2 * (24 * 256 + 1) / GIB)
    assert options["tensor parallel size 4"]["fits"]
    free = 64 * 0.9 - weights - 2.0
    fewer = next(a for a in fit["alternatives"] if a["change"].endswith("instead of 24"))
    assert fewer["change"].startswith(f"{math.floor(free * GIB / bytes_per_block / 256)} requests")  # 21
    shorter = next(a for a in fit["alternatives"] if a["change"].startswith("--max-model-len"))
    length = int(shorter["change"].split()[1].replace(",", ""))
    assert length % 128 == 0 and bytes_per_block * (24 * length // 128 + 1) <= free * GIB
    assert bytes_per_block * (24 * (length // 128 + 1) + 1) > free * GIB  # one block longer would not fit
    text = agent.run("python scripts/device_fit.py --model qwen3-8b --device 910B3 -tp 2 --max-model-len 32768 "
                     "--max-num-seqs 24", expect=1).stdout
    assert "does NOT fit on 910B3" in text and "--kv-cache-dtype fp8" in text
    # the 16G the user has does fit
    ok = agent.json("python scripts/device_fit.py --model qwen3-8b --device 910B3 -tp 2 --max-model-len 32768 "
                    "--kv-cache-memory-bytes 16G --format json")
    assert ok["fits"] and ok["whole_requests"] == 7 and ok["vllm_log"] == npu_line

    # The launch script: changing only the TP size is refused in one line that says what to set
    refused = agent.run("python scripts/render.py launch_with_budget --example --set tensor_parallel_size=2 "
                        "-o launch.sh", expect=2)
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "--set-str extra_env.ASCEND_RT_VISIBLE_DEVICES=0,1" in refused.stderr and not (agent.work / "launch.sh").exists()

    stub = tmp_path / "stub_vllm.py"
    stub.write_text(STUB_SERVER)
    port = _free_port()
    agent.run(f"python scripts/render.py launch_with_budget --example --set-str model={tmp_path / 'Qwen3-8B'} "
              "--set tensor_parallel_size=2 --set-str extra_env.ASCEND_RT_VISIBLE_DEVICES=0,1 "
              "--set-str kv_cache_memory_bytes=16G --set extra_args.max-num-seqs=7 "
              f"--set-str log_file=logs/qwen3-8b.log --set port={port} "
              f"--set-str serve_cmd='{sys.executable} {stub}' -o launch.sh")
    agent.env.update(STUB_ARGV=str(tmp_path / "argv.json"), STUB_TOKENS=str(tokens))
    try:
        agent.run("python scripts/job.py start launch -- bash launch.sh")
        waited = agent.run("python scripts/job.py wait launch --timeout 120", timeout=180)
        assert "done, exit code 0" in waited.stdout
        log = (agent.work / "jobs" / "launch.log").read_text()
        assert f"KV cache {tokens} tokens as planned" in log
    finally:
        _stop_group(agent.work / "logs" / "qwen3-8b.log.pid")
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--max-num-seqs") + 1] == "7"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "16G"


def test_profile_overlap_analysis_trial(tmp_path: Path) -> None:
    """"Why is communication not hidden?" on a single-card torch_npu profile with no collectives."""
    agent = Agent(tmp_path, "profile-overlap-analysis")
    shutil.copytree(SINGLE_CARD, agent.work / "prof" / "run1")
    agent.mkdir("reports")
    report = agent.json("profile-analyzer report prof/run1 --format json")
    summary = report["summary"]
    assert summary["communication_us"] == 0 and summary["communication_not_overlapped_us"] == 0
    # the answer: nothing to hide (no communication), and the idle time is the host launching late
    verdict = report["verdict"]
    assert "no communication operators were found" in verdict and "no communication operators were found" in agent.text
    assert "waiting for the host" in verdict and "waiting for the host" in agent.text
    gaps = report["idle_gaps"][0]["per_stream"][0]
    assert gaps["gaps"] == 275
    host_share = gaps["host_bound_us"] / gaps["idle_us"]
    assert host_share > 0.98 and f"{100 * host_share:.0f}% was spent waiting for the host" in verdict
    assert summary["free_us"] / summary["wall_us"] == pytest.approx(0.826, abs=0.001)
    table = agent.text.split("## 5. Decide the next step", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| no communication at all") or
            line.startswith("| host-bound")]
    assert len(rows) == 2 and "graph mode" in rows[1] and "DBO cannot help" in rows[0]
    # the missing kernel_details.csv warning: what it costs and how to produce it are in the skill
    assert any("kernel_details.csv is missing" in w["message"] for w in report["warnings"])
    assert "kernel_details.csv is missing" in agent.text and "torch_npu.profiler.profiler.analyse" in agent.text
    # the step columns the report prints are explained
    for column in ("**Stage**", "**Preparing**", "excl. receive", "## Stream utilisation"):
        assert column in agent.text, column
    breakdown = report["breakdown"][0]
    assert breakdown["stage"] == pytest.approx(breakdown["computing"] + breakdown["free"] - breakdown["bubble"], abs=0.5)

    agent.run("profile-analyzer report prof/run1 --rank 0 --format html -o reports/run1.html")
    html = (agent.work / "reports" / "run1.html").read_text()
    assert html.count('<rect class="gap k-host"') >= 10 and "of 275 idle gaps" in html
    # whatif (documented): with no communication DBO cannot pay
    whatif = agent.run("profile-analyzer whatif prof/run1").stdout
    assert "NO" in whatif.split("pays", 1)[1]


def test_dbo_debug_trial(tmp_path: Path) -> None:
    """"DBO is on but the step barely improves: here are the DBO-off and DBO-on profiles of 2 ranks.\""""
    agent = Agent(tmp_path, "dbo-debug")
    # the captures the agent would get from step 2 (synthetic 2-rank torch_npu profiles, layer 1 too long to hide)
    for name, extra in (("dbo-off", []), ("dbo-on", ["--dbo", "--exposed-layers", "1"])):
        subprocess.run(["profile-analyzer", "synth", str(agent.work / "prof" / name), "--ranks", "2", "--layers", "4",
                        "--seed", "1", *extra], check=True, capture_output=True, env=agent.env, timeout=120)
    truth = json.loads((agent.work / "prof" / "dbo-on" / "ground_truth.json").read_text())
    agent.mkdir("reports")

    agent.run("python scripts/render.py launch_server --example --set dbo=false --set-str profile_dir=prof/dbo-off "
              "--set-str log_file=logs/dbo-off.log -o launch_off.sh")
    launch = (agent.work / "launch_off.sh").read_text()
    assert "--enable-dbo" not in launch and "--tensor-parallel-size 2" in launch
    agent.run("profile-analyzer report prof/dbo-on --format json -o reports/dbo-on.json")
    agent.run("profile-analyzer report prof/dbo-off --format json -o reports/dbo-off.json")
    agent.run("profile-analyzer compare prof/dbo-off prof/dbo-on --format json -o reports/compare.json")
    on = json.loads((agent.work / "reports" / "dbo-on.json").read_text())
    compare = json.loads((agent.work / "reports" / "compare.json").read_text())
    # the answer's figures: ping-pong found, the least covered layer is the one the profile was built with,
    # and the straggler rank
    rank0 = next(d for d in on["dual_batch"] if d["rank"] == 0)
    assert rank0["detected"]
    by_layer: dict[int, list[float]] = {}
    for row in rank0["layers"]:
        by_layer.setdefault(row["layer"], []).append(row["covered_pct"] or 0.0)
    worst = min(by_layer, key=lambda layer: sum(by_layer[layer]) / len(by_layer[layer]))
    assert worst == truth["params"]["exposed_layers"][0] == 1
    assert on["ranks"]["waited_for_rank"] == truth["slowest_rank"]
    assert compare["new"]["overlap_pct"] > compare["base"]["overlap_pct"]
    agent.run("python scripts/render.py issue_report --example --set-file report_off=reports/dbo-off.json "
              "--set-file report_on=reports/dbo-on.json --set-file compare=reports/compare.json "
              "--set 'precision={}' --set 'bench={}' --set-str title=DBO-trial -o ISSUE.md")
    issue = (agent.work / "ISSUE.md").read_text()
    assert f"{compare['new']['overlap_pct']:.1f}" in issue


def test_dbo_benchmark_trial(tmp_path: Path) -> None:
    """"Does DBO pay off for DeepSeek-V2-Lite at TP=2 on devices 4,5? Set up the ablation, thresholds 256 and 512.\""""
    agent = Agent(tmp_path, "dbo-benchmark")
    refused = agent.run("python scripts/render.py matrix --example --set-str model=/path/to/DeepSeek-V2-Lite-Chat "
                        "--set-str server_env.ASCEND_RT_VISIBLE_DEVICES=4 -o matrix.yaml", expect=2)
    assert "needs 2" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    agent.run("python scripts/render.py matrix --example --set-str model=/path/to/DeepSeek-V2-Lite-Chat "
              "--set-str server_env.ASCEND_RT_VISIBLE_DEVICES=4,5 --set 'dbo_prefill_thresholds=[256, 512]' "
              "--set 'concurrencies=[32, 96]' -o matrix.yaml")
    matrix = yaml.safe_load((agent.work / "matrix.yaml").read_text())
    assert [v["name"] for v in matrix["variants"]] == ["dbo-off", "dbo-on-prefill256", "dbo-on-prefill512"]
    dry = agent.run("python scripts/serve_bench.py run matrix.yaml --out bench-out --dry-run").stdout
    servers = [line for line in dry.splitlines() if "api_server" in line or " serve " in line]
    measured = [line for line in dry.splitlines() if "vllm_bench_serve.py" in line and "warmup.json" not in line]
    assert len(servers) == 3
    assert len(measured) == 3 * 2 * matrix["repeats"]  # variants x concurrencies x repeats
    assert sum("--enable-dbo" in line for line in servers) == 2
    assert all("ASCEND_RT_VISIBLE_DEVICES=4,5" in line for line in servers)
    assert not (agent.work / "bench-out").exists()  # a dry run starts and writes nothing


def test_vllm_serve_bench_trial(tmp_path: Path) -> None:
    """"Benchmark my Qwen server at concurrency 16 and 64 with max-num-seqs 64, devices 0,1, two repeats.\""""
    agent = Agent(tmp_path, "vllm-serve-bench")
    agent.run("python scripts/render.py matrix --example --set-str model=/path/to/Qwen3-8B --set 'concurrencies=[16, 64]' "
              "--set server_args.max-num-seqs=64 --set-str server_env.ASCEND_RT_VISIBLE_DEVICES=0,1 --set repeats=2 "
              "--set 'dbo_prefill_thresholds=[]' -o matrix.yaml")
    matrix = yaml.safe_load((agent.work / "matrix.yaml").read_text())
    assert matrix["server_args"]["max-num-seqs"] == 64 and matrix["server_args"]["tensor-parallel-size"] == 2
    assert [v["name"] for v in matrix["variants"]] == ["dbo-off"]
    dry = agent.run("python scripts/serve_bench.py run matrix.yaml --out bench-out --dry-run").stdout
    measured = [line for line in dry.splitlines() if "vllm_bench_serve.py" in line and "warmup.json" not in line]
    assert len(measured) == 2 * 2
    assert {re.search(r"--max-concurrency (\d+)", line).group(1) for line in measured} == {"16", "64"}
    assert all("/path/to/Qwen3-8B" in line for line in measured)
    assert not (agent.work / "bench-out").exists()
