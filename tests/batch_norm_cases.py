"""Valid aclnnBatchNormBackward / aclnnBatchNormElemtBackward calls and their float64 references."""

from __future__ import annotations

import math

import numpy as np
import torch
from oracle import BF16, rand, sentinel_like, t64

from aclnn_client import DataType, Format, create_tensor

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DATA_TYPES = {F32: DataType.FLOAT, F16: DataType.FLOAT16, BF16: DataType.BF16, np.dtype(np.int32): DataType.INT32}
BN_OUTPUTS = ("gradInput", "gradWeight", "gradBias")
EPS = 1e-5


def tagged(a: np.ndarray, fmt: int) -> object:
    """A C-contiguous array as a tensor with a format tag; as an output, results land in `a`."""
    assert a.flags.c_contiguous
    return create_tensor(
        a.shape, DATA_TYPES[a.dtype], [s // a.itemsize for s in a.strides], 0, fmt, [a.size], a.reshape(-1)
    )


def channel_axis(fmt: int | None, rank: int) -> int:
    return rank - 1 if fmt in (Format.NHWC, Format.NDHWC) else 1


def bn_call(
    rng: np.random.Generator,
    shape=(4, 3, 5),
    axis: int = 1,
    dtype=F32,
    params="same",  # per-channel inputs: "same" (gradOut's dtype) or "float32"
    training: bool = True,
    mask=(True, True, True),
    grad_param_dtype=None,  # gradWeight/gradBias dtype; default the per-channel dtype
) -> dict:
    """A valid call (plain ND arrays): saved stats computed from x; outputs sentinel-filled."""
    dtype = np.dtype(dtype)
    x, g = rand(rng, shape, dtype), rand(rng, shape, dtype)
    c = shape[axis]
    reduce = tuple(i for i in range(len(shape)) if i != axis)
    xf = x.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = xf.mean(axis=reduce) if xf.size else np.zeros(c)
        invstd = 1.0 / np.sqrt(xf.var(axis=reduce) + EPS) if xf.size else np.ones(c)
    pd = dtype if params == "same" else F32
    out_pd = np.dtype(grad_param_dtype or pd)
    return dict(
        gradOut=g,
        input=x,
        weight=rand(rng, c, pd, 0.5, 1.5),
        runningMean=rand(rng, c, pd, -0.5, 0.5),
        runningVar=rand(rng, c, pd, 0.5, 2.0),
        saveMean=mean.astype(pd),
        saveInvstd=invstd.astype(pd),
        training=training,
        eps=EPS,
        outputMask=list(mask),
        gradInput=sentinel_like(shape, dtype) if mask[0] else None,
        gradWeight=sentinel_like(c, out_pd) if mask[1] else None,
        gradBias=sentinel_like(c, out_pd) if mask[2] else None,
    )


def with_format(p: dict, fmt: int) -> dict:
    """The call with gradOut, input and gradInput tagged `fmt` (gradInput still fills p's array)."""
    q = dict(p, gradOut=tagged(p["gradOut"], fmt), input=tagged(p["input"], fmt))
    if p["gradInput"] is not None:
        q["gradInput"] = tagged(p["gradInput"], fmt)
    return q


def bn_reference(p: dict, axis: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch.ops.aten.native_batch_norm_backward in float64, channel moved to axis 1, rank > 5 as [N, C, -1].

    Null per-channel inputs get their documented defaults as explicit tensors.
    """
    g, x = t64(p["gradOut"]).movedim(axis, 1), t64(p["input"]).movedim(axis, 1)
    moved = x.shape
    if x.dim() > 5:
        g, x = g.reshape(moved[0], moved[1], -1), x.reshape(moved[0], moved[1], -1)
    c = moved[1]

    def vec(name: str, default: float) -> torch.Tensor:
        a = p.get(name)
        if a is None or a.size != c:  # null, or the [0] save stats of an inference call
            return torch.full((c,), default, dtype=torch.float64)
        return t64(a)

    gi, gw, gb = torch.ops.aten.native_batch_norm_backward(
        g,
        x,
        vec("weight", 1.0),
        vec("runningMean", 0.0),
        vec("runningVar", 1.0),
        vec("saveMean", 0.0),
        vec("saveInvstd", 1.0),
        p["training"],
        p["eps"],
        [True, True, True],
    )
    return gi.reshape(moved).movedim(1, axis).numpy(), gw.numpy(), gb.numpy()


def elemt_call(
    rng: np.random.Generator,
    shape=(4, 3, 5),
    dtype=F32,
    weight: bool = True,
    counter=None,
    dtypes: dict | None = None,  # per-tensor dtype overrides
) -> dict:
    """A valid aclnnBatchNormElemtBackward call; `counter` defaults to two devices' int32 counts."""
    dtypes = dtypes or {}

    def dt(name):
        return np.dtype(dtypes.get(name, dtype))

    c = shape[1]
    x, g = rand(rng, shape, dt("input")), rand(rng, shape, dt("gradOut"))
    n = math.prod(shape) // c if c else 0
    return dict(
        gradOut=g,
        input=x,
        mean=rand(rng, c, dt("mean"), -0.5, 0.5),
        invstd=rand(rng, c, dt("invstd"), 0.5, 2.0),
        weight=rand(rng, c, dt("weight"), 0.5, 1.5) if weight else None,
        sumDy=rand(rng, c, dt("sumDy"), -3.0, 3.0),
        sumDyXmu=rand(rng, c, dt("sumDyXmu"), -3.0, 3.0),
        counter=np.array([n, n + 3], np.int32) if counter is None else counter,
        gradInput=sentinel_like(shape, dt("gradInput")),
    )


def elemt_reference(p: dict) -> np.ndarray:
    """SPEC 6.2 in float64 from the call's (already rounded) values."""
    x = p["input"].astype(np.float64)
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)

    def vec(name):
        a = p[name]
        return (np.ones(x.shape[1]) if a is None else a.astype(np.float64)).reshape(bshape)

    counter = p["counter"]
    total = float(counter.astype(np.int64).sum()) if counter.dtype == np.int32 else counter.astype(np.float64).sum()
    inv = vec("invstd")
    with np.errstate(invalid="ignore", divide="ignore"):
        return (
            (
                p["gradOut"].astype(np.float64)
                - vec("sumDy") / total
                - (x - vec("mean")) * inv**2 * vec("sumDyXmu") / total
            )
            * inv
            * vec("weight")
        )
