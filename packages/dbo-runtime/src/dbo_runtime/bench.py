"""``python -m dbo_runtime.bench``: the reference benchmark's old entry point (``make bench`` runs it); the code is
:mod:`dbo_runtime.reference.bench`, the command ``dbo-runtime bench``."""

from dbo_runtime.reference.bench import *  # noqa: F403
from dbo_runtime.reference.bench import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
