"""One rank for test_policy.py: a real torch.distributed gloo process running the auto split policy on replayed steps.

Started by multiprocessing ("forkserver" with torch preloaded). Each scenario gives every rank the same step
sequence (what TP ranks of one engine see) and per-rank step times, so that the ranks measure differently:

  {"name": str, "timeout_s": float, "steps": [[num_tokens, decode_only, dummy], ...],
   "per_rank": {"0": {"times": {class label: [split_ms, unsplit_ms]}, "times_after": {...}, "change_at": int,
                      "prior": {class label: speed-up} (a rank configured apart),
                      "stop_after": int (stop calling after this many steps, stay alive linger_s, then stop),
                      "linger_s": float}}}

Each rank reports ``(rank, record)``: its choices (split per step), the agreed verdicts at the end, or the error.
The step clock is a counter advanced by the replayed step time, so the decisions depend on the timings only.
The process ends with os._exit so that a broken process group cannot keep it alive.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any


def run_scenario(rank: int, scenario: dict, results: Any) -> bool:
    """Run one scenario; return False when this rank stopped calling (the group is then unusable)."""
    from dbo_runtime.policy import ShapeClass, SplitPolicy, gloo_max_reducer

    mine = scenario["per_rank"][str(rank)]
    now = [0.0]
    prior = {ShapeClass.parse(label): value for label, value in mine.get("prior", {}).items()}
    policy = SplitPolicy(prior=prior, reduce_max=gloo_max_reducer(None, timeout_s=scenario["timeout_s"]),
                         clock=lambda: now[0], rank=rank)
    record: dict = {"name": scenario["name"], "choices": [], "verdicts": {}}
    started = time.monotonic()
    try:
        for i, (tokens, decode_only, dummy) in enumerate(scenario["steps"]):
            if mine.get("stop_after") is not None and i >= mine["stop_after"]:
                results.put((rank, {**record, "stopped": True}))
                time.sleep(float(mine.get("linger_s", 0)))
                return False
            policy.end_step()
            choice = policy.decide(tokens, decode_only=decode_only, dummy=dummy)
            policy.start_step(choice, choice.split)
            record["choices"].append(bool(choice.split))
            if choice.cls is not None:
                times = mine["times_after"] if i >= mine.get("change_at", 1 << 30) else mine["times"]
                split_ms, unsplit_ms = times[choice.cls.label]
                now[0] += (split_ms if choice.split else unsplit_ms) / 1e3
        table = policy.table()
        record["verdicts"] = {row["class"]: row["verdict"] for row in table["classes"]}
        record["agreed"] = [[row["class"], row["agreed"]] for row in table["classes"]]
        record["alone"] = {}
        for label, (split_ms, unsplit_ms) in mine.get("times_after", mine["times"]).items():
            # what this rank's own timings alone would conclude, for the test to show the ranks measured apart
            record["alone"][label] = split_ms <= unsplit_ms * (1 - policy.config.margin)
        record["classes"] = sorted({str(ShapeClass.of(t, decode_only=d)) for t, d, dummy in scenario["steps"]
                                    if not dummy})
    except Exception as exc:
        record["error"] = type(exc).__name__
        record["message"] = str(exc)
        record["bases"] = [c.__name__ for c in type(exc).__mro__]
    record["elapsed_s"] = time.monotonic() - started
    results.put((rank, record))
    return True


def run_rank(rank: int, world: int, init_method: str, scenarios: list[dict], results: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    code = 0
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        for scenario in scenarios:
            if not run_scenario(rank, scenario, results):
                break
    except BaseException as exc:  # report anything unexpected instead of dying silently
        results.put((rank, {"name": "__crash__", "error": type(exc).__name__, "message": repr(exc)}))
        code = 1
    finally:
        results.close()
        results.join_thread()
        os._exit(code)
