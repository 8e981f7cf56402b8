"""aclnnGroupNormBackward on the [N, C, HxW] view: one parallel task per (sample, group).

A task reads its group's C/group channel rows of HxW elements once for Σg and Σg·x̂ per
channel (`row_sums`: fp32 lanes per ROW_BLOCK, fp64 beyond), keeps them per (sample, channel)
in fp64, and forms the group's Σ gw = Σ_c gamma_c·Σg and Σ gw·x̂ from them; then, with the
group still in cache, it writes gradInput = rstd·(g·gamma − mean(gw) − x̂·mean(gw·x̂)) in
gradOut's dtype. The host adds the per-sample channel sums over samples in fp64, in sample
order, for gradGamma and gradBeta: no result depends on the thread count. Views whose dims do
not merge into [N, C, HxW] run on the operator's NumPy reference (`handles`).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import prange, types

from ...ops.rows import out_of_range
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
from ._reduce import LANES, nonfinite, row_sums


def _signatures():
    sigs = []
    for cin in STORAGE:
        base = array(cin, 1, True, "C")
        strides = types.UniTuple(types.int64, 3)
        vec = array(np.float32, 1, True, "C")
        sums = array(np.float64, 2, False, "C")
        sigs.append(
            types.void(
                *(base, strides, base, strides),  # gradOut's and input's storage and element strides
                types.int64,  # their kind (and gradInput's)
                strides,  # [N, C, HxW]
                types.int64,  # group
                *(vec, vec, vec),  # mean, rstd [N·group], gamma [C] in fp32
                array(cin, 3, False, "C"),  # gradInput [N, C, HxW] (a dummy when masked off)
                *(sums, sums),  # Σg, Σg·x̂ per sample and channel
                types.boolean,  # write gradInput
                array(np.bool_, 1, False, "C"),  # per (sample, group): a gradInput was not finite
            )
        )
    return sigs


@lazy_njit(_signatures)
def groups_kernel(gb, gs, xb, xs, kind, shape, group, mean, rstd, w, dx, sum_g, sum_gx, want_dx, bad):
    n_n, n_c, n_t = shape
    per_group = n_c // group
    d = per_group * n_t
    for task in prange(n_n * group):
        s = task // group
        c0 = (task % group) * per_group
        acc_g = np.empty(LANES, np.float32)
        acc_gx = np.empty(LANES, np.float32)
        gbuf = np.empty(gather_len(gs[2], n_t), gb.dtype)
        xbuf = np.empty(gather_len(xs[2], n_t), xb.dtype)
        mu = mean[task]
        rs = rstd[task]
        total_gw = 0.0
        total_gwx = 0.0
        for c in range(c0, c0 + per_group):
            gi = row(gb, s * gs[0] + c * gs[1], gs[2], n_t, gbuf)
            xi = row(xb, s * xs[0] + c * xs[1], xs[2], n_t, xbuf)
            tg, tgx = row_sums(gi, xi, kind, mu, rs, n_t, acc_g, acc_gx)
            sum_g[s, c] = tg
            sum_gx[s, c] = tgx
            total_gw += w[c] * tg
            total_gwx += w[c] * tgx
        overflow = False
        if want_dx and d:
            mean_gw = np.float32(total_gw / d)
            mean_gwx = np.float32(total_gwx / d)
            for c in range(c0, c0 + per_group):
                gi = row(gb, s * gs[0] + c * gs[1], gs[2], n_t, gbuf)
                xi = row(xb, s * xs[0] + c * xs[1], xs[2], n_t, xbuf)
                wc = w[c]
                di = dx[s, c]
                for j in range(n_t):
                    h = (load(xi[j], kind) - mu) * rs
                    v = (load(gi[j], kind) * wc - mean_gw - h * mean_gwx) * rs
                    overflow |= nonfinite(v)
                    di[j] = narrow(v, di, kind)
        bad[task] = overflow


def kernel_shape(plan: Plan) -> tuple[int, int, int]:
    v = plan.values
    return v["N"], v["C"], v["HxW"]


def handles(plan: Plan) -> bool:
    return views_ready(plan, ("gradOut", "input"), kernel_shape(plan))


def workspace_size(plan: Plan) -> int:
    """Per-sample channel sums in fp64, fp32 statistics and gamma, lanes and gathered rows per running task."""
    n_n, n_c, n_t = kernel_shape(plan)
    if n_n * n_c * n_t == 0:
        return 0
    group = plan.values["group"]
    running = min(n_n * group, numba.config.NUMBA_NUM_THREADS)
    itemsize = plan.inputs["input"].dtype.itemsize
    return 2 * 8 * n_n * n_c + 2 * 4 * n_n * group + 4 * n_c + running * (2 * 4 * LANES + 2 * itemsize * n_t)


def run_groups(g3, x3, group: int, mean, rstd, w, dx3) -> tuple[np.ndarray, np.ndarray, bool]:
    """The kernel on [N, C, HxW] views; returns fp64 (Σg, Σg·x̂) per channel, added over samples in
    order, and whether a gradInput was not finite."""
    n_n, n_c, _ = x3.shape
    gk, kind = kernel_view(g3)
    xk, _ = kernel_view(x3)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    dk = np.empty((1, 1, 1), gk.dtype) if dx3 is None else kernel_view(dx3)[0]
    sum_g, sum_gx = np.empty((n_n, n_c)), np.empty((n_n, n_c))
    bad = np.zeros(n_n * group, np.bool_)
    groups_kernel.run(gb, gs, xb, xs, kind, x3.shape, group, mean, rstd, w, dk, sum_g, sum_gx, dx3 is not None, bad)
    return sum_g.sum(axis=0), sum_gx.sum(axis=0), bool(bad.any())


def as_f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.reshape(-1), np.float32)


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether a result was not finite (the call is then repeated in fp64)."""
    shape = kernel_shape(plan)
    n_c = shape[1]
    dx, dgamma, dbeta = args["gradInput"], args["gradGammaOut"], args["gradBetaOut"]
    if shape[0] * n_c * shape[2]:
        g3, x3 = kernel_ready(args["gradOut"], shape), kernel_ready(args["input"], shape)
        gamma = args["gamma"]
        w = np.ones(n_c, np.float32) if gamma is None else as_f32(gamma)
        dx3 = None
        if dx is not None:
            dx3 = dx.reshape(shape) if dx.flags.c_contiguous else np.empty(shape, dx.dtype)
        mean, rstd = as_f32(args["mean"]), as_f32(args["rstd"])
        sum_g, sum_gx, bad = run_groups(g3, x3, plan.values["group"], mean, rstd, w, dx3)
        if dx is not None and not dx.flags.c_contiguous:
            dx[...] = dx3.reshape(dx.shape)
    else:
        sum_g, sum_gx, bad = np.zeros(n_c), np.zeros(n_c), False
    if dgamma is not None:
        dgamma[...] = sum_gx.reshape(dgamma.shape)
    if dbeta is not None:
        dbeta[...] = sum_g.reshape(dbeta.shape)
    return bad or out_of_range(sum_gx if dgamma is not None else None, sum_g if dbeta is not None else None)


def warm_up() -> None:
    """Runs every compiled signature once on a tiny problem (one contiguous, one gathered)."""
    ones = np.ones(4, np.float32)
    for dtype in FLOAT_DTYPES:
        x = np.ones((2, 4, 3), dtype)
        for view in (x, np.ones((2, 3, 4), dtype).transpose(0, 2, 1)):
            run_groups(view, view, 2, ones, ones, ones, np.empty((2, 4, 3), dtype))
        run_groups(x, x, 2, ones, ones, ones, None)
