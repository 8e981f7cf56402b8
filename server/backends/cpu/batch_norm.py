"""aclnnBatchNorm on the [L, C, T] view around the channel axis (`batch_norm_backward.kernel_shape`).

One parallel task per channel: in training it reads the channel's L rows of T elements once for
Σd and Σd² with d = x − s, s the mean of its first row in fp32 (`shifted_sums`: fp32 lanes per
ROW_BLOCK, fp64 beyond, a fixed order per channel): mean = s + Σd/n, var = Σd²/n − (Σd/n)² in fp64.
Only when s missed the mean by more than 4 standard deviations (`far`), which fp32's rounding of
Σd² could show in the variance, a second pass shifts by fp32(mean), as the reference always does.
Then — the channel still in cache — it writes (x − μ)·scale + bias in x's dtype with the
reference's fp32 coefficients (`coefficients`). Inference skips the sums.

Channel-last tensors (T = 1: NHWC, NDHWC) are [L, C] rows and run on their own kernel: a fixed
number of tasks (a function of L) each sum every channel over its range of rows (fp32 per
LAST_SUB_ROWS rows, then fp64), shifted by the first row, and the host adds the tasks' sums in
task order (a second sums pass when any channel is `far`); a last pass writes the output. Any
thread count gives the same bits.

The host writes saveMean/saveInvstd and updates the running statistics from the fp64 mean and
variance (C values: `ops.batch_norm.update_running`). Calls whose output dtype is not the input's,
or whose view does not merge into these shapes, run on the NumPy reference (`handles`).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import prange, types

from ...ops import batch_norm as reference
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
from ._reduce import LANES, nonfinite, shifted_sums
from .batch_norm_backward import LAST_SUB_ROWS, LAST_TASKS, kernel_shape

FAR = 16.0  # (mean − shift)² above FAR·var: another sums pass, around the mean (see `far`)


@numba.njit(inline="always")
def coefficients(mean, var, eps, w, b):
    """A channel's fp32 (μ, scale, bias) as the reference's `normalize` rounds them: μ = fp32(mean)
    (x − μ exact near the mean), scale = w/√(var + eps), and what rounding took from the mean moved
    into the bias (never 0·inf)."""
    scale = w / np.sqrt(var + eps)
    mu = np.float32(mean)
    lost = mean - np.float64(mu)
    shift = b
    if lost != 0:
        shift = b - lost * scale
    return mu, np.float32(scale), np.float32(shift)


@numba.njit(inline="always")
def far(offset, var):
    """The shift missed the mean by more than 4 standard deviations: Σd² then holds more than
    17·var, whose fp32 rounding could show in the variance, and a pass around the mean follows."""
    return offset * offset > FAR * var


def _signatures():
    sigs = []
    vec_in, vec_out = array(np.float64, 1, True, "C"), array(np.float64, 1, False, "C")
    for cin in STORAGE:
        sigs.append(
            types.void(
                array(cin, 1, True, "C"),  # input's storage from its first element
                types.UniTuple(types.int64, 3),  # its element strides
                types.int64,  # its kind (and output's)
                types.UniTuple(types.int64, 3),  # [L, C, T]
                types.boolean,  # training
                types.float64,  # eps
                vec_in,  # weight per channel (fp64)
                vec_in,  # bias
                vec_out,  # mean: written in training, read in inference
                vec_out,  # variance: likewise
                array(cin, 3, False, "C"),  # output [L, C, T]
                array(np.bool_, 1, False, "C"),  # per channel: an output was not finite
            )
        )
    return sigs


@lazy_njit(_signatures)
def channels_kernel(xb, xs, kind, shape, training, eps, w, b, mean, var, y, bad):
    n_l, n_c, n_t = shape
    count = n_l * n_t
    for c in prange(n_c):
        acc_d = np.empty(LANES, np.float32)
        acc_dd = np.empty(LANES, np.float32)
        xbuf = np.empty(gather_len(xs[2], n_t), xb.dtype)
        if training:
            first = row(xb, c * xs[1], xs[2], n_t, xbuf)
            part, _ = shifted_sums(first, kind, np.float32(0), n_t, acc_d, acc_dd)
            around = np.float32(part / n_t)  # the first row's mean
            for _ in range(2):
                sum_d = 0.0
                sum_dd = 0.0
                for li in range(n_l):
                    xi = row(xb, li * xs[0] + c * xs[1], xs[2], n_t, xbuf)
                    part_d, part_dd = shifted_sums(xi, kind, around, n_t, acc_d, acc_dd)
                    sum_d += part_d
                    sum_dd += part_dd
                offset = sum_d / count
                var[c] = sum_dd / count - offset * offset
                mean[c] = around + offset
                if not far(offset, var[c]):
                    break
                around = np.float32(mean[c])
        mu, scale, shift = coefficients(mean[c], var[c], eps, w[c], b[c])
        overflow = False
        for li in range(n_l):
            xi = row(xb, li * xs[0] + c * xs[1], xs[2], n_t, xbuf)
            yi = y[li, c]
            for j in range(n_t):
                v = (load(xi[j], kind) - mu) * scale + shift
                overflow |= nonfinite(v)
                yi[j] = narrow(v, yi, kind)
        bad[c] = overflow


def _last_signatures():
    sigs = []
    vec_in, sums = array(np.float64, 1, True, "C"), array(np.float64, 2, False, "C")
    for cin in STORAGE:
        sigs.append(
            types.void(
                array(cin, 1, True, "C"),  # input's storage from its first element
                types.UniTuple(types.int64, 2),  # its element strides
                types.int64,  # its kind (and output's)
                types.UniTuple(types.int64, 2),  # [L, C]
                types.boolean,  # the output pass (else a sums pass)
                array(np.float32, 1, True, "C"),  # the sums pass's shift per channel
                sums,  # Σd per task and channel
                sums,  # Σd² per task and channel
                types.float64,  # eps
                *(vec_in, vec_in, vec_in, vec_in),  # weight, bias, mean, variance (fp64)
                array(cin, 2, False, "C"),  # output [L, C]
                array(np.bool_, 1, False, "C"),  # per task: an output was not finite
            )
        )
    return sigs


@lazy_njit(_last_signatures)
def channels_last_kernel(xb, xs, kind, shape, write, shift, task_d, task_dd, eps, w, b, mean, var, y, bad):
    n_l, n_c = shape
    tasks = task_d.shape[0]
    for t in prange(tasks):
        l0 = t * n_l // tasks
        l1 = (t + 1) * n_l // tasks
        xbuf = np.empty(gather_len(xs[1], n_c), xb.dtype)
        if write:
            mu = np.empty(n_c, np.float32)
            scale = np.empty(n_c, np.float32)
            bias = np.empty(n_c, np.float32)
            for c in range(n_c):
                mu[c], scale[c], bias[c] = coefficients(mean[c], var[c], eps, w[c], b[c])
            overflow = False
            for li in range(l0, l1):
                xi = row(xb, li * xs[0], xs[1], n_c, xbuf)
                yi = y[li]
                for c in range(n_c):
                    v = (load(xi[c], kind) - mu[c]) * scale[c] + bias[c]
                    overflow |= nonfinite(v)
                    yi[c] = narrow(v, yi, kind)
            bad[t] = overflow
        else:
            part_d = np.empty(n_c, np.float32)
            part_dd = np.empty(n_c, np.float32)
            td = task_d[t]
            tdd = task_dd[t]
            td[:] = 0
            tdd[:] = 0
            for b0 in range(l0, l1, LAST_SUB_ROWS):
                part_d[:] = 0
                part_dd[:] = 0
                for li in range(b0, min(b0 + LAST_SUB_ROWS, l1)):
                    xi = row(xb, li * xs[0], xs[1], n_c, xbuf)
                    for c in range(n_c):
                        d = load(xi[c], kind) - shift[c]
                        part_d[c] += d
                        part_dd[c] += d * d
                for c in range(n_c):
                    td[c] += part_d[c]
                    tdd[c] += part_dd[c]


def shape_of(plan: Plan) -> tuple[int, ...]:
    return kernel_shape(plan.inputs["input"].shape, plan.values["channel_axis"])


def handles(plan: Plan) -> bool:
    """Every empty input (nothing to compute); else an output in the input's dtype and a view that
    merges into the kernel's shape."""
    x = plan.inputs["input"]
    if x.numel == 0:
        return True
    return plan.outputs["output"].dtype == x.dtype and views_ready(plan, ("input",), shape_of(plan))


def workspace_size(plan: Plan) -> int:
    if plan.inputs["input"].numel == 0:
        return 0
    shape = shape_of(plan)
    n_c = shape[1]
    vectors = n_c * 12 * 8  # weight, bias, mean, variance and the host's per-channel arithmetic, in fp64
    if len(shape) == 2:
        tasks = min(LAST_TASKS, shape[0])
        running = min(tasks, numba.config.NUMBA_NUM_THREADS)
        # Per task: fp64 sums; per running task: fp32 partials or coefficients, and a gathered row.
        return tasks * n_c * 2 * 8 + running * n_c * 4 * 4 + vectors + 4 * n_c
    running = min(n_c, numba.config.NUMBA_NUM_THREADS)
    # Per running task: lane accumulators and a gathered row (strided views).
    return running * (2 * LANES * 4 + 4 * shape[2]) + vectors


def run_channels(x3, training: bool, eps: float, w, b, mean, var, y3) -> bool:
    """The kernel on an [L, C, T] view; returns whether an output was not finite."""
    xk, kind = kernel_view(x3)
    xb, xs = flat(xk)
    yk, _ = kernel_view(y3)
    bad = np.zeros(x3.shape[1], np.bool_)
    channels_kernel.run(xb, xs, kind, x3.shape, training, eps, w, b, mean, var, yk, bad)
    return bool(bad.any())


def run_channels_last(x2, training: bool, eps: float, w, b, mean, var, y2) -> bool:
    """In training a sums pass around the first row (again around the mean when a channel is `far`),
    then the output pass; returns whether an output was not finite."""
    n_l, n_c = x2.shape
    xk, kind = kernel_view(x2)
    xb, xs = flat(xk)
    yk, _ = kernel_view(y2)
    tasks = min(LAST_TASKS, n_l)
    task_d, task_dd = np.zeros((tasks, n_c)), np.zeros((tasks, n_c))
    bad = np.zeros(tasks, np.bool_)

    def run(write: bool, shift: np.ndarray) -> None:
        channels_last_kernel.run(xb, xs, kind, x2.shape, write, shift, task_d, task_dd, eps, w, b, mean, var, yk, bad)

    if training:
        around = x2[0].astype(np.float32)  # the first row
        for _ in range(2):
            run(False, around)
            offset = task_d.sum(axis=0) / n_l  # in task order
            mean[...] = around + offset
            var[...] = task_dd.sum(axis=0) / n_l - offset * offset
            if not (offset * offset > FAR * var).any():
                break
            around = mean.astype(np.float32)
    run(True, np.zeros(n_c, np.float32))
    return bool(bad.any())


def per_channel(t: np.ndarray | None, c: int, default: float) -> np.ndarray:
    return np.full(c, default) if t is None else np.ascontiguousarray(t.reshape(-1), np.float64)


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether fp32 could not hold a result (`out_of_range`: the call is repeated in fp64)."""
    x = args["input"]
    if x.size == 0:  # saveMean 0, saveInvstd NaN when given: the reference's few writes
        return reference.compute(**args)
    shape = shape_of(plan)
    n_c = shape[1]
    training, eps = bool(args["training"]), float(args["eps"])
    w, b = per_channel(args["weight"], n_c, 1.0), per_channel(args["bias"], n_c, 0.0)
    if training:
        mean, var = np.empty(n_c), np.empty(n_c)
    else:  # CANN's defaults when null: mean 0, variance 1
        mean, var = per_channel(args["runningMean"], n_c, 0.0), per_channel(args["runningVar"], n_c, 1.0)
    out = args["output"]
    y = out.reshape(shape) if out.flags.c_contiguous else np.empty(shape, out.dtype)
    run = run_channels_last if len(shape) == 2 else run_channels
    bad = run(kernel_ready(x, shape), training, eps, w, b, mean, var, y)
    if not out.flags.c_contiguous:
        out[...] = y.reshape(out.shape)
    if not training:
        return bad
    args["saveMean"][...] = mean
    args["saveInvstd"][...] = 1.0 / np.sqrt(var + eps)
    n = math.prod(shape) // n_c
    reference.update_running(args["runningMean"], args["runningVar"], mean, var, n, float(args["momentum"]))
    return bad or squares_out_of_range(var + eps)


def warm_up() -> None:
    """Runs every compiled signature once on a tiny problem, training and inference."""
    ones = np.ones(2)
    for dtype in FLOAT_DTYPES:
        x = np.ones((2, 2, 3), dtype)
        for training in (True, False):
            run_channels(x, training, 1e-5, ones, ones, np.ones(2), np.ones(2), np.empty((2, 2, 3), dtype))
            run_channels_last(x[0].T, training, 1e-5, ones, ones, np.ones(2), np.ones(2), np.empty((3, 2), dtype))
