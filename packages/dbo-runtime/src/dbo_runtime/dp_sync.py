"""Every data-parallel rank takes the same micro-batching decision, or the job hangs.

With dual batch overlap each micro-batch issues its own collectives, so if one DP rank splits and another does
not, their collective sequences diverge and every rank waits forever (the DP+DBO hang vLLM-Ascend hit, see
docs/dbo.md). :func:`coordinate_ubatching` is vLLM's ``coordinate_batch_across_dp`` for this runtime: one
all-reduce of a small ``[rows, world_size]`` integer tensor, each rank writing its own column, then the same
pure post-processing on every rank:

- split only if every rank voted yes, and not if the cut at ``max(padded) // 2`` would leave the smallest rank
  without a token in its last micro-batch (upstream's ``is_last_ubatch_empty``);
- when splitting, DP padding is forced: every rank runs ``max(padded)`` tokens, so every rank cuts at the same
  token and the micro-batches have the same size everywhere;
- an idle rank calls it too, with ``num_tokens=0``, and follows the result with a dummy batch.

Beyond upstream: the all-reduce also carries each rank's view of the world size and of its own rank, an
"invalid input" flag and the idle-rank policy flag, so that a misconfigured rank makes *every* rank raise the same
:class:`DBOConfigError` instead of one rank failing and the others hanging; and the wait is bounded by
``timeout_s`` (:class:`DBOTimeoutError` on every rank that arrived).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dbo_runtime.errors import DBOConfigError, DBOError, DBOTimeoutError
from dbo_runtime.ubatch import SUPPORTED_NUM_UBATCHES, is_last_ubatch_empty, validate_num_ubatches

__all__ = ["UBatchDecision", "coordinate_ubatching", "decide_locally", "bounded_all_reduce"]

SITE = "dp_sync.coordinate_ubatching"

# Rows of the all-reduced tensor (each rank fills its own column; the sum is then the concatenation).
_ORIG, _PADDED, _VOTE, _GRAPHS, _WORLD, _RANK_PLUS_ONE, _INVALID, _ABSTAIN, _NUM_ROWS = range(9)


@dataclass(frozen=True)
class UBatchDecision:
    """What every DP rank agreed on for this step (identical on all ranks, except ``rank``).

    ``num_tokens_across_dp[r]``: the number of tokens rank ``r`` runs this step, DP padding included.
    ``padded_num_tokens``: this rank's entry of it; cut with ``split_ubatches(..., num_tokens_padded=...)``.
    """

    split: bool
    num_tokens_across_dp: tuple[int, ...]
    padded_num_tokens: int
    orig_num_tokens_across_dp: tuple[int, ...] = ()
    votes: tuple[bool, ...] = ()
    rank: int = 0
    world_size: int = 1
    num_ubatches: int = SUPPORTED_NUM_UBATCHES

    def dummy_num_scheduled_tokens(self) -> list[int]:
        """The batch an idle rank runs to match the others' collectives: one request of ``padded_num_tokens``."""
        return [self.padded_num_tokens] if self.padded_num_tokens > 0 else []


def _check_local(
    should_split: object, num_tokens: object, num_tokens_padded: object, timeout_s: object
) -> str | None:
    if not isinstance(should_split, bool):
        return f"should_split={should_split!r} is invalid; accepted: True or False"
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        return f"num_tokens={num_tokens!r} is invalid; accepted: an integer >= 0 (0 on an idle rank)"
    if (
        isinstance(num_tokens_padded, bool)
        or not isinstance(num_tokens_padded, int)
        or num_tokens_padded < num_tokens
    ):
        return f"num_tokens_padded={num_tokens_padded!r} is invalid; accepted: an integer >= num_tokens ({num_tokens})"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        return f"timeout_s={timeout_s!r} is invalid; accepted: a finite number of seconds > 0"
    return None


def _decide(table: list[list[int]], *, rank: int, num_ubatches: int, abstain: bool) -> UBatchDecision:
    """The post-processing every rank runs on the same reduced table."""
    world = len(table[_ORIG])
    orig, padded, votes = table[_ORIG], table[_PADDED], [v == 1 for v in table[_VOTE]]
    idle = [abstain and o == 0 for o in orig]
    active = [r for r in range(world) if not idle[r]]
    split = bool(active) and all(votes[r] for r in active)
    if split:
        smallest = min(orig[r] for r in active)
        largest = max(padded)
        split = not is_last_ubatch_empty(smallest, largest, num_ubatches) and largest // num_ubatches > 0
    pad_across_dp = split or all(g == 1 for g in table[_GRAPHS])
    across = tuple([max(padded)] * world) if pad_across_dp else tuple(padded)
    return UBatchDecision(
        split=split,
        num_tokens_across_dp=across,
        padded_num_tokens=across[rank],
        orig_num_tokens_across_dp=tuple(orig),
        votes=tuple(votes),
        rank=rank,
        world_size=world,
        num_ubatches=num_ubatches,
    )


def _mismatches(table: list[list[int]], world: int) -> list[str]:
    problems = []
    for column in range(world):
        claimed_world = table[_WORLD][column]
        claimed_rank = table[_RANK_PLUS_ONE][column] - 1
        if claimed_world != world or claimed_rank != column:
            problems.append(
                f"process-group rank {column} was configured as DP rank {claimed_rank} of {claimed_world}"
            )
    return problems


def bounded_all_reduce(tensor: torch.Tensor, *, group: object | None, timeout_s: float, site: str, waited: str,
                       why_missing: str, failed: str, op: object = None) -> None:
    """``dist.all_reduce(tensor)`` in place over ``group``, waiting at most ``timeout_s``: a peer that does not
    arrive raises :class:`DBOTimeoutError` (``waited`` and ``why_missing`` are its message), any other failure
    :class:`DBOError` (``failed``: the backend's text). Never hangs."""
    kwargs = {} if op is None else {"op": op}
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True, **kwargs)
        completed = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo raises RuntimeError for both a timeout and a peer that went away
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise DBOTimeoutError(f"{waited} and not all arrived ({why_missing})", site=site) from exc
        raise DBOError(f"{failed}: {text}") from exc
    if completed is False:  # some backends report a timeout by returning False
        raise DBOTimeoutError(waited, site=site)


def decide_locally(*, should_split: bool, num_tokens: int, num_tokens_padded: int | None = None,
                   num_ubatches: int = SUPPORTED_NUM_UBATCHES, use_graphs: bool = False,
                   idle_ranks_abstain: bool = False, timeout_s: float = 60.0) -> UBatchDecision:
    """The decision of a rank that coordinates with nobody (data parallel size 1): no collective runs."""
    n = validate_num_ubatches(num_ubatches)
    padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    local_error = _check_local(should_split, num_tokens, padded, timeout_s)
    if local_error:
        raise DBOConfigError(local_error)
    table = [[0] for _ in range(_NUM_ROWS)]
    table[_ORIG][0], table[_PADDED][0] = int(num_tokens), int(padded)
    table[_VOTE][0], table[_GRAPHS][0] = int(bool(should_split)), int(bool(use_graphs))
    return _decide(table, rank=0, num_ubatches=n, abstain=idle_ranks_abstain)


def coordinate_ubatching(
    *,
    should_split: bool,
    num_tokens: int,
    group: object | None = None,
    timeout_s: float = 60.0,
    num_tokens_padded: int | None = None,
    num_ubatches: int = SUPPORTED_NUM_UBATCHES,
    use_graphs: bool = False,
    idle_ranks_abstain: bool = False,
    dp_size: int | None = None,
    dp_rank: int | None = None,
    device: str | torch.device = "cpu",
) -> UBatchDecision:
    """Agree across the data-parallel ``group`` whether to split this step, and at what size every rank runs.

    Args:
        should_split: this rank's vote (``dbo_runtime.ubatch.should_ubatch`` on its unpadded token count).
        num_tokens: this rank's unpadded token count; 0 on an idle rank that will run a dummy batch.
        group: a ``torch.distributed`` process group (default: the world group). Use a CPU (gloo) group unless
            ``device`` says otherwise.
        timeout_s: bound on the wait for the other ranks; past it every rank that arrived raises
            :class:`DBOTimeoutError`.
        num_tokens_padded: this rank's count after graph/SP padding (default ``num_tokens``).
        use_graphs: this rank replays a captured graph this step; if every rank does, all are padded to the
            largest count even without a split (vLLM pads when the minimum graph mode is not NONE).
        idle_ranks_abstain: upstream (False) lets an idle rank's "no" veto the split for everyone. With True an idle
            rank's vote and its zero count are left out of the decision (like upstream's dead-rank columns), and it
            runs ``decision.dummy_num_scheduled_tokens()`` split the same way. Every rank must pass the same value.
        dp_size, dp_rank: what this rank was configured with; checked against the group on every rank.
        device: where the all-reduced tensor lives (``"cpu"`` for gloo; the device for an NCCL/HCCL group).

    Without an initialized process group (or with a group of one rank) the decision is local. Upstream vLLM never
    micro-batches at DP=1 (``coordinate_batch_across_dp`` returns early); here the caller decides whether to call.
    """
    n = validate_num_ubatches(num_ubatches)
    padded_arg = num_tokens if num_tokens_padded is None else num_tokens_padded
    local_error = _check_local(should_split, num_tokens, padded_arg, timeout_s)
    # Even a rank with bad input joins the all-reduce (flagging it), so the others fail now instead of waiting.
    wait_s = float(timeout_s) if local_error is None or "timeout_s" not in local_error else 60.0

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise DBOConfigError(
                "group was given but torch.distributed is not initialized; accepted: group=None"
            )
        world, rank = 1, 0
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise DBOConfigError(
                f"this process is not a member of group {group!r}; accepted: a group containing it"
            )

    if world == 1:
        if local_error:
            raise DBOConfigError(local_error)
        if (dp_size is not None and dp_size != 1) or (dp_rank is not None and dp_rank != 0):
            raise DBOConfigError(
                f"configured as DP rank {dp_rank} of {dp_size}, but the group has 1 rank; accepted: dp_size=1, dp_rank=0"
            )
        return decide_locally(should_split=should_split, num_tokens=num_tokens, num_tokens_padded=padded_arg,
                              num_ubatches=n, use_graphs=use_graphs, idle_ranks_abstain=idle_ranks_abstain,
                              timeout_s=timeout_s)

    mine = torch.zeros(_NUM_ROWS, world, dtype=torch.int64)
    if local_error is None:
        mine[_ORIG, rank] = num_tokens
        mine[_PADDED, rank] = padded_arg
        mine[_VOTE, rank] = int(should_split)
        mine[_GRAPHS, rank] = int(bool(use_graphs))
        mine[_ABSTAIN, rank] = int(bool(idle_ranks_abstain))
    else:
        mine[_INVALID, rank] = 1
    mine[_WORLD, rank] = world if dp_size is None else dp_size
    mine[_RANK_PLUS_ONE, rank] = (rank if dp_rank is None else dp_rank) + 1
    tensor = mine.to(device)

    bounded_all_reduce(
        tensor, group=group, timeout_s=wait_s, site=SITE,
        waited=f"{SITE}: rank {rank} waited {wait_s:g} s for the all-reduce across {world} DP ranks",
        why_missing="a rank that crashed, skipped this step, or runs a different number of steps",
        failed=f"{SITE}: the all-reduce across {world} DP ranks failed on rank {rank}")

    table = tensor.cpu().tolist()
    if local_error is not None:
        raise DBOConfigError(f"{SITE} on rank {rank}: {local_error}")
    invalid = [r for r in range(world) if table[_INVALID][r]]
    if invalid:
        raise DBOConfigError(
            f"{SITE}: rank(s) {invalid} passed invalid input (their own error says which); no rank splits this step"
        )
    problems = _mismatches(table, world)
    if problems:
        raise DBOConfigError(
            f"{SITE}: DP world-size/rank mismatch in a group of {world} ranks: " + "; ".join(problems)
        )
    abstain_flags = set(table[_ABSTAIN])
    if len(abstain_flags) != 1:
        raise DBOConfigError(
            f"{SITE}: ranks disagree on idle_ranks_abstain ({table[_ABSTAIN]}); accepted: the same value on every rank"
        )
    return _decide(table, rank=rank, num_ubatches=n, abstain=bool(table[_ABSTAIN][0]))
