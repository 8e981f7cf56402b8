"""Row reductions in a fixed order that vectorizes without fastmath.

Each ROW_BLOCK of a row is summed as LANES interleaved fp32 partial sums (lane l takes elements
l, l+LANES, ...: a plain elementwise loop over a small accumulator the compiler vectorizes);
the lanes are then added in fp64, in lane order, and so are the blocks. The order depends only
on the row length, never on threads or scheduling.
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import ROW_BLOCK

LANES = 64  # fp32 accumulators per block: ROW_BLOCK / LANES = 16 terms each


@numba.njit(inline="always")
def row_sum(a, n, acc):
    """Σ a[:n] in fp64; `acc` is LANES fp32 of scratch."""
    total = 0.0
    for j0 in range(0, n, ROW_BLOCK):
        j1 = min(j0 + ROW_BLOCK, n)
        acc[:] = 0
        j = j0
        while j + LANES <= j1:
            aj = a[j : j + LANES]
            for lane in range(LANES):
                acc[lane] += aj[lane]
            j += LANES
        aj = a[j:j1]
        for lane in range(j1 - j):
            acc[lane] += aj[lane]
        for lane in range(LANES):
            total += np.float64(acc[lane])
    return total


@numba.njit(inline="always")
def row_dot(a, b, n, acc):
    """Σ a[:n]·b[:n] (fp32 products) in fp64; `acc` is LANES fp32 of scratch."""
    total = 0.0
    for j0 in range(0, n, ROW_BLOCK):
        j1 = min(j0 + ROW_BLOCK, n)
        acc[:] = 0
        j = j0
        while j + LANES <= j1:
            aj = a[j : j + LANES]
            bj = b[j : j + LANES]
            for lane in range(LANES):
                acc[lane] += aj[lane] * bj[lane]
            j += LANES
        aj = a[j:j1]
        bj = b[j:j1]
        for lane in range(j1 - j):
            acc[lane] += aj[lane] * bj[lane]
        for lane in range(LANES):
            total += np.float64(acc[lane])
    return total
