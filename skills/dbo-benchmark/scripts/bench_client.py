#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = []  # run it with the interpreter that has vLLM
# ///
"""`vllm bench serve` for many runs, with vLLM imported once: one child process forked per run.

`scripts/serve_bench.py` starts this with the vLLM interpreter and sends it one request per client run, a JSON line
on stdin: {"argv": [the arguments of `vllm bench serve`], "log": "PATH"}. The client imports vLLM's benchmark once
(10-12 s on a 2-core machine, most of a short run's wall time), says {"ready": true}, then, for each request, forks a
child that runs `vllm bench serve` with those arguments (the same parser and main function as
`scripts/vllm_bench_serve.py`), its stdout and stderr in PATH, and answers {"rc": EXIT CODE} when the child ends. A
run is the same benchmark as a fresh process's: the child starts from the state the import left (no thread, no
event loop, nothing benchmarked yet) and exits when its run ends, so nothing of one run carries into the next.
End of stdin ends the client. The harness kills the client's process group (its children are in it) on a timeout.

Run it by hand only to see that an interpreter can serve as the client: `--check` imports vLLM's benchmark, says how
long that took and exits 0, or exits 2 with one line when that interpreter has no vLLM.

Examples (from the skill's folder; need vLLM in that interpreter):
  python scripts/bench_client.py --check
(`python` here is the vLLM interpreter.)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

Bench = Callable[[list[str]], Any]


def serve(bench: Bench, requests: TextIO, replies: TextIO) -> int:
    """Answer every request line of `requests` on `replies`; 0 at end of input."""
    print(json.dumps({"ready": True, "pid": os.getpid()}), file=replies, flush=True)
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            argv, log = [str(a) for a in request["argv"]], str(request["log"])
        except (ValueError, KeyError, TypeError) as exc:
            print(json.dumps({"rc": 2, "error": f"bad request: {exc}"}), file=replies, flush=True)
            continue
        print(json.dumps({"rc": run_forked(bench, argv, log)}), file=replies, flush=True)
    return 0


def run_forked(bench: Bench, argv: list[str], log: str) -> int:
    """`bench(argv)` in a forked child with its stdout and stderr in `log`; the child's exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)  # the requests are the parent's to read
            os.close(null)
            try:
                bench(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - the run's failure is its exit code and its log, as a process's
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def vllm_bench() -> Bench:
    """vLLM's `vllm bench serve` as a call on its arguments (imports vLLM: do it once, before forking)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_bench_serve import load

    parser, main = load("bench_client.py")
    return lambda argv: main(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv not in ([], ["--check"]):
        print(f"bench_client.py: unknown arguments {' '.join(argv)!r}; accepted: --check, --help, or none (serve the "
              "requests on stdin)", file=sys.stderr)
        return 2
    import time

    started = time.perf_counter()
    bench = vllm_bench()
    if argv == ["--check"]:
        print(f"bench_client.py: vLLM's benchmark imported in {time.perf_counter() - started:.1f} s; this interpreter "
              "can serve the harness's client runs")
        return 0
    return serve(bench, sys.stdin, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
