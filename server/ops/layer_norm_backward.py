"""aclnnLayerNormBackward: the backward of LayerNorm (SPEC §3)."""

from __future__ import annotations

import math

import numpy as np

from aclnn_client.types import DataType

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
from .rows import Rows, block_rows, blocks

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


def workspace_size(plan: Plan) -> int:
    """Four fp32 block temporaries, fp64 column sums, and the widened mean and rstd."""
    n = math.prod(plan.values["normalizedShape"])
    m = plan.inputs["input"].numel // n if n else 0
    return 4 * 4 * min(m, block_rows(n)) * n + 2 * 8 * n + 2 * 4 * m if m * n else 0


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
) -> None:
    """Row blocks of [M, N] in fp32; column sums accumulate in fp64 across blocks."""
    del biasOptional, outputMask  # bias does not enter the gradient; the mask gated the outputs
    lead = input.ndim - len(normalizedShape)
    x, g = Rows(input, lead), Rows(gradOut, lead)
    m, n = x.m, x.n
    mu = mean.reshape(-1).astype(np.float32)[:, None]
    rs = rstd.reshape(-1).astype(np.float32)[:, None]
    w = np.ones(n, np.float32) if weightOptional is None else weightOptional.reshape(-1).astype(np.float32)
    dx = gradInputOut.reshape(m, n) if gradInputOut is not None else None
    sum_gxhat, sum_g = np.zeros(n), np.zeros(n)
    for rows in blocks(m, n) if n else ():
        gb = g[rows].astype(np.float32)
        xhat = (x[rows].astype(np.float32) - mu[rows]) * rs[rows]
        if dx is not None:
            gw = gb * w
            mean_gw = gw.mean(axis=1, keepdims=True)
            mean_gw_xhat = (gw * xhat).mean(axis=1, keepdims=True)
            dx[rows] = rs[rows] * (gw - mean_gw - xhat * mean_gw_xhat)
        if gradWeightOut is not None:
            sum_gxhat += (gb * xhat).sum(axis=0, dtype=np.float64)
        if gradBiasOut is not None:
            sum_g += gb.sum(axis=0, dtype=np.float64)
    if gradWeightOut is not None:
        gradWeightOut.reshape(-1)[:] = sum_gxhat
    if gradBiasOut is not None:
        gradBiasOut.reshape(-1)[:] = sum_g


OPERATOR = Operator("aclnnLayerNormBackward", SIGNATURE, validate, workspace_size, compute)
