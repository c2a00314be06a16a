"""What vLLM prints, read: the KV capacity line, the start-up error, and the verification child's marker lines.

vLLM >= 0.27 logs its capacity in one line, older versions in two:

    CPU KV cache size: 32,768 tokens, Maximum concurrency for 2,048 tokens per request: 16.00x
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MARKER = "KVCAP_VERIFY"  # the child's own lines: "KVCAP_VERIFY <kind> <json>"

# vLLM >= 0.27 logs one line; older versions two.
_CAPACITY_ONE_LINE = re.compile(
    r"(?P<device>[A-Za-z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, "
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
_CAPACITY_TOKENS = re.compile(r"(?P<device>[A-Za-z]+) KV cache size: (?P<tokens>[\d,]+) tokens")
_CAPACITY_CONCURRENCY = re.compile(
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
_VALUE_ERROR = re.compile(r"ValueError: (?P<msg>.+?)\s*$")


@dataclass
class ReportedCapacity:
    """What vLLM's capacity log line says."""

    device: str
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency_text: str  # as printed, two decimals

    @property
    def max_concurrency(self) -> float:
        return float(self.max_concurrency_text)


def parse_capacity(lines: list[str]) -> ReportedCapacity | None:
    """The capacity vLLM reports in these log lines, or None when it has not logged it (yet)."""
    tokens_match = None
    for line in lines:
        match = _CAPACITY_ONE_LINE.search(line)
        if match:
            return ReportedCapacity(
                match["device"], int(match["tokens"].replace(",", "")), int(match["len"].replace(",", "")), match["conc"]
            )
        tokens_match = _CAPACITY_TOKENS.search(line) or tokens_match
        conc_match = _CAPACITY_CONCURRENCY.search(line)
        if tokens_match and conc_match:
            return ReportedCapacity(
                tokens_match["device"],
                int(tokens_match["tokens"].replace(",", "")),
                int(conc_match["len"].replace(",", "")),
                conc_match["conc"],
            )
    return None


def parse_startup_error(lines: list[str]) -> str | None:
    """vLLM's start-up ValueError text (the KV cache check's, if present), else None."""
    found = None
    for line in lines:
        match = _VALUE_ERROR.search(line)
        if match:
            message = match["msg"]
            if "KV cache" in message or "cache blocks" in message:
                return message
            found = found or message
    return found


def markers(lines: list[str]) -> dict[str, Any]:
    """The child's marker lines by kind: their JSON payload, or True when they carry none."""
    out: dict[str, Any] = {}
    prefix = MARKER + " "
    for line in lines:
        if line.startswith(prefix):
            kind, _, payload = line[len(prefix):].partition(" ")
            try:
                out[kind] = json.loads(payload) if payload else True
            except json.JSONDecodeError:
                out[kind] = payload
    return out



__all__ = ["MARKER", "ReportedCapacity", "markers", "parse_capacity", "parse_startup_error"]
