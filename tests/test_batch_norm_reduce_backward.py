"""aclnnBatchNormReduceBackward against its documented formula in float64, and, followed by
aclnnBatchNormElemtBackward, against PyTorch's native_batch_norm_backward in training (float64), on one
device and across two; through gRPC and LocalClient; error table (nothing written on failure)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from batch_norm_cases import tagged
from oracle import BF16, FLOAT_DTYPES, assert_close, cast, expect_error, reshape, retag, sentinel_like, set_, t64
from sync_batch_norm_cases import F32, REDUCE_FLAGS, REDUCE_OUTPUTS, channel_stats, reduce_call, reduce_reference

from aclnn_client import Format

OP, ELEMT_BACKWARD = "aclnnBatchNormReduceBackward", "aclnnBatchNormElemtBackward"
NULL, INVALID = 161001, 161002
F16 = np.dtype(np.float16)
FLAGS = list(itertools.product([True, False], repeat=3))


def check(p: dict) -> None:
    """Every enabled output matches the formula."""
    for name, ref in reduce_reference(p).items():
        if p[REDUCE_FLAGS[name]]:
            assert_close(p[name], ref, name)


SHAPES = [(6, 3), (4, 3, 5), (2, 3, 4, 5), (2, 3, 2, 3, 2), (1, 2, 2, 1, 2, 3, 2), (2, 2, 1, 2, 1, 2, 2, 2)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_matches_formula(client, rng, shape, dtype):
    p = reduce_call(rng, shape, dtype)
    workspace_size, executor = client.get_workspace_size(OP, **p)
    assert workspace_size >= 0
    client.execute(executor)
    check(p)


@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_flags_gate_the_outputs(client, rng, flags):
    """All 8 flag combinations: a disabled output may be null, or of any dtype and shape: it is
    neither validated nor written; the enabled ones match the formula."""
    p = reduce_call(rng, (5, 3, 6), flags=flags)
    bogus = {}
    for name, flag in REDUCE_FLAGS.items():
        if not p[flag] and name != "sumDyXmu":  # sumDyXmu stays null
            p[name] = bogus[name] = sentinel_like((7, 2), np.int32)
    client.run(OP, **p)
    check(p)
    assert all((b == -7).all() for b in bogus.values())


def test_disabled_output_may_be_malformed(client, rng):
    """Even a descriptor that would be refused (a view writing one element twice) is ignored when off."""
    p = reduce_call(rng, (4, 3, 5), flags=(False, True, True))
    p["sumDy"] = np.broadcast_to(np.float32(1), (3,))
    p["sumDyXmu"] = retag(np.zeros(3, F32), Format.NC1HWC0)
    client.run(OP, **p)
    check(p)


@pytest.mark.parametrize(
    "dtypes",
    [
        {"mean": BF16, "invstd": F16, "sumDy": F16, "sumDyXmu": BF16, "gradWeight": F32, "gradBias": BF16},
        {"mean": F16, "invstd": BF16, "weight": F32, "sumDy": F32, "gradWeight": F16},
        {"mean": F32, "invstd": F32, "weight": BF16, "sumDyXmu": F16, "gradBias": F16},
    ],
    ids=["all-different", "f16-stats", "f32-stats"],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_each_dtype_on_its_own(client, rng, dtype, dtypes):
    """CANN's code ties only gradOut's dtype to input's; statistics and outputs each take any float."""
    p = reduce_call(rng, (4, 3, 6), dtype, dtypes=dtypes)
    client.run(OP, **p)
    check(p)


def test_weight_is_not_read(client, rng):
    """Null, of another dtype or shape: CANN's code neither checks nor reads weight."""
    p = reduce_call(rng, (4, 3, 5))
    for weight in (None, np.arange(7, dtype=np.int32), rand_like_f16(rng)):
        q = dict(p, weight=weight, **{n: sentinel_like((3,), F32) for n in REDUCE_OUTPUTS})
        client.run(OP, **q)
        check(q)


def rand_like_f16(rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(0.5, 1.5, (2, 3)).astype(F16)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 3, 0), (0, 3)], ids=str)
@pytest.mark.parametrize("flags", [(True, True, True), (False, True, False), (True, False, True)], ids=str)
def test_empty_input_zero_fills_the_enabled_outputs(client, rng, shape, flags):
    p = reduce_call(rng, shape, flags=flags)
    client.run(OP, **p)
    for name, flag in REDUCE_FLAGS.items():
        if p[flag]:
            assert (p[name] == 0).all(), name


def test_channel_is_dim_1_whatever_the_format_tag(client, rng):
    """An NHWC tag on gradOut and input does not move the channel (unlike aclnnBatchNormBackward)."""
    p = reduce_call(rng, (2, 3, 4, 5))
    client.run(OP, **dict(p, gradOut=tagged(p["gradOut"], Format.NHWC), input=tagged(p["input"], Format.NHWC)))
    check(p)


def test_strided_views(client, rng):
    p = reduce_call(rng, (5, 4, 6))
    big = sentinel_like((4, 3), F32)
    p.update(
        input=np.ascontiguousarray(p["input"].transpose(2, 1, 0)).transpose(2, 1, 0),
        gradOut=np.asfortranarray(p["gradOut"]),
        mean=np.broadcast_to(np.float32(0.75), (4,)),
        invstd=np.ascontiguousarray(np.stack([p["invstd"]] * 2, axis=1))[:, 1],
        sumDy=big[:, 0],
        gradWeight=big[:, 2],
    )
    client.run(OP, **p)
    check(p)
    assert (big[:, 1] == -7.25).all()


def test_centred_sum_survives_a_large_mean(client, rng):
    """Σg·(x − mean) of values around 1000 with spread 1e-2: no cancellation (CANN's Σg·x − mean·Σg
    would lose it in fp32)."""
    p = reduce_call(rng, (64, 2, 33))
    p["input"] = (1000 + rng.uniform(-1e-2, 1e-2, (64, 2, 33))).astype(F32)
    p["mean"] = channel_stats(p["input"])[0].astype(F32)
    client.run(OP, **p)
    check(p)


# followed by aclnnBatchNormElemtBackward: SyncBatchNorm's backward ----------------------------------


def native_backward(x: np.ndarray, g: np.ndarray, weight: np.ndarray | None, mean, invstd) -> tuple:
    """native_batch_norm_backward in training, float64 (rank > 5 as [N, C, -1])."""
    x64, g64 = t64(x), t64(g)
    if x64.dim() > 5:
        x64, g64 = x64.reshape(x.shape[0], x.shape[1], -1), g64.reshape(x.shape[0], x.shape[1], -1)
    c = x.shape[1]
    gi, gw, gb = torch.ops.aten.native_batch_norm_backward(
        g64,
        x64,
        t64(weight),
        torch.zeros(c, dtype=torch.float64),
        torch.ones(c, dtype=torch.float64),
        t64(mean),
        t64(invstd),
        True,
        1e-5,
        [True, True, True],
    )
    return gi.reshape(x.shape), gw, gb


def batch_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FLOAT mean and invstd of the batch, as aclnnBatchNormStats/GatherStatsWithCounts hand them over."""
    mean, var = channel_stats(x)
    return mean.astype(F32), (1.0 / np.sqrt(var + 1e-5)).astype(F32)


def elemt_backward(client, p: dict, sums: tuple[np.ndarray, np.ndarray], counter: np.ndarray, dtype) -> np.ndarray:
    grad_input = sentinel_like(p["input"].shape, dtype)
    client.run(
        ELEMT_BACKWARD,
        gradOut=p["gradOut"],
        input=p["input"],
        mean=p["mean"],
        invstd=p["invstd"],
        weight=p["weight"],
        sumDy=sums[0],
        sumDyXmu=sums[1],
        counter=counter,
        gradInput=grad_input,
    )
    return grad_input


@pytest.mark.parametrize("weight", [True, False], ids=["weight", "null-weight"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5), (2, 4, 3, 3), (2, 3, 2, 2, 2, 2)], ids=lambda s: f"{len(s)}d")
def test_with_elemt_backward_equals_native_batch_norm_backward(client, rng, shape, dtype, weight):
    """Reduce, then ElemtBackward with total = n: BatchNorm's training gradients (weight in FLOAT,
    statistics of the batch in FLOAT, as SyncBatchNorm hands them over)."""
    p = reduce_call(rng, shape, dtype, weight=weight, dtypes={"weight": F32})
    p["mean"], p["invstd"] = batch_statistics(p["input"])
    client.run(OP, **p)
    n = p["input"].size // shape[1]
    grad_input = elemt_backward(client, p, (p["sumDy"], p["sumDyXmu"]), np.array([n], np.int32), dtype)
    gi, gw, gb = native_backward(p["input"], p["gradOut"], p["weight"], p["mean"], p["invstd"])
    assert_close(grad_input, gi, "gradInput")
    assert_close(p["gradWeight"], gw, "gradWeight")
    assert_close(p["gradBias"], gb, "gradBias")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_across_two_devices_equals_the_whole_batch(client, rng, dtype):
    """SyncBatchNorm on two shares of a batch: each reduces its share, sumDy and sumDyXmu are summed
    (the all_reduce), each runs ElemtBackward with both counts; gradInput concatenated, gradWeight and
    gradBias summed, equal native_batch_norm_backward on the whole batch."""
    whole = reduce_call(rng, (7, 4, 3, 2), dtype, dtypes={"weight": F32})
    whole["mean"], whole["invstd"] = batch_statistics(whole["input"])
    outputs = {n: sentinel_like((4,), F32) for n in REDUCE_OUTPUTS}
    shares = [
        dict(
            whole,
            gradOut=whole["gradOut"][rows],
            input=whole["input"][rows],
            **{n: o.copy() for n, o in outputs.items()},
        )
        for rows in (slice(0, 3), slice(3, 7))
    ]
    for share in shares:
        client.run(OP, **share)
    sums = tuple(sum(s[name].astype(np.float64) for s in shares).astype(F32) for name in ("sumDy", "sumDyXmu"))
    counter = np.array([s["input"].size // 4 for s in shares], np.int32)
    grad_input = np.concatenate([elemt_backward(client, s, sums, counter, dtype) for s in shares])
    gi, gw, gb = native_backward(whole["input"], whole["gradOut"], whole["weight"], whole["mean"], whole["invstd"])
    assert_close(grad_input, gi, "gradInput")
    assert_close(sum(s["gradWeight"].astype(np.float64) for s in shares).astype(F32), gw, "gradWeight")
    assert_close(sum(s["gradBias"].astype(np.float64) for s in shares).astype(F32), gb, "gradBias")


# errors ---------------------------------------------------------------------------------------------


def both_private(fmt: int):
    """gradOut and input with the same private tag: the format-equality rule passes, the private one fails."""
    return lambda p: p.update(gradOut=retag(p["gradOut"], fmt), input=retag(p["input"], fmt))


CASES = [
    ("null-gradOut", set_(gradOut=None), NULL, "gradOut"),
    ("null-input", set_(input=None), NULL, "input"),
    ("null-mean", set_(mean=None), NULL, "mean"),
    ("null-invstd", set_(invstd=None), NULL, "invstd"),
    ("null-inputG", set_(inputG=None), NULL, "inputG"),
    ("null-weightG", set_(weightG=None), NULL, "weightG"),
    ("null-biasG", set_(biasG=None), NULL, "biasG"),
    ("inputG-kind", set_(inputG=1), INVALID, "inputG"),
    ("biasG-kind", set_(biasG=[True]), INVALID, "biasG"),
    ("null-sumDy", set_(sumDy=None), NULL, "sumDy"),
    ("null-sumDyXmu", set_(sumDyXmu=None), NULL, "sumDyXmu"),
    ("null-gradWeight", set_(gradWeight=None), NULL, "gradWeight"),
    ("null-gradBias", set_(gradBias=None), NULL, "gradBias"),
    ("null-inputs-before-outputs", set_(invstd=None, sumDy=None), NULL, "invstd"),
    ("null-outputs-in-order", set_(gradWeight=None, gradBias=None, sumDyXmu=None), NULL, "sumDyXmu"),
    ("dtype-gradOut", cast("gradOut", np.float64), INVALID, "gradOut"),
    ("dtype-input", cast("input", np.int32), INVALID, "input"),
    ("dtype-mean", cast("mean", np.float64), INVALID, "mean"),
    ("dtype-invstd", cast("invstd", np.int32), INVALID, "invstd"),
    ("dtype-gradOut-vs-input", cast("gradOut", F16), INVALID, "gradOut"),
    ("dtype-input-vs-gradOut", cast("input", BF16), INVALID, "gradOut"),
    ("dtype-sumDy", cast("sumDy", np.float64), INVALID, "sumDy"),
    ("dtype-sumDyXmu", cast("sumDyXmu", np.int32), INVALID, "sumDyXmu"),
    ("dtype-gradWeight", cast("gradWeight", np.int32), INVALID, "gradWeight"),
    ("dtype-gradBias", cast("gradBias", np.float64), INVALID, "gradBias"),
    (
        "dtype-before-format",
        lambda p: p.update(sumDy=p["sumDy"].astype(np.float64), gradOut=retag(p["gradOut"], Format.NCL)),
        INVALID,
        "sumDy",
    ),
    ("format-gradOut-vs-input", lambda p: p.update(gradOut=retag(p["gradOut"], Format.NCL)), INVALID, "gradOut"),
    ("format-input-vs-gradOut", lambda p: p.update(input=retag(p["input"], Format.NCHW)), INVALID, "gradOut"),
    ("private-gradOut-input", both_private(Format.NC1HWC0), INVALID, "gradOut"),
    ("private-mean", lambda p: p.update(mean=retag(p["mean"], Format.FRACTAL_NZ)), INVALID, "mean"),
    ("private-invstd", lambda p: p.update(invstd=retag(p["invstd"], Format.NC1HWC0)), INVALID, "invstd"),
    ("private-sumDyXmu", lambda p: p.update(sumDyXmu=retag(p["sumDyXmu"], Format.NC1HWC0)), INVALID, "sumDyXmu"),
    ("private-gradBias", lambda p: p.update(gradBias=retag(p["gradBias"], Format.FRACTAL_Z)), INVALID, "gradBias"),
    ("gradOut-rank-1", reshape("gradOut", (60,)), INVALID, "gradOut"),
    ("input-rank-1", reshape("input", (60,)), INVALID, "input"),
    ("both-rank-1", lambda p: p.update(gradOut=np.zeros(3, F32), input=np.zeros(3, F32)), INVALID, "gradOut"),
    ("gradOut-rank-9", reshape("gradOut", (4, 3, 5, 1, 1, 1, 1, 1, 1)), INVALID, "gradOut"),
    ("input-rank-9", reshape("input", (4, 3, 5, 1, 1, 1, 1, 1, 1)), INVALID, "input"),
    (
        "channel-zero",
        lambda p: p.update(gradOut=np.zeros((4, 0, 5), F32), input=np.zeros((4, 0, 5), F32)),
        INVALID,
        "input",
    ),
    ("sumDy-shape", reshape("sumDy", (4,)), INVALID, "sumDy"),
    ("sumDyXmu-rank-2", reshape("sumDyXmu", (3, 1)), INVALID, "sumDyXmu"),
    ("gradWeight-shape", reshape("gradWeight", (2,)), INVALID, "gradWeight"),
    ("gradBias-rank-0", reshape("gradBias", ()), INVALID, "gradBias"),
    ("gradOut-shape", reshape("gradOut", (4, 3, 6)), INVALID, "gradOut"),
    ("gradOut-broadcastable", reshape("gradOut", (1, 3, 5)), INVALID, "gradOut"),
    (
        "output-shape-before-gradOut-shape",
        lambda p: p.update(gradOut=np.zeros((4, 3, 6), F32), gradBias=np.zeros(2, F32)),
        INVALID,
        "gradBias",
    ),
    ("mean-shape", reshape("mean", (4,)), INVALID, "mean"),
    ("mean-rank-2", reshape("mean", (3, 1)), INVALID, "mean"),
    ("invstd-shape", reshape("invstd", (1,)), INVALID, "invstd"),
    ("invstd-rank-0", reshape("invstd", ()), INVALID, "invstd"),
    ("output-overlap", set_(gradWeight=np.broadcast_to(np.float32(0), (3,))), INVALID, "gradWeight"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table(client, rng, mutate, code, param):
    p = reduce_call(rng, (4, 3, 5))
    mutate(p)
    expect_error(client, OP, p, REDUCE_OUTPUTS, code, param)


def test_error_table_names_the_first_enabled_null_output(client, rng):
    """With inputG false, null sumDy and sumDyXmu are fine; a null gradBias is then the first."""
    p = reduce_call(rng, (4, 3, 5), flags=(False, True, True))
    p["gradBias"] = None
    expect_error(client, OP, p, REDUCE_OUTPUTS, NULL, "gradBias")


def test_listed_outputs(server_address):
    """ListOperators: the four outputs are outputs (not optional inputs); the flags are bools."""
    from aclnn_client import Client

    with Client(server_address) as c:
        params = {p["name"]: p for p in c.list_operators()[OP]}
    assert [n for n, p in params.items() if p["output"]] == list(REDUCE_OUTPUTS)
    assert {params[f]["kind"] for f in ("inputG", "weightG", "biasG")} == {"bool"}
