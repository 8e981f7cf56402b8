"""aclnnGroupNorm and aclnnGroupNormBackward against PyTorch float64, through gRPC and LocalClient; error tables."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from group_norm_cases import (
    F32,
    group_norm_backward_call,
    group_norm_backward_reference,
    group_norm_call,
    group_norm_reference,
)
from oracle import BF16, FLOAT_DTYPES, assert_close, cast, expect_error, reshape, retag, sentinel_like, set_

from aclnn_client import Format

FWD, BWD = "aclnnGroupNorm", "aclnnGroupNormBackward"
NULL, INVALID = 161001, 161002
F16 = np.dtype(np.float16)
SHAPES = [((3, 6, 4, 5), 3), ((2, 4), 2), ((2, 6, 7), 1), ((1, 8, 2, 3, 2), 8)]
BWD_OUTPUTS = ("gradInput", "gradGammaOut", "gradBetaOut")


def check_forward(p: dict) -> None:
    for name, ref in zip(("out", "meanOut", "rstdOut"), group_norm_reference(p)):
        assert_close(p[name], ref.reshape(p[name].shape), name)


def check_backward(p: dict) -> None:
    for name, ref, enabled in zip(BWD_OUTPUTS, group_norm_backward_reference(p), p["outputMask"]):
        if enabled:
            assert_close(p[name], ref.reshape(p[name].shape), name)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "null-gamma-beta"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,group", SHAPES, ids=str)
def test_forward_matches_pytorch(client, rng, shape, group, dtype, affine):
    p = group_norm_call(rng, shape, group, dtype, affine, affine)
    workspace_size, executor = client.get_workspace_size(FWD, **p)
    assert workspace_size >= 0
    client.execute(executor)
    check_forward(p)


@pytest.mark.parametrize("stats,gamma", [("same", True), ("float32", True), ("same", False)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,group", SHAPES, ids=str)
def test_backward_matches_pytorch(client, rng, shape, group, dtype, stats, gamma):
    p = group_norm_backward_call(rng, shape, group, dtype, dtype if stats == "same" else F32, gamma)
    client.run(BWD, **p)
    check_backward(p)


@pytest.mark.parametrize("mask", list(itertools.product([True, False], repeat=3)), ids=str)
def test_backward_output_mask(client, rng, mask):
    p = group_norm_backward_call(rng, (2, 6, 3), 3, mask=mask)
    client.run(BWD, **p)
    check_backward(p)


def test_forward_statistics_feed_the_backward(client, rng):
    """meanOut/rstdOut ([N, group], population variance) are the backward's mean/rstd as they are."""
    fwd = group_norm_call(rng, (4, 6, 3, 3), 2, BF16)
    client.run(FWD, **fwd)
    bwd = group_norm_backward_call(rng, (4, 6, 3, 3), 2, BF16)
    bwd.update(input=fwd["self"], mean=fwd["meanOut"], rstd=fwd["rstdOut"], gamma=fwd["gamma"])
    client.run(BWD, **bwd)
    check_backward(bwd)


def test_empty_input(client, rng):
    """CANN: an empty self gives meanOut 0 and rstdOut NaN; an empty batch zero-fills the parameter grads."""
    p = group_norm_call(rng, (2, 4, 0), 2)
    client.run(FWD, **p)
    assert (p["meanOut"] == 0).all() and np.isnan(p["rstdOut"]).all()
    q = group_norm_backward_call(rng, (0, 4, 3), 2)
    client.run(BWD, **q)
    assert (q["gradGammaOut"] == 0).all() and (q["gradBetaOut"] == 0).all()


def test_backward_reads_tensors_by_element_count(client, rng):
    """CANN checks only gradOut's and input's element counts (N·C·HxW): any shape is read flat."""
    p = group_norm_backward_call(rng, (2, 6, 4), 3)
    p["gradOut"] = p["gradOut"].reshape(6, 8)
    p["mean"] = p["mean"].reshape(-1)
    p["input"] = p["input"].reshape(48)
    p["gradInput"] = sentinel_like((48,), F32)  # input's shape
    client.run(BWD, **p)
    check_backward(p)


def test_strided_views_in_and_out(client, rng):
    p = group_norm_call(rng, (4, 6, 5), 3)
    x_t = np.ascontiguousarray(p["self"].transpose(2, 1, 0)).transpose(2, 1, 0)
    big = sentinel_like((4, 6, 10), F32)
    p = dict(p, self=x_t, out=big[:, :, ::2])
    client.run(FWD, **p)
    check_forward(p)
    assert (big[:, :, 1::2] == -7.25).all()
    q = group_norm_backward_call(rng, (4, 6, 5), 3)
    q = dict(q, input=np.ascontiguousarray(q["input"].T).T, gradOut=np.broadcast_to(q["gradOut"][:1], (4, 6, 5)))
    client.run(BWD, **q)
    check_backward(dict(q, gradOut=np.ascontiguousarray(q["gradOut"])))


@pytest.mark.parametrize("name", ["HxW", "group", "eps"])
def test_an_integer_beyond_int64_is_refused_by_name(client, rng, name):
    """CANN's integer parameters are int64 (and a Python int for `eps` is one too): beyond that range a
    call is refused naming the parameter, in process and through the server alike (the wire's encoder
    raised a bare ValueError; found by a mutation fuzz)."""
    p = group_norm_call(rng, (2, 6, 4), 3)
    p[name] = 2**70
    expect_error(client, FWD, p, ("out", "meanOut", "rstdOut"), 161002, name)


def test_self_reaches_the_server_as_a_parameter_name(client, rng):
    """The client takes the operator positionally, so CANN's `self` is an ordinary keyword."""
    p = group_norm_call(rng, (2, 4, 3), 2)
    client.run_async(FWD, **p).result()
    check_forward(p)


FORWARD_CASES = [
    ("null-self", set_(self=None), NULL, "self"),
    ("null-out", set_(out=None), NULL, "out"),
    ("null-meanOut", set_(meanOut=None), NULL, "meanOut"),
    ("null-rstdOut", set_(rstdOut=None), NULL, "rstdOut"),
    ("null-N", set_(N=None), NULL, "N"),
    ("null-group", set_(group=None), NULL, "group"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("N-kind-float", set_(N=3.0), INVALID, "N"),
    ("C-kind-bool", set_(C=True), INVALID, "C"),
    ("eps-kind", set_(eps="x"), INVALID, "eps"),
    ("dtype-self", cast("self", np.float64), INVALID, "self"),
    ("gamma-ne-self", cast("gamma", F16), INVALID, "gamma"),
    ("beta-ne-self", cast("beta", BF16), INVALID, "beta"),
    ("out-ne-self", cast("out", F16), INVALID, "out"),
    ("meanOut-ne-self", cast("meanOut", F16), INVALID, "meanOut"),
    ("rstdOut-ne-self", cast("rstdOut", BF16), INVALID, "rstdOut"),
    ("N-negative", set_(N=-3), INVALID, "N"),
    ("group-zero", set_(group=0), INVALID, "group"),
    ("group-not-dividing-C", set_(group=4), INVALID, "group"),
    ("eps-zero", set_(eps=0.0), INVALID, "eps"),
    ("rank-1", lambda p: p.update(self=np.zeros(6, F32), out=np.zeros(6, F32)), INVALID, "self"),
    ("out-shape", reshape("out", (3, 6, 20)), INVALID, "out"),
    ("meanOut-shape", reshape("meanOut", (3, 3, 1)), INVALID, "meanOut"),
    ("rstdOut-shape", reshape("rstdOut", (3,)), INVALID, "rstdOut"),
    ("N-mismatch", set_(N=2), INVALID, "meanOut"),
    (
        "N-mismatch-stats-fit",
        lambda p: p.update(N=2, meanOut=np.zeros((2, 3), F32), rstdOut=np.zeros((2, 3), F32)),
        INVALID,
        "self",
    ),
    ("C-mismatch", set_(C=3), INVALID, "self"),
    ("HxW-mismatch", set_(HxW=21), INVALID, "self"),
    ("gamma-shape", reshape("gamma", (6, 1)), INVALID, "gamma"),
    ("beta-shape", reshape("beta", (5,)), INVALID, "beta"),
    ("out-format", lambda p: p.update(out=retag(p["out"], Format.NCHW)), INVALID, "out"),
    (
        "self-channel-last",
        lambda p: p.update(self=retag(p["self"], Format.NHWC), out=retag(p["out"], Format.NHWC)),
        INVALID,
        "self",
    ),
    (
        "self-private",
        lambda p: p.update(self=retag(p["self"], Format.NC1HWC0), out=retag(p["out"], Format.NC1HWC0)),
        INVALID,
        "self",
    ),
    ("meanOut-private", lambda p: p.update(meanOut=retag(p["meanOut"], Format.FRACTAL_NZ)), INVALID, "meanOut"),
]

BACKWARD_CASES = [
    ("null-gradOut", set_(gradOut=None), NULL, "gradOut"),
    ("null-input", set_(input=None), NULL, "input"),
    ("null-mean", set_(mean=None), NULL, "mean"),
    ("null-rstd", set_(rstd=None), NULL, "rstd"),
    ("null-outputMask", set_(outputMask=None), NULL, "outputMask"),
    ("null-HxW", set_(HxW=None), NULL, "HxW"),
    ("group-kind", set_(group=2.5), INVALID, "group"),
    ("mask-len-2", set_(outputMask=[True, True]), INVALID, "outputMask"),
    ("mask-before-null-out", set_(outputMask=[True], gradInput=None), INVALID, "outputMask"),
    ("null-gradInput", set_(gradInput=None), NULL, "gradInput"),
    ("null-gradGammaOut", set_(gradGammaOut=None), NULL, "gradGammaOut"),
    ("null-gradBetaOut", set_(gradBetaOut=None), NULL, "gradBetaOut"),
    ("dtype-gradOut", cast("gradOut", np.float64), INVALID, "gradOut"),
    ("dtype-mean", cast("mean", np.int32), INVALID, "mean"),
    ("input-ne-gradOut", cast("input", F16), INVALID, "input"),
    ("gradInput-ne-gradOut", cast("gradInput", F16), INVALID, "gradInput"),
    (
        "mean-f16-gradOut-f32",
        lambda p: p.update(mean=p["mean"].astype(F16), rstd=p["rstd"].astype(F16)),
        INVALID,
        "mean",
    ),
    ("rstd-ne-mean", cast("rstd", F16), INVALID, "rstd"),
    ("gamma-ne-mean", cast("gamma", BF16), INVALID, "gamma"),
    ("gradGammaOut-ne-mean", cast("gradGammaOut", F16), INVALID, "gradGammaOut"),
    ("gradBetaOut-ne-mean", cast("gradBetaOut", BF16), INVALID, "gradBetaOut"),
    ("group-zero", set_(group=0), INVALID, "group"),
    ("group-not-dividing-C", set_(group=4), INVALID, "group"),
    ("C-negative", set_(C=-6), INVALID, "C"),
    ("gradOut-count", reshape("gradOut", (3, 6, 21)), INVALID, "gradOut"),
    ("input-count", reshape("input", (3, 6, 19)), INVALID, "input"),
    ("mean-count", reshape("mean", (3, 2)), INVALID, "mean"),
    ("rstd-count", reshape("rstd", (8,)), INVALID, "rstd"),
    ("gamma-count", reshape("gamma", (5,)), INVALID, "gamma"),
    ("gradInput-shape", reshape("gradInput", (3, 6, 20)), INVALID, "gradInput"),
    ("gradGammaOut-shape", reshape("gradGammaOut", (6, 1)), INVALID, "gradGammaOut"),
    ("gradBetaOut-shape", reshape("gradBetaOut", (7,)), INVALID, "gradBetaOut"),
    ("private-input", lambda p: p.update(input=retag(p["input"], Format.NC1HWC0)), INVALID, "input"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_forward_error_table(client, rng, mutate, code, param):
    p = group_norm_call(rng, (3, 6, 4, 5), 3)
    mutate(p)
    expect_error(client, FWD, p, ("out", "meanOut", "rstdOut"), code, param)


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in BACKWARD_CASES], ids=[c[0] for c in BACKWARD_CASES])
def test_backward_error_table(client, rng, mutate, code, param):
    p = group_norm_backward_call(rng, (3, 6, 4, 5), 3)
    mutate(p)
    expect_error(client, BWD, p, BWD_OUTPUTS, code, param)
