"""Set operations the analyses run on large normalised interval sets (see :mod:`profile_analyzer.intervals`), by
binary search instead of a sweep over every boundary: the same sets, found without sorting the boundaries of both."""

from __future__ import annotations

import numpy as np

from profile_analyzer import intervals as iv


def difference(a: iv.IntervalSet, b: iv.IntervalSet) -> iv.IntervalSet:
    """``iv.difference(a, b)`` for normalised ``a`` and ``b`` (sorted, disjoint, non-touching, as ``iv.union`` and
    ``iv.clip`` give them): the parts of ``a`` that ``b`` does not cover, normalised (so the same arrays)."""
    a_s, a_e = np.asarray(a[0], dtype=np.int64), np.asarray(a[1], dtype=np.int64)
    b_s, b_e = np.asarray(b[0], dtype=np.int64), np.asarray(b[1], dtype=np.int64)
    if a_s.size == 0:
        return iv.empty()
    if b_s.size == 0:
        return a_s.copy(), a_e.copy()
    # what b leaves free inside a's span, then a intersected with it
    lo, hi = int(a_s[0]), int(a_e[-1])
    c_s = np.maximum(np.concatenate([[lo], b_e]), lo)
    c_e = np.minimum(np.concatenate([b_s, [hi]]), hi)
    keep = c_e > c_s
    c_s, c_e = c_s[keep], c_e[keep]
    return _intersect_normalised(a_s, a_e, c_s, c_e)


def _intersect_normalised(a_s: np.ndarray, a_e: np.ndarray, c_s: np.ndarray, c_e: np.ndarray) -> iv.IntervalSet:
    """The intersection of two normalised sets: every pair of overlapping intervals, found by binary search. The
    pieces come out sorted and, as neither set has touching intervals, neither overlapping nor touching."""
    first = np.searchsorted(c_e, a_s, side="right")  # the first interval of c that ends after a's starts
    stop = np.searchsorted(c_s, a_e, side="left")  # past the last interval of c that starts before a's ends
    count = np.maximum(stop - first, 0)
    n = int(count.sum())
    if n == 0:
        return iv.empty()
    ai = np.repeat(np.arange(a_s.size), count)
    ci = np.arange(n) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    s = np.maximum(a_s[ai], c_s[ci])
    e = np.minimum(a_e[ai], c_e[ci])
    keep = e > s
    return s[keep], e[keep]
