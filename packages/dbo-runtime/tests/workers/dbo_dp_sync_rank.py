"""One data-parallel rank for test_dp_sync.py: a real torch.distributed gloo process.

Started by multiprocessing ("forkserver" with torch preloaded, so four ranks start in seconds on two cores).
``steps`` is a list of steps; ``step["per_rank"][str(rank)]`` says what this rank does:
  {"call": {...coordinate_ubatching kwargs...}}  call it and report the decision or the error
  {"skip": true, "linger_s": S}                   report a marker, stay alive S seconds without taking part
                                                  (a rank that never arrives), then stop
  {"crash": true}                                 exit at once with status 3 (a rank that died)
Each result goes to ``results`` as (rank, record). The process ends with os._exit so that a broken process
group cannot keep it alive.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from typing import Any


def run_rank(rank: int, world: int, init_method: str, steps: list[dict], results: Any) -> None:
    import torch.distributed as dist
    from dbo_runtime.dp_sync import coordinate_ubatching

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=20),
        )
        for step in steps:
            action = step["per_rank"][str(rank)]
            if action.get("crash"):
                code = 3
                break
            if action.get("skip"):
                results.put((rank, {"name": step["name"], "skipped": True}))
                time.sleep(float(action.get("linger_s", 0)))
                break
            started = time.monotonic()
            record: dict = {"name": step["name"]}
            try:
                decision = coordinate_ubatching(**action["call"])
                record["decision"] = json.loads(json.dumps(dataclasses.asdict(decision)))  # tuples -> lists
            except Exception as exc:
                record["error"] = type(exc).__name__
                record["message"] = str(exc)
                record["bases"] = [c.__name__ for c in type(exc).__mro__]
            record["elapsed_s"] = time.monotonic() - started
            results.put((rank, record))
    except BaseException as exc:  # report anything unexpected instead of dying silently
        results.put((rank, {"name": "__crash__", "error": type(exc).__name__, "message": repr(exc)}))
        code = 1
    finally:
        results.close()
        results.join_thread()
        os._exit(code)
