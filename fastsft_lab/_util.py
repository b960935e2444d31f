"""Small helpers shared by the library's modules (no torch state, no imports of the package)."""

from __future__ import annotations

from typing import Sequence


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return (n + multiple - 1) // multiple * multiple


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, int(n - 1).bit_length())


def quantile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolation quantile ``p`` in [0, 1] of already sorted values (numpy's default method)."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    x = p * (len(sorted_values) - 1)
    lo = int(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)
