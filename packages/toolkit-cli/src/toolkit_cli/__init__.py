"""The command-line base shared by the toolkit's tools (kv-capacity, profile-analyzer, dbo-runtime).

One way to build a tool on click, so that every tool has the same lazy start-up, the same error lines
and the same options. The API below is stable; add to it, do not change it.

Group and error path
    ToolGroup(name, *, lazy_subcommands={"sub": "pkg.module:attr"}, domain_errors=(MyError,), help=...)
        The top-level group. Subcommands are imported only when they run or when `--help` lists them
        (click's "lazy loading of subcommands"); each attribute is a `click.Command` with the same name.
        `group.run(argv=None) -> int` runs the tool and returns the exit status (use it as `main`);
        `group.main()` does the same and exits (CliRunner and console scripts use it).
        Exit status and stderr, always one line, no traceback for user errors:
          usage error (bad value, missing or unknown option, unknown subcommand), exit 2:
              `<prog> <sub>: error: <message> (see '<prog> <sub> --help')`
          domain error (an instance of `domain_errors`) or CLIError / any ClickException, exit 2:
              `<prog>: error: <message>`
          KeyboardInterrupt: `<prog>: interrupted`, exit 130
          SIGTERM (while `run` is active in the main thread): raised as an exception so that finally
              blocks and context managers run first (workers stopped, no partial output), then
              `<prog>: terminated`, exit 143
          stdout closed by its reader (`| head`): silent, exit 1
          the bare tool name: its help on stdout, exit 0
        A command's return value is the exit status: None -> 0, an int -> that int.
    LazyGroup: the lazy-loading group alone, for nested groups (`tool compare collect`).
    CLIError(message): raise from a command for a one-line `<prog>: error:` exit 2.
    one_line(text) -> str: whitespace folded, for messages built from foreign text.

Parameter types (a bad value is a usage error saying what would be accepted)
    PositiveInt(maximum=2**63-1, what=""), NonNegativeInt(...), BoundedInt(minimum, maximum)
        and the instances POSITIVE_INT, NON_NEGATIVE_INT; `40_960` is accepted; a value of thousands of
        digits is refused without being converted or echoed whole. Numbers take ASCII digits only
        (Arabic-Indic, full-width ... digits are refused by name; ByteSize too, before its parser).
    ByteSize(parse, errors=(ValueError,), metavar="SIZE"): the tool's own size parser as a click type.
    NumberType: the base of every type that reads numbers (the ones above and each tool's own): text with a
        digit other than ASCII 0-9 is refused before its `convert_number` runs; subclasses may not override
        `convert`.
    shorten(value, limit=40) -> str: a value quoted for a message, cut when long.

Output
    output_option(check_early=True, help=...): `-o/--output FILE` (`-` is stdout); the command gets
        `output` (Path or None). With check_early the place is refused at parse time, before long work:
        a directory, a missing parent, a non-regular file, a directory it cannot create files in.
        Under ToolGroup/LazyGroup an `-o` that would destroy an input is refused before the command runs
        (usage error): the file named by any free-text or click.Path parameter (links, `..` and hard links
        resolved), or an existing file inside an input folder (a new file there is allowed).
        Parameters named out* (`--output_path`, `--out`) are destinations, not inputs.
    write_output(path_or_None, text_or_bytes): atomic write (temp file in the same directory, fsync,
        os.replace) or stdout; raises OutputError (a CLIError) with one line, also when the file is one
        of the running command's input files.
    check_output(path_or_None): the early check, for callers that take a path some other way.
    OutputPath(check_early=True): the click type behind output_option.

Formats
    FORMATS = ("text", "json", "md", "html"): the one vocabulary.
    format_option(*choices, default=None, help=None): `--format`, choices a subset of FORMATS (the
        first is the default); the command gets `format`.

Introspection
    walk_commands(group) -> iterator of (path, click.Command): every leaf subcommand, nested groups walked and
        lazy subcommands loaded; `path` is the tuple of names after the tool's (("compare", "diff")). For
        checks that must cover every option of a tool (the number rule's property test).

Readers of argparse parsers
    argparse_mirror(group, prog=None) -> argparse.ArgumentParser: the same subcommands and option strings
        as argparse objects (a description only: nothing converts or runs), for checks written against
        argparse (the skills' command check).

Example
    cli = ToolGroup("kv-capacity", lazy_subcommands={"plan": "kv_capacity.commands:plan"},
                    domain_errors=(KVCapacityError,), help="KV-cache capacity planner")
    def main(argv: list[str] | None = None) -> int:
        return cli.run(argv)
"""

from toolkit_cli._group import CLIError, LazyGroup, ToolGroup, one_line, walk_commands
from toolkit_cli._mirror import argparse_mirror
from toolkit_cli._output import (
    OutputError,
    OutputPath,
    check_output,
    output_option,
    write_output,
    write_probe,
)
from toolkit_cli._types import (
    DEFAULT_INT_MAXIMUM,
    FORMATS,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    BoundedInt,
    ByteSize,
    NonNegativeInt,
    NumberType,
    PositiveInt,
    format_option,
    has_non_ascii_digits,
    shorten,
)

__all__ = [
    "DEFAULT_INT_MAXIMUM",
    "FORMATS",
    "NON_NEGATIVE_INT",
    "POSITIVE_INT",
    "BoundedInt",
    "ByteSize",
    "CLIError",
    "LazyGroup",
    "NonNegativeInt",
    "NumberType",
    "OutputError",
    "OutputPath",
    "PositiveInt",
    "ToolGroup",
    "argparse_mirror",
    "check_output",
    "format_option",
    "has_non_ascii_digits",
    "one_line",
    "output_option",
    "shorten",
    "walk_commands",
    "write_output",
    "write_probe",
]
