"""Exceptions of kv_capacity. Everything the package raises on purpose derives from KVCapacityError."""

from __future__ import annotations


class KVCapacityError(Exception):
    """Base class of every error kv_capacity raises on purpose."""


class KVCapacityInputError(KVCapacityError, ValueError):
    """The input is malformed or unsupported (bad size, unknown model, bad config.json ...).

    The message is one line that names the input and says what would be accepted; the CLI prints it and
    exits with status 2.
    """


class InsufficientKVCacheError(KVCapacityError):
    """The KV-cache budget cannot hold one request at max_model_len; vLLM would refuse to start.

    `vllm_message` is the text of the ValueError vLLM raises at start-up for the same settings; the
    attributes give the figures so callers need not parse it.
    """

    def __init__(
        self,
        message: str,
        *,
        vllm_message: str,
        needed_bytes: int,
        available_bytes: int,
        max_model_len: int,
        estimated_max_model_len: int,
        min_kv_cache_memory_bytes: int,
    ) -> None:
        super().__init__(message)
        self.vllm_message = vllm_message
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.max_model_len = max_model_len
        self.estimated_max_model_len = estimated_max_model_len
        self.min_kv_cache_memory_bytes = min_kv_cache_memory_bytes
