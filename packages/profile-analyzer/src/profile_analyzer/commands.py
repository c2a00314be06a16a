"""``profile-analyzer report`` and ``profile-analyzer compare``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from profile_analyzer.errors import ProfileError

FORMATS = ("text", "json", "md", "html")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="analyse one profile (a directory, a trace file, or a directory of ranks)")
    p.add_argument("path", help="*_ascend_pt dir, PROF_* dir, trace_view.json, msprof_*.json, Kineto .json(.gz), or a dir of ranks")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--output", "-o", help="write here instead of stdout (written atomically)")
    p.add_argument("--rank", type=int, help="only this rank")
    p.add_argument("--step", type=int, help="only this ProfilerStep#N")
    p.add_argument("--top", type=int, default=20, help="rows per ranked table (default 20)")
    p.add_argument("--jobs", "-j", type=_jobs, default=None,
                   help="load and analyse the ranks of a multi-rank profile in this many processes (default: 2 where "
                        "2 or more CPUs are available, else 1; each process holds about one rank at a time, so memory "
                        "grows with N; the report is the same for any N)")
    p.set_defaults(func=run_report)

    c = subparsers.add_parser("compare", help="delta of every breakdown item between two profiles (e.g. DBO off vs on)")
    c.add_argument("base")
    c.add_argument("new")
    c.add_argument("--format", choices=("text", "json", "md"), default="text")
    c.add_argument("--output", "-o")
    c.add_argument("--rank", type=int)
    c.add_argument("--step", type=int)
    c.set_defaults(func=run_compare)


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 1, got {text!r}")
    return n


def default_jobs() -> int:
    """2 where the process may use 2 or more CPUs (the measured sweet spot: 23-26x msprof-analyze's speed at
    under twice the largest file's size in memory, docs/profile-analysis.md), else 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 2 else 1


def _progress_loader(path: str, ranks: list[int] | None, jobs: int = 1, per_rank=None):
    from profile_analyzer.loaders import load

    if not sys.stderr.isatty():
        return load(path, ranks=ranks, workers=jobs, per_rank=per_rank)
    from rich.progress import Progress

    with Progress(transient=True, console=None) as prog:
        task = prog.add_task(f"loading {Path(path).name}", total=None)

        def cb(done: int, total: int, label: str) -> None:
            prog.update(task, completed=done, total=total, description=f"loading {label}")

        return load(path, ranks=ranks, progress=cb, workers=jobs, per_rank=per_rank)


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    out = Path(output)
    d = out.parent if str(out.parent) else Path(".")
    if not d.is_dir():
        raise ProfileError(out, "the output directory does not exist")
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def render(report_dict: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        from profile_analyzer.report.json_report import render_json

        return render_json(report_dict)
    if fmt == "md":
        from profile_analyzer.report.markdown import render_markdown

        return render_markdown(report_dict)
    if fmt == "html":
        try:
            from profile_analyzer.report.html import render_html
        except ModuleNotFoundError as exc:
            raise ProfileError("--format html", f"the HTML renderer is not installed ({exc.name}); use text, json or md") from None
        return render_html(report_dict)
    from profile_analyzer.report.text import render_text

    tty = sys.stdout.isatty()
    # a terminal's own width (at least 100); files and pipes get room for the widest table (breakdown)
    width = max(100, shutil.get_terminal_size((150, 24)).columns) if tty else 150
    return render_text(report_dict, width=width, color=tty and not os.environ.get("NO_COLOR"))


def _fail(exc: ProfileError) -> int:
    print(f"profile-analyzer: {exc}", file=sys.stderr)
    return 2


def run_report(args: argparse.Namespace) -> int:
    from profile_analyzer.api import analyze, analyze_rank

    try:
        # with worker processes, each rank's own analyses run in the worker that loaded it
        per_rank = functools.partial(analyze_rank, step=args.step, top=args.top)
        tl = _progress_loader(args.path, [args.rank] if args.rank is not None else None, args.jobs or default_jobs(), per_rank)
        rep = analyze(tl, rank=args.rank, step=args.step, top=args.top, done=tl.per_rank_results)
        d = rep.to_dict()
        text = render(d, args.format)
        for w in d["warnings"]:
            print(f"profile-analyzer: warning: {w['message']}", file=sys.stderr)
        _write(text, args.output)
    except ProfileError as exc:
        return _fail(exc)
    return 0


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
    return {"schema": "profile-analyzer/compare", "schema_version": 1,
            "base": {"path": base["source"]["path"], "format": base["source"]["format"], "ranks": base["source"]["ranks"],
                     "steps": base["summary"]["steps"], "overlap_pct": ob},
            "new": {"path": new["source"]["path"], "format": new["source"]["format"], "ranks": new["source"]["ranks"],
                    "steps": new["summary"]["steps"], "overlap_pct": on},
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


def run_compare(args: argparse.Namespace) -> int:
    from profile_analyzer.api import analyze

    try:
        ranks = [args.rank] if args.rank is not None else None
        base = analyze(_progress_loader(args.base, ranks, default_jobs()), rank=args.rank, step=args.step).to_dict()
        new = analyze(_progress_loader(args.new, ranks, default_jobs()), rank=args.rank, step=args.step).to_dict()
        _write(render_compare(compare_dicts(base, new), args.format), args.output)
    except ProfileError as exc:
        return _fail(exc)
    return 0
