"""aclnnBatchNormReduceBackward: the per-channel reduce half of SyncBatchNorm's backward.

Per channel c (dim 1, whatever the format tag) over every other axis of the view:
sumDy = Σg, sumDyXmu = Σg·(x − mean[c]), gradWeight = sumDyXmu·invstd[c], gradBias = Σg, each output
written when its flag is true (inputG: sumDy and sumDyXmu; weightG: gradWeight; biasG: gradBias).
The flags are three bool scalars, not an outputMask: a disabled output is ignored entirely, as a
masked-off one (see `params.output(..., enabled_by=...)`). `weight` enters no result (CANN casts
it and never reads it; PyTorch's batch_norm_backward_reduce only takes its dtype).

Σg and Σg·(x − mean) are BatchNorm backward's first pass (`ChannelPasses`, without gradInput):
fp32 tiles of [L, C, T], pairwise fp32 sums within a tile and fp64 across tiles, whatever the
thread count. CANN forms Σg·x − mean·Σg, which cancels when the mean dwarfs the spread; the
centred sum here does not. Checks in the order of
`norm/sync_batch_norm_backward_reduce/op_api/aclnn_batch_norm_backward_reduce.cpp` (CheckParams);
an empty input zero-fills the enabled outputs.
"""

from __future__ import annotations

import math

import numpy as np

from ..params import (
    CallParams,
    Kind,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_same_dtype,
    check_shape,
    output,
    scalar,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .batch_norm_backward import ChannelPasses, passes_scratch
from .rows import Tiles, out_of_range, widened, work_dtype

REQUIRED = ("gradOut", "input", "mean", "invstd")
FLAGS = ("inputG", "weightG", "biasG")
SIGNATURE = Signature(
    (
        tensor("gradOut"),
        tensor("input"),
        tensor("mean"),
        tensor("invstd"),
        tensor("weight", optional=True),
        scalar("inputG", Kind.BOOL),
        scalar("weightG", Kind.BOOL),
        scalar("biasG", Kind.BOOL),
        output("sumDy", enabled_by="inputG"),
        output("sumDyXmu", enabled_by="inputG"),
        output("gradWeight", enabled_by="weightG"),
        output("gradBias", enabled_by="biasG"),
    )
)


def validate(p: CallParams) -> Plan:
    """CANN's CheckParams, step by step (the rows of docs/operators.md); 11 and 12 are its document's."""
    # CheckInputNotNull. 1: gradOut, input, mean, invstd (not weight); the flags, plain bools in CANN,
    # here 161001 when missing. CheckOutputNotNull. 2: the enabled outputs, in order.
    p.require(*REQUIRED, *FLAGS)
    outputs = p.require_outputs()
    grad_out, x, mean, invstd = (p.tensor(n) for n in REQUIRED)
    outs = [p.tensor(n) for n in outputs]
    # CheckDtypeValid. 3: each input on its own; 4: gradOut's == input's; 5: each enabled output on its own.
    check_float_dtypes([grad_out, x, mean, invstd])
    check_same_dtype(grad_out, x)
    check_float_dtypes(outs)
    # CheckFormat. 6: gradOut's == input's; 7: no private format on the inputs, then on the enabled outputs.
    check(grad_out.format == x.format, "gradOut", f"format {grad_out.format.name} must equal input's {x.format.name}")
    check_plain_formats([grad_out, x, mean, invstd])
    check_plain_formats(outs)
    # CheckShape. 8: rank 2–8, gradOut then input; 9: C ≠ 0; 10: the enabled outputs [C].
    for t in (grad_out, x):
        check(2 <= t.rank <= 8, t.name, f"rank {t.rank} is outside 2..8")
    c = x.shape[1]
    check(c != 0, "input", "channel size (dim 1) is 0")
    for t in outs:
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    # CANN's document; its code reads these shapes unchecked. 11: gradOut as input; 12: mean, invstd [C].
    check_shape(grad_out, x.shape, "input's")
    for t in (mean, invstd):
        check(t.shape == (c,), t.name, f"shape {list(t.shape)} must be [C] = [{c}]")
    return plan_from(p, [*REQUIRED, "weight"], outputs, **{flag: p.scalar(flag) for flag in FLAGS})


def workspace_size(plan: Plan) -> int:
    """ChannelPasses' sums pass (`passes_scratch`) and fp64/fp32 per-channel vectors. An empty
    input only zero-fills."""
    x = plan.inputs["input"]
    shape = (x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    return passes_scratch(shape) + (4 * 8 + 5 * 4) * shape[1] if x.numel else 0


def compute(
    gradOut, input, mean, invstd, weight, inputG, weightG, biasG, sumDy, sumDyXmu, gradWeight, gradBias
) -> bool:
    """Disabled outputs arrive as None. Returns `out_of_range`."""
    del weight, inputG, weightG, biasG  # weight enters no result; the flags gated the outputs
    if input.size == 0:  # CANN fills the enabled outputs with zeros
        for t in (sumDy, sumDyXmu, gradWeight, gradBias):
            if t is not None:
                t[...] = 0
        return False
    g, x = Tiles(gradOut, 1), Tiles(input, 1)
    n_c = x.shape[1]
    unit = np.ones(n_c, work_dtype())  # ChannelPasses' gradInput factors: unused without gradInput
    passes = ChannelPasses(g, x, widened(mean.reshape(-1)), unit, unit, training=False, out=None, need_sums=True)
    passes.run()
    results = (
        (sumDy, passes.sum_g),
        (sumDyXmu, passes.sum_gxc),
        (gradWeight, passes.sum_gxc * invstd.reshape(-1).astype(np.float64)),
        (gradBias, passes.sum_g),
    )
    for out, value in results:
        if out is not None:
            out[...] = value
    return out_of_range(*(value for out, value in results if out is not None))


OPERATOR = Operator("aclnnBatchNormReduceBackward", SIGNATURE, validate, workspace_size, compute)
