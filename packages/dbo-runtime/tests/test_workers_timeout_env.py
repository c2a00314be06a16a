"""$DBO_RUNTIME_TIMEOUT_S: the bound of the engine integration's waits, read when the runtime is installed."""

from __future__ import annotations

import pytest
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.workers import TIMEOUT_ENV, resolve_timeout


def test_the_variable_sets_the_bound_and_the_default_stands_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(60.0) == 60.0
    monkeypatch.setenv(TIMEOUT_ENV, " 15 ")
    assert resolve_timeout(60.0) == 15.0
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    assert resolve_timeout(60.0) == 0.5


@pytest.mark.parametrize("value", ["0", "-3", "abc", "inf", "nan"])
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(DBOConfigError, match=rf"^{TIMEOUT_ENV}='{value}' is invalid; accepted: seconds, a number > 0"):
        resolve_timeout(60.0)
