"""Split decision, token-balanced slices and per-request metadata (dbo_runtime.ubatch).

Property checks run over random batches drawn from fixed seeds, so a failure reproduces exactly; each
property is also computed the slow way (token by token) and compared.
"""

from __future__ import annotations

import random

import pytest
from dbo_runtime.errors import DBOConfigError, DBOError
from dbo_runtime.ubatch import (
    DEFAULT_DECODE_TOKEN_THRESHOLD,
    DEFAULT_PREFILL_TOKEN_THRESHOLD,
    UBatchSlice,
    is_last_ubatch_empty,
    is_uniform_decode,
    maybe_create_ubatch_slices,
    pad_to_equal,
    pad_ubatch_slices,
    round_up_to_ubatches,
    should_ubatch,
    slice_request_metadata,
    split_ubatches,
    validate_thresholds,
)

SEEDS = range(300)


def random_batch(rng: random.Random) -> tuple[list[int], list[int]]:
    """Scheduled tokens and seq_lens of a random mixed batch: decodes (1 token) and prefill chunks."""
    num_reqs = rng.randint(1, 24)
    tokens = [1 if rng.random() < 0.5 else rng.randint(1, 300) for _ in range(num_reqs)]
    seq_lens = [t + rng.randint(0, 2000) for t in tokens]  # computed-before + scheduled
    if sum(tokens) < 2:
        tokens.append(1)
        seq_lens.append(7)
    return tokens, seq_lens


def owner_of_each_token(tokens: list[int]) -> list[int]:
    return [r for r, n in enumerate(tokens) for _ in range(n)]


def cumulative(tokens: list[int]) -> list[int]:
    out = [0]
    for n in tokens:
        out.append(out[-1] + n)
    return out


# --- the decision ------------------------------------------------------------------------------------------


def test_defaults_are_vllms() -> None:
    assert DEFAULT_DECODE_TOKEN_THRESHOLD == 32
    assert DEFAULT_PREFILL_TOKEN_THRESHOLD == 512


@pytest.mark.parametrize(
    ("num_tokens", "decode_only", "expected"),
    [
        (31, True, False),
        (32, True, True),  # upstream compares with >=, not >
        (33, True, True),
        (511, False, False),
        (512, False, True),
        (513, False, True),
        (100, False, False),  # a prefill-containing batch uses the prefill threshold
        (0, True, False),  # an idle rank votes no
    ],
)
def test_threshold_comparison_matches_upstream(num_tokens: int, decode_only: bool, expected: bool) -> None:
    assert should_ubatch(num_tokens, is_decode_only=decode_only) is expected


def test_custom_thresholds() -> None:
    assert should_ubatch(4, is_decode_only=True, decode_token_threshold=4)
    assert not should_ubatch(3, is_decode_only=True, decode_token_threshold=4)
    assert should_ubatch(2, is_decode_only=False, prefill_token_threshold=2)
    assert not should_ubatch(1000, is_decode_only=False, prefill_token_threshold=1001)


@pytest.mark.parametrize("bad", [-1, 0, 1, 2.5, "32", None, True])
@pytest.mark.parametrize("which", ["decode_token_threshold", "prefill_token_threshold"])
def test_invalid_thresholds_name_the_accepted_range(which: str, bad: object) -> None:
    with pytest.raises(DBOConfigError) as info:
        should_ubatch(100, is_decode_only=True, **{which: bad})
    message = str(info.value)
    assert f"dbo_{which}={bad!r}" in message
    assert "integer >= 2" in message


def test_threshold_equal_to_num_ubatches_is_accepted() -> None:
    assert validate_thresholds(2, 2) == (2, 2)


@pytest.mark.parametrize("n", [1, 3, 4, 0, True])
def test_only_two_ubatches_supported(n: object) -> None:
    with pytest.raises(DBOConfigError, match="supports only 2 micro-batches"):
        should_ubatch(1000, is_decode_only=False, num_ubatches=n)  # type: ignore[arg-type]
    with pytest.raises(DBOConfigError, match="supports only 2 micro-batches"):
        split_ubatches([10, 10], num_ubatches=n)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.0, None])
def test_invalid_num_tokens(bad: object) -> None:
    with pytest.raises(DBOConfigError, match="num_tokens"):
        should_ubatch(bad, is_decode_only=True)  # type: ignore[arg-type]


def test_errors_share_the_package_base() -> None:
    with pytest.raises(DBOError):
        validate_thresholds(1, 512)
    with pytest.raises(ValueError):  # also a ValueError for generic validators
        validate_thresholds(32, -5)


def test_is_last_ubatch_empty() -> None:
    # padded 10 -> cut at 5; 5 real tokens leave nothing for the second micro-batch
    assert is_last_ubatch_empty(5, 10, 2)
    assert not is_last_ubatch_empty(6, 10, 2)
    assert not is_last_ubatch_empty(2, 2, 2)
    # one token: the cut is at 0, so it is the FIRST half that is empty; upstream's check does not see that
    # (its thresholds keep such batches out), split_ubatches refuses it on its own
    assert not is_last_ubatch_empty(1, 1, 2)
    with pytest.raises(DBOConfigError, match="cannot be split"):
        split_ubatches([1])


# --- the split ---------------------------------------------------------------------------------------------


def test_straddling_request_appears_in_both_slices() -> None:
    first, second = split_ubatches([5, 3, 4])  # 12 tokens, cut at 6: request 1 holds tokens 5..7
    assert first == UBatchSlice(slice(0, 2), slice(0, 6))
    assert second == UBatchSlice(slice(1, 3), slice(6, 12))
    assert (first.num_tokens, second.num_tokens) == (6, 6)
    assert (first.num_requests, second.num_requests) == (2, 2)


def test_cut_on_a_request_boundary_shares_no_request() -> None:
    first, second = split_ubatches([3, 3, 2, 4])  # cut at 6 = start of request 2
    assert first.request_slice == slice(0, 2)
    assert second.request_slice == slice(2, 4)


def test_single_request_prefill_is_split_in_the_middle() -> None:
    first, second = split_ubatches([1001])
    assert first == UBatchSlice(slice(0, 1), slice(0, 500))
    assert second == UBatchSlice(slice(0, 1), slice(500, 1001))


@pytest.mark.parametrize("tokens", [[1], [0, 5], [3, -1], [2.0, 2]])
def test_unsplittable_or_invalid_batches(tokens: list) -> None:
    with pytest.raises(DBOConfigError):
        split_ubatches(tokens)


def test_padded_count_moves_the_cut_and_can_empty_the_second_half() -> None:
    first, second = split_ubatches([4, 4], num_tokens_padded=12)  # DP padding to 12: cut at 6
    assert (first.token_slice, second.token_slice) == (slice(0, 6), slice(6, 8))
    with pytest.raises(DBOConfigError, match="cannot be split"):
        split_ubatches([4, 4], num_tokens_padded=16)  # cut at 8 = every real token in the first half
    with pytest.raises(DBOConfigError, match="num_tokens_padded"):
        split_ubatches([4, 4], num_tokens_padded=7)


@pytest.mark.parametrize("seed", SEEDS)
def test_slices_cover_every_token_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    tokens, _ = random_batch(rng)
    total = sum(tokens)
    padded = total if rng.random() < 0.5 else total + rng.randint(0, total - 1 if total > 2 else 0)
    slices = split_ubatches(tokens, num_tokens_padded=padded)
    assert len(slices) == 2
    covered = [t for s in slices for t in range(s.token_slice.start, s.token_slice.stop)]
    assert covered == list(range(total))
    assert slices[0].num_tokens == padded // 2
    if padded == total:
        assert abs(slices[0].num_tokens - slices[1].num_tokens) <= 1
    owner = owner_of_each_token(tokens)
    for s in slices:
        touched = sorted({owner[t] for t in range(s.token_slice.start, s.token_slice.stop)})
        assert list(range(s.request_slice.start, s.request_slice.stop)) == touched
    # at most one request straddles the cut, and it is the last of the first / first of the second
    shared = set(range(slices[0].request_slice.start, slices[0].request_slice.stop)) & set(
        range(slices[1].request_slice.start, slices[1].request_slice.stop)
    )
    cut = slices[0].token_slice.stop
    assert shared == ({owner[cut]} if owner[cut] == owner[cut - 1] else set())


@pytest.mark.parametrize("seed", SEEDS)
def test_straddling_request_metadata_is_consistent(seed: int) -> None:
    rng = random.Random(10_000 + seed)
    tokens, seq_lens = random_batch(rng)
    qsl = cumulative(tokens)
    owner = owner_of_each_token(tokens)
    slices = split_ubatches(tokens)
    per_request_query = [0] * len(tokens)
    for s in slices:
        ub_qsl, ub_lens = slice_request_metadata(qsl, seq_lens, s)
        requests = list(range(s.request_slice.start, s.request_slice.stop))
        assert ub_qsl[0] == 0 and ub_qsl[-1] == s.num_tokens
        assert len(ub_qsl) == len(requests) + 1 and len(ub_lens) == len(requests)
        for i, r in enumerate(requests):
            mine = [t for t in range(s.token_slice.start, s.token_slice.stop) if owner[t] == r]
            assert ub_qsl[i + 1] - ub_qsl[i] == len(mine) >= 1
            later = sum(1 for t in range(s.token_slice.stop, len(owner)) if owner[t] == r)
            # context seen at this micro-batch's last token of r: everything but r's tokens after the cut
            assert ub_lens[i] == seq_lens[r] - later
            assert ub_lens[i] >= ub_qsl[i + 1] - ub_qsl[i]  # a query never exceeds its context
            per_request_query[r] += len(mine)
    assert per_request_query == tokens


def test_metadata_of_a_known_straddle() -> None:
    qsl, seq_lens = [0, 5, 8, 12], [10, 3, 20]
    first, second = split_ubatches([5, 3, 4])
    # request 1 (3 new tokens, no history) is cut after its first token
    assert slice_request_metadata(qsl, seq_lens, first) == ([0, 5, 6], [10, 1])
    assert slice_request_metadata(qsl, seq_lens, second) == ([0, 2, 6], [3, 20])


def test_metadata_inputs_are_not_modified() -> None:
    qsl, seq_lens = [0, 5, 8, 12], [10, 3, 20]
    for s in split_ubatches([5, 3, 4]):
        slice_request_metadata(qsl, seq_lens, s)
    assert (qsl, seq_lens) == ([0, 5, 8, 12], [10, 3, 20])


def test_metadata_rejects_mismatched_inputs() -> None:
    s = split_ubatches([5, 3, 4])[0]
    with pytest.raises(DBOConfigError, match="query_start_loc"):
        slice_request_metadata([0, 5, 8], [10, 3, 20], s)
    with pytest.raises(DBOConfigError, match="query_start_loc"):
        slice_request_metadata([0, 5, 4, 12], [10, 3, 20], s)
    with pytest.raises(DBOConfigError, match="outside its first request"):
        slice_request_metadata([0, 5, 8, 12], [10, 3, 20], UBatchSlice(slice(1, 3), slice(2, 12)))
    with pytest.raises(DBOConfigError, match="empty or outside"):
        slice_request_metadata([0, 5, 8, 12], [10, 3, 20], UBatchSlice(slice(2, 4), slice(8, 12)))


def test_padded_last_slice_leaves_metadata_unchanged() -> None:
    tokens, seq_lens = [5, 3], [9, 3]
    slices = split_ubatches(tokens, num_tokens_padded=10)  # cut at 5
    padded = pad_ubatch_slices(slices, num_tokens_padded=10)
    assert padded[1].token_slice == slice(5, 10)
    assert slice_request_metadata([0, 5, 8], seq_lens, padded[1]) == ([0, 3], [3])


# --- padding -----------------------------------------------------------------------------------------------


def test_round_up_to_ubatches() -> None:
    assert [round_up_to_ubatches(n) for n in (0, 1, 2, 7, 8)] == [0, 2, 2, 8, 8]


@pytest.mark.parametrize("seed", SEEDS)
def test_pad_to_equal_gives_equal_halves(seed: int) -> None:
    rng = random.Random(20_000 + seed)
    tokens, _ = random_batch(rng)
    target = round_up_to_ubatches(sum(tokens))
    slices = pad_to_equal(split_ubatches(tokens, num_tokens_padded=target), num_reqs_padded=len(tokens) + 1)
    assert [s.num_tokens for s in slices] == [target // 2, target // 2]
    assert slices[-1].token_slice.stop == target
    assert slices[-1].request_slice.stop == len(tokens) + 1
    assert slices[0].token_slice.stop == slices[1].token_slice.start


def test_pad_to_equal_refuses_a_cut_it_cannot_even_out() -> None:
    odd_cut = split_ubatches([7])  # 3 + 4: padding at the end can only grow the second
    with pytest.raises(DBOConfigError, match="equal parts"):
        pad_to_equal(odd_cut)
    with pytest.raises(DBOConfigError, match="equal parts"):
        pad_to_equal(split_ubatches([7], num_tokens_padded=8), num_tokens_padded=10)


def test_pad_ubatch_slices_rejects_shrinking() -> None:
    slices = split_ubatches([6, 6])
    with pytest.raises(DBOConfigError, match="num_tokens_padded"):
        pad_ubatch_slices(slices, num_tokens_padded=11)
    with pytest.raises(DBOConfigError, match="num_reqs_padded"):
        pad_ubatch_slices(slices, num_tokens_padded=12, num_reqs_padded=1)


# --- batch classification and the upstream-shaped entry point ----------------------------------------------


def test_is_uniform_decode_like_vllm() -> None:
    assert is_uniform_decode([1, 1, 1])
    assert not is_uniform_decode([1, 1, 2])  # a 2-token request makes it a mixed batch
    assert is_uniform_decode([3, 3], uniform_decode_query_len=3)  # 2 speculative tokens per request
    assert not is_uniform_decode([3, 2], uniform_decode_query_len=3)
    assert not is_uniform_decode([])
    with pytest.raises(DBOConfigError, match="uniform_decode_query_len"):
        is_uniform_decode([1], uniform_decode_query_len=0)


def test_decode_batch_uses_the_decode_threshold_end_to_end() -> None:
    decodes = [1] * 40
    assert should_ubatch(sum(decodes), is_decode_only=is_uniform_decode(decodes))
    mixed = [1] * 39 + [2]
    assert not should_ubatch(sum(mixed), is_decode_only=is_uniform_decode(mixed))


def test_maybe_create_ubatch_slices() -> None:
    assert maybe_create_ubatch_slices(False, [5, 3, 4]) == (None, None)
    slices, padded = maybe_create_ubatch_slices(True, [5, 3, 4], num_tokens_padded=14, num_reqs_padded=4)
    assert slices == [UBatchSlice(slice(0, 2), slice(0, 7)), UBatchSlice(slice(1, 3), slice(7, 12))]
    assert padded == [UBatchSlice(slice(0, 2), slice(0, 7)), UBatchSlice(slice(1, 4), slice(7, 14))]
    assert [s.num_tokens for s in padded] == [7, 7]
