"""vLLM general plugin entry point (the early KV-capacity check). Not written yet: does nothing."""


def register() -> None:
    return None
