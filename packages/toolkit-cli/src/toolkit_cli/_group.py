"""The group class: lazy subcommands (click's documented recipe) and the toolkit's single error path."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import click
from click.exceptions import NoArgsIsHelpError

USAGE_EXIT = 2
INTERRUPTED_EXIT = 130
TERMINATED_EXIT = 128 + signal.SIGTERM


class CLIError(click.ClickException):
    """A user error found by the command itself: printed as `<prog>: error: <message>`, exit status 2."""

    exit_code = USAGE_EXIT


class _Interrupted(Exception):
    """KeyboardInterrupt re-raised under another name so that click does not turn it into Abort."""


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that finally blocks and context managers run (workers stop,
    temporary files go) before the tool exits."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


class _BrokenPipe(Exception):
    """The reader of standard output went away (`tool ... | head`)."""


def one_line(text: str) -> str:
    """`text` with every run of whitespace, newlines included, folded into one space."""
    return " ".join(str(text).split())


class _ToolContext(click.Context):
    """The context of a tool's command: before the command's own callback runs, an `-o` file that is one of
    its inputs is refused (all parameters are known only then, not while `-o` itself is converted)."""

    def invoke(self, callback: Any, /, *args: Any, **kwargs: Any) -> Any:
        if callback is not None and callback is getattr(self.command, "callback", None):
            from toolkit_cli._output import refuse_outputs_over_inputs

            refuse_outputs_over_inputs(self)
        return super().invoke(callback, *args, **kwargs)


def _checked(command: click.Command) -> click.Command:
    if command.context_class is click.Context:
        command.context_class = _ToolContext
    if isinstance(command, click.Group) and not isinstance(command, LazyGroup):
        # a plain nested group (`dbo-runtime compare diff`): its commands get their contexts from themselves
        for sub in command.commands.values():
            _checked(sub)
    return command


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when needed.

    `lazy_subcommands` maps a subcommand name to "package.module:attribute", the attribute being a
    `click.Command` with that same name. The module is imported when that subcommand runs or when
    `--help` lists the subcommands (to show their one-line help), never at start-up. This is the
    "lazy loading of subcommands" recipe from click's documentation (Advanced patterns).
    """

    def __init__(
        self, *args: Any, lazy_subcommands: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands: dict[str, str] = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_subcommands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            command = self._load(cmd_name)
        else:
            command = super().get_command(ctx, cmd_name)
        return _checked(command) if command is not None else None

    def _load(self, cmd_name: str) -> click.Command:
        target = self.lazy_subcommands[cmd_name]
        module_name, sep, attribute = target.partition(":")
        if not sep or not module_name or not attribute:
            raise ValueError(f"lazy subcommand {cmd_name!r}: {target!r} is not 'module:attribute'")
        command = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"lazy subcommand {cmd_name!r}: {target} is not a click command")
        # click names the context after command.name: a mismatch would print another name in errors.
        if command.name != cmd_name:
            raise ValueError(f"lazy subcommand {cmd_name!r}: {target} is named {command.name!r}")
        return command


def walk_commands(group: click.Group, _path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every leaf subcommand of `group` with its path of names (nested groups walked, lazy subcommands loaded)."""
    ctx = click.Context(group, info_name=group.name)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from walk_commands(command, (*_path, name))
        elif command is not None:
            yield (*_path, name), command


class ToolGroup(LazyGroup):
    """The top-level group of one tool: lazy subcommands plus the one error path.

    `domain_errors` are the tool's own exception classes for bad input found while working (for
    kv-capacity, `KVCapacityError`); they print as one line `<prog>: error: <message>`, exit 2.
    Usage errors (bad value, missing option, unknown subcommand) print
    `<prog> <sub>: error: <message> (see '<prog> <sub> --help')`, exit 2. KeyboardInterrupt prints
    `<prog>: interrupted`, exit 130. A command's integer return value is the exit status (None is 0).
    Anything else is a bug and keeps its traceback.
    """

    def __init__(
        self,
        name: str,
        *,
        lazy_subcommands: Mapping[str, str] | None = None,
        domain_errors: Iterable[type[BaseException]] = (),
        **kwargs: Any,
    ) -> None:
        settings = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
        settings.update(kwargs.pop("context_settings", None) or {})
        super().__init__(name, lazy_subcommands=lazy_subcommands, context_settings=settings, **kwargs)
        self.domain_errors: tuple[type[BaseException], ...] = tuple(domain_errors)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise _Interrupted from exc
        except BrokenPipeError as exc:
            raise _BrokenPipe from exc

    def run(self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any) -> int:
        """Run the tool on `args` (default: sys.argv[1:]) and return the exit status; never exits."""
        prog = prog_name or self.name or "tool"
        try:
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
        except ValueError:  # not the main thread: leave signals alone
            previous = None
        try:
            return self._run(args, prog, **extra)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _run(self, args: Sequence[str] | None, prog: str, **extra: Any) -> int:
        try:
            result = super().main(args=args, prog_name=prog, standalone_mode=False, **extra)
        except NoArgsIsHelpError as exc:  # the bare tool name: its help, as a request for help
            click.echo(exc.ctx.get_help())
            return 0
        except click.UsageError as exc:
            path = exc.ctx.command_path if exc.ctx is not None else prog
            _stderr(f"{path}: error: {one_line(exc.format_message())} (see '{path} --help')")
            return USAGE_EXIT
        except click.ClickException as exc:
            _stderr(f"{prog}: error: {one_line(exc.format_message())}")
            return USAGE_EXIT
        except (_Interrupted, KeyboardInterrupt, click.Abort):
            _stderr(f"{prog}: interrupted")
            return INTERRUPTED_EXIT
        except _Terminated:
            _stderr(f"{prog}: terminated")
            return TERMINATED_EXIT
        except _BrokenPipe:
            _silence_stdout()
            return 1
        except self.domain_errors as exc:
            _stderr(f"{prog}: error: {one_line(str(exc))}")
            return USAGE_EXIT
        except SystemExit as exc:
            if isinstance(exc.code, str):
                _stderr(exc.code)
                return 1
            return _exit_status(exc.code)
        return _exit_status(result)

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:  # embedding: plain click behaviour, exceptions propagate
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        if complete_var is not None:
            extra["complete_var"] = complete_var
        _exit(self.run(args, prog_name, **extra))


def _exit(status: int) -> NoReturn:
    sys.exit(status)


def _exit_status(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    return 0


def _stderr(line: str) -> None:
    click.echo(line, err=True)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not raise EPIPE again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
