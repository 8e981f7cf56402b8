"""aclnnLayerNorm against PyTorch float64, through gRPC and LocalClient; its error table."""

from __future__ import annotations

import numpy as np
import pytest
from layer_norm_cases import layer_norm_reference
from layer_norm_forward_cases import F32, layer_norm_forward_call, layer_norm_forward_reference
from oracle import BF16, FLOAT_DTYPES, assert_close, cast, expect_error, reshape, retag, sentinel_like, set_

from aclnn_client import AclnnError, Format

OP = "aclnnLayerNorm"
NULL, INVALID = 161001, 161002
F16 = np.dtype(np.float16)
OUTPUTS = ("out", "meanOutOptional", "rstdOutOptional")


def check(p: dict) -> None:
    for name, ref in zip(OUTPUTS, layer_norm_forward_reference(p)):
        if p[name] is not None:
            assert_close(p[name], ref.reshape(p[name].shape), name)


@pytest.mark.parametrize("weight", ["same", "float32", None])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,k", [((6, 4, 8), 1), ((3, 5, 7), 2), ((33,), 1), ((2, 3, 4, 5), 3)], ids=str)
def test_matches_pytorch(client, rng, shape, k, dtype, weight):
    p = layer_norm_forward_call(rng, shape, k, dtype, weight)
    workspace_size, executor = client.get_workspace_size(OP, **p)
    assert workspace_size >= 0
    client.execute(executor)
    check(p)


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("stats_dtype", FLOAT_DTYPES, ids=str)
def test_any_float_output_dtypes(client, rng, stats_dtype, out_dtype):
    p = layer_norm_forward_call(rng, (4, 32), 1, BF16, "float32", stats_dtype=stats_dtype, out_dtype=out_dtype)
    client.run(OP, **p)
    check(p)


def test_null_optionals(client, rng):
    """Null weight (ones), bias (zeros), mean and rstd outputs."""
    p = layer_norm_forward_call(rng, (5, 12), 1, weight=None, stats=False)
    client.run(OP, **p)
    check(p)
    q = layer_norm_forward_call(rng, (5, 12), 1, bias=False)
    q["rstdOutOptional"] = None
    client.run(OP, **q)
    check(q)


def test_statistics_feed_the_backward(client, rng):
    p = layer_norm_forward_call(rng, (6, 16), 1, F32)
    client.run(OP, **p)
    g = rng.standard_normal((6, 16)).astype(F32)
    bwd = dict(
        gradOut=g,
        input=p["input"],
        normalizedShape=[16],
        mean=p["meanOutOptional"],
        rstd=p["rstdOutOptional"],
        weightOptional=p["weightOptional"],
        biasOptional=p["biasOptional"],
        outputMask=[True, True, True],
        gradInputOut=sentinel_like((6, 16), F32),
        gradWeightOut=sentinel_like((16,), F32),
        gradBiasOut=sentinel_like((16,), F32),
    )
    client.run("aclnnLayerNormBackward", **bwd)
    for name, ref in zip(("gradInputOut", "gradWeightOut", "gradBiasOut"), layer_norm_reference(bwd)):
        assert_close(bwd[name], ref, name)


def test_empty_tensors(client, rng):
    """CANN: no rows writes nothing; an empty normalized axis gives mean 0 and rstd NaN."""
    p = layer_norm_forward_call(rng, (0, 8))
    p["meanOutOptional"] = p["rstdOutOptional"] = np.zeros(0, F32)  # empty statistics pass any shape
    client.run(OP, **p)
    q = layer_norm_forward_call(rng, (3, 0))
    client.run(OP, **q)
    assert (q["meanOutOptional"] == 0).all() and np.isnan(q["rstdOutOptional"]).all()


def test_strided_views_in_and_out(client, rng):
    p = layer_norm_forward_call(rng, (8, 6))
    big = sentinel_like((8, 12), F32)
    p = dict(p, input=np.ascontiguousarray(p["input"].T).T, out=big[:, ::2])
    p["weightOptional"] = np.broadcast_to(p["weightOptional"][:1], (6,))
    client.run(OP, **p)
    check(p)
    assert (big[:, 1::2] == -7.25).all()


def test_long_rows_meet_fp32_tolerance(client, rng):
    p = layer_norm_forward_call(rng, (3, 200_000), 1)
    p["input"] += np.float32(100)  # a large mean: the variance must not cancel
    client.run(OP, **p)
    check(p)


CASES = [
    ("null-input", set_(input=None), NULL, "input"),
    ("null-normalizedShape", set_(normalizedShape=None), NULL, "normalizedShape"),
    ("null-out", set_(out=None), NULL, "out"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("eps-kind", set_(eps=True), INVALID, "eps"),
    ("normalizedShape-kind", set_(normalizedShape=np.array([8])), INVALID, "normalizedShape"),
    ("dtype-input", cast("input", np.float64), INVALID, "input"),
    ("dtype-weight", cast("weightOptional", np.int32), INVALID, "weightOptional"),
    ("weight-f16-input-f32", cast("weightOptional", F16), INVALID, "weightOptional"),
    ("bias-bf16-input-f32", cast("biasOptional", BF16), INVALID, "biasOptional"),
    ("dtype-out", cast("out", np.float64), INVALID, "out"),
    ("dtype-mean", cast("meanOutOptional", np.int32), INVALID, "meanOutOptional"),
    ("dtype-rstd", cast("rstdOutOptional", np.float64), INVALID, "rstdOutOptional"),
    ("private-input", lambda p: p.update(input=retag(p["input"], Format.NC1HWC0)), INVALID, "input"),
    ("private-out", lambda p: p.update(out=retag(p["out"], Format.FRACTAL_NZ)), INVALID, "out"),
    ("normshape-too-long", set_(normalizedShape=[1] * 9), INVALID, "normalizedShape"),
    ("normshape-empty", set_(normalizedShape=[]), INVALID, "normalizedShape"),
    ("normshape-above-rank", set_(normalizedShape=[1, 6, 4, 8]), INVALID, "input"),
    ("weight-rank", reshape("weightOptional", (1, 8)), INVALID, "weightOptional"),
    ("bias-rank", reshape("biasOptional", (1, 8)), INVALID, "biasOptional"),
    ("input-trailing", set_(normalizedShape=[5]), INVALID, "input"),
    ("weight-shape", reshape("weightOptional", (7,)), INVALID, "weightOptional"),
    ("bias-shape", reshape("biasOptional", (9,)), INVALID, "biasOptional"),
    ("out-shape", reshape("out", (6, 4, 9)), INVALID, "out"),
    ("mean-shape", reshape("meanOutOptional", (6, 4)), INVALID, "meanOutOptional"),
    ("rstd-shape", reshape("rstdOutOptional", (6, 1, 1)), INVALID, "rstdOutOptional"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table(client, rng, mutate, code, param):
    p = layer_norm_forward_call(rng, (6, 4, 8))
    mutate(p)
    expect_error(client, OP, p, OUTPUTS, code, param)


def test_bias_dtype_must_equal_weight_dtype(client, rng):
    p = layer_norm_forward_call(rng, (4, 8), dtype=BF16, weight="float32")
    p["biasOptional"] = p["biasOptional"].astype(BF16)
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, "biasOptional")
