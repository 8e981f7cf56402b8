"""aclnnGroupNormBackward: the backward of aclnnGroupNorm.

gradOut and input are read as `[N, C, HxW]` in their flat (row-major) order, mean and rstd as
`[N, group]`. Per sample and group (D = C/group · HxW elements), with x̂ = (x − mean)·rstd and
gw = gradOut·gamma[c]: gradInput = rstd·(gw − mean_D(gw) − x̂·mean_D(gw·x̂));
gradGammaOut[c] = Σ over samples and HxW of gradOut·x̂; gradBetaOut[c] = Σ of gradOut.
Checks in the order of CANN's `norm/group_norm_grad/op_host/op_api/aclnn_group_norm_backward.cpp`
(CheckParams), with the dtype rules of its mixed-precision path (mean, rstd, gamma and the
parameter gradients in gradOut's dtype or FLOAT), which contain the older chips' rules.
"""

from __future__ import annotations

import numpy as np

from aclnn_common.types import DataType

from ..descriptors import TensorDesc
from ..params import (
    CallParams,
    Kind,
    Signature,
    bool_array,
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
from .group_norm import SIZES, check_sizes
from .rows import Rows, block_rows, blocks, column_sums, out_of_range, store, widened, work_dtype

INPUTS = ("gradOut", "input", "mean", "rstd", "gamma")
SIGNATURE = Signature(
    (
        tensor("gradOut"),
        tensor("input"),
        tensor("mean"),
        tensor("rstd"),
        tensor("gamma", optional=True),
        scalar("N", Kind.INT),
        scalar("C", Kind.INT),
        scalar("HxW", Kind.INT),
        scalar("group", Kind.INT),
        bool_array("outputMask"),
        output("gradInput", 0),
        output("gradGammaOut", 1),
        output("gradBetaOut", 2),
    ),
    mask="outputMask",
)


def check_numel(t: TensorDesc, count: int, what: str) -> None:
    check(t.numel == count, t.name, f"has {t.numel} elements, {what} = {count}")


def validate(p: CallParams) -> Plan:
    """CANN's CheckParams: nulls, mask, dtypes, attributes, shapes; then formats (here only)."""
    p.require("gradOut", "input", "mean", "rstd", "outputMask", *SIZES)  # 1
    mask = p.array("outputMask")
    check(len(mask) == 3, "outputMask", f"must have 3 entries, got {len(mask)}")  # 2
    outputs = p.require_outputs(mask)  # 3
    grad_out, x, mean, rstd, gamma = (p.tensor(n) for n in INPUTS)
    check_float_dtypes([grad_out])  # 4
    check_float_dtypes([mean])
    check_same_dtype(x, grad_out)
    if "gradInput" in outputs:
        check_same_dtype(p.tensor("gradInput"), grad_out)
    check(
        mean.data_type in (grad_out.data_type, DataType.FLOAT),
        "mean",
        f"data type {mean.data_type.name} must be gradOut's ({grad_out.data_type.name}) or FLOAT",
    )
    check_same_dtype(rstd, mean)
    check_same_dtype(gamma, mean)
    for name in ("gradGammaOut", "gradBetaOut"):
        if name in outputs:
            check_same_dtype(p.tensor(name), mean)
    n, c, hxw, group = check_sizes(p)  # 5
    total = n * c * hxw
    check_numel(grad_out, total, "N·C·HxW")  # 6
    check_numel(x, total, "N·C·HxW")
    check_numel(mean, n * group, "N·group")
    check_numel(rstd, n * group, "N·group")
    if gamma is not None:
        check_numel(gamma, c, "C")
    if "gradInput" in outputs:
        check_shape(p.tensor("gradInput"), x.shape, "input's")
    param_shape = gamma.shape if gamma is not None else (c,)
    for name in ("gradGammaOut", "gradBetaOut"):
        if name in outputs:
            check_shape(p.tensor(name), param_shape, "gamma's" if gamma is not None else "[C]")
    check_plain_formats(p.present(INPUTS + tuple(outputs)))  # 7
    return plan_from(p, list(INPUTS), outputs, N=n, C=c, HxW=hxw, group=group, outputMask=tuple(mask))


def _flat_copy_bytes(t: TensorDesc, n: int) -> int:
    """A view whose dim 0 is not N is read through one contiguous copy (see `sample_rows`)."""
    return 0 if t.rank and t.shape[0] == n else t.numel * t.dtype.itemsize


def workspace_size(plan: Plan) -> int:
    """Three fp32 blocks of whole samples, per-channel fp64 sums and fp32 vectors, statistics."""
    v = plan.values
    n, c, group = v["N"], v["C"], v["group"]
    row = c * v["HxW"]
    if n * row == 0:
        return 0
    rows = min(n, block_rows(row))
    copies = sum(_flat_copy_bytes(plan.inputs[name], n) for name in ("gradOut", "input"))
    return 3 * 4 * rows * row + (2 * 8 + 4) * c + 2 * 4 * n * group + 4 * 8 * rows * group + copies


def sample_rows(a: np.ndarray, n: int) -> Rows:
    """`a` as N rows of C·HxW elements in its flat order (CANN checks only its element count)."""
    if a.ndim and a.shape[0] == n:
        return Rows(a, 1)
    return Rows(np.ascontiguousarray(a).reshape(n, -1), 1)


def compute(
    gradOut, input, mean, rstd, gamma, N, C, HxW, group, outputMask, gradInput, gradGammaOut, gradBetaOut
) -> bool:
    """Blocks of whole samples in the block dtype, seen as [samples, group, D]; per-channel sums in
    fp64. Returns `out_of_range`."""
    del outputMask  # it gated the outputs
    row = C * HxW
    d = row // group if group else 0
    sum_g, sum_gx = np.zeros(C), np.zeros(C)
    trouble = False
    if N * row:
        work = work_dtype()
        g, x = sample_rows(gradOut, N), sample_rows(input, N)
        mu, rs = widened(mean.reshape(-1)).reshape(N, group), widened(rstd.reshape(-1)).reshape(N, group)
        w = np.ones((C, 1), work) if gamma is None else widened(gamma.reshape(-1))[:, None]
        dx = None if gradInput is None else gradInput.reshape(N, row)
        buffers = np.empty((3, min(N, block_rows(row)) * row), work)
        for rows in blocks(N, row):
            count = rows.stop - rows.start
            gb, xhat, product = (buf[: count * row].reshape(count, group, d) for buf in buffers)
            widened(g[rows].reshape(count, group, d), gb)
            widened(x[rows].reshape(count, group, d), xhat)
            xhat -= mu[rows, :, None]
            xhat *= rs[rows, :, None]
            np.multiply(gb, xhat, out=product)
            sum_g += column_sums(gb.reshape(count, C, HxW).sum(axis=2))
            sum_gx += column_sums(product.reshape(count, C, HxW).sum(axis=2))
            if dx is None:
                continue
            gb.reshape(count, C, HxW)[...] *= w  # gw
            mean_gw = gb.sum(axis=2, dtype=np.float64) / d
            mean_gwx = np.multiply(gb, xhat, out=product).sum(axis=2, dtype=np.float64) / d
            xhat *= mean_gwx.astype(work)[:, :, None]
            gb -= mean_gw.astype(work)[:, :, None]
            gb -= xhat
            gb *= rs[rows, :, None]
            trouble = trouble or out_of_range(gb)
            store(dx[rows], gb.reshape(count, row), product.reshape(count, row))
    if gradGammaOut is not None:
        gradGammaOut.reshape(-1)[:] = sum_gx
    if gradBetaOut is not None:
        gradBetaOut.reshape(-1)[:] = sum_g
    return trouble or out_of_range(
        sum_gx if gradGammaOut is not None else None, sum_g if gradBetaOut is not None else None
    )


OPERATOR = Operator("aclnnGroupNormBackward", SIGNATURE, validate, workspace_size, compute)
