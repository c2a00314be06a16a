"""``dbo-runtime estimate``: when does DBO pay? A step with DBO off and on predicted from config and rates."""

from __future__ import annotations

import json
import os
from typing import Any

import click
from toolkit_cli import PositiveInt, format_option, output_option, write_output

from dbo_runtime.commands._params import BoundedFloat
from dbo_runtime.errors import DBOConfigError

__all__ = ["estimate"]

MAX_TOKENS = 1 << 20
MAX_RANKS = 1 << 16


def _format_text(result: dict[str, Any]) -> str:
    m, hw, par = result["model"], result["hardware"], result["parallel"]
    lines = [
        f"model {m['name']}: {m['layers']} layers ({m['moe_layers']} MoE), hidden {m['hidden_size']}, "
        + (f"{m['experts']} experts top-{m['top_k']} x {m['moe_intermediate_size']}, shared {m['shared_intermediate_size']}"
           if m["experts"] else f"dense MLP {m['intermediate_size']}") + f", {m['dtype']}",
        f"hardware {hw['name']}: {hw['tflops'] * hw['compute_efficiency']:.4g} TFLOP/s, "
        f"{hw['mem_bw_gbps'] * hw['mem_efficiency']:.4g} GB/s memory, link {hw['link_gbps']:.4g} GB/s "
        f"(x{hw['link_efficiency']:g}), latency {', '.join(f'{k} {v:g} us' for k, v in hw['latency_us'].items())}",
        f"parallel: TP {par['tensor_parallel_size']} x DP {par['data_parallel_size']}"
        f"{', expert parallel' if par['enable_expert_parallel'] else ''} (MoE group {par['moe_group']}); "
        f"scheduler {result['scheduler']}, switch {result['switch_us']:g} us",
    ]
    if hw.get("measured"):
        lines.append(f"measured here: {hw['measured']['gflops']:.1f} GFLOP/s on {hw['measured']['shape']}, "
                     f"copy {hw['measured']['copy_gbps']:.1f} GB/s")
    if hw.get("host_gbps"):
        lines.append("collectives' host work (the backend moving the bytes with this CPU's cores, taken from the compute "
                     "beside it with DBO on): "
                     + ", ".join(f"{k} {v:.3g} GB/s" + (f" + {hw['host_call_us'][k]:.0f} us per call"
                                                         if hw.get("host_call_us", {}).get(k) else "")
                                 for k, v in hw["host_gbps"].items()))
    eh = hw.get("engine_host") or {}
    if eh:
        per_kind = lambda key: ", ".join(f"{k} {v:.0f} us" for k, v in (eh.get(key) or {}).items()) or "-"  # noqa: E731
        lines.append(f"engine host term ({eh.get('source', 'given')}): model code {eh.get('layer_us', 0):.0f} us per "
                     f"layer per pass, step {eh.get('step_us', 0):.0f} us (+{eh.get('split_step_us', 0):.0f} us split), "
                     f"handoff {', '.join(f'{k} {v:.0f} us' for k, v in (eh.get('handoff_us') or {}).items()) or '-'}; "
                     f"collective per call: DBO off (synchronous) {per_kind('sync_us')}, DBO on (asynchronous) "
                     f"{per_kind('async_us')} + gap to the next {per_kind('async_gap_us')}")
    if hw.get("matrix_curve"):
        lines.append("matrix rate by token rows (x the rate above): "
                     + ", ".join(f"{r:g}: {f:.2f}" for r, f in hw["matrix_curve"]))
    for p in result["patterns"]:
        lines.append("")
        lines.append(f"pattern {p['pattern']}")
        lines.append(f"  {'step':<8} {'tokens':>7} {'off ms':>10} {'on ms':>10} {'speed-up':>9} {'compute ms':>11} "
                     f"{'comm ms':>9}  pays")
        for r in p["rows"]:
            lines.append(f"  {r['kind']:<8} {r['tokens']:>7} {r['off_us'] / 1e3:>10.3f} {r['on_us'] / 1e3:>10.3f} "
                         f"{r['speedup']:>9.3f} {r['compute_us'] / 1e3:>11.3f} {r['comm_us'] / 1e3:>9.3f}  "
                         f"{'yes' if r['pays'] else 'no'}")
        if p["rows"]:
            lines.append("  per layer (whole batch / one micro-batch, us), first row:")
            for lk in p["rows"][0]["layer_kinds"]:
                segs = "; ".join(f"{s['name']} {s['full_us']:.1f}/{s['part_us']:.1f}" for s in lk["segments"])
                lines.append(f"    {lk['count']} x {lk['kind']}: {segs}")
        limit = result["workload"]["max_tokens_searched"]
        for kind, n in p["pays_from"].items():
            flag = f"--dbo-{kind}-token-threshold"
            lines.append(f"  {kind}: DBO pays from {n} tokens per rank -> {flag} {n}" if n is not None else
                         f"  {kind}: DBO does not pay up to {limit} tokens per rank -> leave DBO off for {kind} "
                         f"(or {flag} above {limit})")
    return "\n".join(lines)


@click.command(
    "estimate",
    short_help="predict DBO off vs on from a model's config and hardware rates; recommend the token thresholds",
    help="When does DBO pay? From MODEL's config.json (a kv-capacity preset, a file or a model directory) and the "
    "hardware's rates (matrix TFLOP/s, memory bandwidth, link bandwidth and latency per collective kind), predict per "
    "layer the compute and each collective (A2: all-gather/reduce-scatter around the MoE; A3: all-to-all dispatch/"
    "combine with expert parallel; dense TP: all-reduce), then the step with DBO off and on (the two micro-batches "
    "simulated by profile_analyzer.whatif, switch cost included), the token count from which DBO pays, and the "
    "--dbo-decode-token-threshold / --dbo-prefill-token-threshold to set. Own numbers: --hardware-file (JSON/YAML "
    "with a preset's fields, e.g. this command's --format json 'hardware') or --tflops/--mem-bw-gbps/--link-gbps/"
    "--link-latency-us over a preset. Token counts are per data-parallel rank, as vLLM's thresholds count them.",
)
@click.option("--model", required=True, metavar="MODEL",
              help="a kv-capacity preset name, a config.json, or a model directory")
@click.option("--tokens", "tokens", type=PositiveInt(MAX_TOKENS, what="tokens per rank"), multiple=True,
              metavar="N", help="token counts per rank to tabulate (repeatable; default 32 128 512 2048)")
@click.option("--tensor-parallel-size", "-tp", type=PositiveInt(MAX_RANKS, what="tensor-parallel ranks"), default=1,
              show_default=True, metavar="N")
@click.option("--data-parallel-size", "-dp", type=PositiveInt(MAX_RANKS, what="data-parallel ranks"), default=1,
              show_default=True, metavar="N")
@click.option("--enable-expert-parallel", is_flag=True, help="experts split over TP x DP ranks (enables pattern a3)")
@click.option("--pattern", "patterns", type=click.Choice(["a2", "a3", "tp"]), multiple=True,
              help="communication pattern(s); default: a2, plus a3 with --enable-expert-parallel; tp for dense models")
@click.option("--step", type=click.Choice(["decode", "prefill", "both"]), default="both", show_default=True,
              help="which step kind(s) to predict and recommend a threshold for")
@click.option("--context-len", type=PositiveInt(MAX_TOKENS * 16, what="cached tokens per request"), default=2048,
              show_default=True, metavar="N", help="decode: tokens already in each request's KV cache")
@click.option("--prompt-len", type=PositiveInt(MAX_TOKENS * 16, what="prompt tokens per request"), default=2048,
              show_default=True, metavar="N", help="prefill: tokens per prompt (causal attention over them)")
@click.option("--max-tokens", type=PositiveInt(MAX_TOKENS, what="largest token count searched"), default=16384,
              show_default=True, metavar="N", help="search the pays-from token count up to N")
@click.option("--hardware", default="910B", show_default=True, metavar="NAME",
              help="a preset: 910B, 910C, H200, cpu-link (this CPU measured now, TP x DP ranks at once up to one per core, with the reference's link model)")
@click.option("--hardware-file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="JSON or YAML with a preset's fields (replaces --hardware)")
@click.option("--engine-host", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="the vLLM engine's host term measured on this machine (its Python per layer, per step, handoffs, "
              "the collectives as the engine runs them): `dbo-runtime step-profile --format json` output, or a JSON "
              "mapping of those keys; replaces the hardware's (cpu-link carries one measured on the machine of "
              "2026-12-05)")
@click.option("--tflops", type=BoundedFloat(above=0, what="matrix TFLOP/s reached"), default=None, metavar="X")
@click.option("--mem-bw-gbps", type=BoundedFloat(above=0, what="memory GB/s reached"), default=None, metavar="X")
@click.option("--link-gbps", type=BoundedFloat(above=0, what="link GB/s reached per rank"), default=None, metavar="X")
@click.option("--link-latency-us", type=BoundedFloat(minimum=0, what="latency per collective, us"), default=None,
              metavar="X")
@click.option("--dbo-scheduler", type=click.Choice(["thread", "greenlet"]), default="thread", show_default=True,
              help="whose switch cost to charge (the preset's figure for that scheduler)")
@click.option("--switch-us", type=BoundedFloat(minimum=0, what="micro-batch switch cost, us"), default=None,
              metavar="X", help="micro-batch switch cost (default: the preset's, for --dbo-scheduler)")
@format_option("text", "json")
@output_option()
def estimate(**o: Any) -> int:
    from kv_capacity import KVCapacityInputError, load_compute_spec

    from dbo_runtime import estimate as est

    try:
        spec = load_compute_spec(o["model"])
    except KVCapacityInputError as exc:
        raise DBOConfigError(f"--model: {exc}") from None
    hw = est.hardware_from_file(o["hardware_file"]) if o["hardware_file"] else est.hardware_preset(o["hardware"])
    # read before the rates are timed (which takes minutes on a large model's shapes): bad input fails at once
    host = est.load_engine_host(o["engine_host"]) if o["engine_host"] else None
    par = est.Parallel(o["tensor_parallel_size"], o["data_parallel_size"], o["enable_expert_parallel"])
    if hw.name == "cpu-link" and not o["hardware_file"] and o["tflops"] is None:
        # every rank runs on this CPU, as the reference model's do: time the rates with that many at once (at most
        # one per core: more would only time the operating system's time slicing)
        ranks = max(1, min(o["tensor_parallel_size"] * o["data_parallel_size"], os.cpu_count() or 1))
        hw = est.with_measured_cpu(hw, spec, ranks=ranks)
    if host is not None:
        hw = est.with_engine_host(hw, host)
    hw = est.with_overrides(hw, tflops=o["tflops"], mem_bw_gbps=o["mem_bw_gbps"], link_gbps=o["link_gbps"],
                            link_latency_us=o["link_latency_us"])
    patterns = est.patterns_for(spec, par, o["patterns"])
    kinds = ["decode", "prefill"] if o["step"] == "both" else [o["step"]]
    tokens = list(o["tokens"]) or [32, 128, 512, 2048]
    result = est.estimate(spec, hw, par, tokens=tokens, kinds=kinds, patterns=patterns, scheduler=o["dbo_scheduler"],
                          switch_us=o["switch_us"], context_len=o["context_len"], prompt_len=o["prompt_len"],
                          max_tokens=max(o["max_tokens"], 2))
    text = json.dumps(result, indent=2) if o["format"] == "json" else _format_text(result)
    write_output(o["output"], text + "\n")
    return 0
