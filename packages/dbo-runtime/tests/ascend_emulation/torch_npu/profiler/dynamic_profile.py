"""STAND-IN (tests only): torch_npu's dynamic profiler entry points as no-ops."""


def init(*args, **kwargs) -> None:
    return None


def step() -> None:
    return None
