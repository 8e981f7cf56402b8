"""aclnnBatchNorm: BatchNorm's forward (PyTorch's `native_batch_norm`), training and inference.

Training: per-channel batch mean and population variance over every axis but the channel's,
output = (x − mean)·invstd·weight + bias with invstd = 1/√(var + eps); saveMean/saveInvstd get
mean and invstd, and runningMean/runningVar (in/out, when given) become
(1 − momentum)·running + momentum·batch, with the unbiased variance var·n/(n − 1) for runningVar.
Inference: the same normalization with runningMean and 1/√(runningVar + eps) (zeros and ones when
null); nothing else is written. The channel axis is the last one for NHWC (4-D) and NDHWC (5-D),
axis 1 for every other plain tag, as in aclnnBatchNormBackward (`batch_norm_backward.channel_axis`).

Checks in the order of `norm/batch_norm_v3/op_host/op_api/aclnn_batch_norm.cpp`
(aclnnBatchNormGetWorkspaceSize: CheckNotNull, the empty-input return, then CheckParams: dtypes,
other dtypes, format, shape, per-channel shapes, the saved statistics' shapes). Statistics in fp64
from two passes over fp32 tiles (`channel_statistics`), elements in fp32 (`normalize`).
"""

from __future__ import annotations

import math

import numpy as np

from aclnn_common.types import Format

from ..params import (
    CallParams,
    Kind,
    ParamSpec,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_shape,
    inout,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .batch_norm_backward import channel_axis, check_channel_last_rank
from .batch_norm_elemt import normalize
from .batch_norm_stats import channel_statistics
from .rows import NUMPY_BUFFER, Tiles, squares_out_of_range, tile_shape

PER_CHANNEL = ("weight", "bias", "runningMean", "runningVar")
INPUTS = ("input", *PER_CHANNEL)
SAVED = ("saveMean", "saveInvstd")
SIGNATURE = Signature(
    (
        tensor("input"),
        tensor("weight", optional=True),
        tensor("bias", optional=True),
        inout("runningMean"),
        inout("runningVar"),
        scalar("training", Kind.BOOL),
        scalar("momentum", Kind.DOUBLE),
        scalar("eps", Kind.DOUBLE),
        output("output"),
        # Required in training only (CANN's CheckNotNull); in inference not read, checked or written.
        ParamSpec("saveMean", Kind.TENSOR, output=True, optional=True),
        ParamSpec("saveInvstd", Kind.TENSOR, output=True, optional=True),
    )
)
# The tags a 5-D input or output may carry (CheckFormat, Ascend 950's rule: its NDHWC is channel-last).
RANK5_FORMATS = (Format.NCDHW, Format.NDHWC)


def validate(p: CallParams) -> Plan:
    """aclnnBatchNormGetWorkspaceSize's checks, step by step."""
    # 1 CheckNotNull: input, output, and in training saveMean, saveInvstd. training, momentum and eps
    # are plain values in CANN; a missing one is 161001 here, after the tensors CANN checks first.
    p.require("input", "output", "training", "momentum", "eps")
    training = p.scalar("training")
    if training:
        p.require(*SAVED)
    values = dict(training=training, momentum=float(p.scalar("momentum")), eps=float(p.scalar("eps")))
    x, out = p.tensor("input"), p.tensor("output")
    if x.numel == 0:  # 2 HandleBatchNormEmptyTensor: success before any other check
        return empty_plan(p, values)
    saved = p.present(SAVED) if training else []
    check_float_dtypes([x, out, *saved])  # 3 CheckDtypeValid
    per_channel = p.present(PER_CHANNEL)
    check_float_dtypes(per_channel)  # 4 CheckOtherDtypeValid
    check(out.format == x.format, "output", f"format {out.format.name} must equal input's {x.format.name}")  # 5
    for t in (x, out):
        if t.rank == 5:
            check(t.format in RANK5_FORMATS, t.name, f"a 5-D tensor must be NCDHW or NDHWC, not {t.format.name}")
    check_plain_formats([x])
    check_channel_last_rank(x)  # this service: aclnnBatchNormBackward's rule
    check_plain_formats([*per_channel, *saved])  # this service: it cannot read private layouts
    for t in (x, out):  # 6 CheckShape
        check(2 <= t.rank <= 8, t.name, f"rank {t.rank} is outside 2..8")
    check_shape(out, x.shape, "input's")
    axis = channel_axis(x.format, x.rank)
    c = x.shape[axis]
    for t in per_channel:  # 7 CheckOtherShape
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    for t in saved:  # 8 training: the saved statistics
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    running = [t.name for t in per_channel if t.name.startswith("running")]
    outputs = ["output", *SAVED, *running] if training else ["output"]
    return plan_from(p, list(INPUTS), outputs, **values, channel_axis=axis, placeholders={})


def empty_plan(p: CallParams, values: dict) -> Plan:
    """An empty input: CANN fills the given saveMean with 0 and saveInvstd with NaN (training or not)
    and writes nothing else. An `output` with elements (its shape is not checked) is not written: the
    NPU still needs its descriptor, without memory (`placeholders`)."""
    saved = p.present(SAVED)
    # This service: it fills these, so they must hold a float (CANN does not check them here).
    check_float_dtypes(saved)
    out = p.tensor("output")
    outputs = [t.name for t in saved] + (["output"] if out.numel == 0 else [])
    placeholders = {} if out.numel == 0 else {"output": out}
    return plan_from(p, list(INPUTS), outputs, **values, channel_axis=None, placeholders=placeholders)


def workspace_size(plan: Plan) -> int:
    """Four fp32 tiles (the widened tile and the previous one until it is replaced, fp16 rounding's
    scratch or a tile gathered from a strided view, the gather's indices), NumPy's casting buffers,
    fp64 per-channel sums and vectors and their fp32 copies."""
    x = plan.inputs["input"]
    axis = plan.values["channel_axis"]
    if not x.numel or axis is None:
        return 0
    shape = (math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :]))
    return 4 * 4 * math.prod(tile_shape(shape)) + 2 * 8 * NUMPY_BUFFER + (12 * 8 + 3 * 4) * shape[1]


def compute(
    input,
    weight,
    bias,
    runningMean,
    runningVar,
    training,
    momentum,
    eps,
    output,
    saveMean,
    saveInvstd,
    *,
    channel_axis: int | None,
    placeholders: dict,
) -> bool:
    """runningMean/runningVar hold their current values; in training they are updated in place.
    Returns `out_of_range`."""
    del placeholders  # descriptors for the NPU only
    if input.size == 0:
        if saveMean is not None:
            saveMean[...] = 0
        if saveInvstd is not None:
            saveInvstd[...] = np.nan
        return False
    x = Tiles(input, channel_axis)
    n_l, n_c, n_t = x.shape
    if training:
        mean, var = channel_statistics(x)
    else:  # CANN's defaults when null: mean 0, variance 1
        mean = np.zeros(n_c) if runningMean is None else runningMean.reshape(-1).astype(np.float64)
        var = np.ones(n_c) if runningVar is None else runningVar.reshape(-1).astype(np.float64)
    invstd = 1.0 / np.sqrt(var + eps)
    if training:
        saveMean[...] = mean
        saveInvstd[...] = invstd
        update_running(runningMean, runningVar, mean, var, n_l * n_t, momentum)
    w = np.ones(n_c) if weight is None else weight.reshape(-1).astype(np.float64)
    b = np.zeros(n_c) if bias is None else bias.reshape(-1).astype(np.float64)
    trouble = normalize(x, output, mean, invstd * w, b)
    return trouble or (training and squares_out_of_range(var + eps))


def update_running(running_mean, running_var, mean, var, n: int, momentum: float) -> None:
    """In place, in fp64, each when given: the unbiased variance var·n/(n − 1) (NaN when n = 1)."""
    if running_mean is not None:
        running_mean[...] = (1 - momentum) * running_mean.astype(np.float64) + momentum * mean
    if running_var is not None:
        running_var[...] = (1 - momentum) * running_var.astype(np.float64) + momentum * var * n / (n - 1)


OPERATOR = Operator("aclnnBatchNorm", SIGNATURE, validate, workspace_size, compute)
