"""aclnnRmsNorm on [M, N] rows (N: gamma's elements): one pass per row, rows in parallel.

Each task owns a fixed block of rows (its size depends on M only; rows are independent, so
no result depends on the split anyway). Per row it reads x once for Σx² (fp32 lanes per
ROW_BLOCK, fp64 beyond: `row_sums`), takes rstd = 1/√(Σx²/N + epsilon) in fp64 as the
reference does, then, with the row still in cache, writes y = (x·rstd)·gamma in x's dtype.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import prange, types

from ...ops.rows import squares_out_of_range
from ...registry import Plan
from ._jit import (
    FLOAT_DTYPES,
    STORAGE,
    array,
    flat,
    gather_len,
    kernel_ready,
    kernel_view,
    lazy_njit,
    load,
    narrow,
    row,
    views_ready,
)
from ._reduce import LANES, row_sums

MAX_BLOCK_ROWS = 64  # rows per task at most
MIN_BLOCKS = 64  # tasks per call when there are that many rows


def block_rows(m: int) -> int:
    return max(1, min(MAX_BLOCK_ROWS, -(-m // MIN_BLOCKS)))


def _signatures():
    sigs = []
    for cin in STORAGE:
        sigs.append(
            types.void(
                array(cin, 1, True, "C"),  # x's storage from its first element
                types.UniTuple(types.int64, 2),  # its element strides
                types.int64,  # its kind (and y's)
                types.UniTuple(types.int64, 2),  # [M, N]
                array(np.float32, 1, True, "C"),  # gamma [N] in fp32
                types.float64,  # epsilon
                array(cin, 2, False, "C"),  # y [M, N]
                array(np.float32, 1, False, "C"),  # rstd [M]
                types.int64,  # rows per task
            )
        )
    return sigs


@lazy_njit(_signatures)
def rms_kernel(xb, xs, kind, shape, w, eps, y, rstd, rows):
    m, n = shape
    blocks = (m + rows - 1) // rows
    for blk in prange(blocks):
        acc = np.empty(LANES, np.float32)
        acc_sq = np.empty(LANES, np.float32)
        xbuf = np.empty(gather_len(xs[1], n), xb.dtype)
        for i in range(blk * rows, min(blk * rows + rows, m)):
            xi = row(xb, i * xs[0], xs[1], n, xbuf)
            _, sum_sq = row_sums(xi, xi, kind, np.float32(0), np.float32(1), n, acc, acc_sq)
            rs = np.float32(1.0 / np.sqrt(sum_sq / n + eps))
            rstd[i] = rs
            yi = y[i]
            for j in range(n):
                yi[j] = narrow(load(xi[j], kind) * rs * w[j], yi, kind)


def rows_of(plan: Plan) -> tuple[int, int]:
    n = plan.inputs["gamma"].numel
    x = plan.inputs["x"]
    return (x.numel // n if n else 0), n


def handles(plan: Plan) -> bool:
    return views_ready(plan, ("x",), rows_of(plan))


def workspace_size(plan: Plan) -> int:
    """gamma in fp32, and per running task its lane sums and a gathered row (strided views)."""
    m, n = rows_of(plan)
    if m * n == 0:
        return 0
    running = min(-(-m // block_rows(m)), numba.config.NUMBA_NUM_THREADS)
    return 4 * n + running * (2 * 4 * LANES + plan.inputs["x"].dtype.itemsize * n)


def run_rows(x2: np.ndarray, w: np.ndarray, eps: float, y2: np.ndarray, rstd: np.ndarray) -> None:
    """The kernel on an [M, N] view of x into C-ordered y [M, N] and fp32 rstd [M]."""
    m, n = x2.shape
    xk, kind = kernel_view(x2)
    xb, xs = flat(xk)
    yk, _ = kernel_view(y2)
    rms_kernel.run(xb, xs, kind, (m, n), w, float(eps), yk, rstd, block_rows(m))


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether fp32 could not hold the squares (`squares_out_of_range` of 1/rstd²): the call
    is then repeated in fp64. With rstd in range, x·rstd stays within √N; only γ scales it further."""
    m, n = rows_of(plan)
    if m * n == 0:
        return False
    x2 = kernel_ready(args["x"], (m, n))
    w = np.ascontiguousarray(args["gamma"].reshape(-1), np.float32)
    y, rstd = args["yOut"], args["rstdOut"]
    y2 = y.reshape(m, n) if y.flags.c_contiguous else np.empty((m, n), y.dtype)
    rs = rstd.reshape(-1) if rstd.flags.c_contiguous else np.empty(m, np.float32)
    run_rows(x2, w, float(plan.values["epsilon"]), y2, rs)
    if not y.flags.c_contiguous:
        y[...] = y2.reshape(y.shape)
    if not rstd.flags.c_contiguous:
        rstd[...] = rs.reshape(rstd.shape)
    return squares_out_of_range(1.0 / np.square(rs.astype(np.float64)))


def warm_up() -> None:
    """Runs every compiled signature once on a tiny problem (one contiguous, one gathered)."""
    for dtype in FLOAT_DTYPES:
        x = np.ones((2, 3), dtype)
        for view in (x, np.ones((3, 2), dtype).T):
            run_rows(view, np.ones(3, np.float32), 1e-6, np.empty((2, 3), dtype), np.empty(2, np.float32))
