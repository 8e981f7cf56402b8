"""aclnnBatchNormElemtBackward against SPEC 6.2 in float64, through gRPC and LocalClient (SPEC §6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batch_norm_cases import DATA_TYPES, F16, F32, elemt_call, elemt_reference, tagged
from oracle import BF16, FLOAT_DTYPES, Untouched, assert_close, cast, reshape, sentinel_like, set_, t64

from aclnn_client import AclnnError, Format, create_tensor
from aclnn_server.ops import rows

OP = "aclnnBatchNormElemtBackward"
NULL, INVALID = 161001, 161002
I32 = np.dtype(np.int32)


def check(p: dict) -> None:
    assert_close(p["gradInput"], elemt_reference(p), "gradInput")


SHAPES = [
    (6, 3),
    (4, 3, 5),
    (2, 3, 4, 5),
    (2, 3, 2, 3, 2),
    (2, 3, 2, 1, 2, 2),
    (1, 2, 2, 1, 2, 3, 2),
    (2, 2, 1, 2, 1, 2, 2, 2),
]


@pytest.mark.parametrize("weight", [True, False], ids=["weight", "null-weight"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_matches_formula(client, rng, shape, dtype, weight):
    p = elemt_call(rng, shape, dtype, weight)
    workspace_size, executor = client.get_workspace_size(OP, **p)
    assert workspace_size > 0
    client.execute(executor)
    check(p)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5), (2, 4, 3, 3), (2, 3, 2, 2, 2, 2)], ids=lambda s: f"{len(s)}d")
def test_equals_native_batch_norm_backward_in_training(client, rng, shape, dtype):
    """With sumDy = Σg, sumDyXmu = Σg·(x−mean) and total = n it is BatchNorm's training gradInput."""
    p = elemt_call(rng, shape, dtype, weight=True, dtypes={"mean": F32, "invstd": F32, "weight": F32})
    x, g = p["input"].astype(np.float64), p["gradOut"].astype(np.float64)
    reduce = tuple(i for i in range(len(shape)) if i != 1)
    bshape = (1, shape[1]) + (1,) * (len(shape) - 2)
    mean = x.mean(axis=reduce).astype(F32)
    p["mean"] = mean
    p["invstd"] = (1.0 / np.sqrt(x.var(axis=reduce) + 1e-5)).astype(F32)
    p["sumDy"] = g.sum(axis=reduce).astype(F32)
    p["sumDyXmu"] = (g * (x - mean.astype(np.float64).reshape(bshape))).sum(axis=reduce).astype(F32)
    n = x.size // shape[1]
    p["counter"] = np.array([n // 2, n - n // 2], np.int32)
    client.run(OP, **p)
    g64, x64 = t64(p["gradOut"]), t64(p["input"])
    if x64.dim() > 5:
        g64, x64 = g64.reshape(shape[0], shape[1], -1), x64.reshape(shape[0], shape[1], -1)
    c = shape[1]
    ref = torch.ops.aten.native_batch_norm_backward(
        g64,
        x64,
        t64(p["weight"]),
        torch.zeros(c, dtype=torch.float64),
        torch.ones(c, dtype=torch.float64),
        t64(p["mean"]),
        t64(p["invstd"]),
        True,
        1e-5,
        [True, False, False],
    )[0].reshape(shape)
    # the float64 reference of the rounded sums equals PyTorch's up to those sums' fp32 rounding
    assert_close(p["gradInput"], ref, "gradInput vs native_batch_norm_backward")
    check(p)


@pytest.mark.parametrize(
    "counter",
    [
        np.array([20], I32),
        np.array([7, 6, 7], I32),
        np.array([[5, 5], [4, 6]], I32),
        np.full((2, 1, 2, 1), 5, I32),
        np.array([20.0], F16),
        np.array([[12.0, 8.0]], F16),
        np.array([9.5, 10.5], F32),
        np.full((1, 2, 1, 1, 1, 1, 1, 2), 5.0, F32),
    ],
    ids=["i32-1", "i32-3", "i32-2x2", "i32-4d", "f16-1", "f16-1x2", "f32-2", "f32-8d"],
)
def test_counter_dtypes_and_shapes(client, rng, counter):
    p = elemt_call(rng, (4, 3, 5), counter=counter)
    client.run(OP, **p)
    check(p)


def test_int32_counter_sum_is_exact(client, rng):
    """Σ counter is exact for INT32, beyond fp32's 2^24 integer range."""
    p = elemt_call(rng, (4, 3, 5), counter=np.array([2**30 + 1, 2**30 + 3, 7], I32))
    client.run(OP, **p)
    check(p)


def test_counter_strided_and_broadcast(client, rng):
    counter = np.broadcast_to(np.array([3], I32), (4, 5))  # stride 0: twenty 3s
    p = elemt_call(rng, (4, 3, 5), counter=counter)
    client.run(OP, **p)
    check(dict(p, counter=np.ascontiguousarray(counter)))


@pytest.mark.parametrize(
    "dtypes",
    [
        {"gradOut": BF16, "input": F16, "mean": F32, "invstd": BF16, "weight": F16, "sumDy": F32, "sumDyXmu": BF16},
        {"gradOut": F16, "input": F16, "gradInput": F32},
        {"gradOut": F32, "input": F32, "gradInput": BF16, "mean": F16, "sumDy": F16},
        {"gradOut": BF16, "input": BF16, "mean": F32, "invstd": F32, "weight": F32, "sumDy": F32, "sumDyXmu": F32},
    ],
    ids=["all-different", "f16-in-f32-out", "f32-in-bf16-out", "bf16-with-f32-stats"],
)
def test_no_dtype_relations_between_tensors(client, rng, dtypes):
    p = elemt_call(rng, (4, 3, 6), F32, dtypes=dtypes, counter=np.array([10, 14], F16))
    client.run(OP, **p)
    check(p)


def test_zero_total_gives_ieee_inf_nan(client, rng):
    """total = 0 is no error: the divisions give the infinities and NaNs IEEE arithmetic gives."""
    p = elemt_call(rng, (2, 3, 4), counter=np.array([0, 0], I32))
    p["sumDy"] = np.array([1.0, -2.0, 3.0], F32)
    p["sumDyXmu"] = np.array([0.5, 1.0, -1.0], F32)
    p["mean"] = np.full(3, 10.0, F32)  # x − mean < 0 everywhere: −inf·… has one sign per channel
    client.run(OP, **p)
    gi, ref = p["gradInput"].astype(np.float64), elemt_reference(p)
    assert np.isinf(ref).any() and np.isnan(ref).any()
    assert (np.isnan(gi) == np.isnan(ref)).all()
    finite_or_inf = ~np.isnan(ref)
    assert (gi[finite_or_inf] == ref[finite_or_inf]).all()


def test_empty_input_with_channels_writes_nothing(client, rng):
    p = elemt_call(rng, (0, 3, 4))
    client.run(OP, **p)
    assert p["gradInput"].shape == (0, 3, 4)


@pytest.mark.parametrize("fmt", [Format.NHWC, Format.NDHWC, Format.NCHW, Format.HWCN], ids=lambda f: f.name)
def test_format_tags_do_not_move_the_channel(client, rng, fmt):
    p = elemt_call(rng, (2, 3, 4, 5))
    q = dict(p, gradOut=tagged(p["gradOut"], fmt), input=tagged(p["input"], fmt))
    q["gradInput"] = tagged(p["gradInput"], fmt)
    q["mean"] = tagged(p["mean"], Format.FRACTAL_NZ)  # only gradOut, input, gradInput must be plain
    client.run(OP, **q)
    check(p)


def test_strided_inputs_and_output(client, rng):
    base = elemt_call(rng, (6, 4, 5))
    x_t = np.asfortranarray(base["input"])
    g_b = np.broadcast_to(base["gradOut"][:, :, :1], (6, 4, 5))  # stride 0 over the last axis
    inv_big = np.repeat(base["invstd"], 3)
    gi_big = sentinel_like((6, 8, 5), F32)
    p = dict(base, input=x_t, gradOut=g_b, invstd=inv_big[::3], gradInput=gi_big[:, 1::2])
    client.run(OP, **p)
    check(dict(p, gradOut=np.ascontiguousarray(g_b), invstd=base["invstd"]))
    assert (gi_big[:, ::2] == -7.25).all()


def test_tiles_smaller_than_every_dim(client, rng, monkeypatch):
    monkeypatch.setattr(rows, "BLOCK_ELEMENTS", 5)
    p = elemt_call(rng, (3, 7, 4, 3))
    q = dict(p, input=np.asfortranarray(p["input"]))
    client.run(OP, **q)
    check(p)


def test_create_tensor_output_writes_only_its_view(client, rng):
    p = elemt_call(rng, (2, 3, 4))
    storage = sentinel_like(40, F32)
    q = dict(p, gradInput=create_tensor([2, 3, 4], DATA_TYPES[F32], [1, 2, 6], 8, Format.NCL, [40], storage))
    client.run(OP, **q)
    view = np.lib.stride_tricks.as_strided(storage[8:], (2, 3, 4), (4, 8, 24))
    assert_close(view.copy(), elemt_reference(p), "gradInput")
    assert (storage[:8] == -7.25).all() and (storage[32:] == -7.25).all()


def test_deterministic_bit_identical(client, rng):
    p = elemt_call(rng, (32, 8, 200), BF16, dtypes={"gradInput": F32})
    results = []
    for _ in range(3):
        client.run(OP, **p)
        results.append(p["gradInput"].tobytes())
    assert results[0] == results[1] == results[2]


# ---------------------------------------------------------------------------------------------
# SPEC 6.3: every row of the error table, in check order; a failed call writes nothing.


def fmt(name: str, to: int):
    return lambda p: p.update({name: tagged(p[name], to)})


def both(*mutations):
    def apply(p):
        for m in mutations:
            m(p)

    return apply


REQUIRED = ("gradOut", "input", "mean", "invstd", "sumDy", "sumDyXmu", "counter", "gradInput")
CASES = [
    # 1: nulls, in order
    *((f"null-{n}", set_(**{n: None}), NULL, n) for n in REQUIRED),
    ("null-order", set_(input=None, counter=None, gradInput=None), NULL, "input"),
    ("null-before-dtype", both(cast("gradOut", np.float64), set_(sumDyXmu=None)), NULL, "sumDyXmu"),
    # 2: dtypes outside the table
    ("dtype-gradOut", cast("gradOut", np.float64), INVALID, "gradOut"),
    ("dtype-input", cast("input", np.int32), INVALID, "input"),
    ("dtype-mean", cast("mean", np.float64), INVALID, "mean"),
    ("dtype-invstd", cast("invstd", np.int8), INVALID, "invstd"),
    ("dtype-weight", cast("weight", np.float64), INVALID, "weight"),
    ("dtype-sumDy", cast("sumDy", np.int32), INVALID, "sumDy"),
    ("dtype-sumDyXmu", cast("sumDyXmu", np.int64), INVALID, "sumDyXmu"),
    ("dtype-counter-i64", cast("counter", np.int64), INVALID, "counter"),
    ("dtype-counter-bf16", cast("counter", BF16), INVALID, "counter"),
    ("dtype-counter-f64", cast("counter", np.float64), INVALID, "counter"),
    ("dtype-gradInput", cast("gradInput", np.float64), INVALID, "gradInput"),
    ("dtype-gradInput-i32", cast("gradInput", np.int32), INVALID, "gradInput"),
    ("dtype-order", both(cast("counter", BF16), cast("weight", np.float64)), INVALID, "weight"),
    ("dtype-before-format", both(fmt("gradOut", Format.NC1HWC0), cast("gradInput", np.float64)), INVALID, "gradInput"),
    # 3: private formats of gradOut, input, gradInput
    ("private-gradOut", fmt("gradOut", Format.NC1HWC0), INVALID, "gradOut"),
    ("private-input", fmt("input", Format.FRACTAL_Z), INVALID, "input"),
    ("private-gradInput", fmt("gradInput", Format.FRACTAL_NZ), INVALID, "gradInput"),
    ("format-before-rank", both(reshape("input", (5,)), fmt("gradInput", Format.NDC1HWC0)), INVALID, "gradInput"),
    # 4: input rank < 2
    ("rank1-input", reshape("input", (5,)), INVALID, "input"),
    ("rank1-all", both(reshape("input", (5,)), reshape("gradOut", (5,)), reshape("gradInput", (5,))), INVALID, "input"),
    # 5: counter rank 0 (rank > 8 is a descriptor error, see test_descriptors.py)
    ("rank0-counter", set_(counter=np.array(20, np.int32)), INVALID, "counter"),
    ("input-rank-before-counter", both(reshape("input", (5,)), set_(counter=np.array(20, np.int32))), INVALID, "input"),
    # 6: channel size 0
    ("zero-channels", both(*(reshape(n, (4, 0, 5)) for n in ("input", "gradOut", "gradInput"))), INVALID, "input"),
    ("zero-channels-before-shapes", both(reshape("input", (4, 0, 5)), reshape("mean", (2,))), INVALID, "input"),
    ("counter-before-channels", both(reshape("input", (4, 0, 5)), set_(counter=np.array(2, I32))), INVALID, "counter"),
    # 7, 8: gradOut and gradInput shapes
    ("gradOut-shape", reshape("gradOut", (4, 3, 6)), INVALID, "gradOut"),
    ("gradOut-rank1", reshape("gradOut", (60,)), INVALID, "gradOut"),
    ("gradInput-shape", reshape("gradInput", (4, 5, 3)), INVALID, "gradInput"),
    ("gradOut-before-gradInput", both(reshape("gradOut", (4, 3, 6)), reshape("gradInput", (2,))), INVALID, "gradOut"),
    ("gradInput-before-stats", both(reshape("gradInput", (4, 3, 6)), reshape("mean", (2,))), INVALID, "gradInput"),
    # 9: per-channel shapes, in the listed order mean, invstd, sumDy, sumDyXmu, weight
    ("mean-shape", reshape("mean", (4,)), INVALID, "mean"),
    ("invstd-shape", reshape("invstd", (3, 1)), INVALID, "invstd"),
    ("sumDy-shape", reshape("sumDy", ()), INVALID, "sumDy"),
    ("sumDyXmu-shape", reshape("sumDyXmu", (2,)), INVALID, "sumDyXmu"),
    ("weight-shape", reshape("weight", (5,)), INVALID, "weight"),
    ("sumDy-before-weight", both(reshape("weight", (5,)), reshape("sumDy", (2,))), INVALID, "sumDy"),
    ("mean-before-invstd", both(reshape("invstd", (5,)), reshape("mean", (2,))), INVALID, "mean"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table(client, rng, mutate, code, param):
    p = elemt_call(rng, (4, 3, 5))
    mutate(p)
    untouched = Untouched(p["gradInput"])
    with pytest.raises(AclnnError) as info:
        client.get_workspace_size(OP, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    assert param in str(info.value)
    untouched.check()


def test_null_weight_is_ones(client, rng):
    p = elemt_call(rng, (4, 3, 5), weight=False)
    client.run(OP, **p)
    check(p)
    q = dict(p, weight=np.ones(3, F16), gradInput=sentinel_like((4, 3, 5), F32))
    client.run(OP, **q)
    assert q["gradInput"].tobytes() == p["gradInput"].tobytes()


def test_unknown_parameter_is_invalid_never_null(client, rng):
    p = elemt_call(rng)
    p["weightOptional"] = None
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, "weightOptional")
