"""Validate ``dbo-runtime estimate`` against the reference sweep: predicted vs measured DBO speed-up.

    .venv/bin/python packages/dbo-runtime/scripts/validate_estimate.py [bench-results/dbo_runtime.json] [--format md|json]

(that script calls :func:`main` here), and ``dbo-runtime bench`` / ``make bench`` run it on their own sweep
(:func:`bench_check`): the table is the "Estimate check" section of dbo_runtime.md.

For every row of a ``dbo-runtime bench`` JSON (pattern, tokens per rank, link setting; measured T_off, T_on,
compute and communication), the estimate predicts the step from the reference model's config (written as a
DeepSeek-V2-style config.json by ``dbo_runtime.estimate.reference_config``, read back through kv-capacity like any
model) and the ``cpu-link`` hardware with the rates the bench timed right after each row, its two ranks computing
at once (one thread each, as the bench runs them; measured when this script runs for a bench JSON without them),
pooled over the sweep (the median of the rows' timings: one set of rates for the machine, as a user's
``--hardware cpu-link`` has; the error with each row's own timing is beside it):
this CPU's matrix rate on the model's MLP shapes (at 128-2048 token rows: a micro-batch's products have half the
rows, and their rate differs), its copy bandwidth, its elementwise rate
(a SwiGLU of the model's width) and its cost per operator, and one reference layer timed whole (every operator of
its compute) for the fraction of the matrix rate a layer reaches (``compute_efficiency``); the row's modelled
link (``link_spec``); and the handoff median the bench measured as the switch cost. Nothing of the measured step
times goes into the prediction.

On a machine whose speed moves from minute to minute (shared with other work, or throttled), rates timed minutes
away from the sweep predict another machine than the one that ran it, so they are timed within it, beside every
row. One row's timing (a few seconds) is itself noisy, so the prediction takes the median over the rows. Even
so, a row's steps ran at that row's moments, and the machine's speed then was not the median's, nor that of the
seconds after the row (the table's "speed" column is the ratio, row by row). So the bench also
times the rates' reference layer once after every step of a row (``layer_ms_beside_steps``, the median over the
row's steps) and the prediction takes the pooled rates at that speed (:func:`reference.rates.at_moment`: every
compute rate scaled by the pooled layer's time over the row's, the layer's share of the matrix rate kept). That
layer is 512 tokens whatever the row's, and alone (no collective): how the compute grows with the tokens, what a
micro-batch costs, the communication and the schedule all stay the model's. The error with the pooled rates as they
are, and with the row's own timing, are beside it; the table's compute columns show how much of an error is the
rate's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kv_capacity import compute_spec_from_config

from dbo_runtime import estimate as est
from dbo_runtime.reference.model import MoEConfig
from dbo_runtime.reference.rates import at_moment, pool_rates
from dbo_runtime.reference.whatif_check import pair_speedup

# cpu-link as the reference model runs on it: without the vLLM engine's host term (estimate.without_engine_host)
REFERENCE_HW = est.without_engine_host(est.HARDWARE["cpu-link"])
WITHIN = 0.10
LONG_STEP_MS = 10.0
RANKS = 2  # `dbo-runtime bench`: 2 gloo ranks (expert parallel over both, attention data parallel)


def validate(bench: dict) -> dict:
    m = bench["model"]
    config = MoEConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_experts=m["experts"], top_k=m["top_k"],
                       expert_intermediate=m["expert_intermediate"], shared_intermediate=m["shared_intermediate"])
    spec = compute_spec_from_config(est.reference_config(config), name="reference")
    load_before = os.getloadavg()
    beside = all(r.get("cpu_rates") for r in bench["rows"])
    # the rates' reference layer timed after every step of each row: the pooled rates brought to the row's moments
    moment = beside and all(r["cpu_rates"].get("layer_ms_beside_steps") for r in bench["rows"])
    if beside:  # timed by the bench right after each row: their median is the machine's
        pooled = pool_rates([r["cpu_rates"] for r in bench["rows"]])
        hw = est.with_cpu_rates(REFERENCE_HW, spec, pooled, ranks=RANKS)
    else:
        hw = est.with_measured_cpu(REFERENCE_HW, spec, ranks=RANKS, reference=config,
                                   layer_requests=m["requests"])
    switch = float(bench.get("handoff_us", {}).get("median_us") or REFERENCE_HW.switch_us["thread"])
    par = est.Parallel(1, RANKS, True)

    def predict(r: dict, rates_hw: est.Hardware) -> tuple[Any, float, float, float]:
        latency, gbps = (float(x) for x in r["link_spec"].split(","))
        row_hw = est.with_overrides(rates_hw, link_gbps=gbps, link_latency_us=latency)
        # bench batches: `requests` prompts of tokens/requests each, no cached context; the reference attends over
        # its whole padded KV length (full_keys)
        work = est.Workload(r["tokens"], "prefill", prompt_len=max(1, r["tokens"] // m["requests"]), full_keys=True)
        layers = est.layer_costs(spec, row_hw, work, par, r["pattern"])
        comp = sum(s.full_us for x in layers for s in x.segments if s.kind == "compute") / 1e3
        comm = sum(s.full_us for x in layers for s in x.segments if s.kind == "comm") / 1e3
        host = sum(s.host_us for x in layers for s in x.segments) / 1e3
        return est.simulate_step(layers, switch), comp, comm, host

    rows = []
    for i, r in enumerate(bench["rows"]):
        # measured: the median over the row's adjacent DBO-off / DBO-on step pairs (they ran back to back, under the
        # same load) of T_off / T_on, as the what-if check takes it; the ratio of the two medians without them
        measured = pair_speedup(None, i, r) or r["speedup"]
        speed = None
        if moment:
            at = at_moment(pooled, r["cpu_rates"]["layer_ms_beside_steps"])
            speed = at["speed_factor"]
            main_hw = est.with_cpu_rates(REFERENCE_HW, spec, at, ranks=RANKS)
        else:
            main_hw = hw
        sched, comp, comm, host = predict(r, main_hw)
        err = sched.speedup / measured - 1
        # one set of rates for the whole sweep (the median), as a user's `--hardware cpu-link` has
        pooled_err = predict(r, hw)[0].speedup / measured - 1 if moment else None
        row_err = None
        if beside:  # the same prediction with the rates timed right after this row alone
            row_hw = est.with_cpu_rates(REFERENCE_HW, spec, r["cpu_rates"], ranks=RANKS)
            row_err = predict(r, row_hw)[0].speedup / measured - 1
        # the same prediction without the collectives' host work (no host_gbps: nothing taken from the compute)
        no_host = (predict(r, replace(main_hw, host_gbps={}, host_call_us={}))[0].speedup / measured - 1
                   if hw.host_gbps else None)
        rows.append({"pattern": r["pattern"], "tokens": r["tokens"], "link": r["link"], "link_spec": r["link_spec"],
                     "t_off_ms": r["t_off_ms"], "t_on_ms": r["t_on_ms"], "pred_off_ms": sched.off_us / 1e3,
                     "pred_on_ms": sched.on_us / 1e3, "t_compute_ms": r["t_compute_ms"], "pred_compute_ms": comp,
                     "t_comm_ms": r["t_comm_ms"], "pred_comm_ms": comm, "speedup": measured,
                     "speedup_of_medians": r["speedup"],
                     "pred_speedup": sched.speedup, "error": err, "disturbed": bool(r.get("disturbed")),
                     "within": abs(err) <= WITHIN, "long_step": r["t_off_ms"] > LONG_STEP_MS,
                     "gflops": hw.measured["gflops"], "compute_efficiency": hw.measured.get("compute_efficiency"),
                     "error_row_rates": row_err, "error_without_host_work": no_host,
                     "error_one_rate_set": pooled_err, "speed_at_steps": speed,
                     "host_work_ms": host,
                     "row_gflops": r["cpu_rates"]["gflops"] if beside else None})
    long_rows = [x for x in rows if x["long_step"]]
    return {"rates": hw.measured, "rates_beside_rows": beside, "rates_at_steps": moment,
            "load": {"before": load_before, "after": os.getloadavg()}, "switch_us": switch, "ranks": RANKS, "rows": rows,
            "summary": {"rows": len(rows), "long_step_rows": len(long_rows),
                        "within_10pct": sum(x["within"] for x in long_rows),
                        "max_abs_error": max((abs(x["error"]) for x in long_rows), default=None),
                        "undisturbed_within_10pct": sum(x["within"] for x in long_rows if not x["disturbed"]),
                        "undisturbed_rows": sum(not x["disturbed"] for x in long_rows),
                        "within_10pct_row_rates": sum(abs(x["error_row_rates"]) <= WITHIN for x in long_rows)
                        if beside else None,
                        "within_10pct_without_host_work": sum(abs(x["error_without_host_work"]) <= WITHIN
                                                              for x in long_rows) if hw.host_gbps else None,
                        "within_10pct_one_rate_set": sum(abs(x["error_one_rate_set"]) <= WITHIN for x in long_rows)
                        if moment else None}}


def markdown(result: dict) -> str:
    rates = result["rates"]
    if result["rates_beside_rows"]:
        curve = ", ".join(f"{v:.1f} at {k}" for k, v in (rates.get("gflops_by_rows") or {}).items())
        out = [f"Rates timed by the bench right after each row, both ranks at once, and pooled: the median over the "
               f"{len(result['rows'])} rows' timings, {rates['gflops']:.1f} GFLOP/s at 512 rows (by rows: {curve}), "
               f"a reference layer reaching {100 * (rates.get('compute_efficiency') or 0):.0f}% of it. The GFLOP/s "
               "column is each row's own timing; the \"row's rates\" column is the error with it instead of the "
               f"median. Switch {result['switch_us']:.1f} us (the bench's handoff median). The measured speed-up is "
               "the median over the row's adjacent DBO-off / DBO-on step pairs of T_off / T_on, as the what-if "
               "check takes it."]
        if result.get("rates_at_steps"):
            out[0] += (" The machine's speed moves from minute to minute, so the bench also timed the same reference "
                       "layer once after every step of each row: the prediction takes the pooled rates at the speed "
                       "the layer ran beside the row's steps (the \"speed\" column: the pooled layer's time over "
                       "that one); the \"one set of rates\" column is the error with the pooled rates as they are.")
    else:
        out = [f"Rates measured now ({rates['ranks']} ranks at once, one thread each, on {rates['cores']} cores; "
               f"the slowest rank's medians): {rates['gflops']:.1f} GFLOP/s ({rates['shape']}, fp32), copy "
               f"{rates['copy_gbps']:.1f} GB/s, elementwise {rates['elementwise_gbps']:.1f} GB/s (SwiGLU), "
               f"{rates['op_us']:.2f} us per operator; one reference layer of {rates['layer_tokens']} tokens timed "
               f"at {rates['layer_ms']:.1f} ms against {rates['layer_predicted_ms']:.1f} ms at those rates, so the "
               f"matrix products reach {100 * rates['compute_efficiency']:.1f}% of the timed rate; switch "
               f"{result['switch_us']:.1f} us (the bench's handoff median). Load average (1, 5, 15 min) before and "
               f"after the timing: {' '.join(f'{x:.2f}' for x in result['load']['before'])} / "
               f"{' '.join(f'{x:.2f}' for x in result['load']['after'])}."]
    host = rates.get("host_gbps") or {}
    if host:
        out[0] += (" The collectives' host work: gloo moves their bytes at "
                   + ", ".join(f"{k.replace('_', '-')} {v:.2f}" for k, v in host.items())
                   + " GB/s of wire bytes"
                   + (" beyond a fixed " + ", ".join(f"{v:.0f}" for v in rates["host_call_us"].values())
                      + " us per call" if rates.get("host_call_us") else "")
                   + " (timed in the same ranks), with DBO on taken from the compute beside them; "
                   "the error without it is the last column.")
    out += ["",
            "| pattern | tokens | link | GFLOP/s, layer efficiency | off ms (meas / pred) | compute ms (meas / pred) "
            "| comm ms (meas / pred) | speed-up measured | speed-up predicted | error | | error, the row's rates "
            "| host work ms | error without host work | speed | error, one set of rates |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for x in result["rows"]:
        mark = ("ok" if x["within"] else "**miss**") + (" (disturbed)" if x["disturbed"] else "")
        eff = "" if x["compute_efficiency"] is None else f", {100 * x['compute_efficiency']:.0f}%"
        gflops = f"{x['row_gflops']:.1f}" if x.get("row_gflops") is not None else f"{x['gflops']:.1f}{eff}"
        row_err = "-" if x.get("error_row_rates") is None else f"{100 * x['error_row_rates']:+.1f}%"
        out.append(f"| {x['pattern']} | {x['tokens']} | {x['link']} | {gflops} "
                   f"| {x['t_off_ms']:.0f} / {x['pred_off_ms']:.0f} "
                   f"| {x['t_compute_ms']:.0f} / {x['pred_compute_ms']:.0f} | {x['t_comm_ms']:.0f} / "
                   f"{x['pred_comm_ms']:.0f} | {x['speedup']:.3f} | {x['pred_speedup']:.3f} | "
                   f"{100 * x['error']:+.1f}% | {mark} | {row_err} | {x.get('host_work_ms') or 0:.1f} | "
                   + ("-" if x.get("error_without_host_work") is None else f"{100 * x['error_without_host_work']:+.1f}%")
                   + " | " + ("-" if x.get("speed_at_steps") is None else f"{x['speed_at_steps']:.2f}")
                   + " | " + ("-" if x.get("error_one_rate_set") is None else f"{100 * x['error_one_rate_set']:+.1f}%")
                   + " |")
    s = result["summary"]
    out += ["", f"Within 10%: {s['within_10pct']} of {s['long_step_rows']} rows with a step over {LONG_STEP_MS:g} ms "
            f"({s['undisturbed_within_10pct']} of {s['undisturbed_rows']} undisturbed rows); largest error "
            f"{100 * (s['max_abs_error'] or 0):.1f}%"
            + (f"; with each row's own rates: {s['within_10pct_row_rates']} of {s['long_step_rows']}"
               if s.get("within_10pct_row_rates") is not None else "")
            + (f"; without the host work: {s['within_10pct_without_host_work']} of {s['long_step_rows']}"
               if s.get("within_10pct_without_host_work") is not None else "")
            + (f"; with one set of rates: {s['within_10pct_one_rate_set']} of {s['long_step_rows']}"
               if s.get("within_10pct_one_rate_set") is not None else "") + "."]
    return "\n".join(out)


def bench_check(bench: dict) -> tuple[str, dict, str] | None:
    """For :func:`dbo_runtime.reference.bench.run_bench`'s ``checks``: the check of a sweep whose rows carry the rates
    timed beside them (None for one without: its rates would be timed now, minutes from its rows)."""
    if not bench["rows"] or not all(r.get("cpu_rates") for r in bench["rows"]):
        return None
    result = validate(bench)
    return "estimate_check", result, "## Estimate check (`dbo-runtime estimate`, no profile)\n\n" + markdown(result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="?", default="bench-results/dbo_runtime.json", help="a `dbo-runtime bench` JSON")
    ap.add_argument("--format", choices=("md", "json"), default="md")
    args = ap.parse_args(argv)
    try:
        bench = json.loads(Path(args.bench).read_text())
        bench["rows"], bench["model"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"validate_estimate: {args.bench}: not a readable `dbo-runtime bench` JSON ({exc})", file=sys.stderr)
        return 2
    try:
        result = validate(bench)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a JSON of another layout than the bench's
        print(f"validate_estimate: {args.bench}: not a `dbo-runtime bench` JSON ({type(exc).__name__}: {exc} in its "
              "rows or model); accepted: the dbo_runtime.json that `dbo-runtime bench --out DIR` writes",
              file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.format == "json" else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
