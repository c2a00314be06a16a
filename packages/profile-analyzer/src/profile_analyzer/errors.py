"""The one exception base class of profile-analyzer."""

from __future__ import annotations


class ProfileError(Exception):
    """Bad or unusable input. ``str(exc)`` is one line naming the input and what was expected."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[type[ProfileError], tuple[str, str]]:
        # raised in a loader worker process, it travels back to the parent pickled: rebuild it from its parts
        return (type(self), (self.path, self.problem))
