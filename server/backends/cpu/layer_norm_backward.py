"""aclnnLayerNormBackward (SPEC §3) on [M, N] rows: one fused pass per row block.

Each parallel task owns a fixed block of rows (its size depends on M only). Per row it reads
gradOut and input once, widening to fp32 into two row buffers (g·w and x̂) while adding g and
g·x̂ into the block's fp32 column partials; the row sums then come from the buffers (lane
reduction, fp64 across ROW_BLOCKs) and gradInput is written in the output dtype. Column
partials are combined over blocks in fp64, in block order, by the host.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import prange, types

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

MAX_BLOCK_ROWS = 128  # rows per task at most: the fp32 column partials sum this many rows
MIN_BLOCKS = 32  # tasks per call when there are that many rows (load balance on any thread count)


def block_rows(m: int) -> int:
    """Rows per task: a function of M alone, so results never depend on the thread count."""
    return max(1, min(MAX_BLOCK_ROWS, -(-m // MIN_BLOCKS)))


def n_blocks(m: int) -> int:
    return -(-m // block_rows(m)) if m else 0


def _signatures():
    sigs = []
    for cin in STORAGE:
        for cout in STORAGE:
            base = array(cin, 1, True, "C")
            sigs.append(
                types.boolean(
                    base,  # gradOut's storage from its first element
                    types.UniTuple(types.int64, 2),  # its element strides
                    base,  # input's storage
                    types.UniTuple(types.int64, 2),
                    types.int64,  # their kind
                    types.UniTuple(types.int64, 2),  # [M, N]
                    array(np.float32, 1, True, "C"),  # mean [M]
                    array(np.float32, 1, True, "C"),  # rstd [M]
                    array(np.float32, 1, True, "C"),  # weight [N]
                    array(cout, 2, False, "C"),  # gradInput [M, N] (a [1, 1] dummy when masked off)
                    types.int64,  # its kind
                    array(np.float32, 2, False, "C"),  # Σg partials [blocks, N]
                    array(np.float32, 2, False, "C"),  # Σg·x̂ partials [blocks, N]
                    types.int64,  # rows per block
                    types.boolean,  # write gradInput
                    types.boolean,  # accumulate the column partials
                    array(np.bool_, 1, False, "C"),  # per block: a gradInput was not finite
                    array(np.float64, 1, False, "C"),  # Σg per column, over the blocks in order [N]
                    array(np.float64, 1, False, "C"),  # Σg·x̂ likewise
                )
            )
    return sigs


@lazy_njit(_signatures)
def rows_kernel(
    gb,
    gs,
    xb,
    xs,
    kind,
    shape,
    mean,
    rstd,
    w,
    dx,
    out_kind,
    part_g,
    part_gx,
    rows,
    want_dx,
    want_cols,
    bad,
    sum_g,
    sum_gx,
):
    m, n = shape
    blocks = (m + rows - 1) // rows
    for blk in prange(blocks):
        gw = np.empty(n, np.float32)
        xh = np.empty(n, np.float32)
        acc = np.empty(LANES, np.float32)
        acc_dot = np.empty(LANES, np.float32)
        gbuf = np.empty(gather_len(gs[1], n), gb.dtype)
        xbuf = np.empty(gather_len(xs[1], n), xb.dtype)
        pg = part_g[0]  # the one (unused) row there is when the sums are not wanted
        pgx = part_gx[0]
        if want_cols:
            pg = part_g[blk]
            pgx = part_gx[blk]
            pg[:] = 0
            pgx[:] = 0
        overflow = False
        for i in range(blk * rows, min(blk * rows + rows, m)):
            gi = row(gb, i * gs[0], gs[1], n, gbuf)
            xi = row(xb, i * xs[0], xs[1], n, xbuf)
            mu = mean[i]
            rs = rstd[i]
            if want_cols:
                for j in range(n):
                    gv = load(gi[j], kind)
                    h = (load(xi[j], kind) - mu) * rs
                    xh[j] = h
                    gw[j] = gv * w[j]
                    pg[j] += gv
                    pgx[j] += gv * h
            else:
                for j in range(n):
                    xh[j] = (load(xi[j], kind) - mu) * rs
                    gw[j] = load(gi[j], kind) * w[j]
            if want_dx:
                sum_gw, sum_gwxh = row_sums(gw, xh, F32, np.float32(0), np.float32(1), n, acc, acc_dot)
                c1 = np.float32(sum_gw / n)
                c2 = np.float32(sum_gwxh / n)
                di = dx[i]
                for j in range(n):
                    v = rs * (gw[j] - c1 - xh[j] * c2)
                    overflow |= nonfinite(v)
                    di[j] = narrow(v, di, out_kind)
        bad[blk] = overflow
    # Then, on this thread: the column partials in fp64, block after block (as NumPy's
    # sum(axis=0, dtype=float64) adds them), and whether anything was not finite.
    trouble = False
    for blk in range(blocks):
        trouble |= bad[blk]
    if want_cols:
        for j in range(n):
            sum_g[j] = part_g[0, j]
            sum_gx[j] = part_gx[0, j]
        for blk in range(1, blocks):
            for j in range(n):
                sum_g[j] += part_g[blk, j]
                sum_gx[j] += part_gx[blk, j]
        for j in range(n):
            trouble |= nonfinite(sum_g[j]) | nonfinite(sum_gx[j])
    return trouble


def scratch_bytes(m: int, n: int, want_cols: bool = True) -> int:
    """Column partials, fp32 row buffers per running task, fp32 stats and weight, fp64 sums."""
    if m * n == 0:
        return 0
    blocks = n_blocks(m)
    tasks = min(blocks, numba.config.NUMBA_NUM_THREADS)
    partials = 2 * 4 * n * (blocks if want_cols else 1)
    return partials + tasks * 4 * n * 4 + 2 * 4 * m + 4 * n + (2 * 8 * n if want_cols else 0)


def compute_rows(g2, x2, mean, rstd, w, dx2, want_cols: bool) -> tuple[tuple[np.ndarray, np.ndarray] | None, bool]:
    """The fused kernel on [M, N] views; returns fp64 (Σ g, Σ g·x̂) per column (or None), and
    whether a result was not finite (`nonfinite`, or the sums). Everything after the rows (the
    column sums, the checks) runs in the kernel too: NumPy's reductions on a cold cache cost a
    small call more than its rows."""
    m, n = x2.shape
    gk, kind = kernel_view(g2)
    xk, _ = kernel_view(x2)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    if dx2 is not None:
        dk, out_kind = kernel_view(dx2)
    else:
        dk, out_kind = np.empty((1, 1), np.float32), F32
    blocks = n_blocks(m)
    part_g = np.empty((blocks if want_cols else 1, n), np.float32)
    part_gx = np.empty_like(part_g)
    rows = block_rows(m)
    bad = np.empty(blocks, np.bool_)
    sums = (np.empty(n if want_cols else 0), np.empty(n if want_cols else 0))
    trouble = rows_kernel.run(
        *(gb, gs, xb, xs, kind, (m, n), mean, rstd, w, dk, out_kind),
        *(part_g, part_gx, rows, dx2 is not None, want_cols, bad, *sums),
    )
    return (sums if want_cols else None), trouble


def rows_of(plan: Plan) -> tuple[int, int]:
    n = math.prod(plan.values["normalizedShape"])
    x = plan.inputs["input"]
    return math.prod(x.shape[: x.rank - len(plan.values["normalizedShape"])]), n


def handles(plan: Plan) -> bool:
    m, n = rows_of(plan)
    return views_ready(plan, ("gradOut", "input"), (m, n))


def workspace_size(plan: Plan) -> int:
    m, n = rows_of(plan)
    return scratch_bytes(m, n, "gradWeightOut" in plan.outputs or "gradBiasOut" in plan.outputs)


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether a result was not finite (the call is then repeated in fp64)."""
    m, n = rows_of(plan)
    g2, x2 = kernel_ready(args["gradOut"], (m, n)), kernel_ready(args["input"], (m, n))
    dx, dw, db = args["gradInputOut"], args["gradWeightOut"], args["gradBiasOut"]
    want_cols = dw is not None or db is not None
    trouble = False
    if m * n:
        # fp32 statistics as they are (the kernel only reads them), others widened
        mu = np.ascontiguousarray(args["mean"].reshape(-1), np.float32)
        rs = np.ascontiguousarray(args["rstd"].reshape(-1), np.float32)
        weight = args["weightOptional"]
        w = np.ones(n, np.float32) if weight is None else np.ascontiguousarray(weight.reshape(-1), np.float32)
        sums, trouble = compute_rows(g2, x2, mu, rs, w, None if dx is None else dx.reshape(m, n), want_cols)
    else:
        sums = (np.zeros(n), np.zeros(n))
    if dw is not None:
        dw.reshape(-1)[:] = sums[1]
    if db is not None:
        db.reshape(-1)[:] = sums[0]
    return trouble


def warm_up() -> None:
    """Runs every compiled signature once on a tiny problem."""
    for dtype in FLOAT_DTYPES:
        for out in FLOAT_DTYPES:
            x = np.ones((2, 3), dtype)
            compute_rows(
                x,
                x[:, ::-1][:, ::-1],
                np.zeros(2, np.float32),
                np.ones(2, np.float32),
                np.ones(3, np.float32),
                np.empty((2, 3), out),
                True,
            )
