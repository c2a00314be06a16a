"""KV-cache capacity planner for vLLM --kv-cache-memory-bytes."""

__version__ = "0.1.0"
