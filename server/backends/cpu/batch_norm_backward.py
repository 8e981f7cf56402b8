"""aclnnBatchNormBackward (SPEC §5) on the [L, C, T] view around the channel axis.

One parallel task per channel: it reads the channel's L rows of T elements once, widening in
registers, and sums Σg and Σg·x̂ in fp32 lanes per ROW_BLOCK and fp64 beyond (`row_sums`: a
fixed order per channel, so any thread count gives the same bits), then — while the channel
is still in cache — writes its gradInput in the output dtype. Channel-last tensors (T = 1)
and views whose dims do not merge into [L, C, T] run on the operator's NumPy reference
(`handles`).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import prange, types

from ...registry import Plan
from ._jit import F32, FLOAT_DTYPES, STORAGE, array, flat, gather_len, kernel_view, lazy_njit, load, narrow, probe, row
from ._reduce import LANES, row_sums


def _signatures():
    sigs = []
    for cin in STORAGE:
        for cout in (cin,):  # gradInput has gradOut's dtype (SPEC 5.2)
            base = array(cin, 1, True, "C")
            strides = types.UniTuple(types.int64, 3)
            vec = array(np.float32, 1, True, "C")
            sums = array(np.float64, 1, False, "C")
            sigs.append(
                types.void(
                    *(base, strides, base, strides, types.int64, strides),  # gradOut, input, kind, [L, C, T]
                    *(vec, vec, vec),  # μ, s, w per channel
                    *(array(cout, 3, False, "C"), types.int64),  # gradInput [L, C, T] (or a dummy), its kind
                    *(sums, sums),  # Σg, Σg·x̂ per channel (fp64)
                    *(types.boolean, types.boolean, types.boolean),  # training, want gradInput, need sums
                )
            )
    return sigs


@lazy_njit(_signatures)
def channels_kernel(gb, gs, xb, xs, kind, shape, mu, s, w, dx, out_kind, sum_g, sum_gx, training, want_dx, need_sums):
    n_l, n_c, n_t = shape
    count = n_l * n_t
    for c in prange(n_c):
        acc_g = np.empty(LANES, np.float32)
        acc_gx = np.empty(LANES, np.float32)
        gbuf = np.empty(gather_len(gs[2], n_t), gb.dtype)
        xbuf = np.empty(gather_len(xs[2], n_t), xb.dtype)
        m = mu[c]
        sc = s[c]
        tg = 0.0
        tgx = 0.0
        if need_sums:
            for li in range(n_l):
                gi = row(gb, li * gs[0] + c * gs[1], gs[2], n_t, gbuf)
                xi = row(xb, li * xs[0] + c * xs[1], xs[2], n_t, xbuf)
                rg, rgx = row_sums(gi, xi, kind, m, sc, n_t, acc_g, acc_gx)
                tg += rg
                tgx += rgx
        sum_g[c] = tg
        sum_gx[c] = tgx
        if want_dx:
            scale = w[c] * sc
            mean_g = np.float32(0)
            mean_gx = np.float32(0)
            if count:
                mean_g = np.float32(tg / count)
                mean_gx = np.float32(tgx / count)
            for li in range(n_l):
                gi = row(gb, li * gs[0] + c * gs[1], gs[2], n_t, gbuf)
                di = dx[li, c]
                if training:
                    xi = row(xb, li * xs[0] + c * xs[1], xs[2], n_t, xbuf)
                    for j in range(n_t):
                        h = (load(xi[j], kind) - m) * sc
                        di[j] = narrow((load(gi[j], kind) - mean_g - h * mean_gx) * scale, di, out_kind)
                else:
                    for j in range(n_t):
                        di[j] = narrow(load(gi[j], kind) * scale, di, out_kind)


def lct(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def kernel_ready(a: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray | None:
    v = a.view()
    try:
        v.shape = shape
    except AttributeError:
        return None
    return v if flat(v) is not None else None


def handles(plan: Plan) -> bool:
    shape = lct(plan.inputs["input"].shape, plan.values["channel_axis"])
    if shape[2] == 1 and shape[1] > 1:
        return False  # channel-last: per-channel rows of one element (NumPy reference)
    return all(kernel_ready(probe(plan.inputs[name]), shape) is not None for name in ("gradOut", "input"))


def workspace_size(plan: Plan) -> int:
    n_l, n_c, n_t = lct(plan.inputs["input"].shape, plan.values["channel_axis"])
    if n_l * n_c * n_t == 0:
        return 0
    tasks = min(n_c, numba.config.NUMBA_NUM_THREADS)
    # Per running task: lane accumulators, and gathered rows (for strided views); per channel: vectors.
    return tasks * (2 * LANES * 4 + 2 * 4 * n_t) + n_c * (3 * 4 + 2 * 8)


def per_channel(t: np.ndarray | None, c: int, default: float) -> np.ndarray:
    return np.full(c, default, np.float32) if t is None else t.reshape(-1).astype(np.float32)


def run_channels(g3, x3, mu, s, w, dx3, training: bool, need_sums: bool) -> tuple[np.ndarray, np.ndarray]:
    n_c = x3.shape[1]
    gk, kind = kernel_view(g3)
    xk, _ = kernel_view(x3)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    if dx3 is not None:
        dk, out_kind = kernel_view(dx3)
    else:
        dk, out_kind = np.empty((1, 1, 1), np.float32), F32
    sum_g, sum_gx = np.zeros(n_c), np.zeros(n_c)
    channels_kernel.run(
        gb, gs, xb, xs, kind, x3.shape, mu, s, w, dk, out_kind, sum_g, sum_gx, training, dx3 is not None, need_sums
    )
    return sum_g, sum_gx


def compute(plan: Plan, args: dict[str, Any]) -> None:
    shape = lct(args["input"].shape, plan.values["channel_axis"])
    g3, x3 = kernel_ready(args["gradOut"], shape), kernel_ready(args["input"], shape)
    n_c = shape[1]
    training = bool(args["training"])
    w = per_channel(args["weight"], n_c, 1.0)
    if training:
        mu, s = per_channel(args["saveMean"], n_c, 0.0), per_channel(args["saveInvstd"], n_c, 1.0)
    else:
        mu = per_channel(args["runningMean"], n_c, 0.0)
        rv = args["runningVar"]
        var = np.ones(n_c) if rv is None else rv.reshape(-1).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            s = (1.0 / np.sqrt(var + args["eps"])).astype(np.float32)
    dx, dw, db = args["gradInput"], args["gradWeight"], args["gradBias"]
    need_sums = dw is not None or db is not None or (training and dx is not None)
    if math.prod(shape):
        sum_g, sum_gx = run_channels(g3, x3, mu, s, w, None if dx is None else dx.reshape(shape), training, need_sums)
    else:
        sum_g, sum_gx = np.zeros(n_c), np.zeros(n_c)
    if dw is not None:
        dw[...] = sum_gx
    if db is not None:
        db[...] = sum_g


def warm_up() -> None:
    ones = np.ones(2, np.float32)
    for dtype in FLOAT_DTYPES:
        x = np.ones((2, 2, 3), dtype)
        run_channels(x, x, ones, ones, ones, np.empty((2, 2, 3), dtype), True, True)
