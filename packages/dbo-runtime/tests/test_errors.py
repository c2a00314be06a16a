"""The package's exception hierarchy (dbo_runtime.errors): one base, the contract's three kinds."""

from __future__ import annotations

import pytest
from dbo_runtime.errors import DBOConfigError, DBOError, DBOTimeoutError, DBOWorkerError


@pytest.mark.parametrize("cls", [DBOConfigError, DBOTimeoutError, DBOWorkerError])
def test_every_error_derives_from_the_package_base(cls: type[Exception]) -> None:
    assert issubclass(cls, DBOError)
    assert not issubclass(DBOError, cls)


def test_config_and_timeout_errors_are_also_the_builtin_kinds() -> None:
    assert issubclass(DBOConfigError, ValueError)
    assert issubclass(DBOTimeoutError, TimeoutError)
    assert not issubclass(DBOWorkerError, ValueError | TimeoutError)


def test_timeout_error_carries_the_micro_batch_and_site() -> None:
    exc = DBOTimeoutError("micro-batch 1 stuck after 'moe_combine'", ubatch_id=1, site="moe_combine")
    assert (exc.ubatch_id, exc.site) == (1, "moe_combine")
    assert str(exc) == "micro-batch 1 stuck after 'moe_combine'"
    plain = DBOTimeoutError("collective")
    assert (plain.ubatch_id, plain.site) == (None, None)


def test_worker_error_keeps_the_original_as_cause() -> None:
    original = KeyError("expert 7")
    with pytest.raises(DBOWorkerError) as info:
        try:
            raise original
        except KeyError as exc:
            raise DBOWorkerError("micro-batch 0 raised KeyError", ubatch_id=0) from exc
    assert info.value.__cause__ is original
    assert info.value.ubatch_id == 0


def test_errors_cross_a_process_boundary_with_their_fields() -> None:
    # rank processes send their exceptions to the parent pickled
    import pickle

    t = pickle.loads(pickle.dumps(DBOTimeoutError("stuck at 'moe_combine'", ubatch_id=1, site="moe_combine")))
    assert type(t) is DBOTimeoutError and (str(t), t.ubatch_id, t.site) == ("stuck at 'moe_combine'", 1, "moe_combine")
    w = pickle.loads(pickle.dumps(DBOWorkerError("micro-batch 0 raised KeyError", ubatch_id=0)))
    assert type(w) is DBOWorkerError and (str(w), w.ubatch_id) == ("micro-batch 0 raised KeyError", 0)
    c = pickle.loads(pickle.dumps(DBOConfigError("bad threshold")))
    assert type(c) is DBOConfigError and str(c) == "bad threshold"
