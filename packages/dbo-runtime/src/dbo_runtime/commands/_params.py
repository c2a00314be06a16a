"""Parameter types of dbo-runtime's commands (beside toolkit_cli's): bounded numbers, seconds, places to write."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

import click
from toolkit_cli import NumberType, shorten, write_probe

__all__ = ["BoundedFloat", "Seconds", "WritableDir", "dir_problem", "SECONDS"]


class BoundedFloat(NumberType):
    """A number in [minimum, maximum] (either end may be open: `above` instead of `minimum`); NaN never,
    infinity only when `allow_inf` (and then only +inf)."""

    name = "number"

    def __init__(self, minimum: float | None = None, maximum: float | None = None, *, above: float | None = None,
                 allow_inf: bool = False, what: str = "") -> None:
        self.minimum, self.maximum, self.above, self.allow_inf, self.what = minimum, maximum, above, allow_inf, what

    @property
    def expected(self) -> str:
        if self.above is not None:
            text = f"a number > {self.above:g}"
        elif self.minimum is not None:
            text = f"a number >= {self.minimum:g}"
        else:
            text = "a number"
        if self.maximum is not None:
            text += f" and <= {self.maximum:g}"
        if self.allow_inf:
            text += " (or inf)"
        return text + (f" ({self.what})" if self.what else "")

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float | int) and not isinstance(value, bool):
            number = float(value)
        else:
            text = str(value).strip()
            try:
                number = float(text) if len(text) <= 60 else math.nan
            except ValueError:
                self.fail(f"{shorten(value)} is not a number; expected {self.expected}", param, ctx)
        ok = not math.isnan(number) and (number != math.inf or self.allow_inf) and number != -math.inf
        if ok and math.isfinite(number):
            ok = ((self.above is None or number > self.above) and (self.minimum is None or number >= self.minimum)
                  and (self.maximum is None or number <= self.maximum))
        if not ok:
            self.fail(f"{shorten(value)} is out of range; expected {self.expected}", param, ctx)
        return number


class Seconds(BoundedFloat):
    """A positive, finite number of seconds below a bound (a week)."""

    name = "seconds"

    def __init__(self, maximum: float = 7 * 24 * 3600.0) -> None:
        super().__init__(above=0.0, maximum=maximum, what="seconds")


SECONDS = Seconds()


def dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot become (or be) a directory that files are written into, as one line; None when it can.

    An existing directory must accept a scratch file; a missing one needs its nearest existing ancestor to be a
    directory that accepts one (nothing is created here: the command creates the directory when it writes).
    """
    text = os.fspath(path)
    if not text:
        return "the directory is empty; expected a directory path"
    shown = shorten(text, 80)
    probe = Path(text)
    missing = False
    while True:
        try:
            info = probe.stat()
        except FileNotFoundError:
            missing = True
            if probe.parent == probe:
                return f"{shown}: no existing ancestor directory"
            probe = probe.parent
            continue
        except OSError as exc:
            return f"{shown} cannot be examined: {exc.strerror}"
        break
    if not stat.S_ISDIR(info.st_mode):
        where = "is a file" if probe == Path(text) else f"has {shorten(str(probe), 80)}, not a directory, on its way"
        return f"{shown} {where}; expected a directory (created if missing)"
    error = write_probe(probe)
    if error is not None:
        return f"cannot write in {shorten(str(probe), 80)}{' (to create ' + shown + ')' if missing else ''}: {error}"
    return None


class WritableDir(click.ParamType):
    """A directory to write files into, created when missing; refused at parse time when it cannot be written."""

    name = "directory"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "DIR"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        if isinstance(value, Path):
            value = os.fspath(value)
        problem = dir_problem(str(value))
        if problem:
            self.fail(problem, param, ctx)
        return Path(str(value))
