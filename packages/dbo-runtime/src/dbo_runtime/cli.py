"""Command line of dbo-runtime.

Each subcommand lives in its own module, which exposes `add_parser(subparsers)`; that function adds its
subparser and sets `func=<callable(args) -> int>` as the default. The modules are listed below so that
each command's owner can grow it without touching the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES: tuple[str, ...] = ("dbo_runtime.reference.cli", "dbo_runtime.bench", "dbo_runtime.ascend.doctor", "dbo_runtime.ascend.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dbo-runtime", description="Dual batch overlap (DBO) runtime for vLLM-Ascend")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):  # not written yet
                continue
            raise
        add_parser = getattr(module, "add_parser", None)
        if add_parser is not None:
            add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m dbo_runtime.cli
    sys.exit(main())
