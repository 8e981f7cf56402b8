"""Valid SyncBatchNorm-helper calls (aclnnBatchNormStats, aclnnBatchNormGatherStatsWithCounts, ...) and
their float64 references: the documented formulas (PyTorch has these operators only on CUDA)."""

from __future__ import annotations

import numpy as np
from oracle import rand, sentinel_like

F32 = np.dtype(np.float32)
EPS = 1e-5


def stats_call(rng: np.random.Generator, shape=(4, 3, 5, 2), dtype=F32) -> dict:
    """A valid aclnnBatchNormStats call (mean and invstd are FLOAT [C]); outputs sentinel-filled."""
    c = shape[1]
    return dict(
        input=rand(rng, shape, dtype, -1.0, 3.0),
        eps=EPS,
        mean=sentinel_like((c,), F32),
        invstd=sentinel_like((c,), F32),
    )


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp64 per-channel (axis 1) mean and population variance."""
    axes = tuple(i for i in range(x.ndim) if i != 1)
    x64 = np.asarray(x, dtype=np.float64)
    return x64.mean(axis=axes), x64.var(axis=axes)


def stats_reference(p: dict) -> tuple[np.ndarray, np.ndarray]:
    mean, var = channel_stats(p["input"])
    return mean, 1.0 / np.sqrt(var + p["eps"])


def gather_call(
    rng: np.random.Generator,
    c: int = 3,
    devices: int = 4,
    dtype=F32,
    stats_dtype=None,
    running: bool = True,
    momentum: float = 0.1,
) -> dict:
    """A valid aclnnBatchNormGatherStatsWithCounts call: per-device statistics of random batches."""
    dtype, stats = np.dtype(dtype), np.dtype(stats_dtype or dtype)
    counts = rng.integers(2, 40, devices).astype(np.float64)
    mean = rng.uniform(-1, 1, (devices, c))
    var = rng.uniform(0.5, 2.0, (devices, c))
    return dict(
        input=rand(rng, (2, c, 3), dtype),
        mean=mean.astype(stats),
        invstd=(1.0 / np.sqrt(var + EPS)).astype(stats),
        runningMean=rand(rng, (c,), stats) if running else None,
        runningVar=rand(rng, (c,), stats, 0.5, 1.5) if running else None,
        momentum=momentum,
        eps=EPS,
        counts=counts.astype(stats),
        meanAll=sentinel_like((c,), stats),
        invstdAll=sentinel_like((c,), stats),
    )


def gather_reference(p: dict) -> dict[str, np.ndarray]:
    """The documented formula in fp64, written as a Welford-style merge (PyTorch's CUDA kernel)."""
    m, s = np.asarray(p["mean"], np.float64), np.asarray(p["invstd"], np.float64)
    counts, eps, momentum = np.asarray(p["counts"], np.float64), p["eps"], p["momentum"]
    n, avg, m2 = 0.0, np.zeros(m.shape[1]), np.zeros(m.shape[1])
    for count, mu, inv in zip(counts, m, s):
        var_i = (1.0 / (inv * inv) - eps) * count
        factor = 1.0 / (n + count)
        m2 += var_i + (avg - mu) ** 2 * n * count * factor
        avg = n * factor * avg + count * factor * mu
        n += count
    out = {"meanAll": avg, "invstdAll": 1.0 / np.sqrt(m2 / n + eps)}
    if p["runningMean"] is not None:
        out["runningMean"] = (1 - momentum) * np.asarray(p["runningMean"], np.float64) + momentum * avg
    if p["runningVar"] is not None:
        out["runningVar"] = (1 - momentum) * np.asarray(p["runningVar"], np.float64) + momentum * m2 / (n - 1)
    return out


def elemt_call(rng: np.random.Generator, shape=(3, 4, 5), dtype=F32, affine: bool = True) -> dict:
    """A valid aclnnBatchNormElemt call with statistics near the batch's; output sentinel-filled."""
    dtype = np.dtype(dtype)
    c = shape[1]
    return dict(
        input=rand(rng, shape, dtype),
        weight=rand(rng, (c,), dtype, 0.5, 1.5) if affine else None,
        bias=rand(rng, (c,), dtype) if affine else None,
        mean=rand(rng, (c,), dtype, -0.5, 0.5),
        invstd=rand(rng, (c,), dtype, 0.5, 2.0),
        eps=EPS,
        output=sentinel_like(shape, dtype),
    )


def elemt_reference(p: dict):
    """native_batch_norm in inference on running statistics var = 1/invstd² − eps (what CANN builds)."""
    import torch
    from oracle import t64

    invstd = t64(p["invstd"])
    out, _, _ = torch.ops.aten.native_batch_norm(
        t64(p["input"]),
        t64(p["weight"]),
        t64(p["bias"]),
        t64(p["mean"]),
        1.0 / invstd**2 - p["eps"],
        False,
        0.0,
        p["eps"],
    )
    return out


REDUCE_OUTPUTS = ("sumDy", "sumDyXmu", "gradWeight", "gradBias")
REDUCE_FLAGS = {"sumDy": "inputG", "sumDyXmu": "inputG", "gradWeight": "weightG", "gradBias": "biasG"}


def reduce_call(
    rng: np.random.Generator,
    shape=(4, 3, 5),
    dtype=F32,
    flags=(True, True, True),
    weight: bool = True,
    dtypes: dict | None = None,
) -> dict:
    """A valid aclnnBatchNormReduceBackward call: mean and invstd near the batch's (FLOAT unless
    `dtypes` says otherwise), enabled outputs sentinel-filled in FLOAT (or `dtypes`), disabled ones null."""
    dtype, dtypes = np.dtype(dtype), dtypes or {}
    c = shape[1]
    x = rand(rng, shape, dtype, -1.0, 3.0)
    mean, var = channel_stats(x) if x.size else (np.zeros(c), np.ones(c))
    p = dict(
        gradOut=rand(rng, shape, dtype),
        input=x,
        mean=(mean + rng.uniform(-0.1, 0.1, c)).astype(dtypes.get("mean", F32)),
        invstd=(1.0 / np.sqrt(var + EPS)).astype(dtypes.get("invstd", F32)),
        weight=rand(rng, (c,), dtypes.get("weight", dtype), 0.5, 1.5) if weight else None,
        inputG=flags[0],
        weightG=flags[1],
        biasG=flags[2],
    )
    enabled = dict(zip(("inputG", "weightG", "biasG"), flags))
    for name, flag in REDUCE_FLAGS.items():
        p[name] = sentinel_like((c,), dtypes.get(name, F32)) if enabled[flag] else None
    return p


def reduce_reference(p: dict) -> dict[str, np.ndarray]:
    """The documented formula in float64 on the call's (already rounded) inputs: every output."""
    x, g = np.asarray(p["input"], np.float64), np.asarray(p["gradOut"], np.float64)
    axes = tuple(i for i in range(x.ndim) if i != 1)
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    mean = np.asarray(p["mean"], np.float64).reshape(bshape)
    sum_dy, sum_dy_xmu = g.sum(axis=axes), (g * (x - mean)).sum(axis=axes)
    return {
        "sumDy": sum_dy,
        "sumDyXmu": sum_dy_xmu,
        "gradWeight": sum_dy_xmu * np.asarray(p["invstd"], np.float64),
        "gradBias": sum_dy,
    }
