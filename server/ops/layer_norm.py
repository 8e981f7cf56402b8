"""aclnnLayerNorm: LayerNorm's forward, with the statistics its backward takes (mean, rstd).

Checks in the order of CANN's op_api (`norm/layer_norm_v4/op_host/op_api/aclnn_layer_norm.cpp`):
nulls, input dtypes, output dtypes, ranks and normalizedShape, shapes, then the mean/rstd shapes
(CANN checks those on its newest chip only; here always). Each row of `[M, N]` is normalized by
its population variance: rstd = 1/√(var + eps).
"""

from __future__ import annotations

import math

import numpy as np

from aclnn_common.types import DataType

from ..params import (
    FLOAT_TYPES,
    CallParams,
    Kind,
    ParamSpec,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_shape,
    int_array,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rows import Rows, block_rows, blocks, out_of_range, squares_out_of_range, store, widened, work_dtype

INPUTS = ("input", "weightOptional", "biasOptional")
OUTPUTS = ("out", "meanOutOptional", "rstdOutOptional")
SIGNATURE = Signature(
    (
        tensor("input"),
        int_array("normalizedShape"),
        tensor("weightOptional", optional=True),
        tensor("biasOptional", optional=True),
        scalar("eps", Kind.DOUBLE),
        output("out"),
        ParamSpec("meanOutOptional", Kind.TENSOR, output=True, optional=True),
        ParamSpec("rstdOutOptional", Kind.TENSOR, output=True, optional=True),
    )
)


def stats_shape(x_shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The statistics' shape: input's leading dims, the k normalized dims kept as 1."""
    return tuple(x_shape[: len(x_shape) - k]) + (1,) * k


def validate(p: CallParams) -> Plan:
    """CANN's CheckNotNull, CheckInputDtype, CheckOutputDtype, CheckShape, CheckMeanRstdOutputShape."""
    p.require("input", "normalizedShape", "out", "eps")  # 1
    x, out = p.tensor("input"), p.tensor("out")
    weight, bias = p.tensor("weightOptional"), p.tensor("biasOptional")
    check_float_dtypes([x])  # 2
    for t in (weight, bias):
        if t is not None:
            check_float_dtypes([t])
            check(
                t.data_type in (x.data_type, DataType.FLOAT),
                t.name,
                f"data type {t.data_type.name} must be input's ({x.data_type.name}) or FLOAT",
            )
    if weight is not None and bias is not None:
        check(
            bias.data_type == weight.data_type,
            "biasOptional",
            f"data type {bias.data_type.name} must equal weightOptional's {weight.data_type.name}",
        )
    outputs = p.present(OUTPUTS)
    check_float_dtypes(outputs, FLOAT_TYPES)  # 3
    check_plain_formats(p.present(INPUTS) + outputs)  # 4
    shape = p.array("normalizedShape")
    k = len(shape)
    check(k <= 8, "normalizedShape", f"has {k} entries, more than 8")  # 5
    check(k >= 1, "normalizedShape", "has no entries")
    check(x.rank >= k, "input", f"rank {x.rank} is below normalizedShape's length {k}")
    for t in (weight, bias):  # 6
        if t is not None:
            check(t.rank == k, t.name, f"rank {t.rank} must equal normalizedShape's length {k}")
    lead = x.rank - k
    check(  # 7
        tuple(x.shape[lead:]) == tuple(shape),
        "input",
        f"trailing dims {list(x.shape[lead:])} must equal normalizedShape {list(shape)}",
    )
    check_shape(weight, tuple(shape), "normalizedShape")
    check_shape(bias, tuple(shape), "normalizedShape")
    check_shape(out, x.shape, "input's")  # 8
    m = math.prod(x.shape[:lead])
    expected = stats_shape(x.shape, k)
    for t in p.present(("meanOutOptional", "rstdOutOptional")):  # 9
        if not (t.numel == 0 and m == 0):
            check_shape(t, expected, "input's leading dims with normalized dims 1:")
    mean, rstd = p.tensor("meanOutOptional"), p.tensor("rstdOutOptional")
    if mean is not None and rstd is not None:
        check_shape(rstd, mean.shape, "meanOutOptional's")
    return plan_from(
        p, list(INPUTS), [t.name for t in outputs], normalizedShape=tuple(shape), eps=float(p.scalar("eps"))
    )


def workspace_size(plan: Plan) -> int:
    """Two fp32 blocks, fp32 weight and bias rows, per-block statistics."""
    x = plan.inputs["input"]
    n = math.prod(plan.values["normalizedShape"])
    m = x.numel // n if n else 0
    if m * n == 0:
        return 0
    rows = min(m, block_rows(n))
    return 2 * 4 * rows * n + 2 * 4 * n + 3 * 8 * rows


def compute(input, normalizedShape, weightOptional, biasOptional, eps, out, meanOutOptional, rstdOutOptional) -> bool:
    """Row blocks of [M, N] in the block dtype (`normalize_last_axis`); returns `out_of_range`."""
    lead = input.ndim - len(normalizedShape)
    x = Rows(input, lead)
    m, n = x.m, x.n
    mean_out = None if meanOutOptional is None else meanOutOptional.reshape(-1)
    rstd_out = None if rstdOutOptional is None else rstdOutOptional.reshape(-1)
    if m == 0:
        return False
    if n == 0:  # CANN: mean 0, rstd NaN
        if mean_out is not None:
            mean_out[...] = 0
        if rstd_out is not None:
            rstd_out[...] = np.nan
        return False
    w = None if weightOptional is None else widened(weightOptional.reshape(-1))
    b = None if biasOptional is None else widened(biasOptional.reshape(-1))
    y = out.reshape(m, n)
    rows_per_block = min(m, block_rows(n))
    buffers = np.empty((2, rows_per_block * n), work_dtype())
    trouble = False
    for rows in blocks(m, n):
        count = rows.stop - rows.start
        xb, scratch = (buf[: count * n].reshape(count, n) for buf in buffers)
        widened(x[rows], xb)
        mu, rs, squares_trouble = normalize_last_axis(xb, scratch, eps)
        if w is not None:
            xb *= w
        if b is not None:
            xb += b
        trouble = trouble or squares_trouble or out_of_range(xb)
        store(y[rows], xb, scratch)
        if mean_out is not None:
            mean_out[rows] = mu
        if rstd_out is not None:
            rstd_out[rows] = rs
    return trouble


# What rounding took from the mean moves x̂ by less than this: left out (x̂'s own rounding is larger).
NEGLIGIBLE_SHIFT = 2.0**-30


def normalize_last_axis(xb: np.ndarray, scratch: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """x̂ = (x − mean)·rstd along the last axis of a block, in place (also GroupNorm's); returns the
    mean and rstd (fp64, population variance) and whether the squares left fp32's safe range
    (`squares_out_of_range`). `scratch`: a block like `xb`.

    The mean is summed in fp64 and rounded to the block dtype, μ; x − μ is exact near the mean, and
    what the rounding took from it, mean − μ, corrects the variance, Σ(x − μ)²/N − (mean − μ)², and
    x̂ (as BatchNorm's `normalize` moves it into the bias): data far from zero with a small spread
    keep their accuracy.
    """
    n = xb.shape[-1]
    mean = xb.sum(axis=-1, dtype=np.float64) / n
    mu = mean.astype(xb.dtype)
    lost = mean - mu
    xb -= mu[..., None]
    var = np.maximum(np.square(xb, out=scratch).sum(axis=-1, dtype=np.float64) / n - lost * lost, 0)
    rs = 1.0 / np.sqrt(var + eps)
    xb *= rs.astype(xb.dtype)[..., None]
    shift = lost * rs
    if (np.abs(shift) > NEGLIGIBLE_SHIFT).any():
        xb -= shift.astype(xb.dtype)[..., None]
    return mean, rs, squares_out_of_range(var + eps)


OPERATOR = Operator("aclnnLayerNorm", SIGNATURE, validate, workspace_size, compute)
