"""LayerNormGrad (the graph op) against float64 formulas and PyTorch, plus its error table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from oracle import BF16, FLOAT_DTYPES, Untouched, assert_close, cast, rand, retag, sentinel_like, set_, t64

from aclnn_client import AclnnError, Format

OP = "LayerNormGrad"
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


def lng_call(
    rng, x_shape=(4, 6, 8), mean_shape=(4, 6, 1), gamma_shape=(8,), dtype=F32, stats=None, gamma=None, mask=None
) -> dict:
    dtype = np.dtype(dtype)
    stats = np.dtype(stats or (F32 if dtype == F32 else dtype))
    gamma_dtype = np.dtype(gamma or dtype)
    x = rand(rng, x_shape, dtype)
    enabled = mask or (True, True, True)
    p = dict(
        dy=rand(rng, x_shape, dtype),
        x=x,
        variance=rand(rng, mean_shape, stats, 0.5, 2.0),
        mean=rand(rng, mean_shape, stats, -0.5, 0.5),
        gamma=rand(rng, gamma_shape, gamma_dtype, 0.5, 1.5),
        pd_x=sentinel_like(x_shape, dtype) if enabled[0] else None,
        pd_gamma=sentinel_like(gamma_shape, gamma_dtype) if enabled[1] else None,
        pd_beta=sentinel_like(gamma_shape, gamma_dtype) if enabled[2] else None,
    )
    if mask is not None:
        p["output_mask"] = list(mask)
    return p


def lng_reference(p: dict) -> dict[str, np.ndarray]:
    """SPEC 4.3 in float64, axes derived independently of the service's code."""
    x, dy = p["x"].astype(np.float64), p["dy"].astype(np.float64)
    mean, var, gamma = (p[n].astype(np.float64) for n in ("mean", "variance", "gamma"))
    r = x.ndim
    b = mean.ndim if mean.ndim < r else next((i for i in range(r) if mean.shape[i] != x.shape[i]), r)
    stats_shape = x.shape[:b] + (1,) * (r - b)
    rstd = (var.reshape(stats_shape) + 1e-12) ** -0.5
    xhat = (x - mean.reshape(stats_shape)) * rstd
    axes, n = tuple(range(b, r)), math.prod(x.shape[b:])
    dyg = dy * gamma
    pd_x = rstd * (dyg - dyg.sum(axes, keepdims=True) / n - xhat * (dyg * xhat).sum(axes, keepdims=True) / n)
    param_axes = tuple(range(r - gamma.ndim))
    return {"pd_x": pd_x, "pd_gamma": (dy * xhat).sum(param_axes), "pd_beta": dy.sum(param_axes)}


def check(p: dict) -> None:
    ref = lng_reference(p)
    for name in ("pd_x", "pd_gamma", "pd_beta"):
        if p[name] is not None:
            assert_close(p[name], ref[name], name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "x_shape,mean_shape,gamma_shape",
    [
        ((4, 6, 8), (4, 6, 1), (8,)),  # last axis; gamma over it
        ((4, 6, 8), (4, 1, 1), (6, 8)),  # two axes
        ((4, 6, 8), (4,), (6, 8)),  # lower-rank mean
        ((4, 6, 8), (4, 6, 1), (6, 8)),  # gamma covers a row axis too
        ((4, 6, 8), (4, 1, 1), (8,)),  # gamma narrower than the normalization
        ((4, 6, 8), (4, 6, 8), (4, 6, 8)),  # no normalization axes, P empty
        ((5, 7), (), (7,)),  # normalize over everything
        ((), (), ()),  # rank 0
        ((0, 8), (0, 1), (8,)),  # empty rows
    ],
)
def test_matches_float64_formulas(client, rng, dtype, x_shape, mean_shape, gamma_shape):
    p = lng_call(rng, x_shape, mean_shape, gamma_shape, dtype)
    client.run(OP, **p)
    check(p)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_equals_native_layer_norm_backward_with_its_rstd(client, rng, dtype):
    p = lng_call(rng, (6, 16), (6, 1), (16,), dtype, gamma="float32")
    client.run(OP, **p)
    rstd = (t64(p["variance"]) + 1e-12) ** -0.5
    ref = torch.ops.aten.native_layer_norm_backward(
        t64(p["dy"]),
        t64(p["x"]),
        [16],
        t64(p["mean"]),
        rstd,
        t64(p["gamma"]),
        torch.zeros(16, dtype=torch.float64),
        [True, True, True],
    )
    for name, r in zip(("pd_x", "pd_gamma", "pd_beta"), ref):
        assert_close(p[name], r, name)


@pytest.mark.parametrize("mask", [(True, False, True), (False, True, False), (False, False, False)], ids=str)
def test_output_mask(client, rng, mask):
    p = lng_call(rng, mask=mask)
    client.run(OP, **p)
    check(p)


CASES = [
    ("null-dy", set_(dy=None), 161001, "dy"),
    ("null-x", set_(x=None), 161001, "x"),
    ("null-variance", set_(variance=None), 161001, "variance"),
    ("null-mean", set_(mean=None), 161001, "mean"),
    ("null-gamma", set_(gamma=None), 161001, "gamma"),
    ("null-order", set_(gamma=None, variance=None), 161001, "variance"),
    ("mask-length", set_(output_mask=[True, False]), 161002, "output_mask"),
    ("mask-before-null-out", set_(output_mask=[True] * 4, pd_x=None), 161002, "output_mask"),
    ("null-pd_x", set_(pd_x=None), 161001, "pd_x"),
    ("null-pd_beta", set_(pd_beta=None), 161001, "pd_beta"),
    ("dtype-x", cast("x", np.float64), 161002, "x"),
    ("dtype-pd_gamma-int", cast("pd_gamma", np.int32), 161002, "pd_gamma"),
    ("dy-ne-x", cast("dy", F16), 161002, "dy"),
    ("variance-ne-mean", cast("variance", F16), 161002, "variance"),
    (
        "mean-narrower-than-x",
        lambda p: p.update(mean=p["mean"].astype(F16), variance=p["variance"].astype(F16)),
        161002,
        "mean",
    ),
    (
        "gamma-not-x-or-float",
        lambda p: p.update(x=p["x"].astype(F16), dy=p["dy"].astype(F16), gamma=p["gamma"].astype(BF16)),
        161002,
        "gamma",
    ),
    ("pd_x-ne-x", cast("pd_x", F16), 161002, "pd_x"),
    ("pd_beta-ne-gamma", cast("pd_beta", BF16), 161002, "pd_beta"),
    ("private-x", lambda p: p.update(x=retag(p["x"], Format.NC1HWC0)), 161002, "x"),
    ("private-pd_gamma", lambda p: p.update(pd_gamma=retag(p["pd_gamma"], Format.FRACTAL_NZ)), 161002, "pd_gamma"),
    ("dy-shape", set_(dy=np.zeros((4, 6, 7), F32)), 161002, "dy"),
    ("variance-shape", set_(variance=np.ones((4, 1, 1), F32)), 161002, "variance"),
    (
        "mean-form-middle",
        lambda p: p.update(mean=np.zeros((4, 1, 8), F32), variance=np.ones((4, 1, 8), F32)),
        161002,
        "mean",
    ),
    ("mean-form-lower-rank", lambda p: p.update(mean=np.zeros((6,), F32), variance=np.ones((6,), F32)), 161002, "mean"),
    (
        "mean-higher-rank",
        lambda p: p.update(mean=np.zeros((1, 4, 6, 1), F32), variance=np.ones((1, 4, 6, 1), F32)),
        161002,
        "mean",
    ),
    ("gamma-rank", lambda p: p.update(gamma=np.ones((2, 4, 6, 8), F32)), 161002, "gamma"),
    ("gamma-trailing", lambda p: p.update(gamma=np.ones((6,), F32)), 161002, "gamma"),
    ("pd_x-shape", set_(pd_x=np.zeros((4, 48), F32)), 161002, "pd_x"),
    ("pd_gamma-shape", set_(pd_gamma=np.zeros((1, 8), F32)), 161002, "pd_gamma"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table(client, rng, mutate, code, param):
    p = lng_call(rng)
    mutate(p)
    untouched = Untouched(p["pd_x"], p["pd_gamma"], p["pd_beta"])
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    untouched.check()


def test_output_mask_false_allows_null_outputs(client, rng):
    p = lng_call(rng, mask=(True, False, False))
    p["pd_gamma"] = p["pd_beta"] = None
    client.run(OP, **p)
    check(p)
