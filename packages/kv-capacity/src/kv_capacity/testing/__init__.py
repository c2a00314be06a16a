"""Test helpers that run in the vllm virtualenv, not part of the planner (nothing in kv_capacity imports them).

- `tinymodels`: small random-weight models (GQA, MLA, sliding window) for starting a real vLLM anywhere;
  `python -m kv_capacity.testing.tinymodels qwen3 ...` (also `python -m kv_capacity.tinymodels`).
- `vllm_oracle`: vLLM's own `get_kv_cache_configs` on any config.json, without weights, as the reference the
  planner's figures are tested against; `python -m kv_capacity.testing.vllm_oracle CASES.json RESULTS.json`.
"""
