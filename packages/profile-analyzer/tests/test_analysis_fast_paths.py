"""The analyses' fast paths give exactly what the general code gives: the binary-search set difference
(analyses._sets) against intervals.difference, the exposed-time charge of operators that never run at once against
the sweep, and flow ids written as strings against matching their text."""

from __future__ import annotations

import numpy as np
import pytest
from profile_analyzer import intervals as iv
from profile_analyzer.analyses import _sets, exposed
from profile_analyzer.loaders._columns import flow_id_array, match_flows


def _random_set(rng: np.random.Generator) -> iv.IntervalSet:
    n = int(rng.integers(0, 14))
    s = rng.integers(0, 80, n)
    a = iv.union(s, s + rng.integers(0, 15, n))
    if rng.random() < 0.3:
        a = iv.clip(a, int(rng.integers(0, 40)), int(rng.integers(20, 90)))
    return a


@pytest.mark.parametrize("seed", range(4))
def test_difference_matches_intervals(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(500):
        a, b = _random_set(rng), _random_set(rng)
        want, got = iv.difference(a, b), _sets.difference(a, b)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
        assert got[0].dtype == np.int64 and got[1].dtype == np.int64


def _instant_by_instant(starts: np.ndarray, ends: np.ndarray, exposed_set: iv.IntervalSet) -> list[int]:
    """The rule written out per unit instant: an exposed instant goes to the operator running then that started
    last (the lowest index among equal starts)."""
    out = [0] * starts.size
    for a, b in zip(*exposed_set, strict=True):
        for t in range(int(a), int(b)):
            running = [i for i in range(starts.size) if starts[i] <= t < ends[i]]
            if running:
                out[min(running, key=lambda i: (-int(starts[i]), i))] += 1
    return out


@pytest.mark.parametrize("seed", range(4))
def test_exclusive_exposure_disjoint_and_nested(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for trial in range(400):
        n = int(rng.integers(0, 12))
        if trial % 2:  # operators one after the other (the fast path), some of zero length, in any order
            gaps = rng.integers(0, 6, n)
            lens = rng.integers(0, 9, n)
            starts = np.cumsum(gaps + np.r_[0, lens[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
            ends = starts + lens
            perm = rng.permutation(n)
            starts, ends = starts[perm], ends[perm]
        else:  # overlapping and nested operators (the sweep)
            starts = rng.integers(0, 60, n).astype(np.int64)
            ends = starts + rng.integers(0, 20, n)
        ex = _random_set(rng)
        want = _instant_by_instant(starts, ends, ex)
        assert exposed.exclusive_exposure(starts, ends, ex).tolist() == want
        assert exposed.sweep_exposure(starts, ends, ex).tolist() == want


def test_flow_ids_as_numbers_match_as_their_text() -> None:
    assert flow_id_array(["4563402751", "12", "0"]).tolist() == [4563402751, 12, 0]
    for ids in (["01", "1"], [" 1"], ["+1"], ["-3"], ["1.5"], ["x"], ["", "1"], ["99999999999999999999"], ["1e3"]):
        assert flow_id_array(ids).dtype.kind == "U"
    z = np.zeros(0, np.int64)
    cases = [(["7", "8", "9"], [9, 7]), (["07", "8"], [7, 8]), ([7, 8], ["8", "7"]), (["a", "8"], ["8"]),
             (["-3", "4"], [-3, 4]), ([1, "2"], ["1", 2])]
    for s_ids, f_ids in cases:
        flows = {("c", "s"): (flow_id_array(s_ids), np.arange(len(s_ids), dtype=np.int64)),
                 ("c", "f"): (flow_id_array(f_ids), 10 + np.arange(len(f_ids), dtype=np.int64))}
        got = match_flows(flows, "c")
        # by text, as before ids written as strings were read as numbers
        text = {("c", "s"): (np.array([str(i) for i in s_ids]), flows[("c", "s")][1]),
                ("c", "f"): (np.array([str(i) for i in f_ids]), flows[("c", "f")][1])}
        want = match_flows(text, "c")
        pairs = sorted(zip(got[0].tolist(), got[1].tolist(), strict=True))
        assert pairs == sorted(zip(want[0].tolist(), want[1].tolist(), strict=True))
    assert match_flows({}, "c")[0].tolist() == z.tolist()
