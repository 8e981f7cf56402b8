"""aclnnRmsNormGrad on [M, N] rows (N: gamma's elements): one fused pass per row block.

Each parallel task owns a fixed block of rows (its size depends on M only). Per row it reads
dy and x once, widening to fp32 into two row buffers (dy·gamma and x̂ = x·rstd) while adding
dy·x̂ into the block's fp32 column partials; the row's Σ dy·gamma·x̂ then comes from the buffers
(lane reduction, fp64 across ROW_BLOCKs) and dx = rstd·(dy·gamma − x̂·mean) is written in dy's
dtype. The host adds the column partials over blocks in fp64, in block order, for dgamma.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import prange, types

from ...ops.rows import out_of_range
from ...registry import Plan
from ._jit import (
    F32,
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
from ._reduce import LANES, nonfinite, row_sums
from .layer_norm_backward import block_rows, n_blocks


def _signatures():
    sigs = []
    for cin in STORAGE:
        base = array(cin, 1, True, "C")
        strides = types.UniTuple(types.int64, 2)
        vec = array(np.float32, 1, True, "C")
        sigs.append(
            types.void(
                *(base, strides, base, strides),  # dy's and x's storage and element strides
                types.int64,  # their kind (and dx's)
                strides,  # [M, N]
                *(vec, vec),  # rstd [M], gamma [N] in fp32
                array(cin, 2, False, "C"),  # dx [M, N]
                array(np.float32, 2, False, "C"),  # Σ dy·x̂ partials [blocks, N]
                types.int64,  # rows per block
                array(np.bool_, 1, False, "C"),  # per block: a dx was not finite
            )
        )
    return sigs


@lazy_njit(_signatures)
def rows_kernel(gb, gs, xb, xs, kind, shape, rstd, w, dx, part, rows, bad):
    m, n = shape
    blocks = (m + rows - 1) // rows
    for blk in prange(blocks):
        gw = np.empty(n, np.float32)
        xh = np.empty(n, np.float32)
        acc = np.empty(LANES, np.float32)
        acc_dot = np.empty(LANES, np.float32)
        gbuf = np.empty(gather_len(gs[1], n), gb.dtype)
        xbuf = np.empty(gather_len(xs[1], n), xb.dtype)
        pg = part[blk]
        pg[:] = 0
        overflow = False
        for i in range(blk * rows, min(blk * rows + rows, m)):
            gi = row(gb, i * gs[0], gs[1], n, gbuf)
            xi = row(xb, i * xs[0], xs[1], n, xbuf)
            rs = rstd[i]
            for j in range(n):
                gv = load(gi[j], kind)
                h = load(xi[j], kind) * rs
                xh[j] = h
                gw[j] = gv * w[j]
                pg[j] += gv * h
            _, dot = row_sums(gw, xh, F32, np.float32(0), np.float32(1), n, acc, acc_dot)
            c = np.float32(dot / n)
            di = dx[i]
            for j in range(n):
                v = (gw[j] - xh[j] * c) * rs
                overflow |= nonfinite(v)
                di[j] = narrow(v, di, kind)
        bad[blk] = overflow


def rows_of(plan: Plan) -> tuple[int, int]:
    n = plan.inputs["gamma"].numel
    return (plan.inputs["x"].numel // n if n else 0), n


def handles(plan: Plan) -> bool:
    return views_ready(plan, ("dy", "x"), rows_of(plan))


def workspace_size(plan: Plan) -> int:
    """Column partials, fp32 row buffers per running task, fp32 rstd and gamma, fp64 column sums."""
    m, n = rows_of(plan)
    if m * n == 0:
        return 0
    blocks = n_blocks(m)
    running = min(blocks, numba.config.NUMBA_NUM_THREADS)
    return 4 * n * blocks + running * 4 * n * 4 + 4 * m + 4 * n + 8 * n


def run_rows(g2, x2, rstd, w, dx2) -> tuple[np.ndarray, bool]:
    """The kernel on [M, N] views; returns dgamma's column sums in fp64, and whether a dx was not finite."""
    m, n = x2.shape
    gk, kind = kernel_view(g2)
    xk, _ = kernel_view(x2)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    dk, _ = kernel_view(dx2)
    part = np.empty((n_blocks(m), n), np.float32)
    bad = np.zeros(n_blocks(m), np.bool_)
    rows_kernel.run(gb, gs, xb, xs, kind, (m, n), rstd, w, dk, part, block_rows(m), bad)
    return part.sum(axis=0, dtype=np.float64), bool(bad.any())


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether a result was not finite (the call is then repeated in fp64)."""
    m, n = rows_of(plan)
    dx, dgamma = args["dxOut"], args["dgammaOut"]
    if m * n == 0:
        dgamma[...] = 0
        return False
    g2, x2 = kernel_ready(args["dy"], (m, n)), kernel_ready(args["x"], (m, n))
    rstd = np.ascontiguousarray(args["rstd"].reshape(-1), np.float32)
    w = np.ascontiguousarray(args["gamma"].reshape(-1), np.float32)
    dx2 = dx.reshape(m, n) if dx.flags.c_contiguous else np.empty((m, n), dx.dtype)
    sums, bad = run_rows(g2, x2, rstd, w, dx2)
    if not dx.flags.c_contiguous:
        dx[...] = dx2.reshape(dx.shape)
    dgamma[...] = sums.reshape(dgamma.shape)
    return bad or out_of_range(sums)


def warm_up() -> None:
    """Runs every compiled signature once on a tiny problem (one contiguous, one gathered)."""
    for dtype in FLOAT_DTYPES:
        x = np.ones((2, 3), dtype)
        for view in (x, np.ones((3, 2), dtype).T):
            run_rows(view, view, np.ones(2, np.float32), np.ones(3, np.float32), np.empty((2, 3), dtype))
