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

from aclnn_common.errors import null_error
from aclnn_common.types import DataType, Format

from ..descriptors import TensorDesc
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
    column_sums,
    in_order,
    out_of_range,
    store,
    tile_shape,
    tile_view,
    widened,
    work_dtype,
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


def check_channel_last_rank(t: TensorDesc) -> None:
    """A channel-last tag (NHWC, NDHWC) only at its own rank: the channel axis is read from it."""
    if t.format in CHANNEL_LAST:
        need = CHANNEL_LAST[t.format]
        check(t.rank == need, t.name, f"format {t.format.name} needs rank {need}, not {t.rank}")


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
    check_channel_last_rank(grad_out)
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
    return np.full(c, default, work_dtype()) if t is None else widened(t.reshape(-1))


def channel_sums(tile: np.ndarray) -> np.ndarray:
    """Σ over a tile's [l, ·, t] axes per channel: pairwise in fp32 along t, then `column_sums` over l."""
    return column_sums(tile[:, :, 0] if tile.shape[2] == 1 else tile.sum(axis=2))


def whole_channels(chunks: list[list[tuple[slice, slice, slice]]]) -> bool:
    """Every chunk is one tile: a thread then takes both passes of a chunk, else each pass's tiles."""
    return all(len(chunk) == 1 for chunk in chunks)


def parallel_items(chunks: list[list[tuple[slice, slice, slice]]]) -> int:
    """What the threads share out: the chunks, or the tiles of the largest chunk."""
    return len(chunks) if whole_channels(chunks) else max(len(chunk) for chunk in chunks)


def workspace_size(plan: Plan) -> int:
    """Per worker: three fp32 tile buffers, a tile of transients (a gathered strided tile, or fp16
    widening's masks), NumPy's casting buffers; per-channel vectors; partial sums in flight."""
    x = plan.inputs["input"]
    axis = plan.values["channel_axis"]
    shape = (math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :]))
    return passes_scratch(shape) + (8 * 4 + 4 * 6) * shape[1]


def passes_scratch(shape: tuple[int, int, int]) -> int:
    """What ChannelPasses allocates for an [L, C, T] view beyond the per-channel vectors (nothing
    when empty): per worker its tile buffers and NumPy's casting buffers, and partial sums in flight."""
    if not math.prod(shape):
        return 0
    l, c, t = tile_shape(shape)
    workers = workers_for(parallel_items(list(channel_chunks(shape))))
    return workers * (4 * 4 * l * c * t + 2 * 8 * NUMPY_BUFFER) + (workers + 2) * 16 * c


class ChannelPasses:
    """BatchNorm backward over [L, C, T] tiles: pass 1 sums Σg and Σg·(x − μ) per channel, pass 2
    writes gradInput. Each chunk of channels adds its tiles' partial sums in tile order, whatever
    thread computed them, so the results do not depend on the thread count."""

    def __init__(self, g: Tiles, x: Tiles, mu: np.ndarray, s: np.ndarray, scale: np.ndarray, training: bool,
                 out: np.ndarray | None, need_sums: bool) -> None:  # fmt: skip
        self.g, self.x, self.mu, self.s, self.scale, self.training = g, x, mu, s, scale, training
        self.out, self.need_sums = out, need_sums
        n_c = x.shape[1]
        self.n = x.shape[0] * x.shape[2]
        self.sum_g, self.sum_gxc = np.zeros(n_c), np.zeros(n_c)  # x̂ = (x − μ)·s
        self.mean_g, self.slope = np.empty(n_c, work_dtype()), np.empty(n_c, work_dtype())
        self.trouble = False  # a gradInput tile was `out_of_range`

    def run(self) -> None:
        chunks = list(channel_chunks(self.x.shape))
        workers = workers_for(parallel_items(chunks))
        scratch = np.empty((workers, 3, math.prod(tile_shape(self.x.shape))), work_dtype())  # g, x − μ, product
        if whole_channels(chunks):
            for _ in in_order(self.whole_chunk, chunks, scratch):
                pass
            return
        for chunk in chunks:  # short rows (channel-last: one chunk of all channels): threads take the tiles
            if self.need_sums:
                for sums in in_order(self.tile_sums, chunk, scratch):
                    self.add_sums(*sums)
                self.finish_sums(chunk[0][1])
            for _ in in_order(self.tile_write, chunk if self.out is not None else [], scratch):
                pass

    def whole_chunk(self, chunk: list[tuple[slice, slice, slice]], buffers: np.ndarray) -> None:
        """Both passes on a chunk that is one tile, which stays widened between them."""
        if self.need_sums:
            self.add_sums(*self.tile_sums(chunk[0], buffers))
            self.finish_sums(chunk[0][1])
        if self.out is not None:
            self.tile_write(chunk[0], buffers, kept=self.need_sums)

    def tile_sums(self, tile: tuple[slice, slice, slice], buffers: np.ndarray) -> tuple[slice, np.ndarray, np.ndarray]:
        """Pass 1 on a tile: its channels' Σg and Σg·(x − μ); the buffers keep g and x − μ widened."""
        gb, xc, product = (tile_view(buf, tile) for buf in buffers)
        widened(self.g[tile], gb)
        widened(self.x[tile], xc)
        xc -= self.mu[tile[1], None]
        return tile[1], channel_sums(gb), channel_sums(np.multiply(gb, xc, out=product))

    def add_sums(self, cs: slice, tile_g: np.ndarray, tile_gxc: np.ndarray) -> None:
        self.sum_g[cs] += tile_g
        self.sum_gxc[cs] += tile_gxc

    def finish_sums(self, cs: slice) -> None:
        """Pass 2's coefficients for a chunk of channels, once all its tiles are summed."""
        if self.training:
            self.mean_g[cs] = self.sum_g[cs] / self.n
            self.slope[cs] = self.sum_gxc[cs] * self.s[cs] / self.n * self.s[cs]  # mean(g·x̂)·s, per unit of x − μ

    def tile_write(self, tile: tuple[slice, slice, slice], buffers: np.ndarray, kept: bool = False) -> None:
        """Pass 2 on a tile: gradInput; `kept`: the buffers still hold the tile from pass 1."""
        cs = tile[1]
        gb, xc, product = (tile_view(buf, tile) for buf in buffers)
        if not kept:
            widened(self.g[tile], gb)
            if self.training:
                widened(self.x[tile], xc)
                xc -= self.mu[cs, None]
        if self.training:
            xc *= self.slope[cs, None]  # x̂·mean(g·x̂)
            gb -= self.mean_g[cs, None]
            gb -= xc
        gb *= self.scale[cs, None]
        if out_of_range(gb):
            self.trouble = True
        store(self.out[tile], gb, product)


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
) -> bool:
    """ChannelPasses in the block dtype on the per-channel statistics of the mode (saved, or running);
    returns `out_of_range`. s multiplies the sums, as in PyTorch's kernel: gradWeight = s·Σg·(x − μ)."""
    del outputMask  # it gated the outputs
    g, x = Tiles(gradOut, channel_axis), Tiles(input, channel_axis)
    n_c = x.shape[1]
    w = per_channel(weight, n_c, 1.0)
    if training:
        mu, s = per_channel(saveMean, n_c, 0.0), per_channel(saveInvstd, n_c, 1.0)
    else:
        mu = per_channel(runningMean, n_c, 0.0)
        var = np.ones(n_c) if runningVar is None else runningVar.reshape(-1).astype(np.float64)
        s = (1.0 / np.sqrt(var + eps)).astype(work_dtype())
    need_sums = gradWeight is not None or gradBias is not None or (training and gradInput is not None)
    out = None if gradInput is None else gradInput.reshape(x.shape)
    passes = ChannelPasses(g, x, mu, s, w * s, training, out, need_sums)
    passes.run()
    # An empty batch: zeros (not 0·s, which an infinite s would make NaN).
    grad_weight = passes.sum_gxc * s if passes.n else np.zeros(n_c)
    if gradWeight is not None:
        gradWeight[...] = grad_weight
    if gradBias is not None:
        gradBias[...] = passes.sum_g
    return passes.trouble or out_of_range(
        grad_weight if gradWeight is not None else None, passes.sum_g if gradBias is not None else None
    )


OPERATOR = Operator("aclnnBatchNormBackward", SIGNATURE, validate, workspace_size, compute)
