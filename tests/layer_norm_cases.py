"""Valid aclnnLayerNormBackward calls and their float64 PyTorch reference."""

from __future__ import annotations

import math

import numpy as np
import torch
from oracle import rand, sentinel_like, t64

F32 = np.dtype(np.float32)


def layer_norm_call(
    rng: np.random.Generator,
    shape=(6, 4, 8),
    k: int = 1,
    dtype=F32,
    weight: str | None = "same",  # "same" (input's dtype), "float32", or None
    bias: bool = True,
    stats_dtype=None,
    out_dtype=None,
    mask=(True, True, True),
) -> dict:
    """A valid call: stats computed from x; outputs sentinel-filled so writes are visible."""
    dtype = np.dtype(dtype)
    x, g = rand(rng, shape, dtype), rand(rng, shape, dtype)
    lead, norm = tuple(shape[: len(shape) - k]), tuple(shape[len(shape) - k :])
    axes = tuple(range(len(lead), len(shape)))
    xf = x.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = xf.mean(axis=axes, keepdims=True) if xf.size else np.zeros(lead + (1,) * k)
        rstd = 1.0 / np.sqrt(xf.var(axis=axes, keepdims=True) + 1e-5) if xf.size else np.ones(lead + (1,) * k)
    stats = np.dtype(stats_dtype or dtype)
    param_dtype = {"same": dtype, "float32": F32, None: None}[weight]
    w = rand(rng, norm, param_dtype, 0.5, 1.5) if param_dtype is not None else None
    b = rand(rng, norm, param_dtype) if param_dtype is not None and bias else None
    out = np.dtype(out_dtype or dtype)
    return dict(
        gradOut=g,
        input=x,
        normalizedShape=list(norm),
        mean=mean.astype(stats),
        rstd=rstd.astype(stats),
        weightOptional=w,
        biasOptional=b,
        outputMask=list(mask),
        gradInputOut=sentinel_like(shape, out) if mask[0] else None,
        gradWeightOut=sentinel_like(norm, out) if mask[1] else None,
        gradBiasOut=sentinel_like(norm, out) if mask[2] else None,
    )


def layer_norm_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.aten.native_layer_norm_backward in float64 (null weight -> ones)."""
    x = p["input"]
    norm = list(p["normalizedShape"])
    lead = x.shape[: x.ndim - len(norm)]
    stats_shape = tuple(lead) + (1,) * len(norm)
    w = t64(p["weightOptional"]) if p["weightOptional"] is not None else torch.ones(norm, dtype=torch.float64)
    return torch.ops.aten.native_layer_norm_backward(
        t64(p["gradOut"]),
        t64(x),
        norm,
        t64(p["mean"]).reshape(stats_shape),
        t64(p["rstd"]).reshape(stats_shape),
        w,
        torch.zeros(norm, dtype=torch.float64),
        [True, True, True],
    )


def n_of(p: dict) -> int:
    return math.prod(p["normalizedShape"])
