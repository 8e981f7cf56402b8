"""Every row of SPEC 3.3 (aclnnLayerNormBackward's error table), in check order.

Each case mutates one valid call; the call must fail with the row's code naming the
row's parameter, and no output may change.
"""

from __future__ import annotations

import numpy as np
import pytest
from layer_norm_cases import F32, layer_norm_call
from oracle import BF16, Untouched, cast, reshape, retag, sentinel_like, set_

from aclnn_client import AclnnError, DataType, Format, create_tensor

OP = "aclnnLayerNormBackward"
NULL, INVALID = 161001, 161002
F16 = np.dtype(np.float16)


# (id, mutation, expected code, expected param)
CASES = [
    # 1: nulls, in order
    ("null-gradOut", set_(gradOut=None), NULL, "gradOut"),
    ("null-input", set_(input=None), NULL, "input"),
    ("null-normalizedShape", set_(normalizedShape=None), NULL, "normalizedShape"),
    ("null-mean", set_(mean=None), NULL, "mean"),
    ("null-rstd", set_(rstd=None), NULL, "rstd"),
    ("null-outputMask", set_(outputMask=None), NULL, "outputMask"),
    ("null-order", set_(input=None, rstd=None), NULL, "input"),
    # 2: mask length, before the outputs' null checks
    ("mask-len-2", set_(outputMask=[True, True]), INVALID, "outputMask"),
    ("mask-len-4", set_(outputMask=[True] * 4), INVALID, "outputMask"),
    ("mask-empty", set_(outputMask=[]), INVALID, "outputMask"),
    ("mask-len-before-null-out", set_(outputMask=[True, True], gradInputOut=None), INVALID, "outputMask"),
    # 3: enabled outputs must not be null
    ("null-gradInputOut", set_(gradInputOut=None), NULL, "gradInputOut"),
    ("null-gradWeightOut", set_(gradWeightOut=None), NULL, "gradWeightOut"),
    ("null-gradBiasOut", set_(gradBiasOut=None), NULL, "gradBiasOut"),
    # 4: dtypes outside FLOAT/FLOAT16/BF16
    ("dtype-gradOut", cast("gradOut", np.float64), INVALID, "gradOut"),
    ("dtype-input", cast("input", np.int32), INVALID, "input"),
    ("dtype-mean", cast("mean", np.float64), INVALID, "mean"),
    ("dtype-rstd", cast("rstd", np.int8), INVALID, "rstd"),
    ("dtype-weight", cast("weightOptional", np.float64), INVALID, "weightOptional"),
    ("dtype-bias", cast("biasOptional", np.int64), INVALID, "biasOptional"),
    ("dtype-gradInputOut", cast("gradInputOut", np.float64), INVALID, "gradInputOut"),
    ("dtype-gradWeightOut", cast("gradWeightOut", np.int32), INVALID, "gradWeightOut"),
    ("dtype-gradBiasOut", cast("gradBiasOut", np.bool_), INVALID, "gradBiasOut"),
    (
        "dtype-before-null-checks-done",
        lambda p: p.update(input=p["input"].astype(np.int32), gradOut=p["gradOut"].astype(np.float16)),
        INVALID,
        "input",
    ),
    # 5: gradOut's dtype must equal input's
    ("gradOut-ne-input", cast("gradOut", np.float16), INVALID, "gradOut"),
    # 6: weight/bias dtype input's or FLOAT; bias = weight when both given
    ("weight-f16-input-f32", cast("weightOptional", np.float16), INVALID, "weightOptional"),
    ("bias-bf16-input-f32", cast("biasOptional", BF16), INVALID, "biasOptional"),
    # 7: private formats
    ("private-input", lambda p: p.update(input=retag(p["input"], Format.NC1HWC0)), INVALID, "input"),
    ("private-mean", lambda p: p.update(mean=retag(p["mean"], Format.FRACTAL_NZ)), INVALID, "mean"),
    (
        "private-gradBiasOut",
        lambda p: p.update(gradBiasOut=retag(p["gradBiasOut"], Format.FRACTAL_Z)),
        INVALID,
        "gradBiasOut",
    ),
    # 8: rank 0 (rank 9 is a descriptor error, see test_descriptors.py)
    ("rank0-mean", lambda p: p.update(mean=np.zeros((), F32)), INVALID, "mean"),
    ("rank0-weight", lambda p: p.update(weightOptional=np.ones((), F32)), INVALID, "weightOptional"),
    # 9: normalizedShape
    ("normshape-empty", set_(normalizedShape=[]), INVALID, "normalizedShape"),
    ("normshape-too-long", set_(normalizedShape=[1, 6, 4, 8]), INVALID, "normalizedShape"),
    ("normshape-negative", set_(normalizedShape=[-8]), INVALID, "normalizedShape"),
    # 10: input's trailing dims vs normalizedShape
    ("input-trailing", set_(normalizedShape=[5]), INVALID, "input"),
    ("input-trailing-2d", set_(normalizedShape=[5, 8]), INVALID, "input"),
    # 11..16: shapes
    ("gradOut-shape", reshape("gradOut", (6, 4, 9)), INVALID, "gradOut"),
    ("weight-shape", reshape("weightOptional", (4, 8)), INVALID, "weightOptional"),
    ("bias-shape", reshape("biasOptional", (7,)), INVALID, "biasOptional"),
    ("rstd-shape", reshape("rstd", (24,)), INVALID, "rstd"),
    ("mean-count", lambda p: p.update(mean=np.zeros((6, 1, 1), F32), rstd=np.zeros((6, 1, 1), F32)), INVALID, "mean"),
    ("gradInputOut-shape", reshape("gradInputOut", (24, 8)), INVALID, "gradInputOut"),
    ("gradWeightOut-count", reshape("gradWeightOut", (9,)), INVALID, "gradWeightOut"),
    ("gradBiasOut-count", reshape("gradBiasOut", (2, 8)), INVALID, "gradBiasOut"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("phase", ["two-phase", "run"])
def test_error_table(client, rng, mutate, code, param, phase):
    p = layer_norm_call(rng, (6, 4, 8))
    mutate(p)
    untouched = Untouched(p["gradInputOut"], p["gradWeightOut"], p["gradBiasOut"])
    with pytest.raises(AclnnError) as info:
        if phase == "run":
            client.run(OP, **p)
        else:
            client.get_workspace_size(OP, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    assert param in str(info.value)
    untouched.check()


def test_bias_dtype_must_equal_weight_dtype(client, rng):
    p = layer_norm_call(rng, (4, 8), dtype=BF16, weight="float32")
    p["biasOptional"] = p["biasOptional"].astype(BF16)  # input's dtype, but not weight's
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, "biasOptional")


def test_plain_format_tags_are_read_as_nd(client, rng):
    p = layer_norm_call(rng, (2, 3, 4, 8))
    expected = layer_norm_call(np.random.default_rng(20261123), (2, 3, 4, 8))
    client.run(OP, **expected)
    p["input"] = retag(p["input"], Format.NCHW)
    p["gradOut"] = retag(p["gradOut"], Format.NHWC)
    client.run(OP, **p)
    assert p["gradInputOut"].tobytes() == expected["gradInputOut"].tobytes()


def test_unknown_parameter_is_invalid_never_null(client, rng):
    p = layer_norm_call(rng)
    p["weightOptinal"] = None  # a typo passed as None must not read as a null pointer
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, "weightOptinal")


def test_misspelled_required_parameter_is_named(client, rng):
    p = layer_norm_call(rng)
    p["gradOutt"] = p.pop("gradOut")
    with pytest.raises(AclnnError) as info:
        client.get_workspace_size(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, "gradOutt")


def test_unknown_operator(client):
    with pytest.raises(AclnnError) as info:
        client.run("aclnnLayerNormBackwards", gradOut=np.zeros(3, F32))
    assert (info.value.code, info.value.param) == (INVALID, "op")


@pytest.mark.parametrize(
    "name,value",
    [
        ("normalizedShape", "8"),
        ("normalizedShape", [True]),
        ("outputMask", [1, 1, 1]),
        ("outputMask", 1.5),
        ("normalizedShape", np.array([8])),  # a tensor is not an aclIntArray
        ("normalizedShape", [2**64]),  # aclIntArray holds int64: the wire's encoder must not be the one to refuse
        ("normalizedShape", [8, -(2**63) - 1]),
    ],
)
def test_wrong_kind_of_value(client, rng, name, value):
    p = layer_norm_call(rng)
    p[name] = value
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, name)


@pytest.mark.parametrize("name", ["gradInputOut", "gradOut"])
@pytest.mark.parametrize("offset,stride", [(2**62, 1), (0, 2**62), (-1, 1)])
def test_a_descriptor_beyond_any_address_is_invalid(client, rng, name, offset, stride):
    """A hand-made descriptor whose offset or stride no address can reach (2^62 elements; 2^62 times
    a stride is past int64, which aclCreateTensor's int64_t cannot hold): 161002 naming it, in process
    as through the server. Found by a mutation fuzz: in process an output's view over its storage
    raised NumPy's OverflowError, through the server the wire's encoder a ValueError. Nothing is written."""
    p = layer_norm_call(rng)
    shape = p[name].shape
    strides = [stride * s // 4 for s in p[name].strides]
    p[name] = create_tensor(shape, DataType.FLOAT, strides, offset, Format.ND, [p[name].size], p[name].reshape(-1))
    untouched = Untouched(*(p[n] for n in ("gradWeightOut", "gradBiasOut")))
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, name), str(info.value)
    untouched.check()


def test_output_dtype_float_of_int_tensor_named(client, rng):
    p = layer_norm_call(rng)
    p["gradBiasOut"] = sentinel_like((8,), np.float64)
    with pytest.raises(AclnnError) as info:
        client.get_workspace_size(OP, **p)
    assert info.value.param == "gradBiasOut" and info.value.code == INVALID
    assert DataType.DOUBLE.name in str(info.value)
