"""Special files as inputs, for every command of every tool that reads a named file (issue 29): a FIFO, a
character device that never ends, a socket, a dangling link, a folder where a file is read, an empty file. Each is
refused in one line, exit 2, in seconds and without growing memory: never a hang, never a traceback.

The (command, input parameter) pairs are found by walking the click groups (every parameter that may name a file,
as toolkit_cli reads them); only the commands that start engines, servers or rank processes are left out, by name,
below. The table of pairs x kinds runs in one child process (a per-case alarm and an address-space limit), so a
case that hangs or grows fails the test instead of the machine.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from toolkit_cli import OutputPath, walk_commands

TOOLS = {
    "kv-capacity": "kv_capacity.cli:cli",
    "profile-analyzer": "profile_analyzer.cli:cli",
    "dbo-runtime": "dbo_runtime.cli:cli",
}
# commands whose work starts processes that outlive a refusal test's budget (vLLM engines, servers, gloo ranks);
# their inputs are checked by their own packages' tests
STARTS_PROCESSES = {
    ("kv-capacity", "verify"), ("dbo-runtime", "compare", "run"), ("dbo-runtime", "ascend-compare", "run"),
    ("dbo-runtime", "compare", "collect"), ("dbo-runtime", "ascend-compare", "collect"), ("dbo-runtime", "reference"),
    ("dbo-runtime", "bench"), ("dbo-runtime", "policy-sweep"),
}
NOT_INPUTS = {"label", "comm_patterns", "vllm_version", "hardware", "url"}  # free text that names no file
FILLERS = ("1", "8", "0.5", "20,1", "4096", "http://127.0.0.1:9")
KINDS = ("fifo", "dev-zero", "socket", "dangling-link", "folder", "empty-file")


def _group(target: str) -> click.Group:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _reads_a_file(param: click.Parameter) -> bool:
    if isinstance(param.type, OutputPath) or (param.name or "").startswith("out") or param.name in NOT_INPUTS:
        return False
    return isinstance(param.type, click.types.StringParamType | click.Path) and param.nargs == 1


def _filler(param: click.Parameter, command: click.Command, spare: str) -> str | None:
    for value in (*getattr(param.type, "choices", ()), *FILLERS, spare):
        try:
            param.type.convert(value, param, click.Context(command))
        except click.BadParameter:
            continue
        return str(value)
    return None


def _option(param: click.Parameter) -> list[str]:
    return [max(param.opts, key=len)] if isinstance(param, click.Option) else []


def _special(kind: str, folder: Path) -> str:
    path = folder / f"input-{kind}.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        return "/dev/zero"
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "dangling-link":
        path.symlink_to(folder / "nothing-here")
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(b"")
    return str(path)


def _table(folder: Path) -> list[dict]:
    spare = folder / "spare.json"
    spare.write_text("{}")
    cases = []
    for kind in KINDS:
        special = _special(kind, folder)
        for tool, target in TOOLS.items():
            for path, command in walk_commands(_group(target)):
                if (tool, *path) in STARTS_PROCESSES:
                    continue
                for param in [p for p in command.params if _reads_a_file(p)]:
                    argv: list[str] = [*path]
                    for other in command.params:
                        if other is param:
                            argv += [*_option(other), special]
                        elif other.required:
                            value = _filler(other, command, str(spare))
                            if value is None:
                                break
                            argv += [*_option(other), value]
                    else:
                        cases.append({"tool": tool, "target": target, "argv": argv, "kind": kind,
                                      "name": f"{tool} {' '.join(path)} {param.name} <- {kind}"})
    return cases


DRIVER = textwrap.dedent("""
    import contextlib, importlib, io, json, resource, signal, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    class Hang(BaseException):
        pass

    def alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    for case in json.load(open(sys.argv[1])):
        module, _, attribute = case["target"].partition(":")
        group = getattr(importlib.import_module(module), attribute)
        err, out = io.StringIO(), io.StringIO()
        begin = time.monotonic()
        signal.alarm(10)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                status = group.run(case["argv"])
        except Hang:
            status = "hang"
        except BaseException as exc:
            status = f"raised {type(exc).__name__}: {exc}"
        finally:
            signal.alarm(0)
        print(json.dumps({"name": case["name"], "status": status, "err": err.getvalue(),
                          "seconds": round(time.monotonic() - begin, 2)}), flush=True)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs, sockets and /dev/zero as on Linux")
def test_special_files_as_inputs_are_refused_in_one_line(tmp_path):
    cases = _table(tmp_path)
    assert len(cases) > 60 and {c["kind"] for c in cases} == set(KINDS)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "driver.py").write_text(DRIVER)
    run = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=tmp_path)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), run.stderr[-2000:]
    bad = [r for r in results
           if r["status"] != 2 or r["err"].count("\n") != 1 or "Traceback" in r["err"] or r["seconds"] > 10]
    assert not bad, "\n".join(f"{r['name']}: {r['status']} {r['err'][:300]!r}" for r in bad)
