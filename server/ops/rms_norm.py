"""aclnnRmsNorm: y = x · rstd · gamma with rstd = 1/√(mean(x²) + epsilon) over gamma's trailing dims.

CANN generates this aclnn API from the op definition (`norm/rms_norm/op_host/rms_norm_def.cpp`: the
dtype combinations) and checks shapes in its tiling (`rms_norm_tiling.cpp`, CheckInputShape4RmsNorm,
then `epsilon < 0`); here the same checks run at GetWorkspaceSize, as 161002 (CANN reports the tiling
ones as 561002). `rstdOut` has x's leading dims with gamma's dims kept as 1 (`[rows, 1]`), or
x's leading dims alone.
"""

from __future__ import annotations

import numpy as np

from aclnn_common.types import DataType

from ..descriptors import TensorDesc
from ..params import (
    CallParams,
    Kind,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_same_dtype,
    check_shape,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rows import Rows, block_rows, blocks, out_of_range, squares_out_of_range, store, widened, work_dtype

F32_ONLY = frozenset({DataType.FLOAT})
SIGNATURE = Signature(
    (
        tensor("x"),
        tensor("gamma"),
        scalar("epsilon", Kind.DOUBLE),
        output("yOut"),
        output("rstdOut"),
    )
)


def check_gamma(gamma: TensorDesc, x: TensorDesc) -> None:
    """gamma: rank 1..rank(x), no empty dim, equal to x's trailing dims (CANN's tiling checks)."""
    check(1 <= gamma.rank <= 8, "gamma", f"rank {gamma.rank} is outside 1..8")
    check(gamma.rank <= x.rank, "gamma", f"rank {gamma.rank} exceeds x's rank {x.rank}")


def check_gamma_shape(gamma: TensorDesc, x: TensorDesc) -> None:
    check(0 not in gamma.shape, "gamma", f"shape {list(gamma.shape)} is empty (CANN: gamma cannot be empty)")
    trailing = x.shape[x.rank - gamma.rank :]
    check(gamma.shape == trailing, "gamma", f"shape {list(gamma.shape)} must equal x's trailing dims {list(trailing)}")


def rstd_shapes(x_shape: tuple[int, ...], k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """rstd's accepted shapes: x's leading dims with the k normalized dims kept as 1, or without them."""
    lead = tuple(x_shape[: len(x_shape) - k])
    return lead + (1,) * k, lead


def validate(p: CallParams) -> Plan:
    """The op definition's dtypes, then CheckInputShape4RmsNorm, then epsilon."""
    p.require("x", "gamma", "epsilon", "yOut", "rstdOut")  # 1
    x, gamma, y, rstd = (p.tensor(n) for n in ("x", "gamma", "yOut", "rstdOut"))
    check_float_dtypes([x])  # 2
    check_float_dtypes([gamma])
    check(
        gamma.data_type in (x.data_type, DataType.FLOAT),
        "gamma",
        f"data type {gamma.data_type.name} must be x's ({x.data_type.name}) or FLOAT",
    )
    check_same_dtype(y, x)
    check_float_dtypes([rstd], F32_ONLY)
    check_plain_formats((x, gamma, y, rstd))  # 3
    check(1 <= x.rank <= 8, "x", f"rank {x.rank} is outside 1..8")  # 4
    check_gamma(gamma, x)
    check(y.rank == x.rank, "yOut", f"rank {y.rank} must equal x's rank {x.rank}")
    check(1 <= rstd.rank <= 8, "rstdOut", f"rank {rstd.rank} is outside 1..8")
    check_gamma_shape(gamma, x)  # 5
    check_shape(y, x.shape, "x's")  # 6
    kept, flat = rstd_shapes(x.shape, gamma.rank)
    check(  # 7
        rstd.shape in (kept, flat),
        "rstdOut",
        f"shape {list(rstd.shape)} must be {list(kept)} (or {list(flat)}) for x {list(x.shape)}",
    )
    epsilon = float(p.scalar("epsilon"))
    check(epsilon >= 0, "epsilon", f"must not be negative, got {epsilon}")  # 8
    return plan_from(p, ["x", "gamma"], ["yOut", "rstdOut"], epsilon=epsilon)


def workspace_size(plan: Plan) -> int:
    """Two fp32 blocks, fp32 gamma, per-block statistics."""
    x, gamma = plan.inputs["x"], plan.inputs["gamma"]
    n = gamma.numel
    m = x.numel // n
    if m == 0:
        return 0
    rows = min(m, block_rows(n))
    return 2 * 4 * rows * n + 4 * n + 2 * 8 * rows


def compute(x, gamma, epsilon, yOut, rstdOut) -> bool:
    """Row blocks of [M, N] in the block dtype; Σx² per row in fp64. Returns `out_of_range`."""
    rows_x = Rows(x, x.ndim - gamma.ndim)
    m, n = rows_x.m, rows_x.n
    if m == 0:
        return False
    g = widened(gamma.reshape(-1))
    y, rstd = yOut.reshape(m, n), rstdOut.reshape(-1)
    buffers = np.empty((2, min(m, block_rows(n)) * n), work_dtype())
    trouble = False
    for rows in blocks(m, n):
        count = rows.stop - rows.start
        xb, scratch = (buf[: count * n].reshape(count, n) for buf in buffers)
        widened(rows_x[rows], xb)
        square_mean = np.square(xb, out=scratch).sum(axis=1, dtype=np.float64) / n
        rs = 1.0 / np.sqrt(square_mean + epsilon)
        xb *= rs.astype(xb.dtype)[:, None]
        xb *= g
        trouble = trouble or squares_out_of_range(square_mean + epsilon) or out_of_range(xb)
        store(y[rows], xb, scratch)
        rstd[rows] = rs
    return trouble


OPERATOR = Operator("aclnnRmsNorm", SIGNATURE, validate, workspace_size, compute)
