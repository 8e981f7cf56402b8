"""Valid aclnnRmsNorm / aclnnRmsNormGrad calls and their float64 PyTorch references."""

from __future__ import annotations

import numpy as np
import torch
from oracle import rand, sentinel_like, t64

F32 = np.dtype(np.float32)
EPS = 1e-6


def rstd_of(x: np.ndarray, k: int, eps: float = EPS, keepdims: bool = True) -> np.ndarray:
    """1/√(mean(x²) + eps) over the last k dims, in float64."""
    axes = tuple(range(x.ndim - k, x.ndim))
    xf = x.astype(np.float64)
    return 1.0 / np.sqrt((xf * xf).mean(axis=axes, keepdims=keepdims) + eps)


def rms_norm_call(rng: np.random.Generator, shape=(6, 4, 8), k: int = 1, dtype=F32, gamma: str = "same",
                  keepdims: bool = True) -> dict:  # fmt: skip
    """A valid aclnnRmsNorm call; gamma in x's dtype ("same") or FLOAT; outputs sentinel-filled."""
    dtype = np.dtype(dtype)
    norm = tuple(shape[len(shape) - k :])
    lead = tuple(shape[: len(shape) - k])
    rstd_shape = lead + (1,) * k if keepdims else lead
    return dict(
        x=rand(rng, shape, dtype),
        gamma=rand(rng, norm, dtype if gamma == "same" else F32, 0.5, 1.5),
        epsilon=EPS,
        yOut=sentinel_like(shape, dtype),
        rstdOut=sentinel_like(rstd_shape, F32),
    )


def rms_norm_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's rms_norm in float64, and its rstd (the shape of rstdOut)."""
    x, gamma = t64(p["x"]), t64(p["gamma"])
    y = torch.nn.functional.rms_norm(x, list(gamma.shape), gamma, p["epsilon"])
    rstd = rstd_of(p["x"], gamma.dim(), p["epsilon"]).reshape(p["rstdOut"].shape)
    return y, torch.from_numpy(rstd)


def rms_norm_grad_call(rng: np.random.Generator, shape=(6, 4, 8), k: int = 1, dtype=F32, gamma: str = "same",
                       rstd_shape=None) -> dict:  # fmt: skip
    """A valid aclnnRmsNormGrad call: rstd computed from x (float64, stored as FLOAT)."""
    dtype = np.dtype(dtype)
    x = rand(rng, shape, dtype)
    norm = tuple(shape[len(shape) - k :])
    rstd = rstd_of(x, k, keepdims=False).astype(F32) if x.size else np.ones(shape[: len(shape) - k], F32)
    rstd = rstd.reshape(rstd.shape or (1,))  # x of gamma's rank: one row, rstd [1]
    return dict(
        dy=rand(rng, shape, dtype),
        x=x,
        rstd=rstd.reshape(rstd_shape) if rstd_shape is not None else rstd,
        gamma=rand(rng, norm, dtype if gamma == "same" else F32, 0.5, 1.5),
        dxOut=sentinel_like(shape, dtype),
        dgammaOut=sentinel_like(norm, F32),
    )


def rms_norm_grad_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented formula in float64 with the given rstd: dx, dgamma."""
    x, dy, gamma = t64(p["x"]), t64(p["dy"]), t64(p["gamma"])
    k = gamma.dim()
    lead = tuple(x.shape[: x.dim() - k])
    rstd = t64(p["rstd"]).reshape(lead + (1,) * k)
    axes = tuple(range(x.dim() - k, x.dim()))
    xhat = x * rstd
    gw = dy * gamma
    dx = rstd * (gw - xhat * (gw * xhat).mean(dim=axes, keepdim=True))
    dgamma = (dy * xhat).sum(dim=tuple(range(len(lead)))) if lead else dy * xhat
    return dx, dgamma


def rms_norm_grad_autograd(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's own gradient of rms_norm in float64 (rstd recomputed from x)."""
    x = t64(p["x"]).requires_grad_()
    gamma = t64(p["gamma"]).requires_grad_()
    y = torch.nn.functional.rms_norm(x, list(gamma.shape), gamma, EPS)
    y.backward(t64(p["dy"]))
    return x.grad, gamma.grad
