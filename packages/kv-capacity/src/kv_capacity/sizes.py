"""Byte sizes: parse what vLLM's `--kv-cache-memory-bytes` accepts (plus explicit units) and format them.

vLLM parses the flag with `human_readable_int` (vllm/utils/argparse_utils.py):
  * a plain integer: bytes;
  * a number with one of `k m g t` (decimal, 10**3 ...), decimals allowed, e.g. `8g`, `8.5g`;
  * an integer with one of `K M G T` (binary, 2**10 ...), decimals rejected, e.g. `8G`, `2816M`.
This module accepts exactly those, and in addition the explicit unit forms `8GiB`/`8Gi` (binary) and
`8GB` (decimal), `512MiB`, `1024B` ..., which vLLM itself rejects.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kv_capacity.errors import KVCapacityInputError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_VLLM_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_VLLM_BINARY = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}
_UNIT_MULTIPLIER = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "ki": KiB,
    "mi": MiB,
    "gi": GiB,
    "ti": TiB,
}

# A budget is a per-device byte count: vLLM keeps it in a C int64 (torch sizes), so 2**63 bytes and more
# is no setting anyone has, only a typo; refusing it also keeps every product below exact in an int.
MAX_SIZE_BYTES = 2**63 - 1
# Longer digit strings are refused before any conversion (Python's int() refuses > 4,300 digits anyway).
_MAX_DIGITS = 40

ACCEPTED_SIZES = (
    "a positive byte count below 2^63 such as 8589934592, 8G or 2816M (binary, integers only), 8g or 8.5g "
    "(decimal), or 8GiB / 8Gi / 512MiB (binary) / 8GB (decimal)"
)


def _shown(text: str, limit: int = 40) -> str:
    """The input quoted for a message; a long one is cut and its length said instead of echoing it all."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit - 10]!r}... ({len(text):,} characters)"

_VLLM_FORM = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT])")
_UNIT_FORM = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT](?:[iI]?[bB]|[iI])|[bB])")


def parse_size(text: str) -> int:
    """Parse a byte size the way vLLM's `--kv-cache-memory-bytes` does, plus explicit units.

    Returns a positive number of bytes. Raises KVCapacityInputError (one line, naming the input and the
    accepted forms) for anything else, including zero and negative sizes (vLLM treats 0 as "unset" and
    a negative budget fails later with "No available memory for the cache blocks").
    """
    if not isinstance(text, str):
        raise KVCapacityInputError(f"size {_shown(repr(text))} is not text; expected {ACCEPTED_SIZES}")
    value = text.strip()
    shown = _shown(text)
    result: int | None = None
    # One rule for every number of the toolkit: ASCII digits only (Python's int(), float() and a regex
    # digit class also take Arabic-Indic, full-width ... digits, which no other tool reading these flags does).
    if any(ch.isdigit() and not ch.isascii() for ch in value):
        raise KVCapacityInputError(
            f"size {shown} holds non-ASCII digits; expected ASCII digits 0-9 in {ACCEPTED_SIZES}"
        )
    digits = len(re.sub(r"[^0-9]", "", value))
    if digits > _MAX_DIGITS:
        raise KVCapacityInputError(
            f"size {shown} has {digits:,} digits; expected {ACCEPTED_SIZES}"
        )

    match = _VLLM_FORM.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _VLLM_DECIMAL:
            # Same float arithmetic as vLLM, so e.g. 8.5g gives vLLM's exact integer.
            product = float(number) * _VLLM_DECIMAL[suffix]
            result = int(product) if product < 2.0**64 else MAX_SIZE_BYTES + 1
        elif "." in number:
            raise KVCapacityInputError(
                f"size {shown}: decimals are not allowed with binary suffixes like {suffix} "
                f"(vLLM rejects them too); did you mean {number}{suffix.lower()}? Accepted: {ACCEPTED_SIZES}"
            )
        else:
            result = int(number) * _VLLM_BINARY[suffix]
    elif re.fullmatch(r"[0-9]+", value):
        result = int(value)
    else:
        match = _UNIT_FORM.fullmatch(value)
        if match:
            number, unit = match.groups()
            exact = Fraction(number) * _UNIT_MULTIPLIER[unit.lower()]
            if exact.denominator != 1:
                raise KVCapacityInputError(
                    f"size {shown} is not a whole number of bytes; expected {ACCEPTED_SIZES}"
                )
            result = int(exact)

    if result is None:
        raise KVCapacityInputError(f"size {shown} is not understood; expected {ACCEPTED_SIZES}")
    if result <= 0:
        raise KVCapacityInputError(f"size {shown} must be positive; expected {ACCEPTED_SIZES}")
    if result > MAX_SIZE_BYTES:
        raise KVCapacityInputError(
            f"size {shown} is {format_size(result)}, 2^63 bytes or more; expected {ACCEPTED_SIZES}"
        )
    return result


def format_gib(num_bytes: int) -> str:
    """GiB with two decimals at most, exactly as vLLM's `format_gib` (vllm/utils/mem_utils.py)."""
    return f"{round(num_bytes / GiB, 2)}"


def format_size(num_bytes: int) -> str:
    """A readable binary size, e.g. `8 GiB`, `5.62 GiB`, `512 MiB`, `1,024 B`."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(num_bytes) >= factor:
            value = num_bytes / factor
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{num_bytes:,} B"


def to_vllm_flag_value(num_bytes: int) -> str:
    """The shortest spelling vLLM's parser accepts for exactly this many bytes (e.g. `8G`, `2816M`)."""
    for suffix, factor in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if num_bytes % factor == 0:
            return f"{num_bytes // factor}{suffix}"
    return str(num_bytes)
