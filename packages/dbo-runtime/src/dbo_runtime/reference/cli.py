"""``dbo-runtime reference``: run the reference MoE model on local gloo ranks and print where the time goes."""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

from dbo_runtime.comm import LINK_STAND_IN_NOTE, LinkModel
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.reference.model import DTYPES, PATTERNS, Batch, MoEConfig
from dbo_runtime.ubatch import (
    DEFAULT_DECODE_TOKEN_THRESHOLD,
    DEFAULT_PREFILL_TOKEN_THRESHOLD,
    SUPPORTED_NUM_UBATCHES,
)

__all__ = ["add_parser", "build_spec", "run", "format_report"]

MAX_RANKS = 8


def _positive_int(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is invalid; accepted: an integer >= {minimum}")
        return value

    return parse


def _link(text: str) -> str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return LinkModel.parse(text).spec()
    except DBOConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "reference",
        help="run the reference MoE model on local gloo ranks, DBO on or off",
        description="Run a DeepSeek-style MoE decoder on local gloo ranks (expert parallel, pattern A2 or A3) with "
        "dual batch overlap on or off, and print step, compute and communication time. The link between ranks "
        "is MODELLED (latency + bytes/bandwidth), a stand-in for HCCS.",
    )
    p.add_argument("--pattern", choices=PATTERNS, default="a2", help="a2: all-gather/reduce-scatter; a3: all-to-all")
    p.add_argument("--dbo", choices=("on", "off"), default="on")
    p.add_argument("--ranks", type=_positive_int("--ranks", 2), default=2, help="number of local ranks (default 2)")
    p.add_argument("--tokens", type=_positive_int("--tokens"), default=1024, help="tokens per rank (default 1024)")
    p.add_argument("--requests", type=_positive_int("--requests"), default=4, help="requests per rank (prefill)")
    p.add_argument("--decode", action="store_true", help="a decode batch: --tokens requests of one token each")
    p.add_argument("--context", type=_positive_int("--context", 0), default=0, help="tokens already in the KV cache")
    p.add_argument("--layers", type=_positive_int("--layers"), default=4)
    p.add_argument("--experts", type=_positive_int("--experts"), default=8)
    p.add_argument("--hidden", type=_positive_int("--hidden", 8), default=MoEConfig.hidden_size)
    p.add_argument("--intermediate", type=_positive_int("--intermediate"), default=MoEConfig.expert_intermediate,
                   help="intermediate size of each routed expert and of the shared expert "
                   f"(default {MoEConfig.expert_intermediate})")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument(
        "--link",
        type=_link,
        default="auto",
        help="LAT_US,GBPS (e.g. 20,0.05), 'none', or 'auto' (default: calibrated so communication is about 40%% "
        "of a DBO-off step)",
    )
    p.add_argument("--ubatches", type=int, default=SUPPORTED_NUM_UBATCHES, help="micro-batches (only 2 is supported)")
    p.add_argument("--decode-threshold", type=_positive_int("--decode-threshold", 2), default=DEFAULT_DECODE_TOKEN_THRESHOLD)
    p.add_argument("--prefill-threshold", type=_positive_int("--prefill-threshold", 2), default=DEFAULT_PREFILL_TOKEN_THRESHOLD)
    p.add_argument("--steps", type=_positive_int("--steps"), default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=_positive_int("--warmup", 0), default=1)
    p.add_argument("--trace", metavar="DIR", help="write a PyTorch profiler (Kineto) trace per rank of the last step")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a hung run is stopped")
    p.set_defaults(func=run)
    p.error = types.MethodType(_one_line_error, p)  # type: ignore[method-assign]
    return p


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> None:
    """Bad input: one line naming it and what is accepted, exit code 2 (the project's CLI convention)."""
    parser.exit(2, f"{parser.prog}: {message}\n")


def build_spec(args: argparse.Namespace):
    from dbo_runtime.reference.run import RunSpec

    if args.ubatches != SUPPORTED_NUM_UBATCHES:
        raise DBOConfigError(f"--ubatches {args.ubatches} is invalid; accepted: {SUPPORTED_NUM_UBATCHES}")
    if args.ranks > MAX_RANKS:
        raise DBOConfigError(f"--ranks {args.ranks} is invalid; accepted: 2..{MAX_RANKS} on one machine")
    config = MoEConfig(num_layers=args.layers, num_experts=args.experts, hidden_size=args.hidden,
                       expert_intermediate=args.intermediate, shared_intermediate=args.intermediate)
    config.validate(args.ranks)
    if args.decode:
        batch = Batch.decode(args.tokens, max(args.context, 1))
    else:
        if args.requests > args.tokens:
            raise DBOConfigError(f"--requests {args.requests} exceeds --tokens {args.tokens}; accepted: <= tokens")
        base, extra = divmod(args.tokens, args.requests)
        batch = Batch.prefill([base + (1 if i < extra else 0) for i in range(args.requests)], args.context)
    if args.trace:
        target = Path(args.trace)
        if target.exists() and not target.is_dir():
            raise DBOConfigError(f"--trace {args.trace!r} is a file; accepted: a directory (created if missing)")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise DBOConfigError(f"--timeout {args.timeout!r} is invalid; accepted: seconds > 0")
    return RunSpec(
        pattern=args.pattern,
        dbo=args.dbo == "on",
        config=config,
        batch=batch,
        dtype=args.dtype,
        link=args.link,
        steps=args.steps,
        warmup=args.warmup,
        decode_threshold=args.decode_threshold,
        prefill_threshold=args.prefill_threshold,
        trace_dir=str(Path(args.trace).resolve()) if args.trace else None,
        timeout_s=min(args.timeout, 60.0),
        expected_world_size=args.ranks,
    )


def format_report(spec: Any, results: list[dict[str, Any]], ranks: int) -> str:
    run0 = results[0]["runs"][0]
    step = max(r["runs"][0]["step_s"] for r in results)
    compute = max(r["runs"][0]["compute_s"] for r in results)
    comm = max(r["runs"][0]["comm_s"] for r in results)
    kind = "decode" if spec.batch.is_decode_only else "prefill"
    if run0["split"]:
        mode = "on (split into 2 micro-batches)"
    elif spec.dbo:
        mode = "on, but this batch is below the threshold: not split, plain path"
    else:
        mode = "off"
    link = results[0]["link_text"] + (" [auto: calibrated so communication is ~40% of a DBO-off step]"
                                      if results[0]["calibrated"] else "")  # fmt: skip
    lines = [
        f"dbo-runtime reference: pattern {spec.pattern}, DBO {mode}, {ranks} ranks, "
        f"{spec.batch.num_tokens} tokens per rank ({kind}, {spec.batch.num_requests} requests), "
        f"{spec.config.num_layers} layers, {spec.dtype}",
        f"link: {link}",
        f"  note: {LINK_STAND_IN_NOTE}",
        f"step time      {step * 1e3:9.1f} ms   (median of {spec.steps} steps, slowest rank)",
        f"compute        {compute * 1e3:9.1f} ms",
        f"communication  {comm * 1e3:9.1f} ms   ({run0['num_collectives']} collectives in flight, launch to "
        f"completion; {run0['wire_bytes'] / 1e6:.2f} MB on the wire per rank)",
    ]
    if spec.trace_dir:
        lines.append(f"trace: {spec.trace_dir} (one Kineto trace per rank; span names in docs/dbo.md)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dbo_runtime.reference.launcher import RanksFailed, run_ranks

    try:
        spec = build_spec(args)
    except DBOConfigError as exc:
        print(f"dbo-runtime reference: {exc}", file=sys.stderr)
        return 2
    try:
        results = run_ranks(
            "dbo_runtime.reference.run:reference_task",
            spec,
            world_size=args.ranks,
            timeout_s=args.timeout,
            pg_timeout_s=min(args.timeout, 60.0),
        )
    except RanksFailed as exc:
        for err in exc.errors:
            print(f"dbo-runtime reference: {err.line()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"spec": {"pattern": spec.pattern, "dbo": spec.dbo, "ranks": args.ranks,
                                   "tokens": spec.batch.num_tokens, "layers": spec.config.num_layers},
                          "link_note": LINK_STAND_IN_NOTE, "ranks": results}, indent=2))  # fmt: skip
    else:
        print(format_report(spec, results, args.ranks))
    return 0
