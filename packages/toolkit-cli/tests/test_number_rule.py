"""One rule for every number option of every tool (issue 29): ASCII digits 0-9 only, NaN never.

The options are found, not listed: every parameter of every subcommand of the three tools whose type reads a
number (it takes one of a few ASCII number spellings and refuses plain words). For each, hypothesis writes an
accepted spelling with some of its digits in another script (Arabic-Indic, full-width, Devanagari, ...): the
type refuses it naming ASCII digits, and the tool prints one line and exits 2 without running anything. The same
spellings with a number swapped for NaN or an infinity are refused in one line, or give no NaN (and no -inf).
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolkit_cli import ToolGroup, walk_commands

TOOLS = {
    "kv-capacity": "kv_capacity.cli:cli",
    "profile-analyzer": "profile_analyzer.cli:cli",
    "dbo-runtime": "dbo_runtime.cli:cli",
}
# ASCII spellings a number option may take: a count, a fraction, a size, a pair, a list
PROBES = ("8", "1", "3", "0", "0.5", "4096", "8G", "20,1", "1,3")
WORDS = ("zz", "abc")  # a type that takes these reads text (a name, a path), not a number
DIGIT_ZEROS = (0x0660, 0x06F0, 0x0966, 0x09E6, 0x0E50, 0xFF10, 0x1D7CE, 0x104A0)  # each block's digit zero
SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹"
HOSTILE_FLOATS = ("nan", "NaN", "-nan", "+nan", "inf", "-inf", "Infinity", "-Infinity", "1e400", "-1e400")

RULE = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _group(target: str) -> ToolGroup:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _takes(param: click.Parameter, command: click.Command, value: str) -> bool:
    try:
        param.type.convert(value, param, click.Context(command))
    except click.BadParameter:
        return False
    return True


def _number_params() -> list[tuple[str, tuple[str, ...], str, tuple[str, ...]]]:
    """(tool, command path, parameter name, the probes it takes) for every number-reading parameter."""
    found = []
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:  # a directory type may probe that it can write where it is
        os.chdir(scratch)
        try:
            for tool, target in TOOLS.items():
                for path, command in walk_commands(_group(target)):
                    for param in command.params:
                        if getattr(param, "is_flag", False) or getattr(param, "count", False):
                            continue
                        if isinstance(param.type, click.Choice) or any(_takes(param, command, w) for w in WORDS):
                            continue
                        taken = tuple(p for p in PROBES if _takes(param, command, p))
                        if taken:
                            found.append((tool, path, param.name, taken))
        finally:
            os.chdir(here)
    return found


NUMBER_PARAMS = _number_params()


def _lookup(tool: str, path: tuple[str, ...], name: str) -> tuple[ToolGroup, click.Command, click.Parameter]:
    group = _group(TOOLS[tool])
    command = dict(walk_commands(group))[path]
    return group, command, next(p for p in command.params if p.name == name)


def _argv(path: tuple[str, ...], command: click.Command, param: click.Parameter, value: str) -> list[str]:
    if isinstance(param, click.Option):
        return [*path, max(param.opts, key=len), value]
    before = [p for p in command.params[: command.params.index(param)] if isinstance(p, click.Argument)]
    return [*path, *["x"] * len(before), value]


def test_the_number_options_are_found():
    names = {(tool, " ".join(path), name) for tool, path, name, _ in NUMBER_PARAMS}
    for expected in [("kv-capacity", "plan", "kv_cache_memory_bytes"), ("kv-capacity", "verify", "timeout"),
                     ("dbo-runtime", "estimate", "tflops"), ("dbo-runtime", "reference", "link"),
                     ("dbo-runtime", "compare diff", "min_identical"), ("profile-analyzer", "synth", "exposed_layers"),
                     ("profile-analyzer", "whatif", "switch_us"), ("profile-analyzer", "report", "rank")]:
        assert expected in names
    assert len(NUMBER_PARAMS) > 60


def _non_ascii(probe: str, zero: int, mask: list[bool]) -> str:
    digits = [i for i, ch in enumerate(probe) if ch.isdigit()]
    chosen = [i for i, keep in zip(digits, mask, strict=False) if keep] or digits[:1]
    out = list(probe)
    for i in chosen:
        out[i] = SUPERSCRIPTS[int(probe[i])] if zero == 0 else chr(zero + int(probe[i]))
    return "".join(out)


@pytest.mark.parametrize("tool,path,name,probes", NUMBER_PARAMS,
                         ids=[f"{t} {' '.join(p)} {n}" for t, p, n, _ in NUMBER_PARAMS])
@RULE
@given(data=st.data())
def test_a_number_in_non_ascii_digits_is_refused_in_one_line(capsys, tool, path, name, probes, data):
    probe = data.draw(st.sampled_from(probes))
    zero = data.draw(st.sampled_from((0, *DIGIT_ZEROS)))
    value = _non_ascii(probe, zero, data.draw(st.lists(st.booleans(), min_size=4, max_size=4)))
    group, command, param = _lookup(tool, path, name)
    with pytest.raises(click.BadParameter) as refused:  # refused by the type: the command never runs
        param.type.convert(value, param, click.Context(command))
    assert "ASCII digits" in refused.value.format_message()
    capsys.readouterr()
    status = group.run(_argv(path, command, param, value))
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1 and "ASCII digits" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("tool,path,name,probes", NUMBER_PARAMS,
                         ids=[f"{t} {' '.join(p)} {n}" for t, p, n, _ in NUMBER_PARAMS])
@RULE
@given(data=st.data())
def test_nan_and_infinities_are_refused_in_one_line_or_give_no_nan(tool, path, name, probes, data):
    probe = data.draw(st.sampled_from(probes))
    parts = probe.split(",")
    where = data.draw(st.integers(0, len(parts) - 1))
    parts[where] = data.draw(st.sampled_from(HOSTILE_FLOATS))
    if probe.endswith("G"):
        parts[where] += data.draw(st.sampled_from(["", "G", "GiB"]))
    value = ",".join(parts)
    _, command, param = _lookup(tool, path, name)
    try:
        converted = param.type.convert(value, param, click.Context(command))
    except click.BadParameter as exc:
        assert "\n" not in exc.format_message()
        return
    values = converted if isinstance(converted, tuple | list) else [converted]
    for v in values:
        if isinstance(v, float):
            assert not math.isnan(v) and v != -math.inf, (value, v)
        else:
            assert "nan" not in str(v).lower() and "-inf" not in str(v).lower(), (value, v)
