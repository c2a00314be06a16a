"""HTML renderer: one self-contained page (inline CSS and SVG, no script, no external resource).

The page carries a Content-Security-Policy that forbids every external load, so a browser that opens
it fetches nothing. Content: the verdict and summary figures, a per-rank bar of where the time went,
an SVG timeline of each of the worst exposed-communication windows (one lane per stream, the exposed
intervals shaded), the largest idle gaps on the compute streams (where they fall in the step, and the
longest ones ranked, each split into its host-bound part and the rest), and the same tables as the text
and Markdown reports (``report.tables``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jinja2

from profile_analyzer.report.tables import tables

KIND_CLASS = {"compute": "k-compute", "communication": "k-comm", "comm-task": "k-commtask",
              "idle-wait": "k-wait", "host": "k-host", "other": "k-other", "fused": "k-comm"}
KIND_LABEL = {"k-compute": "compute kernel", "k-comm": "communication op", "k-commtask": "communication task",
              "k-wait": "wait (Notify_Wait / EVENT_WAIT)", "k-host": "host", "k-other": "other device task"}

# SVG geometry (user units; the SVG scales to the page width)
SVG_W = 1200
LABEL_W = 250
PLOT_W = SVG_W - LABEL_W - 20
AXIS_H = 28
LANE_H = 20
LANE_GAP = 6
MAX_WINDOWS = 8
GAP_BAR_H = 16
GAP_BAR_GAP = 4
MAX_GAP_BARS = 12

_NUMERIC = re.compile(r"^-?[\d,]+(\.\d+)?%?$")

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("profile_analyzer", "report/templates"),
    autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)


def _fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    if abs(us) >= 1e6:
        return f"{us / 1e6:,.3f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:,.2f} ms"
    return f"{us:,.1f} µs"


def _nice_step(span: float, n: int = 6) -> float:
    """A 1/2/2.5/5 x 10^k tick spacing giving about ``n`` ticks over ``span``."""
    raw = span / max(n, 1)
    if raw <= 0:
        return 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def timeline_svg_model(window: dict[str, Any]) -> dict[str, Any]:
    """Geometry of one timeline window: lanes, task rectangles, exposed bands, axis ticks."""
    start, end = float(window["start_us"]), float(window["end_us"])
    span = max(end - start, 1e-3)

    def x(t: float) -> float:
        return LABEL_W + (min(max(t, start), end) - start) / span * PLOT_W

    lanes = []
    for i, lane in enumerate(window.get("lanes", [])):
        y = AXIS_H + i * (LANE_H + LANE_GAP)
        rects = []
        for t in lane.get("tasks", []):
            s, e = float(t["start_us"]), float(t["end_us"])
            if e < start or s > end:
                continue
            x0, x1 = x(s), x(e)
            cls = KIND_CLASS.get(str(t.get("kind", "other")), "k-other")
            rects.append({"x": round(x0, 2), "w": round(max(x1 - x0, 0.6), 2), "cls": cls,
                          "title": f"{t.get('name', '')}: {s:,.3f} → {e:,.3f} µs ({e - s:,.3f} µs)"})
        label = str(lane.get("stream", ""))
        short = label if len(label) <= 34 else label[:15] + "…" + label[-18:]
        lanes.append({"y": y, "label": short, "full_label": f"{label} ({lane.get('kind', '')})", "rects": rects,
                      "kind": lane.get("kind", "")})
    height = AXIS_H + max(len(lanes), 1) * (LANE_H + LANE_GAP) + 8
    bands = []
    for ex in window.get("exposed", []):
        s, e = float(ex["start_us"]), float(ex["end_us"])
        if e < start or s > end:
            continue
        x0, x1 = x(s), x(e)
        bands.append({"x": round(x0, 2), "w": round(max(x1 - x0, 0.8), 2),
                      "title": f"communication with no compute: {s:,.3f} → {e:,.3f} µs ({e - s:,.3f} µs)"})
    step = _nice_step(span)
    first = (int(start // step) + 1) * step
    ticks = []
    t = first
    while t < end and len(ticks) < 12:
        ticks.append({"x": round(x(t), 2), "label": f"{t:,.0f}" if step >= 1 else f"{t:,.2f}"})
        t += step
    return {"title": window.get("title", ""), "rank": window.get("rank"), "height": height, "lanes": lanes,
            "bands": bands, "ticks": ticks, "exposed_total": sum(float(b["end_us"]) - float(b["start_us"])
                                                                  for b in window.get("exposed", [])),
            "span": span, "start": start, "end": end}


def _gap_parts(gap: dict[str, Any]) -> list[tuple[float, float, str, str]]:
    """(start, end, css class, label) pieces of one idle gap: host-bound first (the device waited for the
    next launch), then the rest (launched, waiting on something else); one piece when the cause is unknown."""
    s, e = float(gap["start_us"]), float(gap["end_us"])
    host = gap.get("host_bound_us")
    if host is None:
        return [(s, e, "k-other", "cause unknown (no launch time)")]
    cut = s + min(max(float(host), 0.0), e - s)
    parts = []
    if cut > s:
        parts.append((s, cut, "k-host", "host-bound: the next kernel was not launched yet"))
    if e > cut:
        parts.append((cut, e, "k-wait", "launched, the stream waited on something else"))
    return parts


def idle_gap_models(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank with idle gaps on its compute streams: an overview SVG (the step on the x axis, one lane per
    stream, each of the largest gaps drawn where it happened) and a ranked bar SVG of the longest gaps."""
    step_span: dict[Any, tuple[float, float]] = {}
    for row in d.get("breakdown", []):
        lo, hi = step_span.get(row["rank"], (math.inf, -math.inf))
        step_span[row["rank"]] = (min(lo, float(row["start_us"])), max(hi, float(row["end_us"])))
    models = []
    for entry in d.get("idle_gaps", []):
        gaps = [g for g in entry.get("largest", []) if float(g["end_us"]) > float(g["start_us"])]
        if not gaps:
            continue
        rank = entry.get("rank")
        lo, hi = step_span.get(rank, (math.inf, -math.inf))
        start = min(lo, min(float(g["start_us"]) for g in gaps))
        end = max(hi, max(float(g["end_us"]) for g in gaps))
        span = max(end - start, 1e-3)

        def x(t: float, start: float = start, span: float = span) -> float:
            return LABEL_W + (t - start) / span * PLOT_W

        streams = list(dict.fromkeys(str(g["stream"]) for g in gaps))
        lanes = []
        for i, stream in enumerate(streams):
            y = AXIS_H + i * (LANE_H + LANE_GAP)
            rects = []
            for g in (g for g in gaps if str(g["stream"]) == stream):
                for s0, e0, cls, label in _gap_parts(g):
                    rects.append({"x": round(x(s0), 2), "w": round(max(x(e0) - x(s0), 0.8), 2), "cls": cls,
                                  "title": f"{_fmt_us(float(g['dur_us']))} idle at {float(g['start_us']):,.1f} µs, "
                                           f"{g.get('before') or '(start)'} → {g.get('after')}; this part "
                                           f"{_fmt_us(e0 - s0)}: {label}"})
            short = stream if len(stream) <= 34 else stream[:15] + "…" + stream[-18:]
            lanes.append({"y": y, "label": short, "full_label": stream, "rects": rects})
        height = AXIS_H + max(len(lanes), 1) * (LANE_H + LANE_GAP) + 8
        step = _nice_step(span)
        ticks = []
        t = (math.floor(start / step) + 1) * step
        while t < end and len(ticks) < 12:
            ticks.append({"x": round(x(t), 2), "label": f"{t:,.0f}" if step >= 1 else f"{t:,.2f}"})
            t += step

        longest = max(float(g["dur_us"]) for g in gaps)
        bars = []
        for i, g in enumerate(gaps[:MAX_GAP_BARS]):
            y = 4 + i * (GAP_BAR_H + GAP_BAR_GAP)
            pieces = []
            offset = 0.0
            for s0, e0, cls, label in _gap_parts(g):
                w = (e0 - s0) / longest * (PLOT_W - 150)
                pieces.append({"x": round(LABEL_W + offset, 2), "w": round(max(w, 0.8), 2), "cls": cls,
                               "title": f"{_fmt_us(e0 - s0)}: {label}"})
                offset += w
            name = f"{g.get('before') or '(start)'} → {g.get('after')}"
            bars.append({"y": y, "pieces": pieces, "label": name if len(name) <= 36 else name[:16] + "…" + name[-19:],
                         "full_label": f"{name} on {g['stream']} at {float(g['start_us']):,.1f} µs",
                         "value": _fmt_us(float(g["dur_us"])), "value_x": round(LABEL_W + offset + 6, 2)})
        idle = sum(float(s["idle_us"]) for s in entry.get("per_stream", []))
        host = sum(float(s["host_bound_us"]) for s in entry.get("per_stream", []))
        total_gaps = sum(int(s["gaps"]) for s in entry.get("per_stream", []))
        models.append({
            "rank": rank, "height": height, "lanes": lanes, "ticks": ticks,
            "bars": bars, "bars_height": 8 + len(bars) * (GAP_BAR_H + GAP_BAR_GAP),
            "title": f"rank {rank}: the {len(gaps)} largest of {total_gaps:,} idle gaps on compute streams "
                     f"({_fmt_us(idle)} idle, {100 * host / idle if idle else 0:.0f}% host-bound)",
            "host_share": (host / idle) if idle else 0.0,
        })
    return models


def _rank_bars(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: Computing, exposed communication and Free as shares of their sum (the device span)."""
    per: dict[Any, dict[str, float]] = {}
    for r in d.get("breakdown", []):
        acc = per.setdefault(r["rank"], {"computing": 0.0, "exposed": 0.0, "free": 0.0, "overlapped": 0.0})
        acc["computing"] += r.get("computing") or 0.0
        acc["exposed"] += r.get("communication_not_overlapped") or 0.0
        acc["free"] += r.get("free") or 0.0
        acc["overlapped"] += r.get("overlapped") or 0.0
    bars = []
    for rank, acc in sorted(per.items(), key=lambda kv: (kv[0] is None, kv[0])):
        total = acc["computing"] + acc["exposed"] + acc["free"]
        if total <= 0:
            continue
        bars.append({"rank": rank, "total": _fmt_us(total), "segments": [
            {"cls": "k-compute", "pct": 100 * acc["computing"] / total,
             "label": f"Computing {_fmt_us(acc['computing'])} (of which {_fmt_us(acc['overlapped'])} "
                      f"hides communication)"},
            {"cls": "k-exposed", "pct": 100 * acc["exposed"] / total,
             "label": f"Communication (Not Overlapped) {_fmt_us(acc['exposed'])}"},
            {"cls": "k-free", "pct": 100 * acc["free"] / total, "label": f"Free {_fmt_us(acc['free'])}"},
        ]})
    return bars


def _summary_cards(d: dict[str, Any]) -> list[dict[str, str]]:
    s = d.get("summary", {})

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}%"

    cards = [
        {"label": "wall (device span)", "value": _fmt_us(s.get("wall_us"))},
        {"label": "Computing", "value": _fmt_us(s.get("computing_us"))},
        {"label": "Communication", "value": _fmt_us(s.get("communication_us"))},
        {"label": "exposed communication", "value": _fmt_us(s.get("communication_not_overlapped_us")),
         "note": f"{pct(s.get('exposed_comm_pct_of_wall'))} of wall",
         "alert": bool(s.get("communication_not_overlapped_us"))},
        {"label": "overlap (HTA)", "value": pct(s.get("overlap_pct")), "note": "|comm ∩ comp| / |comm|"},
        {"label": "Free", "value": _fmt_us(s.get("free_us"))},
    ]
    return [{"note": "", "alert": False, **c} for c in cards]


COMMUNICATION_TABLES = ("Exposed communication", "Worst exposed intervals", "Dual-batch overlap")


def _table_models(d: dict[str, Any], no_communication: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, (title, headers, rows) in enumerate(tables(d)):
        cols_numeric = [all(_NUMERIC.match(str(r[j])) or str(r[j]) == "-" for r in rows) if rows else False
                        for j in range(len(headers))]
        empty = "Nothing to show."
        if no_communication and title.startswith(COMMUNICATION_TABLES):
            empty = ("Nothing to show: the profile has no communication operators (a single card, or a trace "
                     "without HCCL/NCCL tasks), so nothing can be exposed or overlapped.")
        out.append({"id": f"t{i}", "title": title, "headers": headers, "rows": rows, "numeric": cols_numeric,
                    "empty": empty})
    return out


def render_html(report_dict: dict[str, Any]) -> str:
    """The report as one self-contained HTML page (a string)."""
    d = report_dict
    windows = [timeline_svg_model(w) for w in d.get("timeline", [])[:MAX_WINDOWS]]
    used = sorted({r["cls"] for w in windows for lane in w["lanes"] for r in lane["rects"]})
    gap_views = idle_gap_models(d)
    gap_legend = {"k-host": "host-bound (next kernel not launched yet)",
                  "k-wait": "launched, waiting on something else", "k-other": "cause unknown (no launch time)"}
    gap_used = [c for c in gap_legend
                if any(r["cls"] == c for g in gap_views for lane in g["lanes"] for r in lane["rects"])]
    no_communication = not (d.get("summary", {}).get("communication_us") or 0)
    template = _env.get_template("report.html.j2")
    return template.render(
        d=d,
        source=d.get("source", {}),
        verdict=d.get("verdict", ""),
        warnings=d.get("warnings", []),
        cards=_summary_cards(d),
        bars=_rank_bars(d),
        windows=windows,
        legend=[{"cls": c, "label": KIND_LABEL[c]} for c in used],
        gap_views=gap_views,
        gap_legend=[{"cls": c, "label": gap_legend[c]} for c in gap_used],
        gap_bar_h=GAP_BAR_H,
        no_communication=no_communication,
        tables=_table_models(d, no_communication),
        svg_w=SVG_W, label_w=LABEL_W, plot_w=PLOT_W, axis_h=AXIS_H, lane_h=LANE_H, lane_gap=LANE_GAP,
        n_timeline=len(d.get("timeline", [])),
        max_windows=MAX_WINDOWS,
    )
