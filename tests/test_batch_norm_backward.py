"""aclnnBatchNormBackward against PyTorch float64, through gRPC and LocalClient (SPEC §5)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from batch_norm_cases import BN_OUTPUTS, DATA_TYPES, F16, F32, bn_call, bn_reference, tagged, with_format
from oracle import BF16, FLOAT_DTYPES, Untouched, assert_close, cast, reshape, sentinel_like, set_

from aclnn_client import AclnnError, Format, create_tensor
from aclnn_server.ops import rows

OP = "aclnnBatchNormBackward"
NULL, INVALID = 161001, 161002


def check_against_reference(p: dict, axis: int = 1) -> None:
    ref = bn_reference(p, axis)
    for name, r, enabled in zip(BN_OUTPUTS, ref, p["outputMask"]):
        if enabled:
            assert_close(p[name], r, name)


# (id, format, shape): channel last for NHWC/NDHWC, axis 1 for every other plain format
FORMATS = [
    ("NC", Format.NC, (7, 3)),
    ("NCL", Format.NCL, (3, 4, 5)),
    ("NCHW", Format.NCHW, (2, 3, 4, 5)),
    ("NHWC", Format.NHWC, (2, 4, 5, 3)),
    ("NCDHW", Format.NCDHW, (2, 3, 2, 3, 4)),
    ("NDHWC", Format.NDHWC, (2, 2, 3, 4, 3)),
    ("ND-2d", Format.ND, (5, 4)),
    ("ND-4d", Format.ND, (2, 3, 4, 5)),
    ("HWCN", Format.HWCN, (4, 3, 2, 5)),
    ("ND-6d", Format.ND, (2, 3, 2, 2, 3, 2)),
    ("NCHW-7d", Format.NCHW, (2, 3, 2, 1, 2, 3, 2)),
    ("ND-8d", Format.ND, (2, 3, 1, 2, 2, 1, 2, 2)),
    ("NCL-5d", Format.NCL, (2, 3, 2, 2, 2)),
]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fmt,shape", [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_every_format_matches_pytorch(client, rng, fmt, shape, training):
    axis = 3 if fmt == Format.NHWC else 4 if fmt == Format.NDHWC else 1
    p = bn_call(rng, shape, axis, training=training)
    client.run(OP, **with_format(p, fmt))
    check_against_reference(p, axis)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("params", ["same", "float32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dtypes_and_mixed_precision(client, rng, dtype, params, training):
    """fp16/bf16 gradOut with per-channel tensors of its dtype or FLOAT; gradWeight/gradBias of the same."""
    p = bn_call(rng, (6, 4, 10), dtype=dtype, params=params, training=training)
    client.run(OP, **p)
    check_against_reference(p)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_float_param_grads_with_low_precision_weight(client, rng, dtype):
    """gradWeight/gradBias may be FLOAT whatever weight's dtype; gradInput keeps gradOut's."""
    p = bn_call(rng, (5, 3, 8), dtype=dtype, grad_param_dtype=F32)
    client.run(OP, **p)
    check_against_reference(p)
    assert p["gradWeight"].dtype == F32 and p["gradInput"].dtype == dtype


def test_null_weight_takes_gradouts_dtype_for_param_grads(client, rng):
    p = bn_call(rng, (5, 3, 8), dtype=BF16)
    p["weight"] = None
    client.run(OP, **p)
    check_against_reference(p)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mask", list(itertools.product([True, False], repeat=3)), ids=str)
def test_output_mask(client, rng, mask, training):
    """Masked-off outputs may be null; training gradInput still uses the sums (two-phase path)."""
    p = bn_call(rng, (5, 3, 6), training=training, mask=mask)
    workspace_size, executor = client.get_workspace_size(OP, **p)
    assert workspace_size > 0
    client.execute(executor)
    check_against_reference(p)


def test_masked_off_outputs_are_neither_validated_nor_written(client, rng):
    p = bn_call(rng, (4, 3, 5), mask=(True, False, False))
    bogus = sentinel_like((7, 2), np.int32)  # wrong dtype and shape: ignored when masked off
    p["gradWeight"], p["gradBias"] = bogus, bogus
    client.run(OP, **p)
    assert (bogus == -7).all()
    check_against_reference(p)


NULLABLE = ("weight", "runningMean", "runningVar", "saveMean", "saveInvstd")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("nulls", [(n,) for n in NULLABLE] + [NULLABLE], ids=[*NULLABLE, "all"])
def test_null_optionals_take_defaults(client, rng, nulls, training):
    p = bn_call(rng, (4, 3, 6), training=training)
    for name in nulls:
        p[name] = None
    client.run(OP, **p)
    check_against_reference(p)


def test_save_stats_may_be_empty_in_inference(client, rng):
    p = bn_call(rng, (4, 3, 6), training=False)
    p["saveMean"], p["saveInvstd"] = np.zeros(0, F32), np.zeros(0, F32)
    client.run(OP, **p)
    check_against_reference(p)


def test_eps_is_used_only_in_inference(client, rng):
    p = bn_call(rng, (4, 3, 6))
    client.run(OP, **p)
    first = [p[n].copy() for n in BN_OUTPUTS]
    client.run(OP, **dict(p, eps=0.5))
    assert all(a.tobytes() == p[n].tobytes() for a, n in zip(first, BN_OUTPUTS))
    q = bn_call(rng, (4, 3, 6), training=False)
    q["eps"] = 0.5
    client.run(OP, **q)
    check_against_reference(q)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "fmt,shape,axis",
    [(Format.NCHW, (0, 3, 4, 5), 1), (Format.NHWC, (2, 0, 4, 3), 3), (Format.NCL, (4, 3, 0), 1)],
    ids=["empty-batch", "nhwc-empty-h", "ncl-empty-l"],
)
def test_empty_input_zero_fills_param_grads(client, rng, fmt, shape, axis, training):
    p = bn_call(rng, shape, axis, training=training)
    client.run(OP, **with_format(p, fmt))
    assert p["gradInput"].size == 0
    assert (p["gradWeight"] == 0).all() and (p["gradBias"] == 0).all()


def test_zero_channels_writes_nothing(client, rng):
    p = bn_call(rng, (4, 0, 5))
    client.run(OP, **p)
    assert p["gradWeight"].shape == (0,) and p["gradInput"].size == 0


def test_strided_inputs_and_outputs(client, rng):
    """Transposed, sliced and broadcast inputs; strided per-channel tensors; outputs inside larger buffers."""
    base = bn_call(rng, (6, 4, 5), params="float32")
    x_t = np.ascontiguousarray(base["input"].transpose(2, 1, 0)).transpose(2, 1, 0)
    g_b = np.broadcast_to(base["gradOut"][:1], (6, 4, 5))  # stride 0 over the batch
    w_big = np.repeat(base["weight"], 2)  # weight at stride 2
    gi_big, dw_big = sentinel_like((6, 4, 10), F32), sentinel_like((8,), F32)
    p = dict(base, input=x_t, gradOut=g_b, weight=w_big[::2], gradInput=gi_big[:, :, ::2], gradWeight=dw_big[1::2])
    client.run(OP, **p)
    check_against_reference(dict(p, gradOut=np.ascontiguousarray(g_b), weight=base["weight"]))
    assert (gi_big[:, :, 1::2] == -7.25).all() and (dw_big[::2] == -7.25).all()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_channel_last_view_over_channel_first_storage(client, rng, training):
    """An NHWC-tagged view whose strides walk NCHW memory: dims around C do not merge."""
    p = bn_call(rng, (2, 3, 4, 5), 3, params="float32", training=training)
    storage_x = np.ascontiguousarray(p["input"].transpose(0, 3, 1, 2))  # physically N, C, H, W
    storage_g = np.ascontiguousarray(p["gradOut"].transpose(0, 3, 1, 2))
    strides = [60, 4, 1, 12]  # element strides of dims N, H, W, C
    q = dict(
        p,
        input=create_tensor((2, 3, 4, 5), DATA_TYPES[F32], strides, 0, Format.NHWC, [120], storage_x.reshape(-1)),
        gradOut=create_tensor((2, 3, 4, 5), DATA_TYPES[F32], strides, 0, Format.NHWC, [120], storage_g.reshape(-1)),
        gradInput=tagged(p["gradInput"], Format.NHWC),
    )
    client.run(OP, **q)
    check_against_reference(p, 3)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_tiles_smaller_than_every_dim(client, rng, monkeypatch, training):
    """With tiny tiles, every axis ([L, C, T]) is split and strided inputs are gathered tile by tile."""
    monkeypatch.setattr(rows, "BLOCK_ELEMENTS", 7)
    p = bn_call(rng, (5, 6, 4, 3), params="float32", training=training)
    g_nhcw = np.ascontiguousarray(p["gradOut"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    q = dict(p, input=np.asfortranarray(p["input"]), gradOut=g_nhcw)
    client.run(OP, **q)
    check_against_reference(p)
    r = bn_call(rng, (3, 2, 2, 9), 3, training=training)
    client.run(OP, **with_format(r, Format.NHWC))
    check_against_reference(r, 3)


def test_create_tensor_output_writes_only_its_view(client, rng):
    p = bn_call(rng, (2, 3, 2, 2), params="float32")
    storage = sentinel_like(40, F32)
    # gradInput NCHW-tagged, column-major inside the storage, offset 10
    out = create_tensor([2, 3, 2, 2], DATA_TYPES[F32], [1, 2, 6, 12], 10, Format.NCHW, [40], storage)
    q = dict(with_format(p, Format.NCHW), gradInput=out)
    client.run(OP, **q)
    view = np.lib.stride_tricks.as_strided(storage[10:], (2, 3, 2, 2), (4, 8, 24, 48))
    assert_close(view.copy(), bn_reference(p)[0], "gradInput")
    assert (storage[:10] == -7.25).all() and (storage[34:] == -7.25).all()


def test_long_channel_meets_fp32_tolerance(client, rng):
    """Σg and Σg·x̂ over 100 000 elements per channel: fp64 accumulation, not one long fp32 sum."""
    p = bn_call(rng, (1000, 3, 100))
    p["gradOut"] = np.abs(p["gradOut"]) + 1.0  # same-sign terms make sequential fp32 error visible
    p["input"] = (p["input"] + 3.0).astype(F32)  # off-centre: large x̂ sums too
    client.run(OP, **p)
    check_against_reference(p)


def test_deterministic_bit_identical(client, rng):
    p = bn_call(rng, (64, 8, 300), dtype=BF16, params="float32")
    results = []
    for _ in range(3):
        client.run(OP, **p)
        results.append([p[n].tobytes() for n in BN_OUTPUTS])
    assert results[0] == results[1] == results[2]


def test_nan_and_inf_propagate(client, rng):
    p = bn_call(rng, (4, 3, 5))
    p["gradOut"][1, 2, 3] = np.nan
    client.run(OP, **p)
    assert np.isnan(p["gradInput"][:, 2]).all() and not np.isnan(p["gradInput"][:, :2]).any()
    assert np.isnan(p["gradBias"][2]) and not np.isnan(p["gradBias"][:2]).any()


def test_repeatable_executor_takes_new_bytes(client, rng):
    p = bn_call(rng, (4, 3, 5))
    _, executor = client.get_workspace_size(OP, **p)
    client.set_executor_repeatable(executor)
    for _ in range(2):
        client.execute(executor)
        check_against_reference(p)
    client.destroy_executor(executor)


# ---------------------------------------------------------------------------------------------
# SPEC 5.4: every row of the error table, in check order; a failed call writes nothing.


def fmt(*names: str, to: int):
    return lambda p: p.update({n: tagged(p[n], to) for n in names})


def both(*mutations):
    def apply(p):
        for m in mutations:
            m(p)

    return apply


ALL3 = ("gradOut", "input", "gradInput")
CASES = [
    # 1: gradOut, input null (training/eps: plain values, null is 161001 too)
    ("null-gradOut", set_(gradOut=None), NULL, "gradOut"),
    ("null-input", set_(input=None), NULL, "input"),
    ("null-order", set_(gradOut=None, input=None), NULL, "gradOut"),
    ("null-training", set_(training=None), NULL, "training"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("eps-wrong-type", set_(eps="small"), INVALID, "eps"),
    ("training-wrong-type", set_(training=1), INVALID, "training"),
    ("null-input-before-mask", set_(input=None, outputMask=None), NULL, "input"),
    # 2: outputMask null or empty is a null pointer
    ("null-outputMask", set_(outputMask=None), NULL, "outputMask"),
    ("empty-outputMask", set_(outputMask=[]), NULL, "outputMask"),
    ("null-mask-before-null-outputs", set_(outputMask=None, gradInput=None), NULL, "outputMask"),
    # 3: outputMask length, before the outputs' null checks
    ("mask-len-1", set_(outputMask=[True]), INVALID, "outputMask"),
    ("mask-len-2", set_(outputMask=[True, True]), INVALID, "outputMask"),
    ("mask-len-4", set_(outputMask=[True] * 4), INVALID, "outputMask"),
    ("mask-len-before-null-out", set_(outputMask=[True, True], gradWeight=None), INVALID, "outputMask"),
    # 4: enabled outputs must not be null
    ("null-gradInput", set_(gradInput=None), NULL, "gradInput"),
    ("null-gradWeight", set_(gradWeight=None), NULL, "gradWeight"),
    ("null-gradBias", set_(gradBias=None), NULL, "gradBias"),
    ("null-outputs-order", set_(gradWeight=None, gradBias=None), NULL, "gradWeight"),
    ("null-gradBias-before-dtype", both(set_(gradBias=None), cast("input", np.int32)), NULL, "gradBias"),
    # 5: gradOut, input, gradInput dtypes
    ("dtype-gradOut", cast("gradOut", np.float64), INVALID, "gradOut"),
    ("dtype-input", cast("input", np.int32), INVALID, "input"),
    ("dtype-gradInput", cast("gradInput", np.float64), INVALID, "gradInput"),
    ("input-ne-gradOut", cast("input", F16), INVALID, "input"),
    ("gradInput-ne-gradOut", cast("gradInput", BF16), INVALID, "gradInput"),
    ("float-set-before-equality", both(cast("input", F16), cast("gradInput", np.int32)), INVALID, "gradInput"),
    # 6: per-channel dtypes
    ("dtype-weight", cast("weight", np.float64), INVALID, "weight"),
    ("dtype-runningMean", cast("runningMean", np.int32), INVALID, "runningMean"),
    ("weight-f16-gradOut-f32", cast("weight", F16), INVALID, "weight"),
    ("saveMean-bf16-gradOut-f32", cast("saveMean", BF16), INVALID, "saveMean"),
    ("dtype-saveInvstd", cast("saveInvstd", np.int8), INVALID, "saveInvstd"),
    ("dtype-runningVar", cast("runningVar", np.float64), INVALID, "runningVar"),
    ("input-before-per-channel", both(cast("input", F16), cast("weight", np.float64)), INVALID, "input"),
    # 7: gradWeight/gradBias dtypes
    ("dtype-gradWeight", cast("gradWeight", F16), INVALID, "gradWeight"),
    ("dtype-gradBias", cast("gradBias", np.int32), INVALID, "gradBias"),
    ("per-channel-before-grads", both(cast("saveMean", F16), cast("gradBias", F16)), INVALID, "saveMean"),
    # 8: formats
    ("private-gradOut", fmt("gradOut", to=Format.NC1HWC0), INVALID, "gradOut"),
    ("private-input", fmt("input", to=Format.FRACTAL_Z), INVALID, "input"),
    ("private-weight", fmt("weight", to=Format.FRACTAL_NZ), INVALID, "weight"),
    ("private-saveInvstd", fmt("saveInvstd", to=Format.NDC1HWC0), INVALID, "saveInvstd"),
    ("private-gradInput", fmt("gradInput", to=Format.NC1HWC0_C04), INVALID, "gradInput"),
    ("private-gradBias", fmt("gradBias", to=Format.FRACTAL_Z_3D), INVALID, "gradBias"),
    ("input-format-ne-gradOut", fmt("input", to=Format.NCL), INVALID, "input"),
    ("gradInput-format-ne-gradOut", fmt("gradInput", to=Format.NCL), INVALID, "gradInput"),
    ("nhwc-not-4d", fmt(*ALL3, to=Format.NHWC), INVALID, "gradOut"),
    ("ndhwc-not-5d", fmt(*ALL3, to=Format.NDHWC), INVALID, "gradOut"),
    (
        "private-before-format-mismatch",
        both(fmt("weight", to=Format.FRACTAL_NZ), fmt("input", to=Format.NCL)),
        INVALID,
        "weight",
    ),
    ("format-before-shape", both(reshape("input", (4, 3, 6)), fmt(*ALL3, to=Format.NHWC)), INVALID, "gradOut"),
    # 9: ranks and shapes of gradOut, input, gradInput
    ("rank1-all", both(*(reshape(n, (5,)) for n in ALL3)), INVALID, "gradOut"),
    ("rank1-input", reshape("input", (60,)), INVALID, "input"),
    ("rank1-gradInput", reshape("gradInput", (60,)), INVALID, "gradInput"),
    ("input-shape", reshape("input", (4, 3, 6)), INVALID, "input"),
    ("gradInput-shape", reshape("gradInput", (4, 5, 3)), INVALID, "gradInput"),
    ("shape-before-per-channel", both(reshape("input", (4, 3, 6)), reshape("weight", (4,))), INVALID, "input"),
    # 10: per-channel shapes [C]
    ("weight-shape", reshape("weight", (4,)), INVALID, "weight"),
    ("runningMean-shape", reshape("runningMean", (3, 1)), INVALID, "runningMean"),
    ("runningVar-shape", reshape("runningVar", (1, 3)), INVALID, "runningVar"),
    ("saveMean-empty-in-training", reshape("saveMean", (0,)), INVALID, "saveMean"),
    ("saveInvstd-shape", reshape("saveInvstd", (2,)), INVALID, "saveInvstd"),
    ("gradWeight-shape", reshape("gradWeight", (3, 1)), INVALID, "gradWeight"),
    ("gradBias-shape", reshape("gradBias", (5,)), INVALID, "gradBias"),
    ("per-channel-order", both(reshape("gradBias", (5,)), reshape("runningVar", (5,))), INVALID, "runningVar"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table(client, rng, mutate, code, param):
    p = bn_call(rng, (4, 3, 5))
    mutate(p)
    untouched = Untouched(*(p[n] for n in BN_OUTPUTS))
    with pytest.raises(AclnnError) as info:
        client.get_workspace_size(OP, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (code, param), str(info.value)
    untouched.check()


@pytest.mark.parametrize(
    "mutate,param",
    [
        (set_(saveMean=np.zeros(4, F32)), "saveMean"),  # [0] is the only other length allowed
        (both(cast("gradOut", F16), cast("input", F16), cast("gradInput", F16), cast("runningVar", F16)), "runningVar"),
        (both(*(cast(n, F16) for n in ("gradOut", "input", "gradInput", "saveInvstd"))), "saveInvstd"),
        (
            both(*(cast(n, BF16) for n in ("gradOut", "input", "gradInput", "weight")), cast("gradWeight", F16)),
            "gradWeight",
        ),
        (
            both(*(cast(n, F16) for n in ("gradOut", "input", "gradInput")), set_(weight=None), cast("gradBias", BF16)),
            "gradBias",
        ),
    ],
    ids=[
        "inference-saveMean-len",
        "runningVar-ne-runningMean",
        "saveInvstd-ne-saveMean",
        "gradWeight-vs-weight",
        "gradBias-vs-gradOut",
    ],
)
def test_dtype_and_shape_relations(client, rng, mutate, param):
    p = bn_call(rng, (4, 3, 5), training=False)
    mutate(p)
    untouched = Untouched(*(p[n] for n in BN_OUTPUTS))
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, param), str(info.value)
    untouched.check()


def test_plain_tags_on_per_channel_tensors_are_accepted(client, rng):
    p = bn_call(rng, (4, 3, 5))
    q = dict(p, weight=tagged(p["weight"], Format.NCHW), gradWeight=tagged(p["gradWeight"], Format.NHWC))
    client.run(OP, **q)
    check_against_reference(p)


def test_unknown_parameter_is_invalid_never_null(client, rng):
    p = bn_call(rng)
    p["weightOptional"] = None  # LayerNorm's name; BatchNorm's is weight
    with pytest.raises(AclnnError) as info:
        client.run(OP, **p)
    assert (info.value.code, info.value.param) == (INVALID, "weightOptional")
