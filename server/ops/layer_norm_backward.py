"""aclnnLayerNormBackward: the backward of LayerNorm (SPEC §3)."""

from __future__ import annotations

import math

import numpy as np

from aclnn_common.types import DataType

from ..params import (
    CallParams,
    Signature,
    bool_array,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_same_dtype,
    check_shape,
    int_array,
    output,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rows import (
    NUMPY_BUFFER,
    Rows,
    block_rows,
    blocks,
    column_sums,
    in_order,
    out_of_range,
    store,
    widened,
    work_dtype,
    workers_for,
)

INPUTS = ("gradOut", "input", "mean", "rstd", "weightOptional", "biasOptional")
SIGNATURE = Signature(
    (
        tensor("gradOut"),
        tensor("input"),
        int_array("normalizedShape"),
        tensor("mean"),
        tensor("rstd"),
        tensor("weightOptional", optional=True),
        tensor("biasOptional", optional=True),
        bool_array("outputMask"),
        output("gradInputOut", 0),
        output("gradWeightOut", 1),
        output("gradBiasOut", 2),
    ),
    mask="outputMask",
)


def validate(p: CallParams) -> Plan:
    """The error table of SPEC 3.3, row by row."""
    p.require("gradOut", "input", "normalizedShape", "mean", "rstd", "outputMask")  # 1
    mask = p.array("outputMask")
    check(len(mask) == 3, "outputMask", f"must have 3 entries, got {len(mask)}")  # 2
    outputs = p.require_outputs(mask)  # 3
    tensors = p.present(INPUTS + tuple(outputs))
    check_float_dtypes(tensors)  # 4
    grad_out, x, mean, rstd = (p.tensor(n) for n in ("gradOut", "input", "mean", "rstd"))
    check_same_dtype(grad_out, x)  # 5
    weight, bias = p.tensor("weightOptional"), p.tensor("biasOptional")
    for t in p.present(("weightOptional", "biasOptional")):  # 6
        check(
            t.data_type in (x.data_type, DataType.FLOAT),
            t.name,
            f"data type {t.data_type.name} must be input's or FLOAT",
        )
    if weight and bias:
        check_same_dtype(bias, weight)
    check_plain_formats(tensors)  # 7
    for t in tensors:  # 8
        check(1 <= t.rank <= 8, t.name, f"rank {t.rank} is outside 1..8")
    shape = p.array("normalizedShape")
    check(0 < len(shape) <= x.rank, "normalizedShape", f"length {len(shape)} must lie in 1..rank(input)={x.rank}")  # 9
    check(all(d >= 0 for d in shape), "normalizedShape", f"entries must be non-negative, got {list(shape)}")
    lead = x.rank - len(shape)
    check(  # 10
        x.shape[lead:] == shape,
        "input",
        f"trailing dims {list(x.shape[lead:])} must equal normalizedShape {list(shape)}",
    )
    check_shape(grad_out, x.shape, "input's")  # 11
    check_shape(weight, shape, "normalizedShape")  # 12
    check_shape(bias, shape, "normalizedShape")
    check_shape(rstd, mean.shape, "mean's")  # 13
    m, n = math.prod(x.shape[:lead]), math.prod(shape)
    check(mean.numel == m, "mean", f"has {mean.numel} elements, input has {m} rows")  # 14
    if "gradInputOut" in outputs:  # 15
        check_shape(p.tensor("gradInputOut"), x.shape, "input's")
    for name in ("gradWeightOut", "gradBiasOut"):  # 16
        if name in outputs:
            t = p.tensor(name)
            check(t.numel == n, name, f"has {t.numel} elements, normalizedShape has {n}")
    return plan_from(p, list(INPUTS), outputs, normalizedShape=shape, outputMask=mask)


def block_scratch(m: int, n: int, period: int = 1) -> int:
    """Scratch of `layer_norm_rows`, per worker: three fp32 block buffers, a block of transients (a
    gathered strided block, or fp16 widening's masks), NumPy's casting buffers; then fp32 weight
    rows, fp64 sums and the blocks' partial sums waiting to be added, fp32 mean and rstd."""
    if m * n == 0:
        return 0
    rows = min(m, block_rows(n))
    workers = workers_for(sum(1 for _ in blocks(m, n, period)))
    per_worker = 4 * 4 * rows * n + 2 * 8 * NUMPY_BUFFER
    partials = (workers + 2) * 2 * 8 * min(period, rows) * n
    return workers * per_worker + (4 + 2 * 8) * period * n + partials + 4 * (2 * m + 2 * rows)


def workspace_size(plan: Plan) -> int:
    n = math.prod(plan.values["normalizedShape"])
    return block_scratch(plan.inputs["input"].numel // n if n else 0, n)


def far_statistics_dot(
    gw: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray, dot: np.ndarray
) -> np.ndarray:
    """mean(g·w·x̂) along the last axis in fp64 as rstd·(mean(g·w·(x − x₀)) + (x₀ − μ)·mean(g·w)), x₀ the
    row's first element, where that is finite; `dot` (mean(g·w·x̂) as computed) elsewhere.

    x − x₀ is exact in fp64, x − μ is not when the given mean lies ~2^29 times beyond the data
    (statistics that are not the input's own): every x̂ of the row is then the same, and the x̂
    term of the gradient, which the exact result keeps, cancels. Rows holding ±Inf or NaN keep
    the formula as written (and its IEEE results)."""
    first = x[..., :1]
    shifted = np.multiply(gw, x - first).mean(axis=-1, keepdims=True) + (first - mean) * gw.mean(axis=-1, keepdims=True)
    shifted *= rstd
    return np.where(np.isfinite(shifted), shifted, dot)


def layer_norm_rows(
    g: Rows, x: Rows, mean: np.ndarray, rstd: np.ndarray, w: np.ndarray, dx: np.ndarray | None, want_sums: bool
) -> tuple[np.ndarray | None, bool]:
    """The LayerNorm backward over [M, N] rows in bounded blocks; weight rows repeat every K rows.

    `w` is fp32 [K, N] (row i is scaled by w[i % K]: K = 1 for aclnnLayerNormBackward, more when
    LayerNormGrad's gamma spans several rows); `mean` and `rstd` are fp32 [M]. Writes `dx` (an
    [M, N] view) when given. Returns fp64 [2, K, N], Σ g and Σ g·x̂ over the rows i of each
    i % K, when `want_sums` (else None), and whether a result was `out_of_range`. Blocks are
    whole periods of K rows (or lie inside one), seen as [periods, span, N] so that w broadcasts.
    """
    k, n = w.shape
    row_blocks = list(blocks(x.m, n, k)) if n else []
    scratch = np.empty((workers_for(len(row_blocks)), 3, min(x.m, block_rows(n)) * n), work_dtype())
    trouble = []  # a gradInput block was `out_of_range`

    def block(rows: slice, buffers: np.ndarray) -> tuple[slice, np.ndarray | None]:
        span = min(rows.stop - rows.start, k)
        first = rows.start % k
        shape = (-1, span, n)
        gb, xhat, product = (buf[: (rows.stop - rows.start) * n].reshape(shape) for buf in buffers)
        rs = rstd[rows].reshape(-1, span, 1)
        widened(g[rows].reshape(shape), gb)
        widened(x[rows].reshape(shape), xhat)
        xhat -= mean[rows].reshape(-1, span, 1)
        xhat *= rs
        partial = None
        if want_sums:
            partial = np.stack((column_sums(gb), column_sums(np.multiply(gb, xhat, out=product))))
        if dx is not None:
            gb *= w[first : first + span]  # g·w
            # In fp64, so that a constant g·w (x̂ = 0: gradInput exactly 0) is its own mean.
            mean_gw = (gb.sum(axis=2, keepdims=True, dtype=np.float64) / n).astype(gb.dtype)
            np.multiply(gb, xhat, out=product)
            dot = product.mean(axis=2, keepdims=True)
            if gb.dtype == np.float64:
                dot = far_statistics_dot(gb, widened(x[rows].reshape(shape)), mean[rows].reshape(-1, span, 1), rs, dot)
            xhat *= dot
            gb -= mean_gw
            gb -= xhat
            gb *= rs
            if out_of_range(gb):
                trouble.append(rows)
            store(dx[rows], gb.reshape(-1, n), product.reshape(-1, n))
        return slice(first, first + span), partial

    sums = np.zeros((2, k, n)) if want_sums else None
    for weight_rows, partial in in_order(block, row_blocks, scratch):
        if sums is not None:
            sums[:, weight_rows] += partial  # in block order: the same sums on any thread count
    return sums, bool(trouble) or out_of_range(sums)


def compute(
    gradOut,
    input,
    normalizedShape,
    mean,
    rstd,
    weightOptional,
    biasOptional,
    outputMask,
    gradInputOut,
    gradWeightOut,
    gradBiasOut,
) -> bool:
    """Row blocks of [M, N] in the block dtype; column sums accumulate in fp64 across blocks.
    Returns `out_of_range`."""
    del biasOptional, outputMask  # bias does not enter the gradient; the mask gated the outputs
    lead = input.ndim - len(normalizedShape)
    x, g = Rows(input, lead), Rows(gradOut, lead)
    n = x.n
    w = np.ones(n, work_dtype()) if weightOptional is None else widened(weightOptional.reshape(-1))
    dx = gradInputOut.reshape(x.m, n) if gradInputOut is not None else None
    want_sums = gradWeightOut is not None or gradBiasOut is not None
    mean, rstd = widened(mean.reshape(-1)), widened(rstd.reshape(-1))
    sums, trouble = layer_norm_rows(g, x, mean, rstd, w[None], dx, want_sums)
    if gradWeightOut is not None:
        gradWeightOut.reshape(-1)[:] = sums[1, 0]
    if gradBiasOut is not None:
        gradBiasOut.reshape(-1)[:] = sums[0, 0]
    return trouble


OPERATOR = Operator("aclnnLayerNormBackward", SIGNATURE, validate, workspace_size, compute)
