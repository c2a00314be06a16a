"""STAND-IN operators (tests only): filled in below."""
__all__: list[str] = []
