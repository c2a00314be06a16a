"""Numeric parameter types of profile-analyzer's command line.

click.FloatRange takes whatever float() takes, so ``nan`` passed every range check (a comparison with NaN is
false either way) and ``inf`` passed an open upper bound; both then failed deep in the model as a ValueError.
FiniteFloat takes a finite decimal in ASCII digits only (the toolkit's one rule for numbers) and says the
accepted range in its one-line refusal. The quoting and the ASCII-digit rule are toolkit_cli's.
"""

from __future__ import annotations

import math
import re
from typing import Any

import click
from toolkit_cli import NumberType, shorten

# decimal or scientific notation, ASCII digits, underscores between digits (as BoundedInt takes `40_960`)
_DECIMAL = re.compile(r"[+-]?(?:[0-9](?:_?[0-9])*(?:\.(?:[0-9](?:_?[0-9])*)?)?|\.[0-9](?:_?[0-9])*)"
                      r"(?:[eE][+-]?[0-9]+)?", re.ASCII)


def _bound(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"


class FiniteFloat(NumberType):
    """A finite number in [minimum, maximum] (``min_open``: above minimum); NaN and infinities are refused."""

    name = "float"

    def __init__(self, minimum: float, maximum: float, *, min_open: bool = False, what: str = "") -> None:
        if not (math.isfinite(minimum) and math.isfinite(maximum) and minimum <= maximum):
            raise ValueError(f"bad range [{minimum}, {maximum}]")
        self.minimum = float(minimum)
        self.maximum = float(maximum)
        self.min_open = min_open
        self.what = what

    @property
    def expected(self) -> str:
        low = f"above {_bound(self.minimum)}" if self.min_open else f"from {_bound(self.minimum)}"
        text = f"a finite number {low} up to {_bound(self.maximum)}"
        return text + (f" ({self.what})" if self.what else "")

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        else:
            text = str(value).strip()
            if len(text) > 400 or not _DECIMAL.fullmatch(text):
                self.fail(f"{shorten(value)} is not a finite number; expected {self.expected}", param, ctx)
            number = float(text.replace("_", ""))
        if not math.isfinite(number):
            self.fail(f"{shorten(value)} is not a finite number; expected {self.expected}", param, ctx)
        low_ok = number > self.minimum if self.min_open else number >= self.minimum
        if not (low_ok and number <= self.maximum):
            self.fail(f"{shorten(value)} is out of range; expected {self.expected}", param, ctx)
        return number

    def __repr__(self) -> str:
        return f"FiniteFloat({self.minimum}, {self.maximum}, min_open={self.min_open})"


class LayerList(NumberType):
    """Comma-separated layer indices (``3,7``; empty: none), each from 0 to ``maximum``."""

    name = "layers"

    def __init__(self, maximum: int = 100_000) -> None:
        self.maximum = maximum

    @property
    def expected(self) -> str:
        return f"comma-separated layer indices from 0 to {self.maximum:,} like 3,7"

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [x.strip() for x in str(value).split(",") if x.strip()]
        if not all(re.fullmatch(r"[0-9]{1,7}", x, re.ASCII) for x in parts):
            self.fail(f"{shorten(value)} is not a list of layer indices; expected {self.expected}", param, ctx)
        layers = tuple(int(x) for x in parts)
        if any(layer > self.maximum for layer in layers):
            self.fail(f"{shorten(value)} is out of range; expected {self.expected}", param, ctx)
        return layers


__all__ = ["FiniteFloat", "LayerList"]
