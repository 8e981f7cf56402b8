"""Cross-backend agreement, a differential fuzz: random valid calls on the numpy, cpu and torch backends.

Each case is a random call of one operator: rank and sizes (odd, 1, 0, rows longer than a block),
dtypes, null optionals, output masks, a value distribution (plain, far from zero, all inputs huge
or tiny, each input scaled within 2^±40, constant, with ±Inf/NaN entries) and layouts (strided
views at an offset, channel-last tags). Every backend must give the same status; then each result
must be within SPEC 1.5 of the float64 oracle (the suites' own references; for the forward norms
the formula itself) where the oracle is finite, be ±Inf where the oracle rounds
to ±Inf, and have the same non-finite entries on every backend (where the inputs hold ±Inf/NaN the
oracle's own formulas may place them otherwise: then the backends agree among themselves). No call
may write into a strided output's gaps or change an input or print a RuntimeWarning, and the cpu
backend repeats bit for bit.

Seeded and bounded: FUZZ_CASES cases per operator by default. `ACLNN_FUZZ_CASES=2000` runs a long
fuzz, `ACLNN_FUZZ_SEED` another seed; a failure names the operator, case and seed to replay.
"""

from __future__ import annotations

import math
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
from batch_norm_cases import DATA_TYPES, bn_call, bn_reference
from batch_norm_cases import elemt_call as elemt_backward_call
from batch_norm_cases import elemt_reference as elemt_backward_reference
from batch_norm_forward_cases import forward_call
from conftest import CROSS_BACKENDS, TORCH_DEVICE
from group_norm_cases import group_norm_backward_call, group_norm_backward_reference, group_norm_call
from layer_norm_cases import layer_norm_call, layer_norm_reference
from layer_norm_forward_cases import layer_norm_forward_call
from oracle import FLOAT_DTYPES, TOLERANCES
from rms_norm_cases import rms_norm_call, rms_norm_grad_call, rms_norm_grad_reference, rms_norm_reference
from sync_batch_norm_cases import (
    elemt_call,
    gather_call,
    gather_reference,
    reduce_call,
    reduce_reference,
    stats_call,
    stats_reference,
)
from test_layer_norm_grad import lng_call, lng_reference

from aclnn_client import AclnnError, Format, create_tensor
from aclnn_server import LocalClient

FUZZ_CASES = 100  # ~15 s on 2 cores; a bug in 0.7% of calls (a one-element result) shows for half the seeds
CASES = int(os.environ.get("ACLNN_FUZZ_CASES", FUZZ_CASES))
SEED = int(os.environ.get("ACLNN_FUZZ_SEED", 30))
BACKENDS = CROSS_BACKENDS
REPEATED = BACKENDS[1]  # the backend whose repeat must be bit-identical: cpu, or torch on a GPU
F32 = np.dtype(np.float32)
GARBAGE = -3.5  # what fills a strided input's gaps (never read)
SENTINEL = -7.25  # what fills an output's storage (its gaps must keep it)


@dataclass
class Case:
    """A valid call on plain arrays, what it writes, and its float64 oracle."""

    op: str
    call: dict
    outputs: tuple[str, ...]  # the tensors the call writes (in/out ones included)
    reference: Callable[[dict], dict[str, np.ndarray]]
    data: tuple[str, ...]  # the large inputs (value distributions apply to these first)
    tags: dict[str, int]  # format tags by parameter (channel-last BatchNorm)


# --- random calls, one builder per operator -----------------------------------------------------


def normalized(x: np.ndarray, axes: tuple[int, ...], eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x − mean)·rstd over `axes` in float64, the mean and rstd (kept dims): the formula itself, as
    aten's folded x·s + (β − μ·s) cancels catastrophically for a large mean (a one-element group of
    −3.6e36 came out 1e59)."""
    x = x.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(np.square(x - mean).mean(axis=axes, keepdims=True) + eps)
    return (x - mean) * rstd, mean, rstd


def affine(y: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if w is not None:
        y = y * w.astype(np.float64).reshape(shape)
    if b is not None:
        y = y + b.astype(np.float64).reshape(shape)
    return y


def dims(rng: np.random.Generator, rank: int, low: int = 0) -> tuple[int, ...]:
    """Mostly small odd sizes; sometimes 0 or 1; sometimes one long dim (beyond a row block)."""
    shape = [int(rng.choice([low, 1, 2, 3, 5, 7])) if rng.random() < 0.3 else int(rng.integers(max(low, 1), 8))
             for _ in range(rank)]  # fmt: skip
    if rank and rng.random() < 0.15:
        shape[int(rng.integers(rank))] = int(rng.choice([65, 257, 1031, 2053]))
    return tuple(shape)


def pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def mask3(rng: np.random.Generator) -> tuple[bool, bool, bool]:
    return tuple(bool(b) for b in rng.integers(0, 2, 3))


def layer_norm_backward(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(1, 5)))
    k = int(rng.integers(1, len(shape) + 1))
    p = layer_norm_call(rng, shape, k, dtype, pick(rng, ["same", "float32", None]), stats_dtype=pick(rng, FLOAT_DTYPES),
                        out_dtype=pick(rng, FLOAT_DTYPES), mask=mask3(rng))  # fmt: skip
    names = ("gradInputOut", "gradWeightOut", "gradBiasOut")

    def reference(p: dict) -> dict:
        refs = layer_norm_reference(p)
        return {n: r.numpy().reshape(p[n].shape) for n, r in zip(names, refs) if p[n] is not None}

    return Case("aclnnLayerNormBackward", p, names, reference, ("gradOut", "input"), {})


def layer_norm_grad(rng, dtype) -> Case:
    x_shape = dims(rng, int(rng.integers(1, 5)))
    r = len(x_shape)
    b = int(rng.integers(0, r + 1))
    mean_shape = x_shape[:b] + (1,) * (r - b) if b == 0 or rng.random() < 0.5 else x_shape[:b]
    gamma_shape = x_shape[r - int(rng.integers(0, r + 1)) :]
    p = lng_call(rng, x_shape, mean_shape or (1,) * r, gamma_shape, dtype, mask=mask3(rng))
    return Case("LayerNormGrad", p, ("pd_x", "pd_gamma", "pd_beta"), lng_reference, ("dy", "x"), {})


def batch_norm_layout(rng: np.random.Generator, forward: bool) -> tuple[tuple[int, ...], int | None, int]:
    """A BatchNorm shape, its format tag (sometimes channel-last, NHWC or NDHWC; aclnnBatchNorm's
    5-D tensors must be tagged, NCDHW otherwise) and its channel axis."""
    rank = int(rng.integers(2, 7))
    shape = dims(rng, rank)
    fmt = None
    if rank in (4, 5) and rng.random() < 0.4:
        fmt = Format.NHWC if rank == 4 else Format.NDHWC
    elif rank == 5 and forward:
        fmt = Format.NCDHW
    return shape, fmt, rank - 1 if fmt in (Format.NHWC, Format.NDHWC) else 1


def batch_norm_backward(rng, dtype) -> Case:
    shape, fmt, axis = batch_norm_layout(rng, forward=False)
    p = bn_call(rng, shape, axis, dtype, pick(rng, ["same", "float32"]), bool(rng.integers(2)), mask3(rng))
    for name in ("weight", "runningMean", "runningVar", "saveMean", "saveInvstd"):
        if rng.random() < 0.2:
            p[name] = None
    tags = {n: fmt for n in ("gradOut", "input", "gradInput")} if fmt is not None else {}

    def reference(p: dict) -> dict:
        names = ("gradInput", "gradWeight", "gradBias")
        if p["input"].size == 0:  # aten's kernel divides by zero (SIGFPE): the documented zeros
            return {n: np.zeros(p[n].shape) for n in names[1:] if p[n] is not None}
        return {n: r for n, r in zip(names, bn_reference(p, axis)) if p[n] is not None}

    return Case("aclnnBatchNormBackward", p, ("gradInput", "gradWeight", "gradBias"), reference,
                ("gradOut", "input"), tags)  # fmt: skip


def batch_norm_elemt_backward(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(2, 6)))
    shape = (shape[0], max(1, shape[1]), *shape[2:])
    dtypes = {n: pick(rng, FLOAT_DTYPES) for n in ("mean", "invstd", "weight", "sumDy", "sumDyXmu", "gradInput")}
    p = elemt_backward_call(rng, shape, dtype, bool(rng.integers(2)), dtypes=dtypes)
    return Case("aclnnBatchNormElemtBackward", p, ("gradInput",), lambda p: {"gradInput": elemt_backward_reference(p)},
                ("gradOut", "input"), {})  # fmt: skip


def layer_norm(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(1, 5)))
    k = int(rng.integers(1, len(shape) + 1))
    p = layer_norm_forward_call(rng, shape, k, dtype, pick(rng, ["same", "float32", None]), bool(rng.integers(2)),
                                pick(rng, FLOAT_DTYPES), pick(rng, FLOAT_DTYPES), bool(rng.integers(2)))  # fmt: skip
    names = ("out", "meanOutOptional", "rstdOutOptional")

    def reference(p: dict) -> dict:
        if p["input"].size == 0:  # the service writes mean 0, rstd NaN (N = 0): checked alike everywhere
            return {}
        x, k = p["input"], len(p["normalizedShape"])
        y, mean, rstd = normalized(x, tuple(range(x.ndim - k, x.ndim)), p["eps"])
        refs = (affine(y, p["weightOptional"], p["biasOptional"], x.shape[x.ndim - k :]), mean, rstd)
        return {n: r.reshape(p[n].shape) for n, r in zip(names, refs) if p[n] is not None}

    return Case("aclnnLayerNorm", p, names, reference, ("input",), {})


def rms_norm(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(1, 5)), low=1)
    k = int(rng.integers(1, len(shape) + 1))
    keepdims = k == len(shape) or bool(rng.integers(2))  # rstd [rows…, 1…], or [rows…] when there are rows
    p = rms_norm_call(rng, shape, k, dtype, pick(rng, ["same", "float"]), keepdims)

    def reference(p: dict) -> dict:
        y, rstd = rms_norm_reference(p)
        return {"yOut": y.numpy(), "rstdOut": rstd.numpy()}

    return Case("aclnnRmsNorm", p, ("yOut", "rstdOut"), reference, ("x",), {})


def rms_norm_grad(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(1, 5)), low=1)
    k = int(rng.integers(1, len(shape) + 1))
    p = rms_norm_grad_call(rng, shape, k, dtype, pick(rng, ["same", "float"]))

    def reference(p: dict) -> dict:
        dx, dgamma = rms_norm_grad_reference(p)
        return {"dxOut": dx.numpy(), "dgammaOut": dgamma.numpy().reshape(p["dgammaOut"].shape)}

    return Case("aclnnRmsNormGrad", p, ("dxOut", "dgammaOut"), reference, ("dy", "x"), {})


def group_shape(rng) -> tuple[tuple[int, ...], int]:
    rank = int(rng.integers(2, 5))
    shape = list(dims(rng, rank))
    group = int(rng.integers(1, 4))
    shape[1] = group * int(rng.integers(1, 4))
    return tuple(shape), group


def group_norm(rng, dtype) -> Case:
    shape, group = group_shape(rng)
    p = group_norm_call(rng, shape, group, dtype, bool(rng.integers(2)), bool(rng.integers(2)))
    names = ("out", "meanOut", "rstdOut")

    def reference(p: dict) -> dict:
        if p["self"].size == 0:  # the service writes mean 0, rstd NaN: checked alike on every backend
            return {}
        n, c = p["N"], p["C"]
        y, mean, rstd = normalized(p["self"].reshape(n, p["group"], -1), (2,), p["eps"])
        out = affine(y.reshape(n, c, -1), p["gamma"], p["beta"], (1, c, 1))
        return {"out": out.reshape(p["out"].shape), "meanOut": mean.reshape(n, -1), "rstdOut": rstd.reshape(n, -1)}

    return Case("aclnnGroupNorm", p, names, reference, ("self",), {})


def group_norm_backward(rng, dtype) -> Case:
    shape, group = group_shape(rng)
    p = group_norm_backward_call(rng, shape, group, dtype, pick(rng, [dtype, F32]), bool(rng.integers(2)), mask3(rng))
    names = ("gradInput", "gradGammaOut", "gradBetaOut")

    def reference(p: dict) -> dict:
        if p["N"] * p["C"] * p["HxW"] == 0:
            return {n: np.zeros(p[n].shape) for n in names[1:] if p[n] is not None}
        refs = group_norm_backward_reference(p)
        return {n: r.numpy().reshape(p[n].shape) for n, r in zip(names, refs) if p[n] is not None}

    return Case("aclnnGroupNormBackward", p, names, reference, ("gradOut", "input"), {})


def batch_norm_stats(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(2, 6)))
    shape = (shape[0], max(1, shape[1]), *shape[2:])
    p = stats_call(rng, shape, dtype)

    def reference(p: dict) -> dict:
        if p["input"].size == 0:
            return {}
        return dict(zip(("mean", "invstd"), stats_reference(p)))

    return Case("aclnnBatchNormStats", p, ("mean", "invstd"), reference, ("input",), {})


def batch_norm_gather_stats(rng, dtype) -> Case:
    p = gather_call(rng, int(rng.integers(1, 9)), int(rng.integers(1, 6)), dtype, pick(rng, FLOAT_DTYPES),
                    bool(rng.integers(2)), float(rng.uniform(0, 1)))  # fmt: skip
    names = ("meanAll", "invstdAll", "runningMean", "runningVar")

    def reference(p: dict) -> dict:
        """The suites' merge, but meanAll and invstdAll in exact rational arithmetic: the merge's
        fp64 loses a spread far below the means, and eps subtracted and added back loses 1/invstd²
        where invstd² dwarfs 1/eps (docs/operators.md)."""
        ref = gather_reference(p)
        if not np.isfinite(np.asarray(p["counts"], np.float64)).all():
            return ref  # non-finite counts: IEEE's answer, compared among the backends
        counts = [Fraction(float(c)) for c in p["counts"]]
        n = sum(counts)
        mean_all, invstd_all = [], []
        for m, s in zip(np.asarray(p["mean"], np.float64).T, np.asarray(p["invstd"], np.float64).T):
            if not (np.isfinite(m).all() and np.isfinite(s).all() and s.all() and n):
                return ref  # non-finite or zero: IEEE's answer, compared among the backends
            mu = sum(c * Fraction(float(v)) for c, v in zip(counts, m)) / n
            spread = sum(c * (1 / Fraction(float(v)) ** 2 + (Fraction(float(a)) - mu) ** 2)
                         for c, v, a in zip(counts, s, m)) / n  # fmt: skip
            mean_all.append(float(mu))
            invstd_all.append(1 / math.sqrt(spread) if spread > 0 else np.inf)
        return dict(ref, meanAll=np.array(mean_all), invstdAll=np.array(invstd_all))

    return Case("aclnnBatchNormGatherStatsWithCounts", p, names, reference, ("mean", "invstd"), {})


def batch_norm_elemt(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(2, 6)))
    shape = (shape[0], max(1, shape[1]), *shape[2:])
    p = elemt_call(rng, shape, dtype, bool(rng.integers(2)))

    def reference(p: dict) -> dict:
        """(x − mean)·invstd·w + b in float64: the suites' `elemt_reference` goes through CANN's
        var = 1/invstd² − eps, which loses invstd when invstd² dwarfs 1/eps."""
        x = p["input"].astype(np.float64)
        bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)

        def vec(name: str, default: float) -> np.ndarray:
            return np.full(bshape, default) if p[name] is None else p[name].astype(np.float64).reshape(bshape)

        return {"output": (x - vec("mean", 0)) * (vec("invstd", 1) * vec("weight", 1)) + vec("bias", 0)}

    return Case("aclnnBatchNormElemt", p, ("output",), reference, ("input",), {})


def batch_norm_reduce_backward(rng, dtype) -> Case:
    shape = dims(rng, int(rng.integers(2, 6)))
    shape = (shape[0], max(1, shape[1]), *shape[2:])
    flags = mask3(rng)
    p = reduce_call(rng, shape, dtype, flags, bool(rng.integers(2)))
    names = ("sumDy", "sumDyXmu", "gradWeight", "gradBias")

    def reference(p: dict) -> dict:
        if p["input"].size == 0:
            return {n: np.zeros(p[n].shape) for n in names if p[n] is not None}
        return {n: r for n, r in reduce_reference(p).items() if p[n] is not None}

    return Case("aclnnBatchNormReduceBackward", p, names, reference, ("gradOut", "input"), {})


def batch_norm(rng, dtype) -> Case:
    shape, fmt, axis = batch_norm_layout(rng, forward=True)
    training = bool(rng.integers(2))
    params = pick(rng, FLOAT_DTYPES)
    p = forward_call(rng, shape, axis, dtype, training, params, pick(rng, [params, F32]), None,
                     bool(rng.integers(2)), bool(rng.integers(2)), float(rng.uniform(0, 1)))  # fmt: skip
    if not training:
        p["saveMean"] = p["saveInvstd"] = None
    tags = {n: fmt for n in ("input", "output")} if fmt is not None else {}

    def reference(p: dict) -> dict:
        if p["input"].size == 0:
            return {}
        x = np.moveaxis(p["input"].astype(np.float64), axis, 1)
        x = x.reshape(x.shape[0], x.shape[1], -1)
        c, count = x.shape[1], x.size // max(x.shape[1], 1)
        bshape = (1, c, 1)

        def vec(name: str, default: float) -> np.ndarray:
            return np.full(c, default) if p[name] is None else p[name].astype(np.float64)

        if p["training"]:
            y, mean, _ = normalized(x, (0, 2), p["eps"])
            mean, var = mean.reshape(c), np.square(x - mean).mean(axis=(0, 2))
        else:
            mean, var = vec("runningMean", 0.0), vec("runningVar", 1.0)
            y = (x - mean.reshape(bshape)) / np.sqrt(var.reshape(bshape) + p["eps"])
        out = affine(y, p["weight"], p["bias"], bshape)
        ref = {"output": np.moveaxis(out.reshape(np.moveaxis(p["input"], axis, 1).shape), 1, axis)}
        if p["training"]:
            ref.update(saveMean=mean, saveInvstd=1.0 / np.sqrt(var + p["eps"]))
            momentum = p["momentum"]
            for name, value in (("runningMean", mean), ("runningVar", var * count / (count - 1))):
                if p[name] is not None:
                    ref[name] = (1 - momentum) * p[name].astype(np.float64) + momentum * value
        return ref

    names = ("output", "saveMean", "saveInvstd", "runningMean", "runningVar")
    return Case("aclnnBatchNorm", p, names, reference, ("input",), tags)


BUILDERS: dict[str, Callable[[np.random.Generator, np.dtype], Case]] = {
    "aclnnLayerNormBackward": layer_norm_backward,
    "LayerNormGrad": layer_norm_grad,
    "aclnnBatchNormBackward": batch_norm_backward,
    "aclnnBatchNormElemtBackward": batch_norm_elemt_backward,
    "aclnnLayerNorm": layer_norm,
    "aclnnRmsNorm": rms_norm,
    "aclnnRmsNormGrad": rms_norm_grad,
    "aclnnGroupNorm": group_norm,
    "aclnnGroupNormBackward": group_norm_backward,
    "aclnnBatchNormStats": batch_norm_stats,
    "aclnnBatchNormGatherStatsWithCounts": batch_norm_gather_stats,
    "aclnnBatchNormElemt": batch_norm_elemt,
    "aclnnBatchNormReduceBackward": batch_norm_reduce_backward,
    "aclnnBatchNorm": batch_norm,
}


# --- value distributions ------------------------------------------------------------------------


def float_inputs(case: Case) -> list[str]:
    outputs = set(case.outputs) - {"runningMean", "runningVar"}
    return [n for n, v in case.call.items()
            if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size and n not in outputs]  # fmt: skip


def set_values(case: Case, name: str, values: np.ndarray) -> None:
    """Rounds float64 values to the tensor's dtype (overflow is ±Inf, as a client's cast gives)."""
    with np.errstate(over="ignore", invalid="ignore"):
        case.call[name] = np.asarray(values).astype(case.call[name].dtype)  # a 0-d array stays an array


def distribute(rng: np.random.Generator, case: Case) -> str:
    """Changes the inputs' values by one of the distributions; returns its name."""
    kind = pick(rng, ["plain", "plain", "offset", "huge", "tiny", "scaled", "constant", "nonfinite"])
    names = float_inputs(case)
    data = [n for n in case.data if n in names] or names[:1]
    if not names or kind == "plain":
        return "plain"
    if kind == "offset":  # far from zero, a small spread: the rounded mean must be corrected
        for n in data:
            set_values(case, n, case.call[n].astype(np.float64) + float(rng.choice([-1, 1]) * 10 ** rng.uniform(2, 4)))
    elif kind in ("huge", "tiny"):  # every input alike near fp32's range limits
        scale = 2.0 ** float(rng.uniform(60, 125))
        for n in names:
            set_values(case, n, case.call[n].astype(np.float64) * (scale if kind == "huge" else 1 / scale))
    elif kind == "scaled":  # each input its own way, within 2^±40 (see docs/operators.md on ranges)
        for n in names:
            set_values(case, n, case.call[n].astype(np.float64) * 2.0 ** float(rng.uniform(-40, 40)))
    elif kind == "constant":  # one value everywhere: zero variance, gradients of exactly zero
        for n in data:
            set_values(case, n, np.full(case.call[n].shape, float(rng.uniform(-3, 3))))
    else:  # a few ±Inf/NaN entries in one input
        n = pick(rng, names)
        values = case.call[n].astype(np.float64).reshape(-1)
        for i in rng.integers(0, values.size, int(rng.integers(1, 3))):
            values[i] = pick(rng, [np.inf, -np.inf, np.nan])
        set_values(case, n, values.reshape(case.call[n].shape))
    return kind


# --- layouts: each backend gets its own copy of the call, in storage that shows stray writes -----


@dataclass
class Placed:
    """A tensor placed in a larger storage: `view` is what the call sees, `base` the storage."""

    base: np.ndarray
    view: np.ndarray
    region: tuple[slice, ...]  # the view within base
    arg: object  # what the call passes: the view, or a create_tensor over the storage (a format tag)

    def gaps_hold(self, fill: float) -> bool:
        """Whether the storage outside the view still holds `fill` everywhere."""
        outside = np.ones(self.base.shape, bool)
        outside[self.region] = False
        gaps = self.base[outside]
        return np.array_equal(gaps, np.full(gaps.shape, fill, gaps.dtype))


def layout(rng: np.random.Generator, ndim: int) -> tuple:
    """Per dim a step and a leading offset, and whether the storage is column-major (a plain
    array: steps 1, offsets 0, row-major)."""
    if rng.random() < 0.5:
        return (1,) * ndim, (0,) * ndim, False
    return (
        tuple(int(rng.integers(1, 3)) for _ in range(ndim)),
        tuple(int(rng.integers(0, 2)) for _ in range(ndim)),
        (bool(rng.integers(2))),
    )


def place(value: np.ndarray, how: tuple, fill: float, fmt: int | None) -> Placed:
    steps, offsets, column_major = how
    padded = tuple(o + max(d, 1) * s for d, s, o in zip(value.shape, steps, offsets))
    base = np.full(padded, fill, value.dtype, order="F" if column_major else "C")
    region = tuple(slice(o, o + d * s, s) for d, s, o in zip(value.shape, steps, offsets))
    view = base[region] if region else base[...]  # a 0-d tensor: the storage itself
    view[...] = value
    arg: object = view
    if fmt is not None:
        itemsize = value.itemsize
        offset = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // itemsize
        storage = base.reshape(-1, order="A")
        strides = [s // itemsize for s in view.strides]
        arg = create_tensor(value.shape, DATA_TYPES[value.dtype], strides, offset, fmt, [storage.size], storage)
    return Placed(base, view, region, arg)


def is_output(case: Case, name: str) -> bool:
    return name in case.outputs and name not in ("runningMean", "runningVar")


def realize(case: Case, layouts: dict[str, tuple]) -> tuple[dict, dict[str, Placed]]:
    """A fresh call: every tensor in its own storage (outputs filled with SENTINEL, the others with
    their values and GARBAGE in the gaps), laid out as `layouts` says."""
    p, placed = {}, {}
    for name, value in case.call.items():
        if not isinstance(value, np.ndarray):
            p[name] = value
            continue
        out = is_output(case, name)
        start = np.full(value.shape, SENTINEL, value.dtype) if out else value
        placed[name] = place(start, layouts[name], SENTINEL if out else GARBAGE, case.tags.get(name))
        p[name] = placed[name].arg
    return p, placed


# --- the run ------------------------------------------------------------------------------------


def backend_clients() -> Iterator[dict[str, LocalClient]]:
    """A LocalClient on each backend, closed afterwards (the body of a module fixture)."""
    made = {name: LocalClient(backend=name, torch_device=TORCH_DEVICE) for name in BACKENDS}
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def clients():
    yield from backend_clients()


def run(client: LocalClient, case: Case, layouts: dict) -> tuple[tuple | None, dict[str, np.ndarray]]:
    """(None or the error's (code, param), the written tensors), after checking that no input
    changed and no output's gaps were written."""
    p, placed = realize(case, layouts)
    inputs = {n: t.base.copy() for n, t in placed.items() if n not in case.outputs}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the service prints none (a 561000 here)
            client.run(case.op, **p)
        status = None
    except AclnnError as err:
        status = (err.code, err.param)
    for name, before in inputs.items():
        assert placed[name].base.tobytes() == before.tobytes(), f"input {name} was changed"
    for name, t in placed.items():
        if is_output(case, name):
            assert t.gaps_hold(SENTINEL), f"{name}: a write outside the view"
    return status, {n: placed[n].view.copy() for n in case.outputs if n in placed}


def rounded(ref: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return ref.astype(dtype).astype(np.float64)


def check_against_oracle(name: str, got: np.ndarray, ref: np.ndarray, finite_inputs: bool, where: str) -> None:
    """SPEC 1.5 on the entries the oracle has finite (and rounds finite); the oracle's ±Inf/NaN
    entries exactly, when the inputs were finite (else the backends are compared among themselves)."""
    got64 = got.astype(np.float64)
    ref = np.asarray(ref, np.float64).reshape(got.shape)
    ref_rounded = rounded(ref, got.dtype)
    finite = np.isfinite(ref_rounded)
    if finite_inputs:
        assert np.array_equal(np.isnan(got64), np.isnan(ref_rounded)), f"{where} {name}: NaN where the oracle has none"
        inf = np.isinf(ref_rounded)
        assert np.array_equal(got64[inf], ref_rounded[inf]), f"{where} {name}: ±Inf differs from the rounded oracle"
    else:
        finite &= np.isfinite(got64)
    if not finite.any():
        return
    rtol, atol = TOLERANCES[np.dtype(got.dtype)]
    err = np.max(np.abs(got64[finite] - ref[finite]))
    bound = atol + rtol * np.max(np.abs(ref[finite]))
    assert err <= bound, f"{where} {name}: max error {err:.3g} > {bound:.3g} ({got.dtype})"


def nonfinite_pattern(a: np.ndarray) -> bytes:
    """Where a result is NaN, +Inf or −Inf."""
    a = a.astype(np.float64)
    return (np.isnan(a).astype(np.int8) + 2 * (a == np.inf) + 4 * (a == -np.inf)).tobytes()


def fuzz_case(clients: dict, op: str, index: int) -> None:
    seed = zlib.crc32(f"{op}/{SEED}/{index}".encode())
    rng = np.random.default_rng(seed)
    case = BUILDERS[op](rng, pick(rng, FLOAT_DTYPES))
    kind = distribute(rng, case)
    where = f"{op} case {index} (seed {seed}, {kind})"
    layouts = {n: layout(rng, v.ndim) for n, v in case.call.items() if isinstance(v, np.ndarray)}
    results = {}
    for name, client in clients.items():
        status, written = run(client, case, layouts)
        assert status is None, f"{where}: {name} failed with {status}"
        results[name] = written
    repeat = run(clients[REPEATED], case, layouts)[1]
    for name, a in repeat.items():
        assert a.tobytes() == results[REPEATED][name].tobytes(), f"{where}: {REPEATED} repeat differs in {name}"
    finite_inputs = all(np.isfinite(case.call[n]).all() for n in float_inputs(case))
    with np.errstate(all="ignore"):
        reference = case.reference(case.call)
    for name in case.outputs:
        if case.call.get(name) is None:
            continue
        patterns = {b: nonfinite_pattern(results[b][name]) for b in BACKENDS}
        assert len(set(patterns.values())) == 1, f"{where} {name}: non-finite entries differ across backends"
        if name not in reference:
            continue
        for backend in BACKENDS:
            check_against_oracle(name, results[backend][name], reference[name], finite_inputs, f"{where} {backend}")


@pytest.mark.timeout(max(300, CASES))  # a long run: about a second per case at most
@pytest.mark.parametrize("op", list(BUILDERS))
def test_backends_agree_on_random_calls(clients, op):
    for index in range(CASES):
        fuzz_case(clients, op, index)
