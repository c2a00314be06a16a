"""``dbo-runtime reference``: run the reference MoE model on local gloo ranks and print where the time goes.

The DBO flags are vLLM's (``--enable-dbo``, ``--dbo-prefill-token-threshold``, ``--dbo-decode-token-threshold``,
``--ubatch-size``). Every value is checked before a rank starts: a bad one is one line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from toolkit_cli import BoundedInt, NumberType, PositiveInt, format_option, output_option, write_output

from dbo_runtime.commands._params import SECONDS, WritableDir
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.ubatch import (
    DEFAULT_DECODE_TOKEN_THRESHOLD,
    DEFAULT_PREFILL_TOKEN_THRESHOLD,
    SUPPORTED_NUM_UBATCHES,
)

__all__ = ["reference", "build_spec", "format_report", "MAX_RANKS", "MAX_TOKENS"]

MAX_RANKS = 8
# Far above any batch one step of a real server runs (vLLM's max_num_batched_tokens is a few thousand to 64k),
# low enough that a typo is refused before a rank allocates anything.
MAX_TOKENS = 1 << 18
MAX_CONTEXT = 1 << 20
MAX_LAYERS = 1024
MAX_EXPERTS = 256
MAX_HIDDEN = 1 << 16
MAX_INTERMEDIATE = 1 << 18
MAX_STEPS = 100_000
MAX_THRESHOLD = 1 << 30
PATTERN_CHOICES = ("a2", "a3")  # dbo_runtime.reference.model.PATTERNS (kept here so --help does not load torch)
DTYPE_CHOICES = ("float32", "bfloat16")  # dbo_runtime.reference.model.DTYPES
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LINK_LATENCY_US_MAX = 10_000.0  # dbo_runtime.reference.comm's (kept here so --help does not load torch)
LINK_GBPS_RANGE = (1e-3, 1e4)
SCHEDULER_CHOICES = ("thread", "greenlet")  # dbo_runtime.workers.SCHEDULERS (kept here so --help does not load torch)


class LinkParam(NumberType):
    """``LAT_US,GBPS``, ``none`` or ``auto``; normalised to the text the ranks parse back."""

    name = "link"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "LAT_US,GBPS|none|auto"

    @property
    def expected(self) -> str:
        return "LAT_US,GBPS, 'none' or 'auto'"

    def convert_number(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from dbo_runtime.reference.comm import LinkModel

        text = str(value)
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return LinkModel.parse(text[:200]).spec()
        except DBOConfigError as exc:
            self.fail(str(exc).removeprefix("--link "), param, ctx)


def _int(minimum: int, maximum: int, what: str) -> BoundedInt:
    return BoundedInt(minimum, maximum, what=what)


def _memory_available() -> int | None:
    """MemAvailable of this machine in bytes (None where /proc/meminfo cannot say)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def estimated_bytes(config: Any, tokens: int, context: int, ranks: int, dtype: str) -> int:
    """A generous estimate of what all ranks together allocate: weights, KV cache and the largest activations."""
    size = DTYPE_BYTES[dtype]
    attn = config.num_heads * config.head_dim
    per_layer_weights = (4 * config.hidden_size * attn + config.hidden_size * config.num_experts
                         + 3 * config.hidden_size * config.shared_intermediate
                         + (config.num_experts // ranks) * 3 * config.hidden_size * config.expert_intermediate)
    kv = 2 * (tokens + context) * attn
    # all-gathered tokens (A2) times the widest intermediate, a few live copies
    activations = 4 * ranks * tokens * max(config.hidden_size, config.top_k * config.expert_intermediate
                                             + config.shared_intermediate, attn)
    return ranks * size * (config.num_layers * (per_layer_weights + kv) + activations)


def build_spec(*, pattern: str, enable_dbo: bool, ranks: int, tokens: int, requests: int, decode: bool,
               context: int, layers: int, experts: int, hidden: int, intermediate: int, dtype: str, link: str,
               ubatch_size: int, dbo_decode_token_threshold: int, dbo_prefill_token_threshold: int, steps: int,
               warmup: int, trace: Path | None, timeout: float, dbo_scheduler: str = "thread", **_: Any):
    """The run these options describe, or DBOConfigError naming the option that cannot be run."""
    from dbo_runtime.reference.model import Batch, MoEConfig
    from dbo_runtime.reference.run import RunSpec

    if ubatch_size not in (0, SUPPORTED_NUM_UBATCHES):
        raise DBOConfigError(f"--ubatch-size {ubatch_size} is not supported; accepted: {SUPPORTED_NUM_UBATCHES} "
                             "(dual batch overlap) or 0 (the default, 2 with --enable-dbo)")
    config = MoEConfig(num_layers=layers, num_experts=experts, hidden_size=hidden,
                       expert_intermediate=intermediate, shared_intermediate=intermediate)
    try:
        config.validate(ranks)
    except DBOConfigError as exc:
        raise DBOConfigError(f"--experts {experts} with --ranks {ranks}: {exc}") from None
    if decode:
        batch = Batch.decode(tokens, max(context, 1))
    else:
        if requests > tokens:
            raise DBOConfigError(f"--requests {requests} exceeds --tokens {tokens}; accepted: <= tokens")
        base, extra = divmod(tokens, requests)
        batch = Batch.prefill([base + (1 if i < extra else 0) for i in range(requests)], context)
    need = estimated_bytes(config, tokens, context, ranks, dtype)
    available = _memory_available()
    if available is not None and need > available:
        raise DBOConfigError(f"--tokens {tokens}, --layers {layers}, --hidden {hidden}, --intermediate {intermediate} "
                             f"on {ranks} ranks need about {need / 2**30:.1f} GiB; this machine has "
                             f"{available / 2**30:.1f} GiB available: accepted: a smaller model or batch")
    return RunSpec(
        pattern=pattern,
        dbo=enable_dbo,
        config=config,
        batch=batch,
        dtype=dtype,
        link=link,
        steps=steps,
        warmup=warmup,
        decode_threshold=dbo_decode_token_threshold,
        prefill_threshold=dbo_prefill_token_threshold,
        trace_dir=str(trace.resolve()) if trace is not None else None,
        timeout_s=min(timeout, 60.0),
        expected_world_size=ranks,
        scheduler=dbo_scheduler,
    )


def format_report(spec: Any, results: list[dict[str, Any]], ranks: int) -> str:
    from dbo_runtime.reference.comm import LINK_STAND_IN_NOTE

    run0 = results[0]["runs"][0]
    step = max(r["runs"][0]["step_s"] for r in results)
    compute = max(r["runs"][0]["compute_s"] for r in results)
    comm = max(r["runs"][0]["comm_s"] for r in results)
    kind = "decode" if spec.batch.is_decode_only else "prefill"
    if run0["split"]:
        mode = f"on (split into 2 micro-batches, {spec.scheduler} scheduler)"
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


@click.command(
    "reference",
    short_help="run the reference MoE model on local gloo ranks, DBO on or off",
    help="Run a DeepSeek-style MoE decoder on local gloo ranks (expert parallel, pattern A2 or A3) with dual batch "
    "overlap on or off, and print step, compute and communication time. The link between ranks is MODELLED "
    "(latency + bytes/bandwidth), a stand-in for HCCS. The DBO flags are vLLM's.",
)
@click.option("--pattern", type=click.Choice(PATTERN_CHOICES), default="a2", show_default=True,
              help="a2: all-gather/reduce-scatter; a3: all-to-all")
@click.option("--enable-dbo/--no-enable-dbo", default=True, show_default=True,
              help="dual batch overlap (vLLM's flag); --no-enable-dbo runs the plain path")
@click.option("--ranks", type=_int(2, MAX_RANKS, "local ranks"), default=2, show_default=True, metavar="N",
              help="number of local ranks")
@click.option("--tokens", type=PositiveInt(MAX_TOKENS, what="tokens per rank"), default=1024, show_default=True,
              metavar="N", help="tokens per rank")
@click.option("--requests", type=PositiveInt(MAX_TOKENS, what="requests per rank"), default=4, show_default=True,
              metavar="N", help="requests per rank (prefill)")
@click.option("--decode", is_flag=True, help="a decode batch: --tokens requests of one token each")
@click.option("--context", type=_int(0, MAX_CONTEXT, "tokens already in the KV cache"), default=0, show_default=True,
              metavar="N", help="tokens already in the KV cache")
@click.option("--layers", type=PositiveInt(MAX_LAYERS, what="layers"), default=4, show_default=True, metavar="N")
@click.option("--experts", type=PositiveInt(MAX_EXPERTS, what="routed experts"), default=8, show_default=True,
              metavar="N")
@click.option("--hidden", type=_int(8, MAX_HIDDEN, "hidden size"), default=256, show_default=True, metavar="N")
@click.option("--intermediate", type=PositiveInt(MAX_INTERMEDIATE, what="intermediate size"), default=2048,
              show_default=True, metavar="N",
              help="intermediate size of each routed expert and of the shared expert")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True)
@click.option("--link", type=LinkParam(), default="auto", show_default=True,
              help=f"LAT_US,GBPS (e.g. 20,0.05; latency 0-{LINK_LATENCY_US_MAX:g} us, bandwidth "
              f"{LINK_GBPS_RANGE[0]:g}-{LINK_GBPS_RANGE[1]:g} GB/s or inf), 'none', or 'auto' (calibrated so "
              "communication is about 40% of a DBO-off step)")
@click.option("--ubatch-size", type=_int(0, 1 << 10, "micro-batches"), default=0, show_default=True, metavar="N",
              help=f"micro-batches (vLLM's flag): {SUPPORTED_NUM_UBATCHES}, or 0 for DBO's {SUPPORTED_NUM_UBATCHES}")
@click.option("--dbo-decode-token-threshold", type=_int(2, MAX_THRESHOLD, "decode token threshold"),
              default=DEFAULT_DECODE_TOKEN_THRESHOLD, show_default=True, metavar="N",
              help="a decode-only batch splits above this many tokens (vLLM's flag)")
@click.option("--dbo-prefill-token-threshold", type=_int(2, MAX_THRESHOLD, "prefill token threshold"),
              default=DEFAULT_PREFILL_TOKEN_THRESHOLD, show_default=True, metavar="N",
              help="a batch with a prefill splits above this many tokens (vLLM's flag)")
@click.option("--dbo-scheduler", type=click.Choice(SCHEDULER_CHOICES), default="thread", show_default=True,
              envvar="DBO_RUNTIME_SCHEDULER", show_envvar=True,
              help="how the two micro-batches run: one OS thread each handing off through events (upstream vLLM's "
              "design) or both on one thread as greenlets (a switch costs well under a microsecond)")
@click.option("--steps", type=PositiveInt(MAX_STEPS, what="timed steps"), default=5, show_default=True, metavar="N",
              help="timed steps (median reported)")
@click.option("--warmup", type=_int(0, MAX_STEPS, "warm-up steps"), default=1, show_default=True, metavar="N")
@click.option("--trace", type=WritableDir(), default=None,
              help="write a PyTorch profiler (Kineto) trace per rank of the last step into DIR (created if missing)")
@format_option("text", "json")
@output_option()
@click.option("--timeout", type=SECONDS, default=120.0, show_default=True, metavar="SECONDS",
              help="seconds before a hung run is stopped")
def reference(**options: Any) -> int:
    from dbo_runtime.reference.comm import LINK_STAND_IN_NOTE
    from dbo_runtime.reference.launcher import RanksFailed, run_ranks

    spec = build_spec(**options)
    ranks, timeout = options["ranks"], options["timeout"]
    try:
        results = run_ranks("dbo_runtime.reference.run:reference_task", spec, world_size=ranks, timeout_s=timeout,
                            pg_timeout_s=min(timeout, 60.0))
    except RanksFailed as exc:
        for err in exc.errors:
            click.echo(f"dbo-runtime reference: {err.line()}", err=True)
        return 1
    if options["format"] == "json":
        text = json.dumps({"spec": {"pattern": spec.pattern, "dbo": spec.dbo, "scheduler": spec.scheduler, "ranks": ranks,
                                    "tokens": spec.batch.num_tokens, "layers": spec.config.num_layers},
                           "link_note": LINK_STAND_IN_NOTE, "ranks": results}, indent=2)  # fmt: skip
    else:
        text = format_report(spec, results, ranks)
    write_output(options["output"], text + "\n")
    return 0

