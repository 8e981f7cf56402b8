"""Row reductions in a fixed order that vectorizes without fastmath.

Each ROW_BLOCK of a row is summed as LANES interleaved fp32 partial sums (lane l takes elements
l, l+LANES, ...: a plain elementwise loop over a small accumulator the compiler vectorizes);
the lanes are then added in fp64, in lane order, and so are the blocks. The order depends only
on the row length, never on threads or scheduling.

Kernels also note whether a result they wrote was not finite (`nonfinite`): fp32 may have
overflowed on finite data, and the host then repeats the call in fp64 (`backends.widening`).
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import ROW_BLOCK, load

LANES = 64  # fp32 accumulators per block: ROW_BLOCK / LANES = 16 terms each


@numba.njit(inline="always")
def nonfinite(value):
    """Whether a float32 is ±Inf or NaN (value − value is NaN exactly then); OR-reduced, it vectorizes."""
    return (value - value) != 0


@numba.njit(inline="always")
def row_sums(a, b, kind, shift, scale, n, acc_a, acc_ab):
    """(Σ a, Σ a·(b − shift)·scale) over a[:n], b[:n] in fp64, elements widened by `load`.

    Both sums come from one read of the rows (fp32 products, as the kernels' outputs use
    them); `acc_a` and `acc_ab` are LANES fp32 each of scratch. Σ a is n·a[0] + Σ (a − a[0]):
    exact for a constant row, whose mean then cancels it exactly (a gradInput of exactly 0).
    """
    first = load(a[0], kind) if n else np.float32(0)
    total_a = np.float64(first) * n
    total_ab = 0.0
    for j0 in range(0, n, ROW_BLOCK):
        j1 = min(j0 + ROW_BLOCK, n)
        acc_a[:] = 0
        acc_ab[:] = 0
        j = j0
        while j + LANES <= j1:
            aj = a[j : j + LANES]
            bj = b[j : j + LANES]
            for lane in range(LANES):
                av = load(aj[lane], kind)
                acc_a[lane] += av - first
                acc_ab[lane] += av * ((load(bj[lane], kind) - shift) * scale)
            j += LANES
        aj = a[j:j1]
        bj = b[j:j1]
        for lane in range(j1 - j):
            av = load(aj[lane], kind)
            acc_a[lane] += av - first
            acc_ab[lane] += av * ((load(bj[lane], kind) - shift) * scale)
        for lane in range(LANES):
            total_a += np.float64(acc_a[lane])
        for lane in range(LANES):
            total_ab += np.float64(acc_ab[lane])
    return total_a, total_ab


@numba.njit(inline="always")
def shifted_sums(a, kind, shift, n, acc_d, acc_dd):
    """(Σ d, Σ d²) with d = a − shift over a[:n], in fp64 from fp32 lanes per ROW_BLOCK as `row_sums`.

    With `shift` near the mean, d is exact in fp32 and the variance Σd²/n − (Σd/n)² keeps its
    accuracy however far the data sit from zero (BatchNorm's second pass; the first: shift 0).
    """
    total_d = 0.0
    total_dd = 0.0
    for j0 in range(0, n, ROW_BLOCK):
        j1 = min(j0 + ROW_BLOCK, n)
        acc_d[:] = 0
        acc_dd[:] = 0
        j = j0
        while j + LANES <= j1:
            aj = a[j : j + LANES]
            for lane in range(LANES):
                d = load(aj[lane], kind) - shift
                acc_d[lane] += d
                acc_dd[lane] += d * d
            j += LANES
        aj = a[j:j1]
        for lane in range(j1 - j):
            d = load(aj[lane], kind) - shift
            acc_d[lane] += d
            acc_dd[lane] += d * d
        for lane in range(LANES):
            total_d += np.float64(acc_d[lane])
        for lane in range(LANES):
            total_dd += np.float64(acc_dd[lane])
    return total_d, total_dd
