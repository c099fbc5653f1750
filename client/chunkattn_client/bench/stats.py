"""Percentiles and latency summaries, in plain Python so they can be checked by hand."""

from __future__ import annotations

import math
from collections.abc import Iterable

PERCENTILES = (50, 90, 95, 99)


def percentile(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (0..100) of ascending values, interpolating linearly between ranks.

    The same definition as numpy's default ("linear"): rank r = p / 100 * (n - 1), and the value
    between the neighbours floor(r) and ceil(r). For [1, 2, 3, 4]: p50 = 2.5, p90 = 3.7, p100 = 4.
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    rank = p / 100 * (len(sorted_values) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """{"count", "mean", "p50", "p90", "p95", "p99", "max"}; all but count are None for no values."""
    v = sorted(values)
    if not v:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {
        "count": len(v),
        "mean": math.fsum(v) / len(v),
        **{f"p{p}": percentile(v, p) for p in PERCENTILES},
        "max": v[-1],
    }
