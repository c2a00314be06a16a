"""Interval algebra against a brute-force boolean grid."""

from __future__ import annotations

import numpy as np
import pytest
from profile_analyzer import intervals as iv


def grid(starts, ends, n):
    g = np.zeros(n, dtype=bool)
    for s, e in zip(starts, ends, strict=False):
        g[s:e] = True
    return g


def set_grid(a, n):
    return grid(a[0], a[1], n)


@pytest.mark.parametrize("seed", range(20))
def test_ops_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 400
    k = int(rng.integers(0, 40))
    a_s = rng.integers(0, n - 1, k)
    a_e = a_s + rng.integers(0, 40, k)
    a_e = np.minimum(a_e, n)
    m = int(rng.integers(0, 40))
    b_s = rng.integers(0, n - 1, m)
    b_e = np.minimum(b_s + rng.integers(0, 40, m), n)
    A = iv.union(a_s, a_e)
    B = iv.union(b_s, b_e)
    ga, gb = grid(a_s, a_e, n), grid(b_s, b_e, n)
    assert (set_grid(A, n) == ga).all()
    assert iv.total(A) == ga.sum()
    # normalised: sorted, disjoint, non-touching
    assert np.all(A[0][1:] > A[1][:-1])
    assert (set_grid(iv.intersection(A, B), n) == (ga & gb)).all()
    assert (set_grid(iv.difference(A, B), n) == (ga & ~gb)).all()
    assert (set_grid(iv.union_sets(A, B), n) == (ga | gb)).all()
    if A[0].size:
        lo, hi = 10, n - 10
        gap = iv.gaps(A, lo, hi)
        expect = ~ga
        expect[:lo] = False
        expect[hi:] = False
        assert (set_grid(gap, n) == expect).all()
    # coverage of arbitrary intervals by B
    q_s = rng.integers(0, n - 1, 30)
    q_e = np.minimum(q_s + rng.integers(0, 60, 30), n)
    cov = iv.overlap_with_each(q_s, q_e, B)
    assert cov.tolist() == [int(gb[s:e].sum()) for s, e in zip(q_s, q_e, strict=False)]


def test_large_ns_values_are_exact():
    base = 1_704_161_511_422_904_204
    A = iv.union(np.array([base, base + 5]), np.array([base + 10, base + 20]))
    assert A[0].tolist() == [base] and A[1].tolist() == [base + 20]
    assert iv.total(iv.difference(A, iv.union(np.array([base + 3]), np.array([base + 4])))) == 19
