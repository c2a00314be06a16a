"""DP agreement (dbo_runtime.dp_sync) with real torch.distributed gloo processes on loopback.

Each process group is started once per module (startup dominates the cost) and runs a list of steps in order;
the steps that break the group (a rank that never arrives, a rank that dies) come last.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import socket
import sys
import time
from pathlib import Path

import pytest
from dbo_runtime.dp_sync import UBatchDecision, coordinate_ubatching
from dbo_runtime.errors import DBOConfigError

WORKERS_DIR = Path(__file__).parent / "workers"
GROUP_DEADLINE_S = 60.0  # whole group, startup included; the steps themselves take a few seconds
TIMEOUT_BOUND_S = 1.5  # timeout_s passed in the "never arrives" steps


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _context() -> multiprocessing.context.BaseContext:
    # The ranks must import the worker by name: put its folder on sys.path, which children inherit.
    if str(WORKERS_DIR) not in sys.path:
        sys.path.insert(0, str(WORKERS_DIR))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dbo_runtime.dp_sync", "dbo_dp_sync_rank"])
    return ctx


def run_group(world: int, steps: list[dict]) -> tuple[dict[int, dict[str, dict]], dict[int, int | None]]:
    """Start `world` gloo ranks, run `steps`; return {rank: {step name: record}} and the exit codes."""
    ctx = _context()
    import dbo_dp_sync_rank

    init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=dbo_dp_sync_rank.run_rank, args=(rank, world, init_method, steps, queue), daemon=True
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + GROUP_DEADLINE_S
    results: dict[int, dict[str, dict]] = {rank: {} for rank in range(world)}
    try:
        while any(p.is_alive() for p in procs) or not queue.empty():
            try:
                rank, record = queue.get(timeout=0.2)
                results[rank][record["name"]] = record
            except Exception:  # queue.Empty: nothing yet
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the {world}-rank group did not finish within {GROUP_DEADLINE_S} s (a hang): {results}"
                )
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    codes = {rank: proc.exitcode for rank, proc in enumerate(procs)}
    crashed = {rank: r["__crash__"] for rank, r in results.items() if "__crash__" in r}
    assert not crashed, crashed
    return results, codes


def call(**kwargs: object) -> dict:
    return {"call": kwargs}


def same(world: int, action: dict) -> dict[str, dict]:
    return {str(r): action for r in range(world)}


def step(name: str, per_rank: dict[str, dict], **extra: object) -> dict:
    return {"name": name, "per_rank": per_rank, **extra}


YES_600 = call(should_split=True, num_tokens=600)

TWO_RANK_STEPS = [
    step("both_split", {"0": YES_600, "1": call(should_split=True, num_tokens=700)}),
    step("idle_vetoes", {"0": YES_600, "1": call(should_split=False, num_tokens=0)}),
    step(
        "idle_abstains",
        {
            "0": call(should_split=True, num_tokens=600, idle_ranks_abstain=True),
            "1": call(should_split=False, num_tokens=0, idle_ranks_abstain=True),
        },
    ),
    step("one_votes_no", {"0": YES_600, "1": call(should_split=False, num_tokens=600)}),
    step(
        "last_ubatch_empty",
        {"0": YES_600, "1": call(should_split=True, num_tokens=600, num_tokens_padded=1300)},
    ),
    step("graphs_pad_all", same(2, call(should_split=False, num_tokens=10, use_graphs=True))),
    step(
        "graphs_one_rank",
        {
            "0": call(should_split=False, num_tokens=10, use_graphs=True),
            "1": call(should_split=False, num_tokens=20),
        },
    ),
    step("rank_mismatch", {"0": YES_600, "1": call(should_split=True, num_tokens=600, dp_rank=0)}),
    step("world_mismatch", same(2, call(should_split=True, num_tokens=600, dp_size=4))),
    step("invalid_input", {"0": call(should_split=True, num_tokens=-1), "1": YES_600}),
    step(
        "abstain_disagrees",
        {"0": call(should_split=True, num_tokens=600, idle_ranks_abstain=True), "1": YES_600},
    ),
    step("agrees_after_errors", same(2, YES_600)),
    step(
        "never_arrives",
        {
            "0": call(should_split=True, num_tokens=600, timeout_s=TIMEOUT_BOUND_S),
            "1": {"skip": True, "linger_s": TIMEOUT_BOUND_S + 3},
        },
    ),
]


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, dict[str, dict]]:
    results, codes = run_group(2, TWO_RANK_STEPS)
    assert codes == {0: 0, 1: 0}
    return results


FOUR_RANK_BUSY = {"0": 600, "1": 650, "2": 700}
FOUR_RANK_STEPS = [
    step(
        "idle_vetoes",
        {
            **{r: call(should_split=True, num_tokens=n) for r, n in FOUR_RANK_BUSY.items()},
            "3": call(should_split=False, num_tokens=0),
        },
    ),
    step(
        "idle_abstains",
        {
            **{
                r: call(should_split=True, num_tokens=n, idle_ranks_abstain=True)
                for r, n in FOUR_RANK_BUSY.items()
            },
            "3": call(should_split=False, num_tokens=0, idle_ranks_abstain=True),
        },
    ),
    step(
        "rank_dies",
        {
            "0": call(should_split=True, num_tokens=600, timeout_s=TIMEOUT_BOUND_S),
            "1": call(should_split=True, num_tokens=600, timeout_s=TIMEOUT_BOUND_S),
            "2": {"crash": True},
            "3": call(should_split=True, num_tokens=600, timeout_s=TIMEOUT_BOUND_S),
        },
    ),
]


@pytest.fixture(scope="module")
def four_ranks() -> tuple[dict[int, dict[str, dict]], dict[int, int]]:
    return run_group(4, FOUR_RANK_STEPS)


def decisions(results: dict[int, dict[str, dict]], name: str) -> list[dict]:
    out = []
    for rank in sorted(results):
        record = results[rank][name]
        assert "decision" in record, (rank, record)
        out.append(record["decision"])
    return out


def assert_agreed(ds: list[dict]) -> None:
    """Every field but `rank` and this rank's own padded count is identical; those are consistent."""
    for rank, d in enumerate(ds):
        assert d["rank"] == rank
        assert d["padded_num_tokens"] == d["num_tokens_across_dp"][rank]
    shared = [{k: v for k, v in d.items() if k not in ("rank", "padded_num_tokens")} for d in ds]
    assert all(s == shared[0] for s in shared)


# --- two ranks ---------------------------------------------------------------------------------------------


def test_all_yes_splits_with_forced_dp_padding(two_ranks: dict) -> None:
    ds = decisions(two_ranks, "both_split")
    assert_agreed(ds)
    assert ds[0]["split"] is True
    assert ds[0]["num_tokens_across_dp"] == [700, 700]
    assert ds[0]["orig_num_tokens_across_dp"] == [600, 700]


def test_idle_rank_vetoes_by_default_like_upstream(two_ranks: dict) -> None:
    ds = decisions(two_ranks, "idle_vetoes")
    assert_agreed(ds)
    assert ds[0]["split"] is False
    assert ds[0]["num_tokens_across_dp"] == [600, 0]  # no split, no graphs: no DP padding


def test_idle_rank_can_abstain_and_runs_the_padded_dummy(two_ranks: dict) -> None:
    ds = decisions(two_ranks, "idle_abstains")
    assert_agreed(ds)
    assert ds[1]["split"] is True
    assert ds[1]["num_tokens_across_dp"] == [600, 600]
    assert UBatchDecision(
        **{**ds[1], "num_tokens_across_dp": tuple(ds[1]["num_tokens_across_dp"])}
    ).dummy_num_scheduled_tokens() == [600]


def test_one_no_vote_stops_everyone(two_ranks: dict) -> None:
    ds = decisions(two_ranks, "one_votes_no")
    assert_agreed(ds)
    assert ds[0]["split"] is False
    assert ds[0]["votes"] == [True, False]


def test_empty_last_ubatch_aborts_the_split(two_ranks: dict) -> None:
    ds = decisions(two_ranks, "last_ubatch_empty")
    assert_agreed(ds)
    assert ds[0]["split"] is False  # cut at 1300 // 2 = 650 >= 600 real tokens on rank 0


def test_graph_padding_needs_every_rank(two_ranks: dict) -> None:
    padded = decisions(two_ranks, "graphs_pad_all")
    assert_agreed(padded)
    assert padded[0]["num_tokens_across_dp"] == [10, 10]
    mixed = decisions(two_ranks, "graphs_one_rank")
    assert_agreed(mixed)
    assert mixed[0]["num_tokens_across_dp"] == [10, 20]


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("rank_mismatch", "process-group rank 1 was configured as DP rank 0 of 2"),
        ("world_mismatch", "configured as DP rank 0 of 4"),
        ("abstain_disagrees", "disagree on idle_ranks_abstain"),
    ],
)
def test_configuration_mismatch_fails_on_every_rank(two_ranks: dict, name: str, fragment: str) -> None:
    for rank in (0, 1):
        record = two_ranks[rank][name]
        assert record.get("error") == "DBOConfigError", record
        assert fragment in record["message"]


def test_invalid_input_on_one_rank_fails_both_quickly(two_ranks: dict) -> None:
    own, other = two_ranks[0]["invalid_input"], two_ranks[1]["invalid_input"]
    assert own["error"] == other["error"] == "DBOConfigError"
    assert "num_tokens=-1" in own["message"]
    assert "rank(s) [0] passed invalid input" in other["message"]
    assert other["elapsed_s"] < 10


def test_group_still_agrees_after_config_errors(two_ranks: dict) -> None:
    ds = decisions(two_ranks, "agrees_after_errors")
    assert_agreed(ds)
    assert ds[0]["split"] is True


def test_rank_that_never_arrives_times_out_within_the_bound(two_ranks: dict) -> None:
    waiting = two_ranks[0]["never_arrives"]
    assert waiting["error"] == "DBOTimeoutError"
    assert "DBOError" in waiting["bases"]
    assert "dp_sync.coordinate_ubatching" in waiting["message"] and "2 DP ranks" in waiting["message"]
    assert TIMEOUT_BOUND_S * 0.9 <= waiting["elapsed_s"] < TIMEOUT_BOUND_S + 8
    assert two_ranks[1]["never_arrives"]["skipped"] is True


# --- four ranks, one idle ----------------------------------------------------------------------------------


def test_four_ranks_idle_rank_vetoes(four_ranks: tuple) -> None:
    results, _ = four_ranks
    ds = decisions(results, "idle_vetoes")
    assert_agreed(ds)
    assert ds[0]["split"] is False
    assert ds[0]["num_tokens_across_dp"] == [600, 650, 700, 0]


def test_four_ranks_idle_rank_abstains_and_all_pad_alike(four_ranks: tuple) -> None:
    results, _ = four_ranks
    ds = decisions(results, "idle_abstains")
    assert_agreed(ds)
    assert ds[0]["split"] is True
    assert ds[0]["num_tokens_across_dp"] == [700, 700, 700, 700]
    assert ds[3]["padded_num_tokens"] == 700


def test_four_ranks_a_dead_rank_fails_the_others_within_the_bound(four_ranks: tuple) -> None:
    results, codes = four_ranks
    assert codes[2] == 3 and "rank_dies" not in results[2]
    for rank in (0, 1, 3):
        record = results[rank]["rank_dies"]
        assert "DBOError" in record["bases"], record  # a timeout or a closed connection, never a hang
        assert "dp_sync.coordinate_ubatching" in record["message"]
        assert record["elapsed_s"] < TIMEOUT_BOUND_S + 8


# --- one process -------------------------------------------------------------------------------------------


def test_without_a_process_group_the_decision_is_local() -> None:
    d = coordinate_ubatching(should_split=True, num_tokens=600)
    assert (d.split, d.num_tokens_across_dp, d.padded_num_tokens, d.world_size) == (True, (600,), 600, 1)
    assert not coordinate_ubatching(
        should_split=True, num_tokens=1
    ).split  # a 1-token batch has no second half
    assert not coordinate_ubatching(should_split=False, num_tokens=600).split


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_tokens": -3}, "num_tokens=-3"),
        ({"num_tokens": 10, "num_tokens_padded": 5}, "num_tokens_padded=5"),
        ({"num_tokens": 10, "timeout_s": 0}, "timeout_s=0"),
        ({"num_tokens": 10, "timeout_s": float("inf")}, "timeout_s=inf"),
        ({"num_tokens": 10, "num_ubatches": 3}, "supports only 2 micro-batches"),
        ({"num_tokens": 10, "dp_size": 2}, "accepted: dp_size=1"),
        ({"num_tokens": 10, "group": object()}, "not initialized"),
    ],
)
def test_bad_input_without_a_group(kwargs: dict, fragment: str) -> None:
    with pytest.raises(DBOConfigError, match=fragment.replace("(", r"\(")):
        coordinate_ubatching(should_split=True, **kwargs)
