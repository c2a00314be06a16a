"""A whole vLLM engine on vllm-ascend's NPUWorker / NPUModelRunner over the emulated NPU, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): greedy tokens for a fixed set of prompts, DBO off or on.

argv: on|off FAMILY [TP [fc1]] (TP > 1: vLLM's multiprocessing executor, one worker process per rank, their HCCL
groups the emulation's gloo; ``fc1``: FlashComm1 on, ``--additional-config '{"enable_flashcomm1": true}'``, with
expert parallelism, which vllm-ascend requires for it on MoE models). Prints ``TOKENS <json>``. With DBO on, ``DBO_RUNTIME_STATS_DIR`` (set by the caller)
receives the runtime's split counts. Real: vLLM 0.23's engine, scheduler and sampler, vllm-ascend 0.23's platform,
worker, model runner, attention backend and fused-MoE layers, this project's plugin. STAND-IN: the NPU (torch_npu
emulation: its operators and Triton kernels on the CPU), the model's weights (random, generated).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if len(sys.argv) <= 3 or sys.argv[3] == "1":  # TP=1: the engine core and its one worker in this process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _emu  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "one two three four five six seven eight nine",
           "DBO splits a batch", "x y"]


def main() -> None:  # under __main__: the multiprocessing executor re-imports this module
    dbo, family = sys.argv[1] == "on", sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    fc1 = len(sys.argv) > 4 and sys.argv[4] == "fc1"
    from vllm import LLM, SamplingParams

    kwargs = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4) if dbo else {}
    if fc1:
        kwargs.update(additional_config={"enable_flashcomm1": True}, enable_expert_parallel=True)
    llm = LLM(model=str(_emu.tiny_model(family)), dtype="float32", enforce_eager=True, max_model_len=256,
              block_size=_emu.BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=256,
              tensor_parallel_size=tp, distributed_executor_backend=None if tp == 1 else "mp",
              kv_cache_memory_bytes=64 << 20, seed=0, **kwargs)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, logprobs=1))
    # the chosen token's logprob at every step, as float32 bits printed exactly (repr of the Python float)
    result = [{"tokens": list(o.outputs[0].token_ids),
               "logprobs": [step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                    strict=True)]}
              for o in outputs]
    print("TOKENS " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
