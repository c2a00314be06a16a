#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = []
# ///
"""Run a long command in the background, then poll it: for steps longer than an agent's tool timeout.

    python scripts/job.py start NAME [--dir DIR] -- COMMAND [ARG ...]
    python scripts/job.py status [NAME] [--dir DIR] [--tail N]
    python scripts/job.py wait NAME [--dir DIR] [--timeout SECONDS] [--tail N]
    python scripts/job.py stop NAME [--dir DIR] [--grace SECONDS]

`start` detaches COMMAND into its own session (it survives the agent's shell) and returns at once.
Files, in DIR (default ./jobs):
    NAME.pid    the process-group id (kill -- -PID stops the command and every child)
    NAME.log    the command's stdout and stderr
    NAME.rc     its exit code, written only when it has ended (its presence means "done")
    NAME.json   the command, the folder it ran in, start and end times

`status` prints one line per job (running with elapsed time, or done with the exit code) and, for one
NAME, the last --tail lines of its log. `wait` polls until the job ends or --timeout passes (keep it
below the agent's tool timeout and call it again). `stop` sends SIGTERM to the whole group, then
SIGKILL after --grace seconds.

Exit codes of status/wait: 0 done with exit code 0; 1 done with another exit code (or the process
vanished without writing one); 3 still running; 2 bad input (unknown job, a name already in use).

Examples (from the skill's folder; elsewhere prefix scripts/ with that folder; each exits 0):
  python scripts/job.py start nap -- sleep 2
  python scripts/job.py wait nap --timeout 60
  python scripts/job.py status nap
  python scripts/job.py stop nap
(`stop` of a job that has ended only prints its state; `wait` again while it says "running".)
Standard library only; this file's source is skills/job.py, copied into each skill by `make skills-sync`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
RUNNING = 3


class JobError(Exception):
    """Bad input; the message is one line."""


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _paths(folder: Path, name: str) -> dict[str, Path]:
    if not NAME_RE.match(name):
        raise JobError(f"job name {name!r}: letters, digits, '.', '_' and '-' only (e.g. bench-dbo-on)")
    return {kind: folder / f"{name}.{kind}" for kind in ("pid", "log", "rc", "json")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():  # a recycled pid that is not our supervisor does not count
        try:
            return b"_supervise" in cmdline.read_bytes()
        except OSError:
            return False
    return True


def start(folder: Path, name: str, command: list[str]) -> int:
    if not command:
        raise JobError("start: no command given (put it after --, e.g. start bench -- python run.py)")
    folder.mkdir(parents=True, exist_ok=True)
    paths = _paths(folder, name)
    if any(p.exists() for p in paths.values()):
        raise JobError(f"job {name!r} already exists in {folder} (see `status {name}`); pick another name")
    meta = {"name": name, "command": command, "cwd": os.getcwd(), "started": time.time()}
    _write_atomically(paths["json"], json.dumps(meta, indent=1) + "\n")
    with open(paths["log"], "ab", buffering=0) as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_supervise", str(folder.resolve()), name, "--", *command],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    _write_atomically(paths["pid"], f"{proc.pid}\n")
    print(f"started {name}: pid {proc.pid}; log {paths['log']}; poll: job.py status {name} --dir {folder}")
    return 0


def supervise(folder: Path, name: str, command: list[str]) -> int:
    """Run `command` as a child in this process group; write its exit code to NAME.rc when it ends."""
    paths = _paths(folder, name)
    stopping = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum  # the child got the same signal (same group); wait for it, then record

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"job.py: cannot run {command[0]!r}: {exc.strerror or exc}", flush=True)
        rc = 127
    else:
        while True:
            try:
                rc = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
        if rc < 0:
            rc = 128 - rc  # a signal N reads as 128+N, as in a shell
    meta = json.loads(paths["json"].read_text(encoding="utf-8"))
    meta.update({"ended": time.time(), "returncode": rc, "stopped_by_signal": stopping["signal"] or None})
    _write_atomically(paths["json"], json.dumps(meta, indent=1) + "\n")
    _write_atomically(paths["rc"], f"{rc}\n")
    return rc


def _state(folder: Path, name: str) -> tuple[int, str]:
    paths = _paths(folder, name)
    if not paths["json"].exists():
        known = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
        raise JobError(f"no job {name!r} in {folder}; known: {', '.join(known) or '(none)'}")
    meta = json.loads(paths["json"].read_text(encoding="utf-8"))
    if paths["rc"].exists():
        rc = int(paths["rc"].read_text().strip())
        took = meta.get("ended", time.time()) - meta["started"]
        return (0 if rc == 0 else 1), f"{name}: done, exit code {rc}, after {took:.0f} s"
    pid = int(paths["pid"].read_text().strip()) if paths["pid"].exists() else 0
    if pid and _alive(pid):
        return RUNNING, f"{name}: running, pid {pid}, {time.time() - meta['started']:.0f} s so far"
    if not pid:  # start() writes the pid file right after the process exists
        return RUNNING, f"{name}: starting"
    return 1, f"{name}: gone without an exit code (pid {pid} killed or the machine restarted); see its log"


def _tail(path: Path, lines: int) -> str:
    if lines <= 0 or not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 64 * 1024))
        text = handle.read().decode("utf-8", errors="replace")
    # Progress bars rewrite one line with carriage returns: keep the last state of each.
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(kept[-lines:])


def status(folder: Path, name: str | None, tail: int) -> int:
    if name is None:
        names = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
        if not names:
            print(f"no jobs in {folder}")
            return 0
        codes = []
        for each in names:
            code, line = _state(folder, each)
            codes.append(code)
            print(line)
        return RUNNING if RUNNING in codes else max(codes)
    code, line = _state(folder, name)
    print(line)
    text = _tail(folder / f"{name}.log", tail)
    if text:
        print(f"--- last lines of {folder / (name + '.log')} ---\n{text}")
    return code


def wait(folder: Path, name: str, timeout: float, tail: int) -> int:
    deadline = time.monotonic() + timeout
    while True:
        code, _ = _state(folder, name)
        if code != RUNNING or time.monotonic() >= deadline:
            return status(folder, name, tail)
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def stop(folder: Path, name: str, grace: float) -> int:
    code, line = _state(folder, name)
    if code != RUNNING:
        print(line)
        return code
    pgid = int(_paths(folder, name)["pid"].read_text().strip())
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _alive(pgid):
            time.sleep(0.2)
        if not _alive(pgid):
            break
    try:  # a child that outlived the supervisor (ignored SIGTERM, or slow to exit) still belongs to the group
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if not (folder / f"{name}.rc").exists():  # killed before it could record: record it here
        _write_atomically(folder / f"{name}.rc", "137\n")
    return status(folder, name, 0)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # noqa: D401 - argparse hook
        self.exit(2, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="job.py", description=__doc__.split("\n\n", 1)[0], epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_OneLineParser)
    for action, text in (("start", "run COMMAND (after --) in the background"),
                         ("status", "running or done (exit code), and the log's last lines"),
                         ("wait", "poll until done or --timeout"),
                         ("stop", "SIGTERM the job's process group, then SIGKILL")):
        p = sub.add_parser(action, help=text, description=text)
        p.add_argument("name", nargs="?" if action == "status" else None, metavar="NAME")
        p.add_argument("--dir", default="jobs", help="folder of the job files (default ./jobs)")
        if action in ("status", "wait"):
            p.add_argument("--tail", type=int, default=10, help="log lines to show (default 10)")
        if action == "wait":
            p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait at most (default 300)")
        if action == "stop":
            p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (default 30)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    if argv[:1] == ["_supervise"]:
        return supervise(Path(argv[1]), argv[2], command)
    args = build_parser().parse_args(argv)
    try:
        folder = Path(args.dir)
        if args.action == "start":
            return start(folder, args.name, command)
        if command:
            raise JobError(f"{args.action}: unexpected arguments after --: {' '.join(command)}")
        if args.action == "status":
            return status(folder, args.name, args.tail)
        if args.action == "wait":
            return wait(folder, args.name, args.timeout, args.tail)
        return stop(folder, args.name, args.grace)
    except JobError as exc:
        print(f"job.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
