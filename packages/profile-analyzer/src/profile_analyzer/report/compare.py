"""Two reports -> the delta of every breakdown item and of each operator's exposed time, and its renderers."""

from __future__ import annotations

import json
from typing import Any


def compare_dicts(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Delta of every breakdown item and of each operator's exposed time: per-step means over all selected
    ranks and steps (µs)."""
    def means(d: dict[str, Any]) -> dict[str, float]:
        rows = d["breakdown"]
        n = max(len(rows), 1)
        return {k: sum(r[k] for r in rows) / n for k, _ in d["breakdown_items"]}

    mb, mn = means(base), means(new)
    items = []
    for k, col in base["breakdown_items"]:
        b, n = mb[k], mn[k]
        items.append({"item": k, "column": col, "base_us": b, "new_us": n, "delta_us": n - b,
                      "delta_pct": (100.0 * (n - b) / b) if b else None})
    def exposed_by_op(d: dict[str, Any]) -> dict[str, float]:
        n = max(len(d["breakdown"]), 1)
        out: dict[str, float] = {}
        for ex in d["exposed_communication"]:
            for row in ex["by_operator"]:
                out[row["operator"]] = out.get(row["operator"], 0.0) + row["exposed_us"] / n
        return out

    eb, en = exposed_by_op(base), exposed_by_op(new)
    operators = [{"operator": k, "base_exposed_us": eb.get(k, 0.0), "new_exposed_us": en.get(k, 0.0),
                  "delta_us": en.get(k, 0.0) - eb.get(k, 0.0)} for k in sorted(set(eb) | set(en))]
    operators.sort(key=lambda r: r["delta_us"])
    ob, on = base["summary"]["overlap_pct"], new["summary"]["overlap_pct"]
    cno = next(i for i in items if i["item"] == "communication_not_overlapped")
    verdict = (f"Per step, exposed communication went from {cno['base_us']:.1f} µs to {cno['new_us']:.1f} µs "
               f"({cno['delta_us']:+.1f} µs); overlap {_pct(ob)} -> {_pct(on)}.")
    for side, d in (("base", base), ("new", new)):
        gone = d.get("unreadable") or []
        if gone:
            verdict += (f" The {side} profile's figures leave out {len(gone)} rank(s) that could not be read "
                        f"({', '.join(str(u['rank']) for u in gone)}).")
    return {"schema": "profile-analyzer/compare", "schema_version": 1,
            "base": {"path": base["source"]["path"], "format": base["source"]["format"], "ranks": base["source"]["ranks"],
                     "steps": base["summary"]["steps"], "overlap_pct": ob,
                     "unreadable": base.get("unreadable", [])},
            "new": {"path": new["source"]["path"], "format": new["source"]["format"], "ranks": new["source"]["ranks"],
                    "steps": new["summary"]["steps"], "overlap_pct": on,
                    "unreadable": new.get("unreadable", [])},
            "items": items, "exposed_by_operator": operators, "verdict": verdict}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


def render_compare(c: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(c, indent=2, ensure_ascii=False) + "\n"
    headers = ["item", "base µs/step", "new µs/step", "delta µs", "delta %"]
    rows = [[i["column"], f"{i['base_us']:,.1f}", f"{i['new_us']:,.1f}", f"{i['delta_us']:+,.1f}",
             "-" if i["delta_pct"] is None else f"{i['delta_pct']:+.1f}"] for i in c["items"]]
    op_headers = ["operator", "base exposed µs/step", "new exposed µs/step", "delta µs"]
    op_rows = [[o["operator"], f"{o['base_exposed_us']:,.1f}", f"{o['new_exposed_us']:,.1f}", f"{o['delta_us']:+,.1f}"]
               for o in c["exposed_by_operator"]]
    if fmt == "md":
        lines = [f"## Compare `{c['base']['path']}` -> `{c['new']['path']}`", "", c["verdict"], "",
                 "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        if op_rows:
            lines += ["", "| " + " | ".join(op_headers) + " |", "|" + "|".join("---" for _ in op_headers) + "|"]
            lines += ["| " + " | ".join(r) + " |" for r in op_rows]
        return "\n".join(lines) + "\n"
    import io

    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=110, color_system=None, highlight=False)
    con.print(f"base: {c['base']['path']}\nnew:  {c['new']['path']}\n")
    con.print(c["verdict"])
    t = Table()
    for h in headers:
        t.add_column(h, justify="left" if h == "item" else "right")
    for r in rows:
        t.add_row(*r)
    con.print(t)
    if op_rows:
        t2 = Table(title="Exposed communication by operator", title_justify="left")
        for h in op_headers:
            t2.add_column(h, justify="left" if h == "operator" else "right")
        for r in op_rows:
            t2.add_row(*r)
        con.print(t2)
    return buf.getvalue()
