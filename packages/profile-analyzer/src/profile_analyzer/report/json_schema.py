"""The JSON report schema, version 1 (``"schema": "profile-analyzer/report", "schema_version": 1``).

``Report.to_dict()`` returns exactly this shape; ``profile-analyzer report --format json`` writes it.
All durations are microseconds (float). Positions (``start_us``/``end_us``) are relative to the rank's
``t0_ns`` (its first device task, absolute ns on the profiler clock). ``step`` is ``null`` when the
profile has no ``ProfilerStep#N`` ranges (the whole capture is one step). Keys are only ever added
within a schema version, never renamed or removed.

::

    {
      "schema": "profile-analyzer/report", "schema_version": 1,
      "tool": {"name": "profile-analyzer", "version": str},
      "source": {"path": str, "format": "torch_npu"|"msprof"|"kineto"|"multi_rank", "ranks": [int],
                 "events": int},        # tasks in the loaded timeline (all ranks)
      "selection": {"rank": int|null, "step": int|null},
      "warnings": [{"file": str, "missing": str, "affects": [str], "message": str}],
      "verdict": str,                       # one paragraph, plain text
      "summary": {"ranks": int, "steps": int, "wall_us": float, "computing_us": float,
                  "communication_us": float, "communication_not_overlapped_us": float,
                  "overlapped_us": float, "free_us": float,
                  "overlap_pct": float|null,          # HTA: 100·|comm ∩ comp| / |comm|
                  "exposed_comm_pct_of_wall": float|null,
                  "fused_us": float,                  # fused compute+communication kernels (in both: Overlapped)
                  "comm_rules": [{"rank", "rule", "kind": "communication"|"fused", "tasks"}],  # vendor table hits
                  "whole_trace_overlap": [{"rank", "communication_us", "overlapped_us", "overlap_pct": float|null}],
                  "whole_trace_overlap_pct": float|null},  # HTA get_comm_comp_overlap: every task, not per step
      "breakdown": [ {"rank": int, "step": int|null, "t0_ns": int, "start_us": float, "end_us": float,
                      "computing": float, "communication_not_overlapped": float, "overlapped": float,
                      "communication": float, "free": float, "stage": float, "bubble": float,
                      "communication_not_overlapped_exclude_receive": float, "preparing": float,
                      "overlap_pct": float|null} ],                   # µs, msprof step_trace_time columns
      "breakdown_items": [[json_key, msprof_column_name], ...],
      "profiler_agreement": [ {"rank", "step", "item", "source": "overlap_analysis_track"|"step_trace_time.csv"|"communication.json"
                               |"analysis.db:StepTraceTime"|"analysis.db:CommAnalyzerTime",   # the last two: DB export
                               "ours_us", "profiler_us", "delta_us"} ],
      "exposed_communication": [ {"rank": int, "exposed_us": float,
            "by_operator": [{"operator", "count", "exposed_us", "total_us", "exposed_pct"}],
            "by_preceding_compute": [{"preceding_compute", "count", "exposed_us", "total_us", "exposed_pct"}],
            "worst_gaps": [{"rank", "start_us", "end_us", "dur_us", "comm_op", "comm_kind", "occurrence",
                            "stream", "preceding_compute"}]} ],
      "streams": [ {"rank", "stream", "kind": "compute"|"communication", "tasks", "busy_us", "wait_us",
                    "compute_us", "window_us", "utilisation"} ],
      "idle_gaps": [ {"rank": int, "per_stream": [{"rank", "stream", "gaps", "idle_us", "host_bound_us",
                      "launch_known_pct", "max_gap_us", "median_gap_us"}],
                      "largest": [{"rank", "stream", "start_us", "end_us", "dur_us",
                                   "host_bound_us": float|null, "before", "after"}]} ],
      "dual_batch": [ {"rank", "detected": bool, "method": "markers"|"two_comm_streams"|"two_compute_streams"|"paired_ops"|null,
                       "reason": str,
                       "ubatches": [{"ubatch", "comm_ops", "comm_us", "covered_us", "covered_pct", "op_kinds"}],
                       "layers": [{"rank", "ubatch", "layer", "index", "op", "start_us", "comm_us",
                                   "covered_us", "covered_pct"}]} ],
      "ranks": {"per_rank": [{"rank", "computing_us", "communication_us", "exposed_communication_us",
                              "free_us", "comm_wait_us", "caused_wait_us", "arrived_last",
                              "sync_wait_us"}],
                "matched_collectives": int, "slowest_rank": int|null, "waited_for_rank": int|null,
                "explanation": str},
      "timeline": [ {"rank", "t0_ns", "start_us", "end_us", "title",         # windows around the worst gaps
                     "lanes": [{"stream", "kind", "tasks": [{"start_us", "end_us", "name", "kind"}]}],
                     "exposed": [{"start_us", "end_us"}]} ],
      "unreadable": [ {"rank": int, "path": str, "reason": str} ]   # ranks of a directory of ranks left out
    }
"""

SCHEMA_NAME = "profile-analyzer/report"
SCHEMA_VERSION = 1
