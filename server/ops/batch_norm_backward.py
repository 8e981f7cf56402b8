"""aclnnBatchNormBackward: the backward of BatchNorm, training and inference (SPEC §5).

The problem is viewed as `[L, C, T]`: the dims before the channel axis, the channel, the
dims after it (NCHW: `[N, C, H·W]`; NHWC: `[N·H·W, C, 1]`). The reference walks it in
bounded tiles of that 3-D view, in a fixed order that depends only on the shape, with
per-channel sums accumulated in fp64: deterministic and accurate for long channels.

`training` and `eps` are plain values in CANN and cannot be null there; here a missing one
is 161001 naming it, checked with row 1 (its type right after, as for every scalar).
"""

from __future__ import annotations

import math

import numpy as np

from aclnn_client.errors import null_error
from aclnn_client.types import DataType, Format

from ..params import (
    CallParams,
    Kind,
    Signature,
    bool_array,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_same_dtype,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rows import (
    NUMPY_BUFFER,
    Tiles,
    channel_chunks,
    in_order,
    store,
    tile_shape,
    tile_view,
    widened,
    workers_for,
)

PER_CHANNEL = ("weight", "runningMean", "runningVar", "saveMean", "saveInvstd")
INPUTS = ("gradOut", "input", *PER_CHANNEL)
SIGNATURE = Signature(
    (
        tensor("gradOut"),
        tensor("input"),
        tensor("weight", optional=True),
        tensor("runningMean", optional=True),
        tensor("runningVar", optional=True),
        tensor("saveMean", optional=True),
        tensor("saveInvstd", optional=True),
        scalar("training", Kind.BOOL),
        scalar("eps", Kind.DOUBLE),
        bool_array("outputMask"),
        output("gradInput", 0),
        output("gradWeight", 1),
        output("gradBias", 2),
    ),
    mask="outputMask",
)
# Channel-last formats and the rank each requires; every other plain format has C on axis 1.
CHANNEL_LAST = {Format.NHWC: 4, Format.NDHWC: 5}


def channel_axis(fmt: Format, rank: int) -> int:
    return rank - 1 if fmt in CHANNEL_LAST else 1


def validate(p: CallParams) -> Plan:
    """The error table of SPEC 5.4, row by row."""
    p.require("gradOut", "input", "training", "eps")  # 1
    given_mask = p.scalar("outputMask")
    if given_mask is None or len(given_mask) == 0:  # 2
        raise null_error("outputMask", " (or empty)")
    check(len(given_mask) == 3, "outputMask", f"must have 3 entries, got {len(given_mask)}")  # 3
    mask = tuple(given_mask)
    outputs = p.require_outputs(mask)  # 4
    grad_out, x = p.tensor("gradOut"), p.tensor("input")
    grad_input = p.tensor("gradInput") if "gradInput" in outputs else None
    main = [t for t in (grad_out, x, grad_input) if t is not None]
    check_float_dtypes(main)  # 5
    check_same_dtype(x, grad_out)
    check_same_dtype(grad_input, grad_out)
    for t in p.present(PER_CHANNEL):  # 6
        check(
            t.data_type in (grad_out.data_type, DataType.FLOAT),
            t.name,
            f"data type {t.data_type.name} must be gradOut's ({grad_out.data_type.name}) or FLOAT",
        )
    for name, ref in (("runningVar", "runningMean"), ("saveInvstd", "saveMean")):
        if p.tensor(ref) is not None:
            check_same_dtype(p.tensor(name), p.tensor(ref))
    weight = p.tensor("weight")
    param_type = (weight or grad_out).data_type
    for name in ("gradWeight", "gradBias"):  # 7
        if name in outputs:
            t = p.tensor(name)
            check(
                t.data_type in (param_type, DataType.FLOAT),
                name,
                f"data type {t.data_type.name} must be {param_type.name} (weight's, else gradOut's) or FLOAT",
            )
    check_plain_formats(p.present(INPUTS + tuple(outputs)))  # 8
    for t in (x, grad_input):
        if t is not None:
            check(t.format == grad_out.format, t.name, f"format {t.format.name} must equal gradOut's")
    if grad_out.format in CHANNEL_LAST:
        need = CHANNEL_LAST[grad_out.format]
        check(grad_out.rank == need, "gradOut", f"format {grad_out.format.name} needs rank {need}, not {grad_out.rank}")
    for t in main:  # 9
        check(2 <= t.rank <= 8, t.name, f"rank {t.rank} is outside 2..8")
    for t in (x, grad_input):
        if t is not None:
            check(
                t.shape == grad_out.shape, t.name, f"shape {list(t.shape)} must equal gradOut's {list(grad_out.shape)}"
            )
    axis = channel_axis(grad_out.format, grad_out.rank)
    c = grad_out.shape[axis]
    training = p.scalar("training")
    for name in PER_CHANNEL + tuple(n for n in ("gradWeight", "gradBias") if n in outputs):  # 10
        t = p.tensor(name)
        if t is None:
            continue
        unused_stats = not training and name in ("saveMean", "saveInvstd") and t.shape == (0,)
        check(t.shape == (c,) or unused_stats, name, f"shape {list(t.shape)} must be [C] = [{c}]")
    return plan_from(
        p, list(INPUTS), outputs, training=training, eps=float(p.scalar("eps")), outputMask=mask, channel_axis=axis
    )


def per_channel(t: np.ndarray | None, c: int, default: float) -> np.ndarray:
    return np.full(c, default, np.float32) if t is None else widened(t.reshape(-1))


def channel_sums(tile: np.ndarray) -> np.ndarray:
    """Σ over a tile's [l, ·, t] axes per channel: pairwise in fp32 along t, then fp64 over l."""
    return tile.sum(axis=2).sum(axis=0, dtype=np.float64)


def workspace_size(plan: Plan) -> int:
    """Per worker: three fp32 tile buffers, a tile of transients (a gathered strided tile, or fp16
    widening's masks), NumPy's casting buffers; and per-channel vectors."""
    x = plan.inputs["input"]
    axis = plan.values["channel_axis"]
    shape = (math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :]))
    tile = math.prod(tile_shape(shape)) if x.numel else 0
    workers = workers_for(sum(1 for _ in channel_chunks(shape))) if x.numel else 1
    return workers * (4 * 4 * tile + 2 * 8 * NUMPY_BUFFER) + (4 * 8 + 8 * 4) * shape[1]


def compute(
    gradOut,
    input,
    weight,
    runningMean,
    runningVar,
    saveMean,
    saveInvstd,
    training,
    eps,
    outputMask,
    gradInput,
    gradWeight,
    gradBias,
    *,
    channel_axis: int,
) -> None:
    """Per channel chunk: pass 1 sums Σg and Σg·x̂ per channel in fp64 (when needed), pass 2
    writes gradInput by tiles; a chunk that is one tile keeps it widened between the passes."""
    del outputMask  # it gated the outputs
    g, x = Tiles(gradOut, channel_axis), Tiles(input, channel_axis)
    shape = x.shape
    n_c, n = shape[1], shape[0] * shape[2]
    w = per_channel(weight, n_c, 1.0)
    if training:
        mu, s = per_channel(saveMean, n_c, 0.0), per_channel(saveInvstd, n_c, 1.0)
    else:
        mu = per_channel(runningMean, n_c, 0.0)
        var = np.ones(n_c) if runningVar is None else runningVar.reshape(-1).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            s = (1.0 / np.sqrt(var + eps)).astype(np.float32)
    sum_g, sum_gxc = np.zeros(n_c), np.zeros(n_c)  # Σg, Σg·(x − μ); x̂ = (x − μ)·s
    need_sums = gradWeight is not None or gradBias is not None or (training and gradInput is not None)
    scale = w * s
    out = None if gradInput is None else gradInput.reshape(shape)
    chunks = list(channel_chunks(shape))
    # Per worker: g, x − μ, a product. Chunks own disjoint channels: each is summed and written
    # whole by one thread, so the results do not depend on the thread count.
    scratch = np.empty((workers_for(len(chunks)), 3, math.prod(tile_shape(shape))), np.float32)

    def channel_chunk(chunk: list[tuple[slice, slice, slice]], buffers: np.ndarray) -> None:
        cs = chunk[0][1]
        for tile in chunk if need_sums else ():
            gb, xc, product = (tile_view(buf, tile) for buf in buffers)
            widened(g[tile], gb)
            widened(x[tile], xc)
            xc -= mu[cs, None]
            sum_g[cs] += channel_sums(gb)
            sum_gxc[cs] += channel_sums(np.multiply(gb, xc, out=product))
        if out is None:
            return
        if training:
            mean_g = (sum_g[cs] / n).astype(np.float32)
            slope = (sum_gxc[cs] * s[cs] / n * s[cs]).astype(np.float32)  # mean(g·x̂)·s, per unit of x − μ
        for tile in chunk:
            gb, xc, product = (tile_view(buf, tile) for buf in buffers)
            if len(chunk) > 1 or not need_sums:  # else the buffers still hold this tile
                widened(g[tile], gb)
                if training:
                    widened(x[tile], xc)
                    xc -= mu[cs, None]
            if training:
                xc *= slope[:, None]  # x̂·mean(g·x̂)
                gb -= mean_g[:, None]
                gb -= xc
            gb *= scale[cs, None]
            store(out[tile], gb, product)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for _ in in_order(channel_chunk, chunks, scratch):
            pass
    sum_gxhat = sum_gxc * s
    if gradWeight is not None:
        gradWeight[...] = sum_gxhat
    if gradBias is not None:
        gradBias[...] = sum_g


OPERATOR = Operator("aclnnBatchNormBackward", SIGNATURE, validate, workspace_size, compute)
