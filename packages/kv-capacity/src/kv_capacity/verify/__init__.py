"""`kv-capacity verify`: start a real vLLM, read the KV capacity it reports, compare with the planner.

- `log`: what vLLM prints, read (the capacity line, the start-up error, the child's marker lines);
- `child`: the process that runs inside the vllm virtualenv (`python -m kv_capacity.verify --child ...`):
  builds vLLM's engine config, reports the settings vLLM resolved, constructs `vllm.LLM`;
- `run`: finds vLLM's interpreter, starts the child, watches its log, stops its process group;
- `compare`: the planner against what vLLM reported, and the seed's three verification cases.

The command itself (exit status 0 planner == vLLM, 1 any difference, 2 bad input, vLLM missing, vLLM
failing for another reason, or a timeout) is `verify_command` in kv_capacity.commands.
"""

from kv_capacity.verify.compare import (
    Comparison,
    SeedCase,
    compare,
    plan_for_run,
    run_plugin_timing,
    run_seed_cases,
    settings_of_run,
)
from kv_capacity.verify.log import ReportedCapacity, parse_capacity, parse_startup_error
from kv_capacity.verify.run import (
    VerifyError,
    VLLMRun,
    VLLMUnavailableError,
    find_vllm_python,
    probe_vllm_python,
    require_vllm_python,
    run_vllm,
)

__all__ = [
    "Comparison",
    "ReportedCapacity",
    "SeedCase",
    "VLLMRun",
    "VLLMUnavailableError",
    "VerifyError",
    "compare",
    "find_vllm_python",
    "parse_capacity",
    "parse_startup_error",
    "plan_for_run",
    "probe_vllm_python",
    "require_vllm_python",
    "run_plugin_timing",
    "run_seed_cases",
    "run_vllm",
    "settings_of_run",
]
