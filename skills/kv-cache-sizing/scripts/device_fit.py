#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = []  # standard library; it runs the `kv-capacity` command for the KV figures
# ///
"""Does a KV-cache budget plus the model's weights fit one device, and if not, what does?

    python scripts/device_fit.py --model MODEL --device NAME [-tp N] --max-model-len L --max-num-seqs N
    python scripts/device_fit.py --model MODEL --device NAME [-tp N] --max-model-len L --kv-cache-memory-bytes SIZE

The budget is what `kv-capacity required` gives for N requests of L tokens, or the SIZE you name. The
weights per device come from the model folder's *.safetensors files when MODEL is a folder that has them,
else from the parameter count (config.json, or the published count of a bundled kv-capacity preset),
divided by the tensor-parallel size. A device fits when

    weights per device + KV budget + headroom  <=  device memory x gpu-memory-utilization

(headroom: activations of the largest batch, ACL/CUDA graphs and the runtime's own buffers, which the
budget does not include; 2 GiB unless --headroom says otherwise). When it does not fit, it prints what
would: an fp8 KV cache, twice the tensor-parallel size, the longest context at which N requests fit,
the most whole requests at L tokens, and the largest budget. Each figure comes from `kv-capacity`.

Exit codes: 0 fits, 1 does not fit (the alternatives are printed), 2 bad input or no `kv-capacity`.
Devices: --device names one of the table below (nominal memory; the runtime sees a little less: pass
--device-memory with the total of the "Free memory on device (x/y GiB)" log line or `npu-smi info`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

GIB = 1024**3

# Nominal device memory in GiB; "npu" devices print "NPU KV cache size" in vLLM's log.
DEVICES: dict[str, tuple[float, str, str]] = {
    "910B1": (64, "npu", "Atlas A2 (Ascend 910B1)"),
    "910B2": (64, "npu", "Atlas A2 (Ascend 910B2)"),
    "910B2C": (64, "npu", "Atlas A2 (Ascend 910B2C)"),
    "910B3": (64, "npu", "Atlas A2 (Ascend 910B3)"),
    "910B4": (32, "npu", "Atlas A2 (Ascend 910B4, 32 GB)"),
    "910C": (64, "npu", "Atlas A3 (Ascend 910C, one of the two dies of a package)"),
    "A100-40G": (40, "gpu", "NVIDIA A100 40GB"),
    "A100-80G": (80, "gpu", "NVIDIA A100 80GB"),
    "H100": (80, "gpu", "NVIDIA H100 80GB"),
    "H20": (96, "gpu", "NVIDIA H20 96GB"),
    "H200": (141, "gpu", "NVIDIA H200 141GB"),
    "L40S": (48, "gpu", "NVIDIA L40S 48GB"),
}
ALIASES = {"910B": "910B3", "A2": "910B3", "A3": "910C", "A100": "A100-80G"}

# Published parameter counts of kv-capacity's bundled presets (the model cards), and the checkpoint dtype.
PRESET_PARAMETERS: dict[str, tuple[float, str]] = {
    "deepseek-v2-lite": (15.7e9, "bfloat16"),
    "deepseek-v3": (671e9, "bfloat16"),
    "gemma-2-9b": (9.24e9, "bfloat16"),
    "gemma-3-12b": (12.2e9, "bfloat16"),
    "llama-3.1-8b": (8.03e9, "bfloat16"),
    "mistral-7b-v0.1": (7.24e9, "bfloat16"),
    "qwen2.5-7b": (7.62e9, "bfloat16"),
    "qwen3-30b-a3b": (30.5e9, "bfloat16"),
    "qwen3-8b": (8.19e9, "bfloat16"),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 2, "fp8": 1, "int8": 1}  # float32 is served as bf16
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


class FitError(Exception):
    """Bad input or a failed kv-capacity call; one line."""


def parse_gib(option: str, text: str) -> float:
    """`64`, `64G`, `61.3GiB` -> GiB (binary; a plain number is GiB)."""
    match = SIZE_RE.match(text)
    if not match:
        raise FitError(f"{option} {text!r}: expected a size in GiB such as 64, 61.3G or 61.3GiB")
    number, unit = float(match.group(1)), match.group(2).upper()
    scale = {"": 1.0, "K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}[unit]
    if number <= 0:
        raise FitError(f"{option} {text!r}: must be above 0")
    return number * scale


def parameters_from_config(config: dict[str, Any]) -> float:
    """Parameter count of a decoder-only transformer from its config.json (dense, MoE, MLA); an estimate."""
    c = config.get("text_config", config) if "hidden_size" not in config else config
    try:
        hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FitError(f"config.json lacks {exc} to count parameters: give --weights-gib") from None
    heads = int(c.get("num_attention_heads") or 1)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    if c.get("kv_lora_rank"):  # MLA
        rope, nope = int(c.get("qk_rope_head_dim", 64)), int(c.get("qk_nope_head_dim", 128))
        v_dim, kv_rank = int(c.get("v_head_dim", 128)), int(c["kv_lora_rank"])
        q_rank = c.get("q_lora_rank")
        q = hidden * heads * (nope + rope) if not q_rank else hidden * int(q_rank) + int(q_rank) * heads * (nope + rope)
        attention = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    else:
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    dense_mlp = 3 * hidden * int(c.get("intermediate_size") or 4 * hidden)
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or 0)
    if experts:
        expert_size = 3 * hidden * int(c.get("moe_intermediate_size") or c.get("intermediate_size"))
        shared = int(c.get("n_shared_experts") or 0) * expert_size
        moe_mlp = experts * expert_size + shared + hidden * experts
        dense_layers = int(c.get("first_k_dense_replace") or 0)
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return float(layers * attention + mlp_total + embeddings)


def weights_per_device(model: str, tp: int, weights_gib: float | None, dtype: str | None) -> tuple[float, str]:
    """(GiB of weights on one device, how it was found)."""
    if weights_gib is not None:
        return weights_gib, "given with --weights-gib"
    path = Path(model)
    folder = path if path.is_dir() else None
    if folder is not None:
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
        if files:
            total = sum(f.stat().st_size for f in files)
            return total / tp / GIB, f"{len(files)} weight file(s) in {folder}, {total / GIB:.2f} GiB / TP {tp}"
    config_path = folder / "config.json" if folder is not None else path
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FitError(f"--model {model}: cannot read {config_path} ({exc})") from None
        if not isinstance(config, dict):
            raise FitError(f"--model {model}: {config_path} is not a JSON object")
        params = parameters_from_config(config)
        torch_dtype = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        how = f"{params / 1e9:.2f} B parameters counted from {config_path.name}"
    elif model.lower() in PRESET_PARAMETERS:
        params, torch_dtype = PRESET_PARAMETERS[model.lower()]
        torch_dtype = dtype or torch_dtype
        how = f"{params / 1e9:.2f} B parameters (published count of {model.lower()})"
    else:
        raise FitError(f"--model {model}: not a model folder, a config.json or a bundled preset "
                       f"({', '.join(sorted(PRESET_PARAMETERS))}); or give --weights-gib")
    if torch_dtype not in DTYPE_BYTES:
        raise FitError(f"--weights-dtype {torch_dtype}: accepted: {', '.join(DTYPE_BYTES)}")
    size = params * DTYPE_BYTES[torch_dtype]
    return size / tp / GIB, f"{how} x {DTYPE_BYTES[torch_dtype]} B ({torch_dtype}) / TP {tp}"


class KvCapacity:
    """The `kv-capacity` command, called with --format json."""

    def __init__(self, command: str, model: str, common: list[str]) -> None:
        self.command = shlex.split(command)
        self.model = model
        self.common = common

    def _run(self, args: list[str]) -> dict[str, Any]:
        argv = [*self.command, *args, "--model", self.model, *self.common, "--format", "json"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            raise FitError(f"no `{self.command[0]}` command: install the toolkit's kv-capacity package "
                           "(see the skill's compatibility line) or pass --kv-capacity-cmd") from None
        if proc.returncode != 0:
            lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
            raise FitError(f"{' '.join(shlex.quote(a) for a in argv)}: {lines[-1]}")
        return json.loads(proc.stdout)

    def required(self, seqs: int, max_model_len: int, tp: int, dtype: str) -> dict[str, Any]:
        return self._run(["required", "--max-num-seqs", str(seqs), "--max-model-len", str(max_model_len),
                          "--tensor-parallel-size", str(tp), "--kv-cache-dtype", dtype])

    def plan(self, budget_bytes: int, max_model_len: int, tp: int, dtype: str) -> dict[str, Any]:
        return self._run(["plan", "--kv-cache-memory-bytes", str(budget_bytes), "--max-model-len", str(max_model_len),
                          "--tensor-parallel-size", str(tp), "--kv-cache-dtype", dtype])


def vllm_flag(size_bytes: int) -> str:
    """The largest whole-MiB budget not above size_bytes, in vLLM's syntax (upper-case M: binary)."""
    return f"{max(size_bytes // 2**20, 1)}M"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    device_key = ALIASES.get(args.device.upper(), args.device.upper())
    if device_key in DEVICES:
        nominal, platform, description = DEVICES[device_key]
    elif args.device_memory is not None:
        ascend = any(word in device_key for word in ("910", "310", "ASCEND", "NPU"))
        nominal, platform, description = args.device_memory, "npu" if ascend else "gpu", "memory given"
    else:
        raise FitError(f"--device {args.device}: accepted: {', '.join(DEVICES)} (or add --device-memory GIB)")
    memory = args.device_memory if args.device_memory is not None else nominal
    if not 0 < args.gpu_memory_utilization <= 1:
        raise FitError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    limit = memory * args.gpu_memory_utilization
    tp = args.tensor_parallel_size
    weights, weights_how = weights_per_device(args.model, tp, args.weights_gib, args.weights_dtype)
    kv = KvCapacity(args.kv_capacity_cmd, args.model, ["--block-size", str(args.block_size)])
    if args.max_num_seqs is not None:
        required = kv.required(args.max_num_seqs, args.max_model_len, tp, args.kv_cache_dtype)
        budget, plan = int(required["required_bytes"]), required["plan"]
        seqs = args.max_num_seqs
    else:
        plan = kv.plan(args.kv_cache_memory_bytes, args.max_model_len, tp, args.kv_cache_dtype)
        budget = int(plan["kv_cache_memory_bytes"])
        seqs = math.floor(plan["max_concurrency"])
    device_word = "NPU" if platform == "npu" else "GPU"
    total = weights + budget / GIB + args.headroom
    result: dict[str, Any] = {
        "device": device_key, "device_description": description, "device_memory_gib": memory,
        "gpu_memory_utilization": args.gpu_memory_utilization, "usable_gib": limit,
        "tensor_parallel_size": tp, "weights_per_device_gib": weights, "weights_source": weights_how,
        "kv_cache_memory_bytes": budget, "kv_cache_gib": budget / GIB,
        "kv_cache_flag": required["kv_cache_memory_bytes_flag"] if args.max_num_seqs is not None
        else str(args.kv_cache_memory_bytes),
        "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len,
        "whole_requests": math.floor(plan["max_concurrency"]), "max_concurrency": plan["max_concurrency"],
        "vllm_log": re.sub(r"^GPU ", f"{device_word} ", plan["vllm_log"]),
        "headroom_gib": args.headroom, "total_gib": total, "fits": total <= limit,
        "over_gib": max(total - limit, 0.0), "alternatives": [],
    }
    free = limit - weights - args.headroom  # GiB left for the KV cache on this device
    result["largest_budget_flag"] = vllm_flag(int(free * GIB)) if free > 0 else None
    if result["fits"]:
        return result
    alternatives = result["alternatives"]
    if args.kv_cache_dtype == "auto" or not args.kv_cache_dtype.startswith("fp8"):
        fp8 = kv.required(seqs, args.max_model_len, tp, "fp8")
        fp8_total = weights + fp8["required_bytes"] / GIB + args.headroom
        alternatives.append({
            "change": "fp8 KV cache", "flags": f"--kv-cache-dtype fp8 --kv-cache-memory-bytes {fp8['kv_cache_memory_bytes_flag']}",
            "kv_cache_gib": fp8["required_bytes"] / GIB, "total_gib": fp8_total, "fits": fp8_total <= limit,
            "note": "halves the KV bytes; only where your vLLM-Ascend release supports an 8-bit KV cache for this "
                    "model (check its quantization documentation), and check accuracy"})
    if tp * 2 <= args.max_tensor_parallel_size:
        wider = kv.required(seqs, args.max_model_len, tp * 2, args.kv_cache_dtype)
        wider_weights = weights * tp / (tp * 2)
        wider_total = wider_weights + wider["required_bytes"] / GIB + args.headroom
        alternatives.append({
            "change": f"tensor parallel size {tp * 2} ({tp * 2} devices per replica)",
            "flags": f"--tensor-parallel-size {tp * 2} --kv-cache-memory-bytes {wider['kv_cache_memory_bytes_flag']}",
            "kv_cache_gib": wider["required_bytes"] / GIB, "total_gib": wider_total, "fits": wider_total <= limit,
            "note": f"weights {wider_weights:.2f} GiB per device; KV heads split over {tp * 2} ranks "
                    "(replicated when there are fewer KV heads than ranks)"})
    if free > 0:
        at_free = kv.plan(int(free * GIB), args.max_model_len, tp, args.kv_cache_dtype)
        fewer = math.floor(at_free["max_concurrency"])
        if fewer >= 1:
            alternatives.append({
                "change": f"{fewer} requests of {args.max_model_len:,} tokens instead of {seqs}",
                "flags": f"--max-num-seqs {fewer} --kv-cache-memory-bytes {vllm_flag(int(free * GIB))}",
                "kv_cache_gib": free, "total_gib": limit, "fits": True,
                "note": "the most whole requests at this context in what the device has left"})
        block = args.block_size
        lo, hi = 0, math.ceil(args.max_model_len / block) - 1  # blocks per request that fit (search)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            need = kv.required(seqs, mid * block, tp, args.kv_cache_dtype)["required_bytes"] / GIB
            lo, hi = (mid, hi) if need <= free else (lo, mid - 1)
        if lo >= 1:
            shorter = lo * block
            need = kv.required(seqs, shorter, tp, args.kv_cache_dtype)
            alternatives.append({
                "change": f"--max-model-len {shorter:,} for {seqs} requests",
                "flags": f"--max-model-len {shorter} --kv-cache-memory-bytes {need['kv_cache_memory_bytes_flag']}",
                "kv_cache_gib": need["required_bytes"] / GIB,
                "total_gib": weights + need["required_bytes"] / GIB + args.headroom, "fits": True,
                "note": "the longest context (whole KV blocks) at which that many requests fit"})
    return result


def render_text(r: dict[str, Any]) -> str:
    lines = [
        f"device {r['device']} ({r['device_description']}): {r['device_memory_gib']:g} GiB; at "
        f"gpu-memory-utilization {r['gpu_memory_utilization']:g}: {r['usable_gib']:.2f} GiB usable",
        f"weights per device: {r['weights_per_device_gib']:.2f} GiB ({r['weights_source']})",
        f"KV-cache budget per device: {r['kv_cache_gib']:.2f} GiB (--kv-cache-memory-bytes {r['kv_cache_flag']}, "
        f"{r['kv_cache_dtype']}): {r['whole_requests']} whole requests of {r['max_model_len']:,} tokens "
        f"({r['max_concurrency']:.2f}x)",
        f"vLLM will log: {r['vllm_log']}",
        f"headroom for activations, graphs and runtime buffers: {r['headroom_gib']:.2f} GiB",
    ]
    if r["fits"]:
        lines.append(f"total {r['total_gib']:.2f} GiB <= {r['usable_gib']:.2f} GiB: fits on {r['device']} "
                     f"(the largest budget that fits: --kv-cache-memory-bytes {r['largest_budget_flag']})")
        return "\n".join(lines) + "\n"
    lines.append(f"total {r['total_gib']:.2f} GiB > {r['usable_gib']:.2f} GiB: does NOT fit on {r['device']} "
                 f"({r['over_gib']:.2f} GiB over)")
    lines.append(f"What fits on {r['device']} instead:")
    for alt in r["alternatives"]:
        verdict = "fits" if alt["fits"] else "still does not fit"
        lines.append(f"  - {alt['change']}: {alt['kv_cache_gib']:.2f} GiB KV, total {alt['total_gib']:.2f} GiB, "
                     f"{verdict}; {alt['flags']} ({alt['note']})")
    if r["largest_budget_flag"]:
        lines.append(f"  - the largest budget beside these weights: --kv-cache-memory-bytes {r['largest_budget_flag']}")
    return "\n".join(lines) + "\n"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse hook: one line, exit 2
        self.exit(2, f"{self.prog}: {message}\n")


EXAMPLES = """Examples (from the skill's folder; elsewhere prefix scripts/ with that folder):
  python scripts/device_fit.py --model qwen3-8b --device 910B3 -tp 2 --max-model-len 32768 --max-num-seqs 8
  python scripts/device_fit.py --model qwen3-8b --device 910B3 -tp 2 --max-model-len 32768 --kv-cache-memory-bytes 16G --format json

Devices: """ + ", ".join(f"{k} ({v[0]:g} GiB)" for k, v in DEVICES.items())


def build_parser() -> argparse.ArgumentParser:
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = _OneLineParser(prog="device_fit.py", description=summary + "\n\n" + details,
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="kv-capacity preset, config.json, or model folder")
    parser.add_argument("--device", required=True, help="device name (table below), e.g. 910B3")
    parser.add_argument("--device-memory", type=lambda t: parse_gib("--device-memory", t), metavar="GIB",
                        help="the device's memory instead of the table's nominal figure, e.g. 61.3G")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N")
    parser.add_argument("--max-model-len", type=int, required=True, metavar="L")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--max-num-seqs", type=int, metavar="N", help="size the budget for N requests of L tokens")
    budget.add_argument("--kv-cache-memory-bytes", metavar="SIZE", help="a budget in vLLM's syntax (8G, 55305M)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, bfloat16, fp8 ... (as vLLM)")
    parser.add_argument("--block-size", type=int, default=128, help="128 on vLLM-Ascend")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of the device vLLM may use")
    parser.add_argument("--headroom", type=lambda t: parse_gib("--headroom", t), default=2.0, metavar="GIB",
                        help="activations, graphs, runtime buffers (default 2 GiB)")
    parser.add_argument("--weights-gib", type=lambda t: parse_gib("--weights-gib", t), metavar="GIB",
                        help="weights per device when known (e.g. from the server log)")
    parser.add_argument("--weights-dtype", choices=sorted(DTYPE_BYTES), help="checkpoint dtype (default: config's)")
    parser.add_argument("--max-tensor-parallel-size", type=int, default=16, metavar="N",
                        help="devices one replica may span (the TP alternative stays at or below it)")
    parser.add_argument("--kv-capacity-cmd", default="kv-capacity", metavar="CMD", help="the kv-capacity command")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        for name in ("tensor_parallel_size", "max_model_len", "block_size", "max_num_seqs"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise FitError(f"--{name.replace('_', '-')} {value}: must be 1 or more")
        result = evaluate(args)
    except FitError as exc:
        print(f"device_fit.py: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(render_text(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
