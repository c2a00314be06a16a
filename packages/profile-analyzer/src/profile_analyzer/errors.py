"""The one exception base class of profile-analyzer."""

from __future__ import annotations


class ProfileError(Exception):
    """Bad or unusable input. ``str(exc)`` is one line naming the input and what was expected."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
