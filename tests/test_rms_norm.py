"""aclnnRmsNorm and aclnnRmsNormGrad against PyTorch float64, through gRPC and LocalClient; their error tables."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import BF16, FLOAT_DTYPES, assert_close, cast, expect_error, reshape, retag, sentinel_like, set_
from rms_norm_cases import (
    F32,
    rms_norm_call,
    rms_norm_grad_autograd,
    rms_norm_grad_call,
    rms_norm_grad_reference,
    rms_norm_reference,
)

from aclnn_client import Format

FWD, BWD = "aclnnRmsNorm", "aclnnRmsNormGrad"
NULL, INVALID = 161001, 161002
F16 = np.dtype(np.float16)
SHAPES = [((6, 4, 8), 1), ((3, 5, 7), 2), ((33,), 1), ((2, 1, 3, 4), 3)]


def check_forward(p: dict) -> None:
    y, rstd = rms_norm_reference(p)
    assert_close(p["yOut"], y, "yOut")
    assert_close(p["rstdOut"], rstd, "rstdOut")


def check_backward(p: dict) -> None:
    dx, dgamma = rms_norm_grad_reference(p)
    assert_close(p["dxOut"], dx, "dxOut")
    assert_close(p["dgammaOut"], dgamma.reshape(p["dgammaOut"].shape), "dgammaOut")


@pytest.mark.parametrize("gamma", ["same", "float32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", SHAPES, ids=str)
def test_forward_matches_pytorch(client, rng, shape, k, dtype, gamma):
    p = rms_norm_call(rng, shape, k, dtype, gamma)
    workspace_size, executor = client.get_workspace_size(FWD, **p)
    assert workspace_size >= 0
    client.execute(executor)
    check_forward(p)


@pytest.mark.parametrize("gamma", ["same", "float32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", SHAPES, ids=str)
def test_backward_matches_formula_and_autograd(client, rng, shape, k, dtype, gamma):
    p = rms_norm_grad_call(rng, shape, k, dtype, gamma)
    client.run(BWD, **p)
    check_backward(p)
    if dtype == F32:  # PyTorch's own gradient (rstd recomputed from x) agrees too
        dx, dgamma = rms_norm_grad_autograd(p)
        assert_close(p["dxOut"], dx, "dxOut vs autograd")
        assert_close(p["dgammaOut"], dgamma, "dgammaOut vs autograd")


def test_forward_then_backward_chain(client, rng):
    """rstdOut of the forward ([rows, 1]) is the backward's rstd input as it is."""
    fwd = rms_norm_call(rng, (5, 3, 16), 1, BF16, "float32")
    client.run(FWD, **fwd)
    bwd = dict(
        dy=rng.standard_normal((5, 3, 16)).astype(BF16),
        x=fwd["x"],
        rstd=fwd["rstdOut"],
        gamma=fwd["gamma"],
        dxOut=sentinel_like((5, 3, 16), BF16),
        dgammaOut=sentinel_like((16,), F32),
    )
    client.run(BWD, **bwd)
    check_backward(bwd)


def test_flat_rstd_accepted(client, rng):
    p = rms_norm_call(rng, (4, 3, 8), 1, keepdims=False)
    client.run(FWD, **p)
    check_forward(p)
    q = rms_norm_grad_call(rng, (4, 1, 8), 1, rstd_shape=(4,))  # CANN's example: x's first dims, then 1s
    client.run(BWD, **q)
    check_backward(q)


def test_empty_rows(client, rng):
    p = rms_norm_call(rng, (0, 8))
    client.run(FWD, **p)
    assert p["yOut"].size == 0 and p["rstdOut"].size == 0
    q = rms_norm_grad_call(rng, (0, 3, 8))
    client.run(BWD, **q)
    assert (q["dgammaOut"] == 0).all()


def test_strided_views_in_and_out(client, rng):
    base = rms_norm_grad_call(rng, (8, 6))
    x_t = np.ascontiguousarray(base["x"].T).T
    dy_b = np.broadcast_to(base["dy"][:1], (8, 6))
    big = sentinel_like((8, 12), F32)
    p = dict(base, x=x_t, dy=dy_b, dxOut=big[:, ::2])
    client.run(BWD, **p)
    check_backward(dict(p, dy=np.ascontiguousarray(dy_b)))
    assert (big[:, 1::2] == -7.25).all()
    f = rms_norm_call(rng, (8, 6))
    y_big = sentinel_like((16, 6), F32)
    f = dict(f, x=np.ascontiguousarray(f["x"].T).T, yOut=y_big[::2])
    client.run(FWD, **f)
    check_forward(f)
    assert (y_big[1::2] == -7.25).all()


def test_long_reduction_meets_fp32_tolerance(client, rng):
    p = rms_norm_grad_call(rng, (50_000, 4))
    p["dy"] = np.abs(p["dy"]) + 1.0
    p["x"] = np.abs(p["x"]) + 1.0
    p["rstd"] = (1 / np.sqrt((p["x"].astype(np.float64) ** 2).mean(axis=1) + 1e-6)).astype(F32)
    client.run(BWD, **p)
    check_backward(p)


FORWARD_CASES = [
    ("null-x", set_(x=None), NULL, "x"),
    ("null-gamma", set_(gamma=None), NULL, "gamma"),
    ("null-epsilon", set_(epsilon=None), NULL, "epsilon"),
    ("null-yOut", set_(yOut=None), NULL, "yOut"),
    ("null-rstdOut", set_(rstdOut=None), NULL, "rstdOut"),
    ("epsilon-kind", set_(epsilon="1e-6"), INVALID, "epsilon"),
    ("dtype-x", cast("x", np.float64), INVALID, "x"),
    ("dtype-gamma", cast("gamma", np.int32), INVALID, "gamma"),
    ("gamma-f16-x-f32", cast("gamma", F16), INVALID, "gamma"),
    ("yOut-ne-x", cast("yOut", F16), INVALID, "yOut"),
    ("rstdOut-not-float", cast("rstdOut", F16), INVALID, "rstdOut"),
    ("private-x", lambda p: p.update(x=retag(p["x"], Format.NC1HWC0)), INVALID, "x"),
    ("private-rstdOut", lambda p: p.update(rstdOut=retag(p["rstdOut"], Format.FRACTAL_NZ)), INVALID, "rstdOut"),
    ("rank0-x", lambda p: p.update(x=np.zeros((), F32)), INVALID, "x"),
    ("rank0-gamma", lambda p: p.update(gamma=np.ones((), F32)), INVALID, "gamma"),
    ("gamma-rank-above-x", reshape("gamma", (1, 6, 4, 8)), INVALID, "gamma"),
    ("yOut-rank", reshape("yOut", (24, 8)), INVALID, "yOut"),
    (
        "gamma-empty",
        lambda p: p.update(
            x=np.zeros((6, 0), F32), gamma=np.zeros(0, F32), yOut=np.zeros((6, 0), F32), rstdOut=np.zeros((6, 1), F32)
        ),
        INVALID,
        "gamma",
    ),
    ("gamma-trailing", reshape("gamma", (7,)), INVALID, "gamma"),
    ("yOut-shape", reshape("yOut", (6, 4, 9)), INVALID, "yOut"),
    ("rstdOut-shape", reshape("rstdOut", (6, 1, 1)), INVALID, "rstdOut"),
    ("rstdOut-rows", reshape("rstdOut", (24, 1)), INVALID, "rstdOut"),
    ("epsilon-negative", set_(epsilon=-1e-6), INVALID, "epsilon"),
]

BACKWARD_CASES = [
    ("null-dy", set_(dy=None), NULL, "dy"),
    ("null-x", set_(x=None), NULL, "x"),
    ("null-rstd", set_(rstd=None), NULL, "rstd"),
    ("null-gamma", set_(gamma=None), NULL, "gamma"),
    ("null-dxOut", set_(dxOut=None), NULL, "dxOut"),
    ("null-dgammaOut", set_(dgammaOut=None), NULL, "dgammaOut"),
    ("null-order", set_(x=None, dy=None), NULL, "dy"),
    ("dtype-dy", cast("dy", np.float64), INVALID, "dy"),
    ("x-ne-dy", cast("x", F16), INVALID, "x"),
    ("rstd-not-float", cast("rstd", BF16), INVALID, "rstd"),
    ("gamma-f16-dy-f32", cast("gamma", F16), INVALID, "gamma"),
    ("dxOut-ne-dy", cast("dxOut", BF16), INVALID, "dxOut"),
    ("dgammaOut-not-float", cast("dgammaOut", F16), INVALID, "dgammaOut"),
    ("private-gamma", lambda p: p.update(gamma=retag(p["gamma"], Format.FRACTAL_Z)), INVALID, "gamma"),
    ("rank0-rstd", lambda p: p.update(rstd=np.ones((), F32)), INVALID, "rstd"),
    ("gamma-rank-above-x", reshape("gamma", (1, 6, 4, 8)), INVALID, "gamma"),
    ("dy-rank", reshape("dy", (24, 8)), INVALID, "dy"),
    ("dxOut-rank", reshape("dxOut", (24, 8)), INVALID, "dxOut"),
    ("dgammaOut-rank", reshape("dgammaOut", (1, 8)), INVALID, "dgammaOut"),
    ("dy-shape", reshape("dy", (6, 4, 9)), INVALID, "dy"),
    ("dxOut-shape", reshape("dxOut", (6, 5, 8)), INVALID, "dxOut"),
    (
        "dy-last-axis-0",
        lambda p: p.update(dy=np.zeros((6, 4, 0), F32), x=np.zeros((6, 4, 0), F32), dxOut=np.zeros((6, 4, 0), F32)),
        INVALID,
        "dy",
    ),
    ("rstd-shape", reshape("rstd", (6, 3)), INVALID, "rstd"),
    ("rstd-trailing-not-1", reshape("rstd", (6, 4, 2)), INVALID, "rstd"),
    ("gamma-trailing", reshape("gamma", (9,)), INVALID, "gamma"),
    ("dgammaOut-shape", reshape("dgammaOut", (9,)), INVALID, "dgammaOut"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_forward_error_table(client, rng, mutate, code, param):
    p = rms_norm_call(rng, (6, 4, 8))
    mutate(p)
    expect_error(client, FWD, p, ("yOut", "rstdOut"), code, param)


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in BACKWARD_CASES], ids=[c[0] for c in BACKWARD_CASES])
def test_backward_error_table(client, rng, mutate, code, param):
    p = rms_norm_grad_call(rng, (6, 4, 8))
    mutate(p)
    expect_error(client, BWD, p, ("dxOut", "dgammaOut"), code, param)
