"""The Triton kernels of fused.py (imported only where Triton is: this module imports it).

`rows` and `columns` are LayerNorm backward's fp32 pass; `chunk` is the part of a row both of
`rows`' passes read. Kernels call each other by module-level name, as Triton resolves them.
"""

import triton
import triton.language as tl


@triton.jit
def chunk(g_at, x_at, W, start, n, mean, rstd, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [start, start + BLOCK) of a row: their indices, which are inside it, g·w and x̂."""
    cols = start + tl.arange(0, BLOCK)
    inside = cols < n
    gw = tl.load(g_at + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_W:
        gw = gw * tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    xhat = (tl.load(x_at + cols, mask=inside, other=0.0).to(tl.float32) - mean) * rstd
    return cols, inside, gw, xhat


@triton.jit
def rows(G, X, W, MEAN, RSTD, DX, n, g_row, x_row, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    g_at, x_at = G + r * g_row, X + r * x_row
    mean = tl.load(MEAN + r).to(tl.float32)
    rstd = tl.load(RSTD + r).to(tl.float32)
    first = tl.load(g_at).to(tl.float32)
    if HAS_W:
        first = first * tl.load(W).to(tl.float32)
    shift_sums = tl.zeros([BLOCK], dtype=tl.float32)
    dot_sums = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols, inside, gw, xhat = chunk(g_at, x_at, W, start, n, mean, rstd, HAS_W, BLOCK)
        shift_sums += tl.where(inside, gw - first, 0.0)
        dot_sums += tl.where(inside, gw * xhat, 0.0)
    mean_shifted = tl.sum(shift_sums, 0) / n
    mean_dot = tl.sum(dot_sums, 0) / n
    for start in range(0, n, BLOCK):  # again: the row's chunks are still in L2
        cols, inside, gw, xhat = chunk(g_at, x_at, W, start, n, mean, rstd, HAS_W, BLOCK)
        shifted = (gw - first) - xhat * mean_dot
        tl.store(DX + r * n + cols, shifted * rstd - mean_shifted * rstd, mask=inside)


@triton.jit
def columns(G, X, MEAN, RSTD, GX_RUNS, G_RUNS, m, n, g_row, x_row, RUN: tl.constexpr, BLOCK: tl.constexpr):
    # One flat grid axis (a grid's second axis holds at most 65535 blocks: rows of 8 Mi elements)
    program = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(n, BLOCK)
    run = program // blocks
    cols = (program % blocks) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gx_sums = tl.zeros([BLOCK], dtype=tl.float32)
    g_sums = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, RUN):
        r = run * RUN + i
        if r < m:
            g = tl.load(G + r * g_row + cols, mask=inside, other=0.0).to(tl.float32)
            x = tl.load(X + r * x_row + cols, mask=inside, other=0.0).to(tl.float32)
            xhat = (x - tl.load(MEAN + r).to(tl.float32)) * tl.load(RSTD + r).to(tl.float32)
            gx_sums += g * xhat
            g_sums += g
    tl.store(GX_RUNS + run * n + cols, gx_sums, mask=inside)
    tl.store(G_RUNS + run * n + cols, g_sums, mask=inside)
