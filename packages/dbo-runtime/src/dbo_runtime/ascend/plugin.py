"""vLLM general plugin entry point for DBO on vLLM-Ascend. Not written yet: does nothing."""


def register() -> None:
    return None
