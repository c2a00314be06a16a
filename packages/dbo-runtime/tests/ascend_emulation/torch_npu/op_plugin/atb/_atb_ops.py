"""STAND-IN (tests only): ATB operator registration; the emulation registers no ATB kernels."""


def _register_atb_extensions() -> None:
    return None
