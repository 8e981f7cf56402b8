"""LayerNormGrad: the graph-mode LayerNorm backward, served two-phase (SPEC §4)."""

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
    output,
    tensor,
)
from ..registry import Operator, Plan, plan_from

INPUTS = ("dy", "x", "variance", "mean", "gamma")
SIGNATURE = Signature(
    (
        tensor("dy"),
        tensor("x"),
        tensor("variance"),
        tensor("mean"),
        tensor("gamma"),
        bool_array("output_mask", optional=True),
        output("pd_x", 0),
        output("pd_gamma", 1),
        output("pd_beta", 2),
    ),
    mask="output_mask",
    default_mask=(True, True, True),
)
EPSILON = 1e-12  # CANN's kernel constant, every dtype


def normalization_start(x_shape: tuple[int, ...], mean_shape: tuple[int, ...]) -> int | None:
    """The first normalization axis b that mean's shape implies (SPEC 4.2), or None."""
    r = len(x_shape)
    if len(mean_shape) < r:
        b = len(mean_shape)
        return b if mean_shape == x_shape[:b] else None
    if len(mean_shape) > r:
        return None
    b = next((i for i in range(r) if mean_shape[i] != x_shape[i]), r)
    return b if all(d == 1 for d in mean_shape[b:]) else None


def validate(p: CallParams) -> Plan:
    """The error table of SPEC 4.4, row by row."""
    p.require(*INPUTS)  # 1
    given_mask = p.scalar("output_mask")
    check(
        given_mask is None or len(given_mask) == 3, "output_mask", f"must have 3 entries, got {len(given_mask or ())}"
    )  # 2
    mask = tuple(given_mask) if given_mask is not None else (True, True, True)
    outputs = p.require_outputs(mask)  # 3
    tensors = p.present(INPUTS + tuple(outputs))
    dy, x, variance, mean, gamma = (p.tensor(n) for n in INPUTS)
    check_float_dtypes(tensors)  # 4
    check_same_dtype(dy, x)
    check_same_dtype(variance, mean)
    check(
        mean.dtype.itemsize >= x.dtype.itemsize,
        "mean",
        f"data type {mean.data_type.name} is narrower than x's {x.data_type.name}",
    )
    check(
        gamma.data_type in (x.data_type, DataType.FLOAT),
        "gamma",
        f"data type {gamma.data_type.name} must be x's or FLOAT",
    )
    inferred = {"pd_x": x, "pd_gamma": gamma, "pd_beta": gamma}
    for name in outputs:
        check_same_dtype(p.tensor(name), inferred[name])
    check_plain_formats(tensors)  # 5
    for t in tensors:  # 6
        check(t.rank <= 8, t.name, f"rank {t.rank} exceeds 8")
    check_shape(dy, x.shape, "x's")  # 7
    check_shape(variance, mean.shape, "mean's")  # 8
    forms = "x's leading dims, or x's shape with trailing dims 1"
    starts = normalization_start(x.shape, mean.shape)  # 9
    check(starts is not None, "mean", f"shape {list(mean.shape)} is not one of {forms}, x is {list(x.shape)}")
    check(  # 10
        gamma.rank <= x.rank and x.shape[x.rank - gamma.rank :] == gamma.shape,
        "gamma",
        f"shape {list(gamma.shape)} must equal x's trailing dims {list(x.shape)}",
    )
    for name in outputs:  # 11
        check_shape(p.tensor(name), inferred[name].shape, f"{inferred[name].name}'s")
    return plan_from(p, list(INPUTS), outputs, output_mask=mask)


def workspace_size(plan: Plan) -> int:
    """Six full-size fp32 temporaries (this graph op is computed whole, not in blocks)."""
    return 6 * 4 * plan.inputs["x"].numel


def compute(dy, x, variance, mean, gamma, output_mask, pd_x, pd_gamma, pd_beta) -> None:
    del output_mask  # it gated the outputs
    r, b = x.ndim, normalization_start(x.shape, mean.shape)
    stats_shape = x.shape[:b] + (1,) * (r - b)
    rstd = 1.0 / np.sqrt(variance.reshape(stats_shape).astype(np.float32) + np.float32(EPSILON))
    xhat = (x.astype(np.float32) - mean.reshape(stats_shape).astype(np.float32)) * rstd
    g = dy.astype(np.float32)
    if pd_x is not None:
        norm_axes, n = tuple(range(b, r)), math.prod(x.shape[b:])
        dyg = g * gamma.astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_dyg = (dyg.sum(norm_axes, keepdims=True, dtype=np.float64) / n).astype(np.float32)
            mean_dyg_xhat = ((dyg * xhat).sum(norm_axes, keepdims=True, dtype=np.float64) / n).astype(np.float32)
        pd_x[...] = rstd * (dyg - mean_dyg - xhat * mean_dyg_xhat)
    param_axes = tuple(range(r - gamma.ndim))
    if pd_gamma is not None:
        pd_gamma[...] = (g * xhat).sum(param_axes, dtype=np.float64)
    if pd_beta is not None:
        pd_beta[...] = g.sum(param_axes, dtype=np.float64)


OPERATOR = Operator("LayerNormGrad", SIGNATURE, validate, workspace_size, compute)
