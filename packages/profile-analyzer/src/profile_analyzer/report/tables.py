"""The report as (title, headers, rows) tables, shared by the text and Markdown renderers."""

from __future__ import annotations

from typing import Any


def _f(x: object, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)


SHORT_COLUMNS = {
    "computing": "Computing", "communication_not_overlapped": "Comm not overlapped", "overlapped": "Overlapped",
    "communication": "Communication", "free": "Free", "stage": "Stage", "bubble": "Bubble",
    "communication_not_overlapped_exclude_receive": "Comm not ovl. excl. receive", "preparing": "Preparing",
}


def tables(d: dict[str, Any], top: int = 10, short: bool = False) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    items = d["breakdown_items"]
    out.append(("Step breakdown (µs, msprof step_trace_time columns)",
                ["rank", "step"] + [SHORT_COLUMNS.get(k, col) if short else col for k, col in items] + ["overlap %"],
                [[_f(r["rank"]), _f(r["step"])] + [_f(r[k]) for k, _ in items] + [_f(r["overlap_pct"])] for r in d["breakdown"]]))
    ag = d["profiler_agreement"]
    if ag:
        groups: dict[tuple[object, str], list[dict[str, Any]]] = {}
        for a in ag:
            groups.setdefault((a["rank"], a["source"]), []).append(a)
        rows = []
        for (rank, source), lst in groups.items():
            worst = max(lst, key=lambda a: abs(a["delta_us"]))
            rows.append([_f(rank), source, _f(len({a["step"] for a in lst})), _f(len(lst)), worst["item"],
                         _f(abs(worst["delta_us"]), 3), "yes" if abs(worst["delta_us"]) < 1.0 else "NO"])
        out.append(("Agreement with the profiler's own figures (recomputed from raw tasks)",
                    ["rank", "source", "steps", "values", "worst item", "max |delta| µs", "within 1 µs"], rows))
    ex_rows, prev_rows, gap_rows = [], [], []
    for ex in d["exposed_communication"]:
        for r in ex["by_operator"][:top]:
            ex_rows.append([_f(ex["rank"]), r["operator"], _f(r["count"]), _f(r["exposed_us"]), _f(r["total_us"]), _f(r["exposed_pct"])])
        for r in ex["by_preceding_compute"][:top]:
            prev_rows.append([_f(ex["rank"]), r["preceding_compute"], _f(r["count"]), _f(r["exposed_us"]), _f(r["exposed_pct"])])
        for g in ex["worst_gaps"][:top]:
            gap_rows.append([_f(g["rank"]), _f(g["start_us"]), _f(g["dur_us"]), _f(g["comm_op"]), _f(g["occurrence"]), _f(g["stream"]),
                             _f(g["preceding_compute"])])
    out.append(("Exposed communication by operator", ["rank", "operator", "count", "exposed µs", "total µs", "exposed %"], ex_rows))
    out.append(("Exposed communication by the compute operator just before", ["rank", "preceding compute", "count", "exposed µs", "exposed %"], prev_rows))
    out.append(("Worst exposed intervals", ["rank", "at µs", "dur µs", "operator", "occurrence", "stream", "after compute"], gap_rows))
    out.append(("Stream utilisation", ["rank", "stream", "kind", "tasks", "busy µs", "wait µs", "utilisation %"],
                [[_f(s["rank"]), s["stream"], s["kind"], _f(s["tasks"]), _f(s["busy_us"]), _f(s["wait_us"]), _f(100 * s["utilisation"])]
                 for s in d["streams"]]))
    idle = []
    for g in d["idle_gaps"]:
        for s in g["per_stream"]:
            idle.append([_f(s["rank"]), s["stream"], _f(s["gaps"]), _f(s["idle_us"]), _f(s["host_bound_us"]),
                         _f(s["max_gap_us"]), _f(s["median_gap_us"], 2)])
    out.append(("Idle gaps on compute streams (host-bound: the next kernel was launched after the stream went idle)",
                ["rank", "stream", "gaps", "idle µs", "host-bound µs", "max gap µs", "median gap µs"], idle))
    db_rows = []
    for db in d["dual_batch"]:
        if not db["detected"]:
            db_rows.append([_f(db["rank"]), "-", "-", "-", "-", "-", db["reason"]])
            continue
        for u in db["ubatches"]:
            db_rows.append([_f(db["rank"]), _f(u["ubatch"]), _f(u["comm_ops"]), _f(u["comm_us"]), _f(u["covered_us"]),
                            _f(u["covered_pct"]), db["method"]])
    out.append(("Dual-batch overlap (communication of each micro-batch covered by the other's compute)",
                ["rank", "ubatch", "comm ops", "comm µs", "covered µs", "covered %", "method / reason"], db_rows))
    layer_rows = []
    for db in d["dual_batch"]:
        for lr in db["layers"][: 4 * top]:
            layer_rows.append([_f(lr["rank"]), _f(lr["layer"]), _f(lr["ubatch"]), lr["op"], _f(lr["comm_us"]), _f(lr["covered_us"]),
                               _f(lr["covered_pct"])])
    out.append(("Dual-batch overlap per layer", ["rank", "layer", "ubatch", "op", "comm µs", "covered µs", "covered %"], layer_rows))
    rk = d["ranks"]
    if len(rk["per_rank"]) > 1:
        out.append((f"Ranks (slowest: {rk['slowest_rank']}, waited for: {rk['waited_for_rank']})",
                    ["rank", "computing µs", "communication µs", "exposed µs", "free µs", "comm wait µs", "caused wait µs", "arrived last"],
                    [[_f(r["rank"]), _f(r["computing_us"]), _f(r["communication_us"]), _f(r["exposed_communication_us"]),
                      _f(r["free_us"]), _f(r["comm_wait_us"]), _f(r["caused_wait_us"]), _f(r["arrived_last"])] for r in rk["per_rank"]]))
    return out
