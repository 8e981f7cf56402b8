"""Valid aclnnGroupNorm / aclnnGroupNormBackward calls and their float64 PyTorch references."""

from __future__ import annotations

import math

import numpy as np
import torch
from oracle import rand, sentinel_like, t64

F32 = np.dtype(np.float32)
EPS = 1e-5


def group_norm_call(rng: np.random.Generator, shape=(3, 6, 4, 5), group: int = 3, dtype=F32, gamma: bool = True,
                    beta: bool = True) -> dict:  # fmt: skip
    """A valid aclnnGroupNorm call (GroupNorm's input is named `self`); outputs sentinel-filled."""
    dtype = np.dtype(dtype)
    n, c = shape[0], shape[1]
    return dict(
        self=rand(rng, shape, dtype),
        gamma=rand(rng, (c,), dtype, 0.5, 1.5) if gamma else None,
        beta=rand(rng, (c,), dtype) if beta else None,
        N=n,
        C=c,
        HxW=math.prod(shape[2:]),
        group=group,
        eps=EPS,
        out=sentinel_like(shape, dtype),
        meanOut=sentinel_like((n, group), dtype),
        rstdOut=sentinel_like((n, group), dtype),
    )


def group_norm_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten.native_group_norm in float64: out, mean [N, group], rstd [N, group]."""
    return torch.ops.aten.native_group_norm(
        t64(p["self"]), t64(p["gamma"]), t64(p["beta"]), p["N"], p["C"], p["HxW"], p["group"], p["eps"]
    )


def group_norm_backward_call(rng: np.random.Generator, shape=(3, 6, 4, 5), group: int = 3, dtype=F32,
                             stats_dtype=None, gamma: bool = True, mask=(True, True, True)) -> dict:  # fmt: skip
    """A valid aclnnGroupNormBackward call: mean and rstd from x; mean/rstd/gamma/grads in `stats_dtype`."""
    dtype = np.dtype(dtype)
    stats = np.dtype(stats_dtype or dtype)
    n, c = shape[0], shape[1]
    x = rand(rng, shape, dtype)
    if x.size:
        groups = x.astype(np.float64).reshape(n, group, -1)
        mean, rstd = groups.mean(axis=2), 1.0 / np.sqrt(groups.var(axis=2) + EPS)
    else:
        mean, rstd = np.zeros((n, group)), np.ones((n, group))
    return dict(
        gradOut=rand(rng, shape, dtype),
        input=x,
        mean=mean.astype(stats),
        rstd=rstd.astype(stats),
        gamma=rand(rng, (c,), stats, 0.5, 1.5) if gamma else None,
        N=n,
        C=c,
        HxW=math.prod(shape[2:]),
        group=group,
        outputMask=list(mask),
        gradInput=sentinel_like(shape, dtype) if mask[0] else None,
        gradGammaOut=sentinel_like((c,), stats) if mask[1] else None,
        gradBetaOut=sentinel_like((c,), stats) if mask[2] else None,
    )


def group_norm_backward_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten.native_group_norm_backward in float64 (null gamma: ones)."""
    n, c, hxw = p["N"], p["C"], p["HxW"]
    gamma = t64(p["gamma"]) if p["gamma"] is not None else torch.ones(c, dtype=torch.float64)
    return torch.ops.aten.native_group_norm_backward(
        t64(p["gradOut"]).reshape(n, c, hxw),
        t64(p["input"]).reshape(n, c, hxw),
        t64(p["mean"]).reshape(n, p["group"]),
        t64(p["rstd"]).reshape(n, p["group"]),
        gamma,
        n,
        c,
        hxw,
        p["group"],
        [True, True, True],
    )
