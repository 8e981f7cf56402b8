"""aclnnBatchNormElemt: SyncBatchNorm's normalization with given (global) statistics.

output = (input − mean[c])·invstd[c]·weight[c] + bias[c], channel c on dim 1 whatever the format tag
(CANN checks the per-channel tensors against dim 1). CANN rebuilds var = 1/invstd² − eps and runs
BatchNorm inference with eps, which normalizes by invstd itself: the reference uses invstd directly
(eps is validated and otherwise unused). Per-channel coefficients in fp64 rounded to fp32 once, the
elements in fp32 by bounded tiles. Checks in the order of
`norm/batch_norm_elemt/op_host/op_api/aclnn_batch_norm_elemt.cpp`; an empty input writes nothing.
"""

from __future__ import annotations

import math

import numpy as np

from ..params import (
    CallParams,
    Kind,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_shape,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rows import Tiles, out_of_range, store, tile_shape, tiles, widened, work_dtype

PER_CHANNEL = ("weight", "bias", "mean", "invstd")
SIGNATURE = Signature(
    (
        tensor("input"),
        tensor("weight", optional=True),
        tensor("bias", optional=True),
        tensor("mean"),
        tensor("invstd"),
        scalar("eps", Kind.DOUBLE),
        output("output"),
    )
)


def validate(p: CallParams) -> Plan:
    """CANN's CheckBatchNormElemtParams, step by step."""
    p.require("input", "mean", "invstd", "output", "eps")  # 1
    check_float_dtypes(p.present(("input", *PER_CHANNEL, "output")))  # 2
    x, out = p.tensor("input"), p.tensor("output")
    check(out.format == x.format, "output", f"format {out.format.name} must equal input's {x.format.name}")  # 3
    check_plain_formats([x, *p.present(PER_CHANNEL)])
    for t in (x, out):  # 4
        check(2 <= t.rank <= 8, t.name, f"rank {t.rank} is outside 2..8")
    check_shape(out, x.shape, "input's")
    c = x.shape[1]
    check(c != 0, "input", "channel size (dim 1) is 0")  # 5
    vectors = p.present(PER_CHANNEL)
    for t in vectors:  # 6
        check(t.rank == 1, t.name, f"rank {t.rank} must be 1")
    for t in vectors:
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    return plan_from(p, ["input", *PER_CHANNEL], ["output"], eps=float(p.scalar("eps")))


def workspace_size(plan: Plan) -> int:
    """An fp32 tile and its fp16 rounding scratch; fp64 and fp32 per-channel vectors."""
    x = plan.inputs["input"]
    shape = (x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    return (2 * 4 * math.prod(tile_shape(shape)) if x.numel else 0) + (6 * 8 + 3 * 4) * shape[1]


def compute(input, weight, bias, mean, invstd, eps, output) -> bool:
    del eps  # CANN adds it back to the variance it derived from invstd: invstd is the factor
    if input.size == 0:
        return False
    x = Tiles(input, 1)
    n_c = x.shape[1]

    def vec(t: np.ndarray | None, default: float) -> np.ndarray:
        return np.full(n_c, default) if t is None else t.reshape(-1).astype(np.float64)

    return normalize(x, output, vec(mean, 0.0), vec(invstd, 1.0) * vec(weight, 1.0), vec(bias, 0.0))


def normalize(x: Tiles, output: np.ndarray, mean: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> bool:
    """output = (x − mean[c])·scale[c] + bias[c] over the tiles of the [L, C, T] view `x` (also
    aclnnBatchNorm's): the per-channel vectors rounded to the block dtype once, the elements in it.
    `output` is C-ordered (the engine's result array), so it reshapes to x's view. Returns
    `out_of_range`.

    x − μ is exact in fp32 for x near μ = fp32(mean); what rounding took from an fp64 mean moves
    into the bias, (mean − μ)·scale, so data far from zero with a small spread keep their accuracy.
    An infinite mean loses nothing to rounding: x − mean is IEEE's."""
    work = work_dtype()
    mu = mean.astype(work)
    s = scale.astype(work)
    lost = np.where(np.isfinite(mean), mean - mu, 0)
    b = (bias - np.where(lost != 0, lost * scale, 0)).astype(work)  # not 0·inf: an infinite scale stays
    out = output.reshape(x.shape)
    trouble = False
    for tile in tiles(x.shape):
        cs = tile[1]
        xb = widened(x[tile])
        xb -= mu[cs, None]
        xb *= s[cs, None]
        xb += b[cs, None]
        trouble = trouble or out_of_range(xb)
        store(out[tile], xb)
    return trouble


OPERATOR = Operator("aclnnBatchNormElemt", SIGNATURE, validate, workspace_size, compute)
