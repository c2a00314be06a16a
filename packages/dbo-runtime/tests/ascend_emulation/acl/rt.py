"""STAND-IN ``acl.rt`` (tests only): see ``acl``."""

from acl import _not_emulated


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_emulated(f"rt.{name}")
