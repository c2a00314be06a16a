"""parse_size: vLLM's human_readable_int semantics plus explicit units."""

from __future__ import annotations

import pytest
from kv_capacity import KVCapacityInputError, parse_size
from kv_capacity.sizes import format_gib, format_size, to_vllm_flag_value


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8589934592", 8 * 2**30),
        ("8G", 8 * 2**30),  # binary suffix: GiB
        ("8g", 8 * 10**9),  # decimal suffix
        ("8.5g", 8_500_000_000),
        ("2816M", 2816 * 2**20),
        ("4G", 4 * 2**30),
        ("1T", 2**40),
        ("512k", 512_000),
        ("512K", 512 * 1024),
        (" 8G ", 8 * 2**30),
        ("8GiB", 8 * 2**30),
        ("8Gi", 8 * 2**30),
        ("8gib", 8 * 2**30),
        ("8GB", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1024B", 1024),
    ],
)
def test_accepted(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "G", "8.5G", "-8G", "0", "0G", "8X", "8 G", "eight", "1e9", "8GiBs", "0.1B", "-1"]
)
def test_rejected_with_what_is_accepted(text):
    with pytest.raises(KVCapacityInputError) as info:
        parse_size(text)
    message = str(info.value)
    assert "\n" not in message
    assert repr(text) in message
    assert "8GiB" in message  # names the accepted forms


def test_binary_decimal_hint():
    with pytest.raises(KVCapacityInputError, match="did you mean 8.5g"):
        parse_size("8.5G")


def test_formatting():
    assert format_gib(16 * 2**30) == "16.0"
    assert format_gib(6_039_797_760) == "5.62"
    assert format_size(8 * 2**30) == "8 GiB"
    assert format_size(1000) == "1,000 B"
    assert to_vllm_flag_value(8 * 2**30) == "8G"
    assert to_vllm_flag_value(2816 * 2**20) == "2816M"
    assert to_vllm_flag_value(1001) == "1001"
    for value in (8 * 2**30, 2816 * 2**20, 123456789, 3 * 2**10):
        assert parse_size(to_vllm_flag_value(value)) == value
