"""Renderers of a ``whatif`` result (``profile_analyzer.whatif.whatif``): text, json and Markdown."""

from __future__ import annotations

import io
import json
from typing import Any

from profile_analyzer.report.tables import _f


def verdict(d: dict[str, Any]) -> str:
    s, st = d["summary"], d["settings"]
    on, off = s["on_us"], s["off_us"]
    what = "the step" if s["steps"] == 1 else f"the {s['steps']} steps"
    head = (f"With DBO on ({st['ubatches']} micro-batches, {st['switch_us']:g} µs per switch) {what} would take "
            f"{on / 1000:,.3f} ms instead of {off / 1000:,.3f} ms ")
    head += (f"({off / on:.2f}x faster)." if on < off else f"({on / off:.2f}x slower: DBO does not pay here).")
    worst = [(r["rank"], x["layer"]) for r in d["ranks"] for x in r["layers"] if not x["pays"] and x["layer"] is not None]
    if worst:
        layers = sorted({str(layer) for _, layer in worst})
        head += f" Layers where it cannot pay: {', '.join(layers[:12])}{' ...' if len(layers) > 12 else ''}."
    if s["exposed_comm_us"] == 0:
        head += " The DBO-off step has no exposed communication: there is nothing to hide."
    m = d.get("measured_on")
    if m is not None:
        head += (f" Measured with DBO on ({m['path']}): {m['steps']} steps, {m['on_us'] / 1000:,.3f} ms, "
                 f"{m['mean_step_us'] / 1000:,.3f} ms per step against {m['predicted_mean_step_us'] / 1000:,.3f} "
                 f"predicted ({m['error']:+.1%}).")
    gone = d.get("unreadable") or []
    if gone:
        head += (f" {len(gone)} rank(s) could not be read ({', '.join(str(u['rank']) for u in gone)}): the "
                 f"prediction leaves them out.")
    return head


def tables(d: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    summary = [[_f(r["rank"]), _f(r["step"]), _f(r["collectives"]), _f(r["comm_us"]), _f(r["off_us"]), _f(r["on_us"]),
                _f(r["speedup"], 2) + "x", _f(r["switches"]), _f(r["compute_idle_us"])] for r in d["ranks"]]
    layers = [[_f(r["rank"]), _f(x["layer"]), _f(x["compute_us"]), _f(x["comm_us"]), _f(x["off_us"]), _f(x["on_us"]),
               _f(x["alone_us"]), "yes" if x["pays"] else "NO"] for r in d["ranks"] for x in r["layers"]]
    steps = [[_f(r["rank"]), _f(x["step"]), _f(x["collectives"]), _f(x["comm_us"]), _f(x["off_us"]), _f(x["on_us"]),
              _f(x["speedup"], 2) + "x"] for r in d["ranks"] for x in r["steps"]]
    out = []
    m = d.get("measured_on")
    if m is not None:
        colls = [[which, c["name"], _f(c["count"]), _f(c["mean_us"]), _f(c["total_us"])]
                 for which, key in (("DBO off", "collectives_off"), ("DBO on", "collectives")) for c in m[key]]
        out.append(("Communication operators with DBO off and on (the prediction assumes DBO runs the same ones)",
                    ["profile", "operator", "count", "mean µs", "total µs"], colls))
    if len(steps) > len(d["ranks"]):
        out.append(("Every step (µs)", ["rank", "step", "collectives", "exposed comm (off)", "step off", "step on",
                                        "speed-up"], steps))
    return out + [("The longest step of each rank, with DBO on (µs)",
             ["rank", "step", "collectives", "exposed comm (off)", "step off", "step on", "speed-up", "switches",
              "compute waits"], summary),
            ("Per layer (µs; on in the step: when the layer's last segment ends minus when the previous layer's "
             "ended; on alone: the layer scheduled by itself, which decides whether it pays)",
             ["rank", "layer", "compute (off)", "exposed comm (off)", "off", "on (in the step)", "on (alone)",
              "pays"], layers)]


def render_whatif(d: dict[str, Any], fmt: str, width: int = 120) -> str:
    if fmt == "json":
        return json.dumps(d, indent=2) + "\n"
    st = d["settings"]
    setting = (f"{st['ubatches']} micro-batches; per micro-batch, compute x{st['compute_scale']:g} and communication "
               f"{st['comm_fixed_us']:g} µs + the rest x{st['comm_scale']:g}; a switch costs {st['switch_us']:g} µs")
    if st.get("measured_off_us") is not None:
        setting += f"; compute scaled to a measured DBO-off step of {st['measured_off_us']:,.1f} µs"
    host = max((r["host_us"] for r in d["ranks"]), default=0.0)
    if host > 0:
        setting += (f"; the collectives' host work (gloo's transfers) takes the cores from the compute beside them: "
                    f"up to {host:,.1f} µs in the longest step")
    elif not st.get("host_work", True):
        setting += "; the collectives' host work left out (--no-host-work)"
    if fmt == "md":
        lines = [f"## What would DBO give? `{d['source']['path']}`", "", verdict(d), "", f"Model: {setting}.", ""]
        for title, headers, rows in tables(d):
            lines += [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
            lines += ["| " + " | ".join(rows_cell.replace("|", "\\|") for rows_cell in r) + " |" for r in rows]
            lines.append("")
        return "\n".join(lines)
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, highlight=False)
    console.print(f"profile-analyzer whatif: {d['source']['path']} ({d['source']['format']}, ranks {d['source']['ranks']})")
    console.print()
    console.print(verdict(d))
    console.print(f"Model: {setting}.")
    for title, headers, rows in tables(d):
        t = Table(title=title, title_justify="left")
        for h in headers:
            t.add_column(h, justify="left" if h in ("pays", "profile", "operator") else "right")
        for r in rows:
            t.add_row(*r)
        console.print()
        console.print(t)
    return buf.getvalue()
