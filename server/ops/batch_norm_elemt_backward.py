"""aclnnBatchNormElemtBackward: SyncBatchNorm's element-wise backward (SPEC §6).

gradInput = (g − sumDy/total − (x − mean)·invstd²·sumDyXmu/total) · invstd · w, per channel
(axis 1, whatever the format tag), with total = Σ counter. The per-channel coefficients are
formed in fp64 and rounded to fp32 once; the elements are computed in fp32 by bounded tiles.
"""

from __future__ import annotations

import math

import numpy as np

from aclnn_common.types import DataType

from ..params import (
    FLOAT_TYPES,
    CallParams,
    Signature,
    check,
    check_float_dtypes,
    check_plain_formats,
    check_shape,
    output,
    tensor,
)
from ..registry import Operator, Plan, plan_from
from .rows import Tiles, out_of_range, store, tile_shape, tiles, widened, work_dtype

REQUIRED = ("gradOut", "input", "mean", "invstd", "sumDy", "sumDyXmu", "counter", "gradInput")
INPUTS = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter")
COUNTER_TYPES = frozenset({DataType.INT32, DataType.FLOAT16, DataType.FLOAT})
SIGNATURE = Signature(
    (
        tensor("gradOut"),
        tensor("input"),
        tensor("mean"),
        tensor("invstd"),
        tensor("weight", optional=True),
        tensor("sumDy"),
        tensor("sumDyXmu"),
        tensor("counter"),
        output("gradInput"),
    )
)


def validate(p: CallParams) -> Plan:
    """The error table of SPEC 6.3, row by row."""
    p.require(*REQUIRED)  # 1
    for t in p.present((*INPUTS, "gradInput")):  # 2
        check_float_dtypes([t], COUNTER_TYPES if t.name == "counter" else FLOAT_TYPES)
    grad_out, x, grad_input, counter = (p.tensor(n) for n in ("gradOut", "input", "gradInput", "counter"))
    check_plain_formats((grad_out, x, grad_input))  # 3
    check(x.rank >= 2, "input", f"rank {x.rank} is below 2")  # 4
    for t in (x, grad_out, grad_input):  # 5
        check(t.rank <= 8, t.name, f"rank {t.rank} exceeds 8")
    check(1 <= counter.rank <= 8, "counter", f"rank {counter.rank} is outside 1..8")
    c = x.shape[1]
    check(c != 0, "input", "channel size (dim 1) is 0")  # 6
    check_shape(grad_out, x.shape, "input's")  # 7
    check_shape(grad_input, x.shape, "input's")  # 8
    for name in ("mean", "invstd", "sumDy", "sumDyXmu", "weight"):  # 9
        check_shape(p.tensor(name), (c,), "[C]")
    return plan_from(p, list(INPUTS), ["gradInput"])


def workspace_size(plan: Plan) -> int:
    """Four fp32 tile temporaries (two of them gathers of strided inputs) and per-channel vectors."""
    x = plan.inputs["input"]
    shape = (x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    tile = math.prod(tile_shape(shape)) if x.numel else 0
    return 4 * 4 * tile + (4 * 8 + 4 * 4) * shape[1]


def counter_total(counter: np.ndarray) -> float:
    """Σ counter: exact for INT32 (int64 accumulation), fp64 for floating counters."""
    if counter.dtype == np.int32:
        return float(counter.sum(dtype=np.int64))
    return float(counter.sum(dtype=np.float64))


def compute(gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter, gradInput) -> bool:
    """Per-channel coefficients in fp64 rounded to the block dtype once; returns `out_of_range`."""
    g, x = Tiles(gradOut, 1), Tiles(input, 1)
    n_c = x.shape[1]
    work = work_dtype()

    def vec(t: np.ndarray) -> np.ndarray:
        return t.reshape(-1).astype(np.float64)

    total = counter_total(counter)
    inv = vec(invstd)
    w = np.ones(n_c) if weight is None else vec(weight)
    shift = (vec(sumDy) / total).astype(work)  # sumDy/total
    slope = (inv * inv * vec(sumDyXmu) / total).astype(work)  # invstd²·sumDyXmu/total
    scale = (inv * w).astype(work)
    mu = vec(mean).astype(work)
    out = gradInput.reshape(x.shape)
    trouble = False
    for tile in tiles(x.shape):
        cs = tile[1]
        gb = widened(g[tile])
        xb = widened(x[tile])
        xb -= mu[cs, None]
        xb *= slope[cs, None]
        gb -= shift[cs, None]
        gb -= xb
        gb *= scale[cs, None]
        trouble = trouble or out_of_range(gb)
        store(out[tile], gb)
    return trouble


OPERATOR = Operator("aclnnBatchNormElemtBackward", SIGNATURE, validate, workspace_size, compute)
