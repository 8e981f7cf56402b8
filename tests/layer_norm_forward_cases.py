"""Valid aclnnLayerNorm calls and their float64 PyTorch reference."""

from __future__ import annotations

import numpy as np
import torch
from oracle import rand, sentinel_like, t64

F32 = np.dtype(np.float32)
EPS = 1e-5


def layer_norm_forward_call(rng: np.random.Generator, shape=(6, 4, 8), k: int = 1, dtype=F32, weight="same",
                            bias=True, stats_dtype=None, out_dtype=None, stats=True) -> dict:  # fmt: skip
    """A valid aclnnLayerNorm call; weight/bias in input's dtype ("same"), FLOAT, or null."""
    dtype = np.dtype(dtype)
    norm = tuple(shape[len(shape) - k :])
    stats_shape = tuple(shape[: len(shape) - k]) + (1,) * k
    param = {"same": dtype, "float32": F32, None: None}[weight]
    sd = np.dtype(stats_dtype or dtype)
    return dict(
        input=rand(rng, shape, dtype),
        normalizedShape=list(norm),
        weightOptional=rand(rng, norm, param, 0.5, 1.5) if param is not None else None,
        biasOptional=rand(rng, norm, param) if param is not None and bias else None,
        eps=EPS,
        out=sentinel_like(shape, np.dtype(out_dtype or dtype)),
        meanOutOptional=sentinel_like(stats_shape, sd) if stats else None,
        rstdOutOptional=sentinel_like(stats_shape, sd) if stats else None,
    )


def layer_norm_forward_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten.native_layer_norm in float64: out, mean, rstd (statistics with normalized dims 1)."""
    return torch.ops.aten.native_layer_norm(
        t64(p["input"]), p["normalizedShape"], t64(p["weightOptional"]), t64(p["biasOptional"]), p["eps"]
    )
