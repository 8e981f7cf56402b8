"""aclnnBatchNormElemtBackward (SPEC §6): one elementwise pass over [L, C, T] (channel axis 1).

Per-channel constants (sumDy/total, invstd²·sumDyXmu/total, invstd·w) are formed in fp64 and
rounded to fp32 exactly as the reference does; each task then writes whole (l, c) rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import prange, types

from ...ops.batch_norm_elemt_backward import counter_total
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
from ._reduce import nonfinite
from .batch_norm_backward import lct


def _signatures():
    sigs = []
    for cin in STORAGE:
        for cout in STORAGE:
            base = array(cin, 1, True, "C")
            strides = types.UniTuple(types.int64, 3)
            vec = array(np.float32, 1, True, "C")
            sigs.append(
                types.void(
                    *(base, strides, base, strides, types.int64, strides),
                    *(vec, vec, vec, vec),  # mean, shift, slope, scale
                    *(array(cout, 3, False, "C"), types.int64),
                    array(np.bool_, 1, False, "C"),  # per (l, c) row: a gradInput was not finite
                )
            )
    return sigs


@lazy_njit(_signatures)
def elemt_kernel(gb, gs, xb, xs, kind, shape, mu, shift, slope, scale, dx, out_kind, bad):
    n_l, n_c, n_t = shape
    for r in prange(n_l * n_c):
        li = r // n_c
        c = r - li * n_c
        gbuf = np.empty(gather_len(gs[2], n_t), gb.dtype)
        xbuf = np.empty(gather_len(xs[2], n_t), xb.dtype)
        gi = row(gb, li * gs[0] + c * gs[1], gs[2], n_t, gbuf)
        xi = row(xb, li * xs[0] + c * xs[1], xs[2], n_t, xbuf)
        di = dx[li, c]
        m, sh, sl, sc = mu[c], shift[c], slope[c], scale[c]
        overflow = False
        for j in range(n_t):
            h = (load(xi[j], kind) - m) * sl
            v = (load(gi[j], kind) - sh - h) * sc
            overflow |= nonfinite(v)
            di[j] = narrow(v, di, out_kind)
        bad[r] = overflow


def handles(plan: Plan) -> bool:
    """One dtype for gradOut and input (the kernel reads both alike); dims that merge into [L, C, T]."""
    if plan.inputs["gradOut"].dtype != plan.inputs["input"].dtype:
        return False
    shape = lct(plan.inputs["input"].shape, 1)
    return views_ready(plan, ("gradOut", "input"), shape)


def workspace_size(plan: Plan) -> int:
    return 4 * 4 * plan.inputs["input"].shape[1]


def run(g3, x3, mu, shift, slope, scale, dx3) -> bool:
    """The kernel on [L, C, T] views; returns whether a gradInput was not finite."""
    gk, kind = kernel_view(g3)
    xk, _ = kernel_view(x3)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    dk, out_kind = kernel_view(dx3)
    bad = np.zeros(x3.shape[0] * x3.shape[1], np.bool_)
    elemt_kernel.run(gb, gs, xb, xs, kind, x3.shape, mu, shift, slope, scale, dk, out_kind, bad)
    return bool(bad.any())


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether a result was not finite (the call is then repeated in fp64)."""
    shape = lct(args["input"].shape, 1)
    if not math.prod(shape):
        return False
    n_c = shape[1]

    def vec(t: np.ndarray) -> np.ndarray:
        return t.reshape(-1).astype(np.float64)

    total = counter_total(args["counter"])
    inv = vec(args["invstd"])
    w = np.ones(n_c) if args["weight"] is None else vec(args["weight"])
    shift = (vec(args["sumDy"]) / total).astype(np.float32)
    slope = (inv * inv * vec(args["sumDyXmu"]) / total).astype(np.float32)
    scale = (inv * w).astype(np.float32)
    mu = vec(args["mean"]).astype(np.float32)
    g3, x3 = kernel_ready(args["gradOut"], shape), kernel_ready(args["input"], shape)
    return run(g3, x3, mu, shift, slope, scale, args["gradInput"].reshape(shape))


def warm_up() -> None:
    ones = np.ones(2, np.float32)
    for dtype in FLOAT_DTYPES:
        for out in FLOAT_DTYPES:
            x = np.ones((2, 2, 3), dtype)
            run(x, x, ones, ones, ones, ones, np.empty((2, 2, 3), out))
