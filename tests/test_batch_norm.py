"""aclnnBatchNorm (training and inference) against PyTorch float64, through gRPC and LocalClient;
the running statistics updated in place; the error table in CANN's check order (nothing written)."""

from __future__ import annotations

import numpy as np
import pytest
from batch_norm_cases import DATA_TYPES, F16, F32, tagged
from batch_norm_forward_cases import (
    OP,
    RUNNING,
    SAVED,
    WRITTEN,
    check,
    forward_call,
    forward_reference,
    run_checked,
    snapshot,
    with_format,
)
from oracle import BF16, FLOAT_DTYPES, assert_close, cast, expect_error, reshape, retag, sentinel_like, set_

from aclnn_client import Format, create_tensor

NULL, INVALID = 161001, 161002
MODES = pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])

# (id, format, shape, channel axis): channel last for NHWC/NDHWC, axis 1 for every other plain tag;
# a 5-D tensor must be NCDHW or NDHWC (CANN's CheckFormat).
FORMATS = [
    ("NC", Format.NC, (7, 3), 1),
    ("ND-2d", Format.ND, (5, 4), 1),
    ("NCL", Format.NCL, (3, 4, 5), 1),
    ("NCHW", Format.NCHW, (2, 3, 4, 5), 1),
    ("ND-4d", Format.ND, (2, 3, 4, 5), 1),
    ("HWCN", Format.HWCN, (4, 3, 2, 5), 1),
    ("NHWC", Format.NHWC, (2, 4, 5, 3), 3),
    ("NCDHW", Format.NCDHW, (2, 3, 2, 3, 4), 1),
    ("NDHWC", Format.NDHWC, (2, 2, 3, 4, 3), 4),
    ("ND-6d", Format.ND, (2, 3, 2, 2, 3, 2), 1),
    ("NCHW-7d", Format.NCHW, (2, 3, 2, 1, 2, 3, 2), 1),
    ("ND-8d", Format.ND, (2, 3, 1, 2, 2, 1, 2, 2), 1),
]


@MODES
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (6, 2), (2, 5, 7), (1, 2, 1, 2, 1, 3, 1, 2)], ids=str)
def test_matches_native_batch_norm(client, rng, shape, dtype, training):
    p = forward_call(rng, shape, dtype=dtype, training=training)
    ref, before = forward_reference(p), snapshot(p)
    workspace_size, executor = client.get_workspace_size(OP, **p)
    assert workspace_size >= 0
    client.execute(executor)
    check(p, ref, before)


@MODES
@pytest.mark.parametrize("fmt,shape,axis", [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_every_format(client, rng, fmt, shape, axis, training):
    p = forward_call(rng, shape, axis, training=training)
    run_checked(client, p, axis, with_format(p, fmt))


@MODES
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_mixed_precision(client, rng, dtype, training):
    """Each dtype is checked on its own (CANN's code): fp16/bf16 data with FLOAT parameters, running
    and saved statistics, as autocast runs BatchNorm; and a FLOAT output of fp16/bf16 data."""
    p = forward_call(rng, (6, 4, 10), dtype=dtype, training=training, params=F32)
    run_checked(client, p)
    q = forward_call(rng, (6, 4, 10), dtype=dtype, training=training, params=F32, saved=BF16, out_dtype=F32)
    run_checked(client, q)
    r = forward_call(rng, (6, 4, 10), dtype=F32, training=training, params=F16, saved=F16, out_dtype=BF16)
    run_checked(client, r)


@MODES
@pytest.mark.parametrize("nulls", [("weight", "bias"), RUNNING, ("runningMean",), ("runningVar", "weight")], ids=str)
def test_null_optionals(client, rng, nulls, training):
    """Null weight/bias are ones/zeros; in training a null running statistic is simply not updated
    (each one given is), in inference it is its default (mean 0, variance 1)."""
    p = forward_call(rng, (5, 3, 4), training=training)
    p.update(dict.fromkeys(nulls))
    run_checked(client, p)


@pytest.mark.parametrize("momentum", [0.0, 1.0, 0.3, -0.5])
def test_momentum(client, rng, momentum):
    """0 keeps the running statistics, 1 replaces them by the batch's (unbiased variance)."""
    p = forward_call(rng, (5, 3, 4), momentum=momentum)
    run_checked(client, p)
    if momentum == 0.0:
        q = forward_call(np.random.default_rng(1), (5, 3, 4))
        p_before = {n: p[n].copy() for n in RUNNING}
        run_checked(client, dict(p, input=q["input"]))
        assert all((p[n] == p_before[n]).all() for n in RUNNING)


def test_running_variance_is_unbiased(client, rng):
    """momentum 1: runningVar is exactly the batch's n/(n − 1) variance, saveInvstd the population one's."""
    p = forward_call(rng, (3, 2, 4), momentum=1.0)
    client.run(OP, **p)
    x = p["input"].astype(np.float64)
    var = x.var(axis=(0, 2), ddof=1)
    assert_close(p["runningVar"], var, "runningVar")
    assert_close(p["saveInvstd"], 1 / np.sqrt(x.var(axis=(0, 2)) + p["eps"]), "saveInvstd")


def test_inference_writes_only_output(client, rng):
    """In inference saveMean/saveInvstd may be null, or of any shape and dtype: never read, checked
    or written; the running statistics are only read."""
    p = forward_call(rng, (4, 3, 5), training=False)
    run_checked(client, p)
    q = forward_call(rng, (4, 3, 5), training=False)
    q.update(saveMean=None, saveInvstd=None)
    run_checked(client, q)
    r = forward_call(rng, (4, 3, 5), training=False)
    r.update(saveMean=sentinel_like((7, 2), np.int32), saveInvstd=sentinel_like((), np.float64))
    run_checked(client, r)


def test_single_value_per_channel(client, rng):
    """n = 1: the variance is 0 (output = bias), invstd 1/√eps; the unbiased variance 0/0 is NaN, as in PyTorch."""
    p = forward_call(rng, (1, 3))
    ref = forward_reference(p)
    client.run(OP, **p)
    assert np.isnan(ref.pop("runningVar")).all() and np.isnan(p["runningVar"]).all()
    for name, value in ref.items():
        assert_close(p[name], value, name)


@MODES
@pytest.mark.parametrize("shape,axis", [((0, 3, 4), 1), ((2, 0, 4), 1), ((3, 4, 0), 1), ((2, 0, 3, 4), 3)], ids=str)
def test_empty_input(client, rng, shape, axis, training):
    """CANN's code, before any other check: success, saveMean 0 and saveInvstd NaN (whenever given),
    nothing else written (the running statistics stay)."""
    p = forward_call(rng, shape, axis, training=training)
    before = snapshot(p)
    client.run(OP, **(with_format(p, Format.NHWC) if axis == 3 else p))
    assert (p["saveMean"] == 0).all() and np.isnan(p["saveInvstd"]).all()
    for name in RUNNING:
        assert p[name].tobytes() == before[name]


def test_empty_input_skips_every_other_check(client, rng):
    """An empty input returns before the dtype, format and shape checks (CANN's code): an output of
    another shape and format, a weight of another dtype and shape are accepted, and not written."""
    p = forward_call(rng, (0, 3, 4))
    p.update(
        output=sentinel_like((5, 2), F32),
        weight=np.ones(7, np.int32),
        runningVar=np.ones((2, 2), np.float64),
        saveMean=sentinel_like((1, 4), F16),
        saveInvstd=None,
        training=False,
    )
    before = snapshot(p)
    client.run(OP, **dict(p, input=tagged(np.zeros((0, 3, 4), F32), Format.NC1HWC0)))
    assert (p["saveMean"] == 0).all()
    for name in ("output", "runningVar"):
        assert p[name].tobytes() == before[name]


def test_strided_views(client, rng):
    """Transposed and broadcast inputs, strided per-channel tensors and running statistics (in/out),
    outputs inside larger buffers: only the views' elements change."""
    base = forward_call(rng, (6, 4, 5), params=F32)
    x_t = np.ascontiguousarray(base["input"].transpose(2, 1, 0)).transpose(2, 1, 0)
    w_big = np.repeat(base["weight"], 2)
    out_big, mean_big = sentinel_like((6, 4, 10), F32), sentinel_like((8,), F32)
    rv_big = np.zeros(12, F32)
    rv_big[::3] = base["runningVar"]
    p = dict(
        base,
        input=x_t,
        weight=w_big[::2],
        bias=np.broadcast_to(np.float32(0.5), (4,)),
        runningVar=rv_big[::3],
        output=out_big[:, :, ::2],
        saveMean=mean_big[1::2],
    )
    run_checked(client, p)
    assert (out_big[:, :, 1::2] == -7.25).all() and (mean_big[::2] == -7.25).all()
    assert (rv_big.reshape(4, 3)[:, 1:] == 0).all()


@MODES
def test_channel_last_view_over_channel_first_storage(client, rng, training):
    """An NHWC-tagged view whose strides walk NCHW memory: the dims around C do not merge."""
    p = forward_call(rng, (2, 3, 4, 5), 3, training=training)
    storage = np.ascontiguousarray(p["input"].transpose(0, 3, 1, 2))  # physically N, C, H, W
    view = create_tensor((2, 3, 4, 5), DATA_TYPES[F32], [60, 4, 1, 12], 0, Format.NHWC, [120], storage.reshape(-1))
    run_checked(client, p, 3, dict(p, input=view, output=tagged(p["output"], Format.NHWC)))


def test_large_mean_small_spread(client, rng):
    """Two passes: the variance of values near 1000 with spread 1e-2 survives fp32."""
    p = forward_call(rng, (64, 2, 33))
    p["input"] = (1000 + rng.uniform(-1e-2, 1e-2, (64, 2, 33))).astype(F32)
    run_checked(client, p)


@pytest.mark.parametrize("fmt", [Format.NCL, Format.NHWC], ids=["NCL", "NHWC"])
def test_first_row_far_from_the_mean(client, rng, fmt):
    """Each channel's first row is an outlier, 64 standard deviations from the mean: a kernel that
    shifts its sums by the first row (the cpu backend) must take its second pass around the mean."""
    shape, axis = ((4096, 2, 4), 1) if fmt == Format.NCL else ((4096, 2, 2, 2), 3)
    p = forward_call(rng, shape, axis)
    x = 1000 + rng.uniform(-1e-2, 1e-2, shape)
    x[0] += 50.0
    p["input"] = x.astype(F32)
    run_checked(client, p, axis, with_format(p, fmt))


def test_long_channels(client, rng):
    """100 000 values per channel: fp64 sums, fp32 tolerance."""
    p = forward_call(rng, (1000, 3, 100))
    run_checked(client, p)


def test_executor_reads_running_statistics_when_executed(client, rng):
    """A repeatable executor: each run reads the current input and running statistics, then updates them."""
    p = forward_call(rng, (4, 3, 5))
    _, executor = client.get_workspace_size(OP, **p)
    client.set_executor_repeatable(executor)
    for i in range(2):
        p["input"][...] = forward_call(np.random.default_rng(i), (4, 3, 5))["input"]
        ref, before = forward_reference(p), snapshot(p)
        client.execute(executor)
        check(p, ref, before)
    client.destroy_executor(executor)


def test_deterministic_bit_identical(client, rng):
    p = forward_call(rng, (64, 8, 300), dtype=BF16, params=F32)
    results = []
    for _ in range(3):
        q = dict(p, runningMean=p["runningMean"].copy(), runningVar=p["runningVar"].copy())
        client.run(OP, **q)
        results.append([q[n].tobytes() for n in WRITTEN])
    assert results[0] == results[1] == results[2]


def test_nan_propagates_within_its_channel(client, rng):
    p = forward_call(rng, (4, 3, 5))
    p["input"][1, 2, 3] = np.nan
    client.run(OP, **p)
    assert np.isnan(p["output"][:, 2]).all() and not np.isnan(p["output"][:, :2]).any()
    assert np.isnan(p["saveMean"][2]) and np.isnan(p["runningVar"][2]) and not np.isnan(p["runningVar"][:2]).any()


def test_running_statistics_are_listed_as_inout(server_address):
    from aclnn_client import Client

    with Client(server_address) as c:
        params = {p["name"]: p for p in c.list_operators()[OP]}
    assert all(params[n]["inout"] and not params[n]["output"] for n in RUNNING)
    assert all(params[n]["output"] and params[n]["optional"] for n in SAVED)


# ---------------------------------------------------------------------------------------------
# The error table, row by row in CANN's order; a failed call writes nothing (running statistics too).


def fmt(*names: str, to: int):
    return lambda p: p.update({n: retag(p[n], to) for n in names})


def both(*mutations):
    def apply(p):
        for m in mutations:
            m(p)

    return apply


IO = ("input", "output")


def io(shape: tuple[int, ...], to: int | None = None):
    """input and output of another shape (zeros), tagged `to` when given."""

    def apply(p):
        p.update(input=np.zeros(shape, F32), output=np.zeros(shape, F32))
        if to is not None:
            fmt(*IO, to=to)(p)

    return apply


CASES = [
    # 1: nulls (input, output, the plain values, then the saved statistics in training)
    ("null-input", set_(input=None), NULL, "input"),
    ("null-output", set_(output=None), NULL, "output"),
    ("null-input-first", set_(input=None, output=None), NULL, "input"),
    ("null-training", set_(training=None), NULL, "training"),
    ("null-momentum", set_(momentum=None), NULL, "momentum"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("null-saveMean", set_(saveMean=None), NULL, "saveMean"),
    ("null-saveInvstd", set_(saveInvstd=None), NULL, "saveInvstd"),
    ("null-before-kind", set_(eps=None, momentum="x"), NULL, "eps"),
    ("training-kind", set_(training=1, saveMean=None), INVALID, "training"),
    ("momentum-kind", set_(momentum=True), INVALID, "momentum"),
    ("eps-kind", set_(eps=[1.0]), INVALID, "eps"),
    # 3: input, output, saved statistics' dtypes
    ("dtype-input", cast("input", np.float64), INVALID, "input"),
    ("dtype-output", cast("output", np.int32), INVALID, "output"),
    ("dtype-saveMean", cast("saveMean", np.float64), INVALID, "saveMean"),
    ("dtype-saveInvstd", cast("saveInvstd", np.int32), INVALID, "saveInvstd"),
    ("dtype-before-format", both(cast("output", np.int32), fmt("output", to=Format.NCL)), INVALID, "output"),
    # 4: the per-channel tensors' dtypes
    ("dtype-weight", cast("weight", np.int32), INVALID, "weight"),
    ("dtype-bias", cast("bias", np.float64), INVALID, "bias"),
    ("dtype-runningMean", cast("runningMean", np.float64), INVALID, "runningMean"),
    ("dtype-runningVar", cast("runningVar", np.int32), INVALID, "runningVar"),
    ("dtype-saved-first", both(cast("weight", np.int32), cast("saveMean", np.int32)), INVALID, "saveMean"),
    # 5: formats
    ("output-format", fmt("output", to=Format.NCL), INVALID, "output"),
    ("5d-nd", io((2, 3, 2, 2, 2)), INVALID, "input"),
    ("5d-ncl", io((2, 3, 2, 2, 2), Format.NCL), INVALID, "input"),
    ("5d-output", both(reshape("output", (4, 3, 5, 2, 1)), fmt(*IO, to=Format.NCHW)), INVALID, "output"),
    ("private-input", fmt(*IO, to=Format.NC1HWC0), INVALID, "input"),
    ("nhwc-not-4d", io((4, 3, 5), Format.NHWC), INVALID, "input"),
    ("ndhwc-not-5d", fmt(*IO, to=Format.NDHWC), INVALID, "input"),
    ("private-weight", fmt("weight", to=Format.FRACTAL_NZ), INVALID, "weight"),
    ("private-runningVar", fmt("runningVar", to=Format.NC1HWC0), INVALID, "runningVar"),
    ("private-saveInvstd", fmt("saveInvstd", to=Format.FRACTAL_Z), INVALID, "saveInvstd"),
    ("format-before-shape", both(reshape("output", (4, 3, 5)), fmt("output", to=Format.NCL)), INVALID, "output"),
    # 6: ranks and the output's shape
    ("rank-1", io((12,)), INVALID, "input"),
    ("output-rank-1", reshape("output", (120,)), INVALID, "output"),
    ("output-shape", reshape("output", (4, 3, 5, 3)), INVALID, "output"),
    # 7: the per-channel tensors' shapes: [C]
    ("weight-shape", reshape("weight", (4,)), INVALID, "weight"),
    ("bias-rank-2", reshape("bias", (3, 1)), INVALID, "bias"),
    ("runningMean-shape", reshape("runningMean", (2,)), INVALID, "runningMean"),
    ("runningVar-rank-0", reshape("runningVar", ()), INVALID, "runningVar"),
    ("nhwc-channel", fmt(*IO, to=Format.NHWC), INVALID, "weight"),  # C is dim 3 (2) for NHWC
    # 8: training: the saved statistics' shapes
    ("saveMean-shape", reshape("saveMean", (4,)), INVALID, "saveMean"),
    ("saveInvstd-rank-2", reshape("saveInvstd", (3, 1)), INVALID, "saveInvstd"),
    ("per-channel-first", both(reshape("saveMean", (4,)), reshape("runningVar", (4,))), INVALID, "runningVar"),
    # descriptor checks: an in/out tensor is written, so its view may not overlap itself
    ("running-overlap", lambda p: p.update(runningMean=np.broadcast_to(F32.type(1), (3,))), INVALID, "runningMean"),
    # empty input: only the null checks, and the saved statistics it fills must hold floats (this service)
    ("empty-null-output", both(reshape("input", (0, 3)), set_(output=None)), NULL, "output"),
    ("empty-saveMean-int", both(reshape("input", (0, 3)), cast("saveMean", np.int32)), INVALID, "saveMean"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table(client, rng, mutate, code, param):
    p = forward_call(rng, (4, 3, 5, 2))
    mutate(p)
    expect_error(client, OP, p, WRITTEN, code, param)


EVAL_CASES = [
    ("eval-null-input", set_(input=None), NULL, "input"),
    ("eval-dtype-runningVar", cast("runningVar", np.float64), INVALID, "runningVar"),
    ("eval-5d-nd", io((2, 3, 2, 2, 2)), INVALID, "input"),
    ("eval-runningMean-shape", reshape("runningMean", (4,)), INVALID, "runningMean"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in EVAL_CASES], ids=[c[0] for c in EVAL_CASES])
def test_eval_error_table(client, rng, mutate, code, param):
    """Inference checks the same rows; the saved statistics are neither required nor checked."""
    p = forward_call(rng, (4, 3, 5, 2), training=False)
    p.update(saveMean=None, saveInvstd=np.zeros(9, np.int64))
    mutate(p)
    expect_error(client, OP, p, WRITTEN, code, param)
