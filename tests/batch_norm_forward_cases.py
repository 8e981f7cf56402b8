"""Valid aclnnBatchNorm calls and their float64 reference, torch.ops.aten.native_batch_norm."""

from __future__ import annotations

import numpy as np
import torch
from batch_norm_cases import EPS, F32, tagged
from oracle import assert_close, rand, sentinel_like, t64

OP = "aclnnBatchNorm"
RUNNING = ("runningMean", "runningVar")
SAVED = ("saveMean", "saveInvstd")
WRITTEN = ("output", *SAVED, *RUNNING)  # everything a call may write


def forward_call(
    rng: np.random.Generator,
    shape=(4, 3, 5, 2),
    axis: int = 1,
    dtype=F32,
    training: bool = True,
    params=None,  # dtype of weight, bias and the running statistics; default the input's
    saved=None,  # dtype of saveMean/saveInvstd; default `params`
    out_dtype=None,  # dtype of output; default the input's
    affine: bool = True,
    running: bool = True,
    momentum: float = 0.1,
) -> dict:
    """A valid call (plain ND arrays, channel on `axis`); output and saved statistics sentinel-filled."""
    dtype = np.dtype(dtype)
    pd = np.dtype(params or dtype)
    sd = np.dtype(saved or pd)
    c = shape[axis]
    return dict(
        input=rand(rng, shape, dtype, -1.0, 3.0),
        weight=rand(rng, c, pd, 0.5, 1.5) if affine else None,
        bias=rand(rng, c, pd) if affine else None,
        runningMean=rand(rng, c, pd, -0.5, 0.5) if running else None,
        runningVar=rand(rng, c, pd, 0.5, 2.0) if running else None,
        training=training,
        momentum=momentum,
        eps=EPS,
        output=sentinel_like(shape, np.dtype(out_dtype or dtype)),
        saveMean=sentinel_like(c, sd),
        saveInvstd=sentinel_like(c, sd),
    )


def with_format(p: dict, fmt: int) -> dict:
    """The call with input and output tagged `fmt` (output still fills p's array)."""
    return dict(p, input=tagged(p["input"], fmt), output=tagged(p["output"], fmt))


def forward_reference(p: dict, axis: int = 1) -> dict[str, np.ndarray]:
    """What the call must write: native_batch_norm in float64, channel moved to axis 1, rank > 5 as
    [N, C, −1]; the running statistics are updated in place on float64 copies (unbiased variance).
    A null running statistic is CANN's default (zeros, ones) where aten needs one."""
    x = t64(p["input"]).movedim(axis, 1)
    moved = x.shape
    if x.dim() > 5:
        x = x.reshape(moved[0], moved[1], -1)
    c, training = moved[1], p["training"]
    rm, rv = t64(p["runningMean"]), t64(p["runningVar"])
    if not training or (rm is None) != (rv is None):  # aten takes both or neither: a stand-in, not returned
        rm = torch.zeros(c, dtype=torch.float64) if rm is None else rm
        rv = torch.ones(c, dtype=torch.float64) if rv is None else rv
    out, mean, invstd = torch.ops.aten.native_batch_norm(
        x, t64(p["weight"]), t64(p["bias"]), rm, rv, training, p["momentum"], p["eps"]
    )
    ref = {"output": out.reshape(moved).movedim(1, axis).numpy()}
    if training:
        ref.update(saveMean=mean.numpy(), saveInvstd=invstd.numpy())
        ref.update({name: r.numpy() for name, r in zip(RUNNING, (rm, rv)) if p[name] is not None})
    return ref


def check(p: dict, ref: dict[str, np.ndarray], before: dict[str, bytes]) -> None:
    """Each written tensor against the reference; every other one (given) kept its bytes."""
    for name in WRITTEN:
        if name in ref:
            assert_close(p[name], ref[name], name)
        elif p.get(name) is not None:
            assert p[name].tobytes() == before[name], f"{name} was written"


def snapshot(p: dict) -> dict[str, bytes]:
    return {name: p[name].tobytes() for name in WRITTEN if isinstance(p.get(name), np.ndarray)}


def run_checked(client, p: dict, axis: int = 1, call: dict | None = None) -> None:
    """Runs `call` (default p: the same arrays, maybe tagged or viewed otherwise) and checks p's
    arrays against the reference taken before the call (the running statistics change in place)."""
    ref, before = forward_reference(p, axis), snapshot(p)
    client.run(OP, **(call or p))
    check(p, ref, before)
