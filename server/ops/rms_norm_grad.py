"""aclnnRmsNormGrad: the backward of aclnnRmsNorm.

x̂ = x · rstd, dx = rstd · (dy·gamma − x̂ · mean_row(dy·gamma·x̂)), dgamma = Σ over rows of dy · x̂.
CANN generates this aclnn API from the op definition (`norm/rms_norm_grad/op_host/rms_norm_grad_def.cpp`)
and checks shapes in its tiling (`rms_norm_grad_tiling.cpp`: CheckInputDim, CheckOutputDim,
CheckInputAndOutputShape, CheckRstdShape, CheckGammaAndDgammaShape, in that order); here at
GetWorkspaceSize, as 161002.
"""

from __future__ import annotations

import numpy as np

from aclnn_common.types import DataType

from ..params import (
    CallParams,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_same_dtype,
    check_shape,
    output,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rms_norm import F32_ONLY, check_gamma, check_gamma_shape
from .rows import Rows, block_rows, blocks, column_sums, out_of_range, store, widened, work_dtype

INPUTS = ("dy", "x", "rstd", "gamma")
SIGNATURE = Signature(
    (
        tensor("dy"),
        tensor("x"),
        tensor("rstd"),
        tensor("gamma"),
        output("dxOut"),
        output("dgammaOut"),
    )
)


def rstd_fits(rstd: tuple[int, ...], x: tuple[int, ...], lead: int) -> bool:
    """CheckRstdShape: rstd is x's first dims (the rest of x's leading dims 1), or x's leading dims
    followed by dims of 1 (CANN leaves those unchecked; here they must be 1, so rstd has M elements)."""
    if len(rstd) < lead:
        return rstd == x[: len(rstd)] and all(d == 1 for d in x[len(rstd) : lead])
    return rstd[:lead] == x[:lead] and all(d == 1 for d in rstd[lead:])


def validate(p: CallParams) -> Plan:
    """The op definition's dtypes, then the tiling's shape checks in their order."""
    p.require(*INPUTS, "dxOut", "dgammaOut")  # 1
    dy, x, rstd, gamma, dx, dgamma = (p.tensor(n) for n in (*INPUTS, "dxOut", "dgammaOut"))
    check_float_dtypes([dy])  # 2
    check_same_dtype(x, dy)
    check_float_dtypes([rstd], F32_ONLY)
    check_float_dtypes([gamma])
    check(
        gamma.data_type in (dy.data_type, DataType.FLOAT),
        "gamma",
        f"data type {gamma.data_type.name} must be dy's ({dy.data_type.name}) or FLOAT",
    )
    check_same_dtype(dx, dy)
    check_float_dtypes([dgamma], F32_ONLY)
    check_plain_formats((dy, x, rstd, gamma, dx, dgamma))  # 3
    check(1 <= x.rank <= 8, "x", f"rank {x.rank} is outside 1..8")  # 4
    check_gamma(gamma, x)
    check(dy.rank == x.rank, "dy", f"rank {dy.rank} must equal x's rank {x.rank}")
    check(1 <= rstd.rank <= 8, "rstd", f"rank {rstd.rank} is outside 1..8")
    check(dx.rank == dy.rank, "dxOut", f"rank {dx.rank} must equal dy's rank {dy.rank}")  # 5
    check(dgamma.rank == gamma.rank, "dgammaOut", f"rank {dgamma.rank} must equal gamma's rank {gamma.rank}")
    check_shape(dy, x.shape, "x's")  # 6
    check_shape(dx, dy.shape, "dy's")
    check(dy.shape[-1] != 0, "dy", f"last dim of {list(dy.shape)} is 0 (CANN: the last axis cannot be 0)")
    lead = x.rank - gamma.rank
    check(  # 7
        rstd_fits(rstd.shape, x.shape, lead),
        "rstd",
        f"shape {list(rstd.shape)} must be x's leading dims {list(x.shape[:lead])} (trailing 1s allowed)",
    )
    check_gamma_shape(gamma, x)  # 8
    check_shape(dgamma, gamma.shape, "gamma's")
    return plan_from(p, list(INPUTS), ["dxOut", "dgammaOut"])


def workspace_size(plan: Plan) -> int:
    """Three fp32 blocks, fp32 gamma, fp64 column sums."""
    x, gamma = plan.inputs["x"], plan.inputs["gamma"]
    n = gamma.numel
    m = x.numel // n
    rows = min(m, block_rows(n))
    return 3 * 4 * rows * n + 4 * n + 8 * n + 4 * m


def compute(dy, x, rstd, gamma, dxOut, dgammaOut) -> bool:
    """Row blocks of [M, N] in the block dtype; dgamma's column sums in fp64 across blocks, in
    block order. Returns `out_of_range`."""
    lead = x.ndim - gamma.ndim
    rows_x, rows_g = Rows(x, lead), Rows(dy, lead)
    m, n = rows_x.m, rows_x.n
    sums = np.zeros(n)
    trouble = False
    if m:
        g = widened(gamma.reshape(-1))
        rs = widened(rstd.reshape(-1))
        dx = dxOut.reshape(m, n)
        buffers = np.empty((3, min(m, block_rows(n)) * n), work_dtype())
        for rows in blocks(m, n):
            count = rows.stop - rows.start
            gb, xhat, product = (buf[: count * n].reshape(count, n) for buf in buffers)
            widened(rows_g[rows], gb)
            widened(rows_x[rows], xhat)
            xhat *= rs[rows, None]
            sums += column_sums(np.multiply(gb, xhat, out=product))
            gb *= g  # dy·gamma
            coefficient = np.multiply(gb, xhat, out=product).sum(axis=1, dtype=np.float64) / n
            xhat *= coefficient.astype(xhat.dtype)[:, None]
            gb -= xhat
            gb *= rs[rows, None]
            trouble = trouble or out_of_range(gb)
            store(dx[rows], gb, product)
    dgammaOut.reshape(-1)[:] = sums
    return trouble or out_of_range(sums)


OPERATOR = Operator("aclnnRmsNormGrad", SIGNATURE, validate, workspace_size, compute)
