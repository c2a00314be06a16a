"""`-o/--output FILE`: checked before the work starts, written atomically after it ends."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from toolkit_cli._group import CLIError
from toolkit_cli._types import shorten

_F = TypeVar("_F", bound=Callable[..., Any])
STDOUT = "-"


class OutputError(CLIError):
    """The output file cannot be written there (a directory, a missing parent, no permission ...)."""


def output_problem(path: str | os.PathLike[str], *, probe: bool = True) -> str | None:
    """Why `path` cannot receive an atomically written file, as one line; None when it can.

    With `probe`, a scratch file is created in the target directory and removed, which is the only
    honest test of "can I write here" (permissions, read-only mounts, /proc, quotas; root passes
    `os.access` everywhere).
    """
    text = os.fspath(path)
    if not text:
        return "output path is empty; expected a file path or '-' for standard output"
    target = Path(text)
    shown = shorten(text, 80)
    try:
        info = target.stat()
    except FileNotFoundError:
        info = None
    except OSError as exc:
        return f"output {shown} cannot be examined: {exc.strerror}"
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            return f"output {shown} is a directory; expected a file path"
        if not stat.S_ISREG(info.st_mode):
            return f"output {shown} exists and is not a regular file; expected a file path"
    parent = target.parent
    if not parent.exists():
        return f"output directory {shorten(str(parent), 80)} does not exist"
    if not parent.is_dir():
        return f"output {shown}: {shorten(str(parent), 80)} is not a directory"
    if probe:
        error = write_probe(parent)
        if error is not None:
            return f"cannot write in directory {shorten(str(parent), 80)}: {error}"
    return None


def write_probe(directory: str | os.PathLike[str]) -> str | None:
    """Create and remove a scratch file in `directory`: None when that works, else why not (the OS's words).

    Permission bits alone do not say it (root, ACLs, read-only mounts): the probe asks the file system itself."""
    try:
        fd, scratch = tempfile.mkstemp(dir=directory, prefix=".probe-", suffix=".tmp")
    except OSError as exc:
        return str(exc.strerror or exc)
    os.close(fd)
    os.unlink(scratch)
    return None


def _is_destination(param: click.Parameter) -> bool:
    """An output parameter: `-o` itself, or one named out* (`--output_path DIR`, `--out DIR`, OUT_DIR)."""
    return isinstance(param.type, OutputPath) or (param.name or "").startswith("out")


def _named_paths(ctx: click.Context) -> list[tuple[str, str]]:
    """(hint, path) for every value that names an existing file or folder, in `ctx` and its parents, of a
    parameter that may take a path: free text or click.Path (never a choice, a number or an output)."""
    found: list[tuple[str, str]] = []
    context: click.Context | None = ctx
    while context is not None:
        for param in context.command.params:
            if _is_destination(param) or not isinstance(
                param.type, (click.types.StringParamType, click.Path, click.types.UnprocessedParamType)
            ):
                continue
            value = context.params.get(param.name or "")
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(item, (str, os.PathLike)) or os.fspath(item) in ("", STDOUT):
                    continue
                try:
                    os.stat(item)
                except (OSError, ValueError):
                    continue
                found.append((param.get_error_hint(context), os.fspath(item)))
        context = context.parent
    return found


def input_clash(
    path: str | os.PathLike[str], ctx: click.Context | None, *, inside_folders: bool = True
) -> str | None:
    """Why writing `path` would destroy an input of the command of `ctx`, as one line; None when it would not.

    An input is a value of the command's parameters that names an existing file or folder. The output may
    not be that file (after resolving `.`/`..` and links, or a hard link to it), nor, with `inside_folders`,
    be an existing file inside an input folder (a profile or model directory): the command may have read it.
    A new file there is allowed (msprof-analyze itself writes its reports into the profile folder).
    """
    if ctx is None or os.fspath(path) in ("", STDOUT):
        return None
    target = os.path.realpath(path)
    shown = shorten(os.fspath(path), 80)
    for hint, source in _named_paths(ctx):
        real = os.path.realpath(source)
        if os.path.isdir(real):
            if inside_folders and target.startswith(real.rstrip(os.sep) + os.sep) and os.path.lexists(target):
                return (
                    f"output {shown} is a file inside the input folder {hint} {shorten(source, 80)}, which "
                    "may be what was read; expected a new file or one outside the command's inputs"
                )
            continue
        try:
            same = target == real or os.path.samefile(target, real)
        except OSError:
            same = False
        if same:
            return (
                f"output {shown} is the input {hint} {shorten(source, 80)}, which writing would destroy; "
                "expected a file other than the command's inputs"
            )
    return None


def refuse_outputs_over_inputs(ctx: click.Context) -> None:
    """Before a command runs: refuse (a usage error naming `-o`) an output file that is one of its inputs."""
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param.type, OutputPath) and isinstance(value, (str, os.PathLike)):
            problem = input_clash(value, ctx)
            if problem:
                raise click.BadParameter(problem, ctx=ctx, param=param)


def check_output(path: str | os.PathLike[str] | None) -> None:
    """Raise OutputError when `path` (None: standard output) cannot be written; call it before long work."""
    if path is None or os.fspath(path) == STDOUT:
        return
    problem = output_problem(path)
    if problem:
        raise OutputError(problem)


class OutputPath(click.ParamType):
    """A file to write, or '-' for standard output (converted to None).

    With `check_early` the place is checked while the command line is parsed, so a wrong `-o` is refused
    before any long work; `write_output` checks again when it writes.
    """

    name = "file"

    def __init__(self, check_early: bool = True) -> None:
        self.check_early = check_early

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | None:
        if value is None:
            return None
        if isinstance(value, Path):
            text = os.fspath(value)
        else:
            text = str(value)
        if text == STDOUT:
            return None
        if not text:
            self.fail("output path is empty; expected a file path or '-' for standard output", param, ctx)
        if self.check_early:
            problem = output_problem(text)
            if problem:
                self.fail(problem, param, ctx)
        return Path(text)


def output_option(
    *, check_early: bool = True, help: str = "write to FILE (atomically) instead of standard output"
) -> Callable[[_F], _F]:
    """`-o/--output FILE`; the command receives `output`: a Path, or None for standard output."""
    return click.option(
        "-o", "--output", "output", type=OutputPath(check_early), default=None, metavar="FILE", help=help
    )


def _new_file_mode(existing: Path) -> int:
    try:
        return stat.S_IMODE(existing.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_output(path: str | os.PathLike[str] | None, data: str | bytes) -> None:
    """Write `data` to `path`, or to standard output when `path` is None or '-'.

    A file is written whole or not at all: the bytes go to a temporary file in the same directory, are
    flushed to disk, and replace the target with one `os.replace` (a reader never sees half a report, a
    failure leaves the old file as it was). The new file gets the old file's mode, or the umask's.
    Raises OutputError with one line when the place cannot be written.
    """
    if path is None or os.fspath(path) == STDOUT:
        if isinstance(data, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(data)
            sys.stdout.flush()
        return
    target = Path(os.fspath(path))
    # the early check ran on `-o` before the work (ToolGroup); this one also covers callers outside it and
    # outputs found other ways (`--output_path DIR`, where msprof-analyze writes into the profile folder)
    problem = output_problem(target, probe=False) or input_clash(
        target, click.get_current_context(silent=True), inside_folders=False
    )
    if problem:
        raise OutputError(problem)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    mode = _new_file_mode(target)
    try:
        fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:100]}.", suffix=".tmp")
    except OSError as exc:
        raise OutputError(f"cannot write {shorten(str(target), 80)}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(scratch, mode)
        os.replace(scratch, target)
    except BaseException as exc:
        try:
            os.unlink(scratch)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {shorten(str(target), 80)}: {exc.strerror}") from None
        raise
