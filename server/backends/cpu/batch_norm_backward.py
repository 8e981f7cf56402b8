"""aclnnBatchNormBackward (SPEC §5) on the [L, C, T] view around the channel axis.

One parallel task per channel: it reads the channel's L rows of T elements once, widening in
registers, and sums Σg and Σg·x̂ in fp32 lanes per ROW_BLOCK and fp64 beyond (`row_sums`: a
fixed order per channel, so any thread count gives the same bits), then — while the channel
is still in cache — writes its gradInput in the output dtype.

Channel-last tensors (T = 1: NHWC, NDHWC) are [L, C] rows with one element per channel, and
run on their own kernel: a fixed number of tasks (a function of L) each own a range of rows
and sum every channel over them (fp32 per LAST_SUB_ROWS rows, then fp64); the host adds the
tasks' sums in task order, and a second pass writes gradInput. Views whose dims do not merge
into these shapes run on the operator's NumPy reference (`handles`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def storage_signatures(rank: int, rest: Callable[[Any], tuple]) -> list[Any]:
    """One signature per storage type: gradOut, input, their kind and the rank-D view's shape,
    then `rest(storage type)` (gradInput has gradOut's dtype, SPEC 5.2)."""
    sigs = []
    for cin in STORAGE:
        base = array(cin, 1, True, "C")
        strides = types.UniTuple(types.int64, rank)
        sigs.append(types.void(base, strides, base, strides, types.int64, strides, *rest(cin)))
    return sigs


def _signatures():
    vec, sums = array(np.float32, 1, True, "C"), array(np.float64, 1, False, "C")
    return storage_signatures(
        3,
        lambda cin: (
            *(vec, vec, vec),  # μ, s, w per channel
            *(array(cin, 3, False, "C"), types.int64),  # gradInput [L, C, T] (or a dummy), its kind
            *(sums, sums),  # Σg, Σg·x̂ per channel (fp64)
            *(types.boolean, types.boolean, types.boolean),  # training, want gradInput, need sums
            array(np.bool_, 1, False, "C"),  # per channel: a gradInput was not finite
        ),
    )


@lazy_njit(_signatures)
def channels_kernel(
    gb, gs, xb, xs, kind, shape, mu, s, w, dx, out_kind, sum_g, sum_gx, training, want_dx, need_sums, bad
):
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
        overflow = False
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
                        v = (load(gi[j], kind) - mean_g - h * mean_gx) * scale
                        overflow |= nonfinite(v)
                        di[j] = narrow(v, di, out_kind)
                else:
                    for j in range(n_t):
                        v = load(gi[j], kind) * scale
                        overflow |= nonfinite(v)
                        di[j] = narrow(v, di, out_kind)
        bad[c] = overflow


LAST_TASKS = 32  # tasks of a channel-last call (fewer when L is smaller): never the thread count
LAST_SUB_ROWS = 128  # rows a channel-last fp32 partial sum spans before it is added in fp64


def _last_signatures():
    vec, sums = array(np.float32, 1, True, "C"), array(np.float64, 2, False, "C")
    return storage_signatures(
        2,
        lambda cin: (
            *(vec, vec),  # μ, s per channel
            *(vec, vec, vec),  # mean(g), mean(g·x̂), w·s per channel (the gradInput pass)
            *(array(cin, 2, False, "C"), types.int64),  # gradInput [L, C] (or a dummy), its kind
            *(sums, sums),  # Σg, Σg·x̂ per task and channel (the sums pass)
            *(types.boolean, types.boolean),  # the sums pass (else gradInput's), training
            array(np.bool_, 1, False, "C"),  # per task: a gradInput was not finite
        ),
    )


@lazy_njit(_last_signatures)
def channels_last_kernel(
    gb, gs, xb, xs, kind, shape, mu, s, mean_g, mean_gx, scale, dx, out_kind, task_g, task_gx, sums_pass, training, bad
):
    n_l, n_c = shape
    tasks = task_g.shape[0]
    for t in prange(tasks):
        l0 = t * n_l // tasks
        l1 = (t + 1) * n_l // tasks
        gbuf = np.empty(gather_len(gs[1], n_c), gb.dtype)
        xbuf = np.empty(gather_len(xs[1], n_c), xb.dtype)
        if sums_pass:
            part_g = np.empty(n_c, np.float32)
            part_gx = np.empty(n_c, np.float32)
            tg = task_g[t]
            tgx = task_gx[t]
            tg[:] = 0
            tgx[:] = 0
            for b0 in range(l0, l1, LAST_SUB_ROWS):
                part_g[:] = 0
                part_gx[:] = 0
                for li in range(b0, min(b0 + LAST_SUB_ROWS, l1)):
                    gi = row(gb, li * gs[0], gs[1], n_c, gbuf)
                    xi = row(xb, li * xs[0], xs[1], n_c, xbuf)
                    for c in range(n_c):
                        gv = load(gi[c], kind)
                        part_g[c] += gv
                        part_gx[c] += gv * ((load(xi[c], kind) - mu[c]) * s[c])
                for c in range(n_c):
                    tg[c] += part_g[c]
                    tgx[c] += part_gx[c]
        else:
            overflow = False
            for li in range(l0, l1):
                gi = row(gb, li * gs[0], gs[1], n_c, gbuf)
                di = dx[li]
                if training:
                    xi = row(xb, li * xs[0], xs[1], n_c, xbuf)
                    for c in range(n_c):
                        h = (load(xi[c], kind) - mu[c]) * s[c]
                        v = (load(gi[c], kind) - mean_g[c] - h * mean_gx[c]) * scale[c]
                        overflow |= nonfinite(v)
                        di[c] = narrow(v, di, out_kind)
                else:
                    for c in range(n_c):
                        v = load(gi[c], kind) * scale[c]
                        overflow |= nonfinite(v)
                        di[c] = narrow(v, di, out_kind)
            bad[t] = overflow


def lct(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def kernel_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """[L, C] for channel-last tensors (T = 1 and several channels: rows of channels), else [L, C, T]."""
    n_l, n_c, n_t = lct(shape, axis)
    return (n_l, n_c) if n_t == 1 and n_c > 1 else (n_l, n_c, n_t)


def handles(plan: Plan) -> bool:
    shape = kernel_shape(plan.inputs["input"].shape, plan.values["channel_axis"])
    return views_ready(plan, ("gradOut", "input"), shape)


def workspace_size(plan: Plan) -> int:
    shape = kernel_shape(plan.inputs["input"].shape, plan.values["channel_axis"])
    n_c = shape[1]
    if math.prod(shape) == 0:
        return 0
    vectors = n_c * (6 * 4 + 2 * 8)  # μ, s, w, the means and w·s in fp32; the sums in fp64
    if len(shape) == 2:
        tasks = min(LAST_TASKS, shape[0])
        running = min(tasks, numba.config.NUMBA_NUM_THREADS)
        # Per task: fp64 sums; per running task: fp32 partials and gathered rows (strided views).
        return tasks * n_c * 2 * 8 + running * n_c * 4 * 4 + vectors
    running = min(n_c, numba.config.NUMBA_NUM_THREADS)
    # Per running task: lane accumulators, and gathered rows (for strided views).
    return running * (2 * LANES * 4 + 2 * 4 * shape[2]) + vectors


def per_channel(t: np.ndarray | None, c: int, default: float) -> np.ndarray:
    return np.full(c, default, np.float32) if t is None else t.reshape(-1).astype(np.float32)


def run_channels(g3, x3, mu, s, w, dx3, training: bool, need_sums: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """The kernel on [L, C, T] views: (Σg, Σg·x̂) per channel, and whether a gradInput was not finite."""
    n_c = x3.shape[1]
    gk, kind = kernel_view(g3)
    xk, _ = kernel_view(x3)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    if dx3 is not None:
        dk, out_kind = kernel_view(dx3)
    else:  # a placeholder of the storage type the signature takes
        dk, out_kind = np.empty((1, 1, 1), gk.dtype), F32
    sum_g, sum_gx = np.zeros(n_c), np.zeros(n_c)
    bad = np.zeros(n_c, np.bool_)
    channels_kernel.run(
        gb, gs, xb, xs, kind, x3.shape, mu, s, w, dk, out_kind, sum_g, sum_gx, training, dx3 is not None, need_sums, bad
    )
    return sum_g, sum_gx, bool(bad.any())


def run_channels_last(g2, x2, mu, s, w, dx2, training: bool, need_sums: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """The channel-last kernel on [L, C] views: a sums pass (when needed), then a gradInput pass;
    returns `run_channels`' results."""
    n_l, n_c = x2.shape
    gk, kind = kernel_view(g2)
    xk, _ = kernel_view(x2)
    (gb, gs), (xb, xs) = flat(gk), flat(xk)
    tasks = min(LAST_TASKS, n_l)
    task_g, task_gx = np.zeros((tasks, n_c)), np.zeros((tasks, n_c))
    bad = np.zeros(tasks, np.bool_)
    unused = np.empty(0, np.float32)
    if need_sums:
        dummy = np.empty((1, 1), gk.dtype)
        channels_last_kernel.run(
            *(gb, gs, xb, xs, kind, x2.shape, mu, s, unused, unused, unused, dummy, F32),
            *(task_g, task_gx, True, training, bad),
        )
    sum_g, sum_gx = task_g.sum(axis=0), task_gx.sum(axis=0)  # in task order
    if dx2 is not None:
        dk, out_kind = kernel_view(dx2)
        means = [(total / n_l).astype(np.float32) for total in (sum_g, sum_gx)]
        channels_last_kernel.run(
            *(gb, gs, xb, xs, kind, x2.shape, mu, s, *means, w * s, dk, out_kind),
            *(task_g, task_gx, False, training, bad),
        )
    return sum_g, sum_gx, bool(bad.any())


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether a result was not finite (the call is then repeated in fp64)."""
    shape = kernel_shape(args["input"].shape, plan.values["channel_axis"])
    g, x = kernel_ready(args["gradOut"], shape), kernel_ready(args["input"], shape)
    n_c = shape[1]
    training = bool(args["training"])
    w = per_channel(args["weight"], n_c, 1.0)
    if training:
        mu, s = per_channel(args["saveMean"], n_c, 0.0), per_channel(args["saveInvstd"], n_c, 1.0)
    else:
        mu = per_channel(args["runningMean"], n_c, 0.0)
        rv = args["runningVar"]
        var = np.ones(n_c) if rv is None else rv.reshape(-1).astype(np.float64)
        s = (1.0 / np.sqrt(var + args["eps"])).astype(np.float32)
    dx, dw, db = args["gradInput"], args["gradWeight"], args["gradBias"]
    need_sums = dw is not None or db is not None or (training and dx is not None)
    if math.prod(shape):
        run = run_channels_last if len(shape) == 2 else run_channels
        sum_g, sum_gx, bad = run(g, x, mu, s, w, None if dx is None else dx.reshape(shape), training, need_sums)
    else:
        sum_g, sum_gx, bad = np.zeros(n_c), np.zeros(n_c), False
    if dw is not None:
        dw[...] = sum_gx
    if db is not None:
        db[...] = sum_g
    return bad or out_of_range(sum_gx if dw is not None else None, sum_g if db is not None else None)


def warm_up() -> None:
    """Runs every compiled signature once on a tiny problem: [2, 2, 3] and channel-last [2, 3]."""
    for dtype in FLOAT_DTYPES:
        x = np.ones((2, 2, 3), dtype)
        ones = np.ones(2, np.float32)
        run_channels(x, x, ones, ones, ones, np.empty((2, 2, 3), dtype), True, True)
        ones = np.ones(3, np.float32)
        run_channels_last(x[0], x[0], ones, ones, ones, np.empty((2, 3), dtype), True, True)
