"""Parameter types shared by the toolkit's command lines, and the one `--format` vocabulary."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

FORMATS: tuple[str, ...] = ("text", "json", "md", "html")
# Beyond this an integer option is a typo, not a setting; it also keeps every count exact in a float64
# product far from the point where Python's int() refuses long digit strings (4,300 digits).
DEFAULT_INT_MAXIMUM = 2**63 - 1

_INTEGER = re.compile(r"[+-]?[0-9]+")
_F = TypeVar("_F", bound=Callable[..., Any])


def has_non_ascii_digits(text: str) -> bool:
    """Whether `text` holds a digit other than 0-9 (Arabic-Indic, full-width ...).

    The toolkit's one rule for numbers is ASCII digits only: Python's int(), float() and a regex digit
    class take every Unicode digit, vLLM's and msprof-analyze's flags do not, and a digit a reader cannot
    see as one is no setting to act on."""
    return any(ch.isdigit() and not ch.isascii() for ch in text)


def shorten(value: object, limit: int = 40) -> str:
    """`value` quoted for an error message; a long one is cut, with its length said instead."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit - 10]!r}... ({len(text):,} characters)"


class NumberType(click.ParamType):
    """The base of every parameter type that reads a number (or several) from text, in all the toolkit's tools.

    Its `convert` applies the one rule for numbers first: a text value holding a digit other than ASCII 0-9 is
    refused in one line, whatever the subclass would make of it. A subclass implements `convert_number` and
    `expected` (what is accepted, for messages); defining `convert` is refused when the class is made, so no
    number type can skip the rule."""

    name = "number"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "convert" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: a NumberType implements convert_number, not convert")

    @property
    def expected(self) -> str:
        return "a number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and has_non_ascii_digits(value):
            self.fail(f"{shorten(value)} holds non-ASCII digits; expected {self.expected} in ASCII digits 0-9",
                      param, ctx)
        return self.convert_number(value, param, ctx)

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        raise NotImplementedError


class BoundedInt(NumberType):
    """An integer in [minimum, maximum]; underscores between digits are accepted (`40_960`)."""

    name = "integer"

    def __init__(self, minimum: int, maximum: int | None = DEFAULT_INT_MAXIMUM, *, what: str = "") -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.what = what

    @property
    def expected(self) -> str:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            self.minimum, f"an integer of at least {self.minimum:,}"
        )
        if self.maximum is not None:
            kind += f" up to {self.maximum:,}"
        return kind + (f" ({self.what})" if self.what else "")

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip().replace("_", "")
            if not _INTEGER.fullmatch(text):
                self.fail(f"{shorten(value)} is not an integer; expected {self.expected}", param, ctx)
            digits = text.lstrip("+-").lstrip("0")
            limit_digits = max(len(str(abs(self.maximum))) if self.maximum is not None else 0, 30)
            if len(digits) > limit_digits:
                self.fail(f"{shorten(value)} is out of range; expected {self.expected}", param, ctx)
            number = int(text)
        if number < self.minimum or (self.maximum is not None and number > self.maximum):
            self.fail(f"{shorten(value)} is out of range; expected {self.expected}", param, ctx)
        return number

    def __repr__(self) -> str:
        return f"BoundedInt({self.minimum}, {self.maximum})"


class PositiveInt(BoundedInt):
    """An integer >= 1, at most `maximum`."""

    def __init__(self, maximum: int | None = DEFAULT_INT_MAXIMUM, *, what: str = "") -> None:
        super().__init__(1, maximum, what=what)


class NonNegativeInt(BoundedInt):
    """An integer >= 0, at most `maximum`."""

    def __init__(self, maximum: int | None = DEFAULT_INT_MAXIMUM, *, what: str = "") -> None:
        super().__init__(0, maximum, what=what)


POSITIVE_INT = PositiveInt()
NON_NEGATIVE_INT = NonNegativeInt()


class ByteSize(NumberType):
    """A byte size parsed by the tool's own parser (the syntax differs per tool, the error path not).

    A value with a digit other than ASCII 0-9 is refused before the parser sees it (one rule for numbers).

    `parse(text) -> int` raises one of `errors` with a one-line message that says what is accepted; that
    message becomes the usage error.
    """

    name = "size"

    def __init__(
        self,
        parse: Callable[[str], int],
        errors: tuple[type[Exception], ...] = (ValueError,),
        *,
        metavar: str = "SIZE",
    ) -> None:
        self.parse = parse
        self.errors = errors
        self.metavar = metavar

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.metavar

    @property
    def expected(self) -> str:
        return "a size"

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return self.parse(str(value))
        except self.errors as exc:
            self.fail(str(exc), param, ctx)


def format_option(*choices: str, default: str | None = None, help: str | None = None) -> Callable[[_F], _F]:
    """The `--format` option, its choices a subset of text|json|md|html (the first is the default).

    The value reaches the command as the keyword argument `format`.
    """
    if not choices:
        raise ValueError("format_option needs at least one of " + "|".join(FORMATS))
    unknown = [c for c in choices if c not in FORMATS]
    if unknown:
        raise ValueError(f"format_option: {unknown} not in the shared vocabulary {'|'.join(FORMATS)}")
    chosen = default or choices[0]
    if chosen not in choices:
        raise ValueError(f"format_option: default {chosen!r} is not among {choices}")
    return click.option(
        "--format",
        "format",
        type=click.Choice(choices, case_sensitive=False),
        default=chosen,
        show_default=True,
        help=help or "output format",
    )
