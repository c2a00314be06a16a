"""Whether a batch is split into micro-batches, where, and how per-request metadata follows the cut.

Pure functions on plain integers; no torch, no torch.distributed. The rules are vLLM's
(``vllm/config/parallel.py`` ``ParallelConfig`` and ``vllm/v1/worker/ubatch_utils.py``):

- A decode-only batch (every request schedules the same single-step query, ``uniform_decode`` upstream) is split
  when it has at least ``dbo_decode_token_threshold`` tokens (default 32); any batch with a prefill in it when it
  has at least ``dbo_prefill_token_threshold`` tokens (default 512). Upstream's comparison is ``>=`` even though
  its option help text says "greater than"; we follow the code.
- A threshold below the number of micro-batches is rejected: such a batch could not give every micro-batch a
  token.
- The cut is by tokens, at ``num_tokens_padded // num_ubatches``, so a request may straddle it. The straddling
  request appears in both slices: the first part is an ordinary chunk, the second continues it like a chunked
  prefill (it runs after the first, whose KV it can then read).
- Only two micro-batches are supported (``--enable-dbo`` means exactly two upstream).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dbo_runtime.errors import DBOConfigError

__all__ = [
    "DEFAULT_DECODE_TOKEN_THRESHOLD",
    "DEFAULT_PREFILL_TOKEN_THRESHOLD",
    "SUPPORTED_NUM_UBATCHES",
    "UBatchSlice",
    "is_last_ubatch_empty",
    "is_uniform_decode",
    "maybe_create_ubatch_slices",
    "pad_to_equal",
    "pad_ubatch_slices",
    "round_up_to_ubatches",
    "should_ubatch",
    "slice_request_metadata",
    "split_ubatches",
    "validate_num_ubatches",
    "validate_thresholds",
]

DEFAULT_DECODE_TOKEN_THRESHOLD = 32
"""vLLM ``ParallelConfig.dbo_decode_token_threshold``: decode-only batches split from this many tokens."""

DEFAULT_PREFILL_TOKEN_THRESHOLD = 512
"""vLLM ``ParallelConfig.dbo_prefill_token_threshold``: batches with a prefill split from this many tokens."""

SUPPORTED_NUM_UBATCHES = 2
"""Dual batch overlap: exactly two micro-batches."""


def _require_int(name: str, value: object, *, minimum: int, accepted: str) -> int:
    # bool is an int subclass; True as a token count is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DBOConfigError(f"{name}={value!r} is invalid; accepted: {accepted}")
    return value


def validate_num_ubatches(num_ubatches: object) -> int:
    """Return ``num_ubatches`` if it is 2, else raise :class:`DBOConfigError`."""
    if isinstance(num_ubatches, bool) or num_ubatches != SUPPORTED_NUM_UBATCHES:
        raise DBOConfigError(
            f"num_ubatches={num_ubatches!r} is not supported; dual batch overlap supports only "
            f"{SUPPORTED_NUM_UBATCHES} micro-batches"
        )
    return SUPPORTED_NUM_UBATCHES


def validate_thresholds(
    decode_token_threshold: object = DEFAULT_DECODE_TOKEN_THRESHOLD,
    prefill_token_threshold: object = DEFAULT_PREFILL_TOKEN_THRESHOLD,
    *,
    num_ubatches: object = SUPPORTED_NUM_UBATCHES,
) -> tuple[int, int]:
    """Check both thresholds like vLLM's ``ParallelConfig`` does and return them.

    Each must be an integer of at least ``num_ubatches`` (vLLM: ``ge=0`` on the field, then
    ``min(decode, prefill) >= num_ubatches`` when micro-batching is on).
    """
    n = validate_num_ubatches(num_ubatches)
    accepted = f"an integer >= {n} (the number of micro-batches; at least one token each)"
    decode = _require_int("dbo_decode_token_threshold", decode_token_threshold, minimum=n, accepted=accepted)
    prefill = _require_int(
        "dbo_prefill_token_threshold", prefill_token_threshold, minimum=n, accepted=accepted
    )
    return decode, prefill


def should_ubatch(
    num_tokens: int,
    *,
    is_decode_only: bool,
    decode_token_threshold: int = DEFAULT_DECODE_TOKEN_THRESHOLD,
    prefill_token_threshold: int = DEFAULT_PREFILL_TOKEN_THRESHOLD,
    num_ubatches: int = SUPPORTED_NUM_UBATCHES,
) -> bool:
    """This rank's vote: split a batch of ``num_tokens`` (unpadded) tokens?

    vLLM's ``check_ubatch_thresholds``: ``num_tokens >= decode_token_threshold`` for a decode-only batch,
    ``num_tokens >= prefill_token_threshold`` otherwise. Data-parallel ranks must then agree
    (:func:`dbo_runtime.dp_sync.coordinate_ubatching`).
    """
    decode, prefill = validate_thresholds(
        decode_token_threshold, prefill_token_threshold, num_ubatches=num_ubatches
    )
    _require_int("num_tokens", num_tokens, minimum=0, accepted="an integer >= 0")
    return num_tokens >= (decode if is_decode_only else prefill)


def is_uniform_decode(num_scheduled_tokens: Sequence[int], *, uniform_decode_query_len: int = 1) -> bool:
    """Whether a batch is "decode-only" in vLLM's sense (``GPUModelRunner._is_uniform_decode``).

    Every request schedules exactly ``uniform_decode_query_len`` tokens (1, or 1 + the number of speculative
    tokens). Such a batch is judged against the decode threshold, any other against the prefill threshold.
    """
    _require_int("uniform_decode_query_len", uniform_decode_query_len, minimum=1, accepted="an integer >= 1")
    if not num_scheduled_tokens:
        return False
    largest = max(num_scheduled_tokens)
    return largest == uniform_decode_query_len and sum(num_scheduled_tokens) == largest * len(
        num_scheduled_tokens
    )


def is_last_ubatch_empty(
    orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int = SUPPORTED_NUM_UBATCHES
) -> bool:
    """True when cutting at ``padded_num_tokens // num_ubatches`` would leave no real token for the last micro-batch.

    vLLM aborts micro-batching in that case (with the smallest real and the largest padded count across DP ranks).
    """
    return (padded_num_tokens // num_ubatches) * (num_ubatches - 1) >= orig_num_tokens


def round_up_to_ubatches(num_tokens: int, num_ubatches: int = SUPPORTED_NUM_UBATCHES) -> int:
    """The smallest count ``>= num_tokens`` that divides into ``num_ubatches`` equal micro-batches."""
    n = validate_num_ubatches(num_ubatches)
    _require_int("num_tokens", num_tokens, minimum=0, accepted="an integer >= 0")
    return -(-num_tokens // n) * n


@dataclass(frozen=True)
class UBatchSlice:
    """One micro-batch: the requests it touches and the token range it owns (both half-open, step 1).

    A request straddling the cut is in the ``request_slice`` of both neighbours; the token slices never overlap.
    """

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_requests(self) -> int:
        return self.request_slice.stop - self.request_slice.start

    def is_empty(self) -> bool:
        return self.num_requests == 0 or self.num_tokens == 0


def _cumulative(num_scheduled_tokens: Sequence[int]) -> list[int]:
    for i, n in enumerate(num_scheduled_tokens):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise DBOConfigError(
                f"num_scheduled_tokens[{i}]={n!r} is invalid; accepted: an integer >= 1 (every scheduled request has "
                "at least one token)"
            )
    return [0, *itertools.accumulate(num_scheduled_tokens)]


def split_ubatches(
    num_scheduled_tokens: Sequence[int],
    *,
    num_ubatches: int = SUPPORTED_NUM_UBATCHES,
    num_tokens_padded: int | None = None,
) -> list[UBatchSlice]:
    """Token-balanced micro-batch slices of a batch, as vLLM's ``maybe_create_ubatch_slices``.

    ``num_scheduled_tokens[i]`` is request ``i``'s token count in this step. The cut is at
    ``num_tokens_padded // num_ubatches`` (``num_tokens_padded`` defaults to the real total; pass the DP- or
    graph-padded count so every rank cuts at the same place, as upstream). The returned slices cover the real
    tokens only; :func:`pad_ubatch_slices` / :func:`pad_to_equal` extend the last one over the padding.

    Raises :class:`DBOConfigError` if a micro-batch would get no real token (upstream's ``is_last_ubatch_empty``
    case, which the split decision should have ruled out).
    """
    n = validate_num_ubatches(num_ubatches)
    cu = _cumulative(num_scheduled_tokens)
    total = cu[-1]
    padded = total if num_tokens_padded is None else num_tokens_padded
    _require_int(
        "num_tokens_padded", padded, minimum=total, accepted=f"an integer >= the real token count {total}"
    )
    split_point = padded // n
    if split_point <= 0 or is_last_ubatch_empty(total, padded, n):
        raise DBOConfigError(
            f"a batch of {total} tokens (padded to {padded}) cannot be split into {n} non-empty micro-batches "
            f"at token {split_point}; accepted: at least {n} tokens and a cut before the last real token"
        )
    slices: list[UBatchSlice] = []
    start = 0
    for stop in [split_point * i for i in range(1, n)] + [total]:
        # First request containing `start` (a request starting exactly at `start` counts as containing it) ...
        req_start = bisect.bisect_right(cu, start) - 1
        # ... up to, exclusive, the first request that starts at or after `stop`.
        req_stop = bisect.bisect_left(cu, stop)
        slices.append(UBatchSlice(slice(req_start, req_stop), slice(start, stop)))
        start = stop
    return slices


def pad_ubatch_slices(
    slices: Sequence[UBatchSlice], *, num_tokens_padded: int, num_reqs_padded: int | None = None
) -> list[UBatchSlice]:
    """Extend the last slice over the padding tokens (and padding requests), as vLLM's ``_pad_out_ubatch_slices``."""
    if not slices:
        raise DBOConfigError("slices is empty; accepted: the slices returned by split_ubatches")
    last = slices[-1]
    _require_int(
        "num_tokens_padded",
        num_tokens_padded,
        minimum=last.token_slice.stop,
        accepted=f"an integer >= the real token count {last.token_slice.stop}",
    )
    req_stop = last.request_slice.stop if num_reqs_padded is None else num_reqs_padded
    _require_int(
        "num_reqs_padded",
        req_stop,
        minimum=last.request_slice.stop,
        accepted=f"an integer >= the real request count {last.request_slice.stop}",
    )
    padded_last = UBatchSlice(
        slice(last.request_slice.start, req_stop), slice(last.token_slice.start, num_tokens_padded)
    )
    return [*slices[:-1], padded_last]


def pad_to_equal(
    slices: Sequence[UBatchSlice], *, num_tokens_padded: int | None = None, num_reqs_padded: int | None = None
) -> list[UBatchSlice]:
    """Pad the last slice so that every micro-batch has the same number of tokens (what a captured graph needs).

    Padding can only go at the end of the token buffer, so the earlier slices must already have the target size:
    cut with ``split_ubatches(..., num_tokens_padded=round_up_to_ubatches(total))`` (or any even padded count), then
    pad here. ``num_tokens_padded`` defaults to ``num_ubatches * slices[0].num_tokens``.
    """
    if not slices:
        raise DBOConfigError("slices is empty; accepted: the slices returned by split_ubatches")
    n = validate_num_ubatches(len(slices))
    size = slices[0].num_tokens
    target = n * size if num_tokens_padded is None else num_tokens_padded
    uneven = [s.num_tokens for s in slices[:-1] if s.num_tokens != size]
    if uneven or target != n * size or slices[-1].num_tokens > size:
        raise DBOConfigError(
            f"micro-batches of {[s.num_tokens for s in slices]} tokens cannot be padded to {n} equal parts of "
            f"{target} tokens in total; accepted: slices cut with split_ubatches(..., num_tokens_padded=T) and "
            f"num_tokens_padded=T where T is a multiple of {n}"
        )
    return pad_ubatch_slices(slices, num_tokens_padded=target, num_reqs_padded=num_reqs_padded)


def slice_request_metadata(
    query_start_loc: Sequence[int], seq_lens: Sequence[int], ub: UBatchSlice
) -> tuple[list[int], list[int]]:
    """The micro-batch's own ``query_start_loc`` (rebased to 0) and ``seq_lens``, as vLLM's ``_make_metadata_with_slice``.

    ``query_start_loc`` has one entry per request plus a final total; ``seq_lens[i]`` is request ``i``'s context
    length after this step (computed tokens + scheduled tokens).

    - A request whose first tokens belong to the previous micro-batch (it straddles the cut at this slice's start)
      keeps its ``seq_len``: it continues from the KV the previous micro-batch wrote. Its query shrinks to the tokens
      in this slice.
    - A request whose last tokens belong to the next micro-batch loses those tokens from its query and from its
      ``seq_len``: here it sees only the context up to the cut.
    - Padding tokens past the last request's end (a padded last slice) change nothing, as upstream.
    """
    qsl = list(query_start_loc)
    lens = list(seq_lens)
    if len(qsl) != len(lens) + 1 or not qsl or qsl[0] != 0 or any(b < a for a, b in itertools.pairwise(qsl)):
        raise DBOConfigError(
            f"query_start_loc of length {len(qsl)} does not describe {len(lens)} requests; accepted: a "
            "non-decreasing sequence starting at 0 with one entry per request plus the total"
        )
    rs, ts = ub.request_slice, ub.token_slice
    if not (0 <= rs.start < rs.stop <= len(lens)) or ts.start < 0 or ts.stop <= ts.start:
        raise DBOConfigError(
            f"micro-batch {ub} is empty or outside the batch of {len(lens)} requests; accepted: a slice from "
            "split_ubatches over the same batch"
        )
    first, last = rs.start, rs.stop - 1
    if not (qsl[first] <= ts.start < qsl[first + 1]):
        raise DBOConfigError(
            f"micro-batch {ub} starts at token {ts.start}, outside its first request {first} "
            f"(tokens {qsl[first]}..{qsl[first + 1] - 1}); accepted: a slice from split_ubatches over the same batch"
        )
    base = qsl[first]
    out_qsl = [q - base for q in qsl[first : last + 2]]
    out_lens = lens[first : last + 1]
    head_skipped = ts.start - qsl[first]
    if head_skipped > 0:
        out_qsl[1:] = [q - head_skipped for q in out_qsl[1:]]
    tail_skipped = qsl[last + 1] - ts.stop
    if tail_skipped > 0:
        out_qsl[-1] -= tail_skipped
        out_lens[-1] -= tail_skipped
    return out_qsl, out_lens


def maybe_create_ubatch_slices(
    should_split: bool,
    num_scheduled_tokens: Sequence[int],
    *,
    num_tokens_padded: int | None = None,
    num_reqs_padded: int | None = None,
    num_ubatches: int = SUPPORTED_NUM_UBATCHES,
) -> tuple[list[UBatchSlice] | None, list[UBatchSlice] | None]:
    """vLLM's ``maybe_create_ubatch_slices``: ``(None, None)`` unless splitting, else the real and the padded slices.

    ``should_split`` is the agreed decision (``UBatchDecision.split``) and ``num_tokens_padded`` the count this rank
    runs (``UBatchDecision.padded_num_tokens``), so every DP rank cuts at the same token. The padded slices extend
    the last micro-batch over the padding tokens and requests, for forward contexts and captured graphs.
    """
    if not should_split:
        return None, None
    total = sum(num_scheduled_tokens)
    padded = total if num_tokens_padded is None else num_tokens_padded
    slices = split_ubatches(num_scheduled_tokens, num_ubatches=num_ubatches, num_tokens_padded=padded)
    reqs = len(num_scheduled_tokens) if num_reqs_padded is None else num_reqs_padded
    return slices, pad_ubatch_slices(slices, num_tokens_padded=padded, num_reqs_padded=reqs)
