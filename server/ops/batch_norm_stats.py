"""aclnnBatchNormStats: one device's per-channel mean and 1/√(var + eps), SyncBatchNorm's first step.

Documented in `hicann/ops-math` (`math/reduce_std_with_mean/`), not ops-nn. The channel is dim 1
whatever the format tag (CANN reduces every other axis of the view). The variance is the population
one (1/n, correction 0). Checks in the order of CANN's `op_api/aclnn_batch_norm_stats.cpp`
(CheckParams: nulls, dtypes, private formats, shapes). An empty `input` gives mean 0 and invstd NaN,
as CANN's code writes them.
"""

from __future__ import annotations

import math

import numpy as np

from aclnn_common.types import DataType

from ..params import CallParams, Kind, Signature, check, check_float_dtypes, check_plain_formats, output, scalar, tensor
from ..registry import Operator, Plan, plan_from
from .batch_norm_backward import channel_sums
from .rows import Tiles, squares_out_of_range, tile_shape, tiles, widened, work_dtype

SIGNATURE = Signature((tensor("input"), scalar("eps", Kind.DOUBLE), output("mean"), output("invstd")))


def validate(p: CallParams) -> Plan:
    """CANN's CheckParams, step by step."""
    p.require("input", "eps", "mean", "invstd")  # 1
    x, mean, invstd = (p.tensor(n) for n in ("input", "mean", "invstd"))
    check_float_dtypes([x])  # 2
    check_float_dtypes([mean, invstd], frozenset({DataType.FLOAT}))
    check_plain_formats([x, mean, invstd])  # 3
    check(2 <= x.rank <= 8, "input", f"rank {x.rank} is outside 2..8")  # 4
    for t in (mean, invstd):
        check(t.rank == 1, t.name, f"rank {t.rank} must be 1")
    c = x.shape[1]
    check(c != 0, "input", "channel size (dim 1) is 0")  # 5
    for t in (mean, invstd):  # 6
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    return plan_from(p, ["input"], ["mean", "invstd"], eps=float(p.scalar("eps")))


def workspace_size(plan: Plan) -> int:
    """Two fp32 tiles (the widened tile, x − μ) and fp64 per-channel sums."""
    x = plan.inputs["input"]
    shape = (x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    return (2 * 4 * math.prod(tile_shape(shape)) if x.numel else 0) + 3 * 8 * shape[1]


def channel_statistics(x: Tiles) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and population variance in fp64 of an [L, C, T] view, in two passes over
    fp32 tiles: a first mean μ, then the shifted data d = x − μ (exact in fp32 near μ), whose Σd and
    Σd² give mean = μ + Σd/n and var = Σd²/n − (Σd/n)², accurate when the mean dwarfs the spread."""
    n_l, n_c, n_t = x.shape
    count = n_l * n_t
    total, shifted, squares = np.zeros(n_c), np.zeros(n_c), np.zeros(n_c)
    for tile in tiles(x.shape):
        total[tile[1]] += channel_sums(widened(x[tile]))
    first = total / count
    mu = first.astype(work_dtype())
    for tile in tiles(x.shape):
        d = widened(x[tile])
        d -= mu[tile[1], None]
        shifted[tile[1]] += channel_sums(d)
        squares[tile[1]] += channel_sums(np.square(d, out=d))
    offset = shifted / count
    return np.where(np.isfinite(mu), mu + offset, first), np.maximum(squares / count - offset * offset, 0)


def compute(input, eps, mean, invstd) -> bool:
    if input.size == 0:
        mean[...] = 0
        invstd[...] = np.nan
        return False
    mu, var = channel_statistics(Tiles(input, 1))
    mean[...] = mu
    invstd[...] = 1.0 / np.sqrt(var + eps)
    return squares_out_of_range(var + eps)


OPERATOR = Operator("aclnnBatchNormStats", SIGNATURE, validate, workspace_size, compute)
