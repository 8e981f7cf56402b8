"""LayerNormGrad: the graph-mode LayerNorm backward, served two-phase (SPEC §4)."""

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
    output,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .layer_norm_backward import block_scratch, layer_norm_rows
from .rows import Rows, widened

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


def gamma_rows(n: int, gamma_size: int) -> int:
    """The rows of N elements gamma spans: 1 when it covers only normalization axes."""
    return max(1, gamma_size // n) if n else 1


def workspace_size(plan: Plan) -> int:
    """LayerNormBackward's block scratch, plus the variance widened and gamma before tiling."""
    x, gamma = plan.inputs["x"], plan.inputs["gamma"]
    b = normalization_start(x.shape, plan.inputs["mean"].shape)
    m, n = math.prod(x.shape[:b]), math.prod(x.shape[b:])
    return block_scratch(m, n, gamma_rows(n, gamma.numel)) + 4 * m + 4 * gamma.numel if m * n else 0


def compute(dy, x, variance, mean, gamma, output_mask, pd_x, pd_gamma, pd_beta) -> bool:
    """LayerNormBackward's row blocks, with rstd from variance and gamma tiled to whole rows.
    Returns `out_of_range`."""
    del output_mask  # it gated the outputs
    b = normalization_start(x.shape, mean.shape)
    rows_x, rows_dy = Rows(x, b), Rows(dy, b)
    m, n = rows_x.m, rows_x.n
    trouble = False
    if m * n == 0:
        sums = np.zeros((2, gamma.size))
    else:
        variance = widened(variance.reshape(-1))
        rstd = 1.0 / np.sqrt(variance + variance.dtype.type(EPSILON))
        # Gamma covers the last normalization axes (tiled along the row) or more (it spans K rows).
        w = np.tile(widened(gamma.reshape(-1)), max(1, n // gamma.size)).reshape(gamma_rows(n, gamma.size), n)
        dx = None if pd_x is None else pd_x.reshape(m, n)
        want_sums = pd_gamma is not None or pd_beta is not None
        sums, trouble = layer_norm_rows(rows_dy, rows_x, widened(mean.reshape(-1)), rstd, w, dx, want_sums)
        if sums is not None:  # fold them onto gamma's positions, in order
            sums = sums.reshape(2, -1, gamma.size).sum(axis=1)
    if pd_gamma is not None:
        pd_gamma.reshape(-1)[:] = sums[1]
    if pd_beta is not None:
        pd_beta.reshape(-1)[:] = sums[0]
    return trouble


OPERATOR = Operator("LayerNormGrad", SIGNATURE, validate, workspace_size, compute)
