"""aclnnGroupNorm: GroupNorm's forward with the statistics its backward takes.

`self` is `[N, C, *]`; its C channels form `group` groups of C/group channels, and each sample's
group (C/group · HxW elements) is normalized by its mean and population variance (1/n, as CANN's
Chinese document and golden data have it): out = (x − mean)·rstd·gamma[c] + beta[c], with
rstd = 1/√(var + eps). meanOut and rstdOut are `[N, group]`. Checks in the order of CANN's
`norm/group_norm/op_host/op_api/aclnn_group_norm.cpp` (CheckParams: nulls, dtypes, attributes,
shapes, formats). An empty `self` gives meanOut 0 and rstdOut NaN, as CANN's code writes them.
"""

from __future__ import annotations

import math

import numpy as np

from aclnn_common.types import PRIVATE_FORMATS, Format

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
from .layer_norm import normalize_last_axis
from .rows import Rows, block_rows, blocks, out_of_range, store, widened, work_dtype

SIZES = ("N", "C", "HxW", "group")
SIGNATURE = Signature(
    (
        tensor("self"),
        tensor("gamma", optional=True),
        tensor("beta", optional=True),
        scalar("N", Kind.INT),
        scalar("C", Kind.INT),
        scalar("HxW", Kind.INT),
        scalar("group", Kind.INT),
        scalar("eps", Kind.DOUBLE),
        output("out"),
        output("meanOut"),
        output("rstdOut"),
    )
)
# CheckFormat: ND, NCL, NCHW, NCDHW and the other channel-first tags; never channel-last.
CHANNEL_LAST = frozenset({Format.NHWC, Format.HWCN, Format.NDHWC})


def check_sizes(p: CallParams) -> tuple[int, int, int, int]:
    """N, C, HxW not negative (here: CANN does not check it), group > 0 dividing C (CheckAttr)."""
    n, c, hxw, group = (int(p.scalar(name)) for name in SIZES)
    for name, value in (("N", n), ("C", c), ("HxW", hxw)):
        check(value >= 0, name, f"must not be negative, got {value}")
    check(group > 0, "group", f"must be greater than 0, got {group}")
    check(c % group == 0, "group", f"must divide C = {c}, got {group}")
    return n, c, hxw, group


def check_channel_vector(t: TensorDesc | None, c: int) -> None:
    if t is not None:
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")


def validate(p: CallParams) -> Plan:
    """CANN's CheckParams, step by step."""
    p.require("self", "out", "meanOut", "rstdOut", *SIZES, "eps")  # 1
    x, out, mean, rstd = (p.tensor(n) for n in ("self", "out", "meanOut", "rstdOut"))
    gamma, beta = p.tensor("gamma"), p.tensor("beta")
    check_float_dtypes([x])  # 2
    for t in (gamma, beta, out, mean, rstd):
        check_same_dtype(t, x)
    n, c, hxw, group = check_sizes(p)  # 3
    eps = float(p.scalar("eps"))
    check(eps > 0, "eps", f"must be greater than 0, got {eps}")
    check(2 <= x.rank <= 8, "self", f"rank {x.rank} is outside 2..8")  # 4
    check_shape(out, x.shape, "self's")
    check_shape(mean, (n, group), "[N, group]")
    check_shape(rstd, (n, group), "[N, group]")
    check(x.shape[0] == n, "self", f"dim 0 is {x.shape[0]}, N is {n}")
    check(x.shape[1] == c, "self", f"dim 1 is {x.shape[1]}, C is {c}")
    spatial = math.prod(x.shape[2:])
    check(spatial == hxw, "self", f"dims after N and C hold {spatial} elements, HxW is {hxw}")
    check_channel_vector(gamma, c)
    check_channel_vector(beta, c)
    check(out.format == x.format, "out", f"format {out.format.name} must equal self's {x.format.name}")  # 5
    check(
        x.format not in PRIVATE_FORMATS and x.format not in CHANNEL_LAST,
        "self",
        f"format {x.format.name} is not one of ND, NCL, NCHW, NCDHW",
    )
    check_plain_formats(p.present(("gamma", "beta", "meanOut", "rstdOut")))
    sizes = dict(N=n, C=c, HxW=hxw, group=group)
    return plan_from(p, ["self", "gamma", "beta"], ["out", "meanOut", "rstdOut"], **sizes, eps=eps)


def workspace_size(plan: Plan) -> int:
    """Two fp32 blocks of whole samples, fp32 gamma and beta, per-block statistics."""
    x = plan.inputs["self"]
    if not x.numel:
        return 0
    n = x.shape[0]
    row = x.numel // n
    rows = min(n, block_rows(row))
    return 2 * 4 * rows * row + 2 * 4 * x.shape[1] + 3 * 8 * rows * plan.values["group"]


def compute(self, gamma, beta, N, C, HxW, group, eps, out, meanOut, rstdOut) -> bool:
    """Blocks of whole samples, each seen as [samples, group, C/group·HxW] (`normalize_last_axis`);
    returns `out_of_range`."""
    if self.size == 0:
        meanOut[...] = 0
        rstdOut[...] = np.nan
        return False
    x = Rows(self, 1)
    row = x.n
    d = row // group
    g = None if gamma is None else widened(gamma.reshape(-1))[:, None]
    b = None if beta is None else widened(beta.reshape(-1))[:, None]
    y, mean_out, rstd_out = out.reshape(N, row), meanOut.reshape(N, group), rstdOut.reshape(N, group)
    buffers = np.empty((2, min(N, block_rows(row)) * row), work_dtype())
    trouble = False
    for rows in blocks(N, row):
        count = rows.stop - rows.start
        xb, scratch = (buf[: count * row].reshape(count, group, d) for buf in buffers)
        widened(x[rows].reshape(count, group, d), xb)
        mu, rs, squares_trouble = normalize_last_axis(xb, scratch, eps)
        channels = xb.reshape(count, C, HxW)
        if g is not None:
            channels *= g
        if b is not None:
            channels += b
        trouble = trouble or squares_trouble or out_of_range(xb)
        store(y[rows], xb.reshape(count, row), scratch.reshape(count, row))
        mean_out[rows] = mu
        rstd_out[rows] = rs
    return trouble


OPERATOR = Operator("aclnnGroupNorm", SIGNATURE, validate, workspace_size, compute)
