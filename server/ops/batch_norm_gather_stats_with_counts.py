"""aclnnBatchNormGatherStatsWithCounts: SyncBatchNorm's global statistics from every device's.

`mean` and `invstd` are `[devices, C]` (each row one device's aclnnBatchNormStats), `counts`
`[devices]` its element count per channel. In fp64 (PyTorch's batch_norm_gather_stats_with_counts):
n = Σcounts, meanAll = Σcountsᵢ·meanᵢ/n, var = Σcountsᵢ·(1/invstdᵢ² − eps + (meanᵢ − meanAll)²)/n,
invstdAll = 1/√(var + eps) (taken without subtracting eps and adding it back, see `gather`);
runningMean ← (1 − momentum)·runningMean + momentum·meanAll and
runningVar ← (1 − momentum)·runningVar + momentum·var·n/(n − 1) (the unbiased variance), each in
place when given. `input` is read for its channel count and dtype only. Checks in the order of
`norm/sync_batch_norm_gather_stats_with_counts/op_host/op_api/aclnn_batch_norm_gather_stats_with_counts.cpp`.
"""

from __future__ import annotations

import numpy as np

from ..params import (
    CallParams,
    Kind,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    inout,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from

REQUIRED = ("input", "mean", "invstd", "counts", "meanAll", "invstdAll", "momentum", "eps")
TENSORS = ("input", "mean", "invstd", "runningMean", "runningVar", "counts", "meanAll", "invstdAll")
SIGNATURE = Signature(
    (
        tensor("input"),
        tensor("mean"),
        tensor("invstd"),
        inout("runningMean"),
        inout("runningVar"),
        scalar("momentum", Kind.DOUBLE),
        scalar("eps", Kind.DOUBLE),
        tensor("counts"),
        output("meanAll"),
        output("invstdAll"),
    )
)


def validate(p: CallParams) -> Plan:
    """CANN's CheckBatchNormGatherStatsWithCountsParams, step by step."""
    p.require(*REQUIRED)  # 1
    check_float_dtypes(p.present(TENSORS))  # 2
    check_plain_formats(p.present(TENSORS))  # 3 (CANN: input, mean, invstd, counts; here every tensor)
    x, mean, invstd, counts = (p.tensor(n) for n in ("input", "mean", "invstd", "counts"))
    check(2 <= x.rank <= 8, "input", f"rank {x.rank} is outside 2..8")  # 4
    for t in (mean, invstd):
        check(t.rank == 2, t.name, f"rank {t.rank} must be 2 ([devices, C])")
    devices = mean.shape[0]
    check(invstd.shape[0] == devices, "invstd", f"dim 0 is {invstd.shape[0]}, mean's is {devices}")  # 5
    check(counts.rank >= 1 and counts.shape[0] == devices, "counts", f"dim 0 must be mean's {devices}")
    c = x.shape[1]
    for t in (mean, invstd):  # 6
        check(t.shape[1] == c, t.name, f"dim 1 is {t.shape[1]}, input's channel size is {c}")
    for name in ("runningMean", "runningVar"):  # 7
        t = p.tensor(name)
        if t is not None:
            check(t.shape == (c,), name, f"shape {list(t.shape)} must be [C] = [{c}]")
    check(counts.rank == 1, "counts", f"rank {counts.rank} must be 1")  # 8
    for t in (p.tensor("meanAll"), p.tensor("invstdAll")):  # 9
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    running = [n for n in ("runningMean", "runningVar") if p.tensor(n) is not None]
    return plan_from(
        p,
        ["input", "mean", "invstd", *running, "counts"],
        ["meanAll", "invstdAll", *running],
        momentum=float(p.scalar("momentum")),
        eps=float(p.scalar("eps")),
    )


def workspace_size(plan: Plan) -> int:
    """fp64 copies of mean, invstd and their products ([devices, C]); per-channel fp64 vectors."""
    devices, c = plan.inputs["mean"].shape
    return 8 * (3 * devices * c + devices + 6 * c)


def gather(mean: np.ndarray, invstd: np.ndarray, counts: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    """fp64 (meanAll, population variance, var + eps, total count) of per-device statistics.

    var + eps is Σcountsᵢ·(1/invstdᵢ² + (meanᵢ − meanAll)²)/n, the eps the documented formula
    subtracts from each device and adds back cancelled exactly: with invstdᵢ² far above 1/eps,
    subtracting and adding it back would lose what 1/invstdᵢ² holds. The means are taken relative
    to the first device's (exact differences near it), so a spread far below the means survives."""
    m, s = mean.astype(np.float64), invstd.astype(np.float64)
    n_i = counts.astype(np.float64)[:, None]
    n = n_i.sum()
    first = m[0]
    offset = (n_i * (m - first)).sum(axis=0) / n  # meanAll − first
    spread = (n_i * (1.0 / (s * s) + np.square(m - first - offset))).sum(axis=0) / n
    return first + offset, spread - eps, spread, n


def compute(input, mean, invstd, runningMean, runningVar, momentum, eps, counts, meanAll, invstdAll) -> bool:
    """runningMean/runningVar hold their current values and are updated in place. In fp64 whole:
    never `out_of_range`."""
    del input  # its channel count and dtype were validated
    if mean.size == 0:
        meanAll[...] = 0
        invstdAll[...] = np.nan
        return False
    mean_all, var, spread, n = gather(mean, invstd, counts, eps)
    meanAll[...] = mean_all
    invstdAll[...] = 1.0 / np.sqrt(spread)
    if runningMean is not None:
        runningMean[...] = (1 - momentum) * runningMean.astype(np.float64) + momentum * mean_all
    if runningVar is not None:
        runningVar[...] = (1 - momentum) * runningVar.astype(np.float64) + momentum * var * n / (n - 1)
    return False


OPERATOR = Operator("aclnnBatchNormGatherStatsWithCounts", SIGNATURE, validate, workspace_size, compute)
