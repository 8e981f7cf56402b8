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
from .rows import Rows, block_rows, blocks, store, widened

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


def compute(input, normalizedShape, weightOptional, biasOptional, eps, out, meanOutOptional, rstdOutOptional) -> None:
    """Row blocks of [M, N]: fp32 sums (pairwise within a row), statistics in fp64, y in fp32."""
    lead = input.ndim - len(normalizedShape)
    x = Rows(input, lead)
    m, n = x.m, x.n
    mean_out = None if meanOutOptional is None else meanOutOptional.reshape(-1)
    rstd_out = None if rstdOutOptional is None else rstdOutOptional.reshape(-1)
    if m == 0:
        return
    if n == 0:  # CANN: mean 0, rstd NaN
        if mean_out is not None:
            mean_out[...] = 0
        if rstd_out is not None:
            rstd_out[...] = np.nan
        return
    w = None if weightOptional is None else widened(weightOptional.reshape(-1))
    b = None if biasOptional is None else widened(biasOptional.reshape(-1))
    y = out.reshape(m, n)
    rows_per_block = min(m, block_rows(n))
    buffers = np.empty((2, rows_per_block * n), np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for rows in blocks(m, n):
            count = rows.stop - rows.start
            xb, scratch = (buf[: count * n].reshape(count, n) for buf in buffers)
            widened(x[rows], xb)
            mu = xb.sum(axis=1, dtype=np.float64) / n
            xb -= mu.astype(np.float32)[:, None]
            var = np.square(xb, out=scratch).sum(axis=1, dtype=np.float64) / n
            rs = 1.0 / np.sqrt(var + eps)
            xb *= rs.astype(np.float32)[:, None]
            if w is not None:
                xb *= w
            if b is not None:
                xb += b
            store(y[rows], xb, scratch)
            if mean_out is not None:
                mean_out[rows] = mu
            if rstd_out is not None:
                rstd_out[rows] = rs


OPERATOR = Operator("aclnnLayerNorm", SIGNATURE, validate, workspace_size, compute)
