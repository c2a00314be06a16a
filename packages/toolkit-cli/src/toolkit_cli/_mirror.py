"""An argparse picture of a click tool, for readers written against argparse parsers."""

from __future__ import annotations

import argparse

import click


def argparse_mirror(group: click.Command, prog: str | None = None) -> argparse.ArgumentParser:
    """An `argparse.ArgumentParser` with the subcommands (nested groups included) and option strings of
    `group`. It is a description for tools that inspect parsers (the skills' command check), not a
    replacement: values are not converted and nothing is run. Subcommands are loaded to read their options.
    """
    name = prog or group.name or "tool"
    parser = argparse.ArgumentParser(prog=name, add_help=False)
    _fill(parser, group, click.Context(group, info_name=name))
    return parser


def _fill(parser: argparse.ArgumentParser, command: click.Command, ctx: click.Context) -> None:
    for param in command.get_params(ctx):
        if isinstance(param, click.Option):
            strings = [*param.opts, *param.secondary_opts]
            if param.is_flag or param.count:
                parser.add_argument(*strings, dest=param.name, action="store_true")
            else:
                parser.add_argument(*strings, dest=param.name, nargs=None if param.nargs == 1 else param.nargs)
        elif isinstance(param, click.Argument):
            parser.add_argument(param.name, nargs="*" if param.nargs == -1 else None)
    if isinstance(command, click.Group):
        subparsers = parser.add_subparsers(dest=f"{command.name}_command", metavar="COMMAND")
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is None:
                continue
            child = subparsers.add_parser(sub_name, add_help=False, prog=f"{parser.prog} {sub_name}")
            _fill(child, sub, click.Context(sub, info_name=sub_name, parent=ctx))
