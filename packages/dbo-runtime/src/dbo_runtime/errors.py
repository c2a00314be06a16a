"""Exceptions of dbo_runtime. Everything the package raises on purpose derives from :class:`DBOError`."""

from __future__ import annotations

__all__ = ["DBOError", "DBOConfigError", "DBOTimeoutError", "DBOWorkerError"]


class DBOError(Exception):
    """Base class of every error dbo_runtime raises on purpose."""


class DBOConfigError(DBOError, ValueError):
    """Bad input or configuration: the message names the input and what would be accepted.

    Also a ``ValueError`` so that callers which validate arguments generically (argparse types, pydantic-style
    config layers) treat it as a bad value.
    """


class DBOTimeoutError(DBOError, TimeoutError):
    """A handoff or collective that did not arrive in time.

    ``ubatch_id`` and ``site`` say which micro-batch waited and at which hook site (``None`` when the wait was not
    tied to one, e.g. a data-parallel collective). The message always names them when they are known.
    """

    def __init__(self, message: str, *, ubatch_id: int | None = None, site: str | None = None) -> None:
        super().__init__(message)
        self.ubatch_id = ubatch_id
        self.site = site

    def __reduce__(self):  # keeps the fields when a rank process sends it to its parent
        return (_rebuild, (type(self), self.args[0], {"ubatch_id": self.ubatch_id, "site": self.site}))


class DBOWorkerError(DBOError):
    """An exception raised inside a micro-batch thread, re-raised in the caller.

    The original exception is ``__cause__`` (raise it with ``raise DBOWorkerError(...) from exc``); ``ubatch_id``
    names the micro-batch it came from.
    """

    def __init__(self, message: str, *, ubatch_id: int | None = None) -> None:
        super().__init__(message)
        self.ubatch_id = ubatch_id

    def __reduce__(self):  # keeps the field when a rank process sends it to its parent
        return (_rebuild, (type(self), self.args[0], {"ubatch_id": self.ubatch_id}))


def _rebuild(cls: type[DBOError], message: str, fields: dict[str, object]) -> DBOError:
    return cls(message, **fields)
