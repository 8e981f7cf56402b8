"""SyncBatchNorm's helpers against their documented formulas in float64, cross-checked by identities,
through gRPC and LocalClient; error tables (nothing written on failure)."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import BF16, FLOAT_DTYPES, assert_close, cast, expect_error, reshape, retag, sentinel_like, set_
from sync_batch_norm_cases import (
    F32,
    channel_stats,
    elemt_call,
    elemt_reference,
    gather_call,
    gather_reference,
    stats_call,
    stats_reference,
)

from aclnn_client import Format

STATS, GATHER = "aclnnBatchNormStats", "aclnnBatchNormGatherStatsWithCounts"
NULL, INVALID = 161001, 161002
F16 = np.dtype(np.float16)


# aclnnBatchNormStats ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (6, 2), (2, 5, 7), (1, 2, 1, 2, 1, 3, 1, 2)], ids=str)
def test_stats_match_the_formula(client, rng, shape, dtype):
    p = stats_call(rng, shape, dtype)
    workspace_size, executor = client.get_workspace_size(STATS, **p)
    assert workspace_size >= 0
    client.execute(executor)
    for name, ref in zip(("mean", "invstd"), stats_reference(p)):
        assert_close(p[name], ref, name)


def test_stats_channel_is_dim_1_whatever_the_format_tag(client, rng):
    """CANN reduces every axis but 1, also for an NHWC tag (unlike aclnnBatchNormBackward)."""
    p = stats_call(rng, (2, 3, 4, 5))
    client.run(STATS, **dict(p, input=retag(p["input"], Format.NHWC)))
    for name, ref in zip(("mean", "invstd"), stats_reference(p)):
        assert_close(p[name], ref, name)


def test_stats_large_mean_small_spread(client, rng):
    """Two passes: the variance of values around 1000 with spread 1e-2 survives fp32."""
    p = stats_call(rng, (64, 2, 33))
    p["input"] = (1000 + rng.uniform(-1e-2, 1e-2, (64, 2, 33))).astype(F32)
    client.run(STATS, **p)
    for name, ref in zip(("mean", "invstd"), stats_reference(p)):
        assert_close(p[name], ref, name)


def test_stats_empty_input(client, rng):
    """CANN's code: mean 0, invstd NaN."""
    p = stats_call(rng, (0, 3, 4))
    client.run(STATS, **p)
    assert (p["mean"] == 0).all() and np.isnan(p["invstd"]).all()


def test_stats_strided_views(client, rng):
    x = rng.uniform(-1, 1, (5, 4, 6)).astype(F32)
    big = sentinel_like((8,), F32)
    p = dict(
        stats_call(rng, (5, 4, 6)),
        input=np.ascontiguousarray(x.transpose(2, 1, 0)).transpose(2, 1, 0)[:, :, ::2],
        mean=big[::2],
        invstd=sentinel_like((4,), F32),
    )
    client.run(STATS, **p)
    for name, ref in zip(("mean", "invstd"), stats_reference(p)):
        assert_close(p[name], ref, name)
    assert (big[1::2] == -7.25).all()


STATS_CASES = [
    ("null-input", set_(input=None), NULL, "input"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("null-mean", set_(mean=None), NULL, "mean"),
    ("null-invstd", set_(invstd=None), NULL, "invstd"),
    ("eps-kind", set_(eps="x"), INVALID, "eps"),
    ("dtype-input", cast("input", np.float64), INVALID, "input"),
    ("dtype-mean", cast("mean", F16), INVALID, "mean"),
    ("dtype-invstd", cast("invstd", BF16), INVALID, "invstd"),
    ("private-input", lambda p: p.update(input=retag(p["input"], Format.NC1HWC0)), INVALID, "input"),
    ("private-mean", lambda p: p.update(mean=retag(p["mean"], Format.FRACTAL_NZ)), INVALID, "mean"),
    ("rank-1", reshape("input", (12,)), INVALID, "input"),
    ("rank-9", reshape("input", (1, 3, 1, 1, 1, 1, 1, 1, 1)), INVALID, "input"),
    ("mean-rank-2", reshape("mean", (3, 1)), INVALID, "mean"),
    ("invstd-rank-0", reshape("invstd", ()), INVALID, "invstd"),
    (
        "channel-zero",
        lambda p: p.update(input=np.zeros((4, 0, 2), F32), mean=np.zeros(0, F32), invstd=np.zeros(0, F32)),
        INVALID,
        "input",
    ),
    ("mean-shape", reshape("mean", (4,)), INVALID, "mean"),
    ("invstd-shape", reshape("invstd", (2,)), INVALID, "invstd"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in STATS_CASES], ids=[c[0] for c in STATS_CASES])
def test_stats_error_table(client, rng, mutate, code, param):
    p = stats_call(rng)
    mutate(p)
    expect_error(client, STATS, p, ("mean", "invstd"), code, param)


# aclnnBatchNormGatherStatsWithCounts ---------------------------------------------------------

GATHER_WRITTEN = ("meanAll", "invstdAll", "runningMean", "runningVar")


def check_gather(p: dict, ref: dict) -> None:
    for name, value in ref.items():
        assert_close(p[name], value, name)


@pytest.mark.parametrize("stats", ["same", "float32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gather_matches_the_formula(client, rng, dtype, stats):
    p = gather_call(rng, 5, 4, dtype, dtype if stats == "same" else F32)
    ref = gather_reference(p)
    client.run(GATHER, **p)
    check_gather(p, ref)


def test_gather_executor_updates_running_stats_in_place(client, rng):
    """runningMean/runningVar are read when executed and the new values land in the caller's arrays."""
    p = gather_call(rng, 3, 2)
    _, executor = client.get_workspace_size(GATHER, **p)
    p["runningMean"][...] = [1.0, 2.0, 3.0]  # read at execute, not at planning
    ref = gather_reference(p)
    client.execute(executor)
    check_gather(p, ref)


def test_gather_null_running_stats(client, rng):
    p = gather_call(rng, 4, 3, running=False)
    ref = gather_reference(p)
    client.run(GATHER, **p)
    check_gather(p, ref)
    q = gather_call(rng, 4, 3)
    q["runningMean"] = None  # each is updated when given (PyTorch), whatever the other
    ref = gather_reference(q)
    client.run(GATHER, **q)
    check_gather(q, ref)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gathered_device_statistics_equal_the_whole_batch(client, rng, dtype):
    """Stats on each part of a batch, gathered with counts = the statistics of the concatenated batch,
    and the running variance takes the unbiased variance (n/(n − 1)), as native_batch_norm does."""
    import torch

    parts = [rand_batch(rng, n, dtype) for n in (3, 5, 1)]
    means, invstds = [], []
    for x in parts:
        p = stats_call(rng, x.shape)
        p["input"] = x
        client.run(STATS, **p)
        means.append(p["mean"])
        invstds.append(p["invstd"])
    counts = np.array([x.shape[0] * x.shape[2] for x in parts], F32)
    g = gather_call(rng, 4, 3)
    g.update(
        mean=np.stack(means),
        invstd=np.stack(invstds),
        counts=counts,
        input=parts[0],
        runningMean=np.zeros(4, F32),
        runningVar=np.ones(4, F32),
        momentum=0.3,
    )
    g.update(meanAll=sentinel_like((4,), F32), invstdAll=sentinel_like((4,), F32))
    client.run(GATHER, **g)
    whole = np.concatenate(parts)
    mean, var = channel_stats(whole)
    assert_close(g["meanAll"], mean, "meanAll")
    assert_close(g["invstdAll"], 1.0 / np.sqrt(var + g["eps"]), "invstdAll")
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    torch.ops.aten.native_batch_norm(
        torch.from_numpy(whole.astype(np.float64)), None, None, rm, rv, True, 0.3, g["eps"]
    )
    assert_close(g["runningMean"], rm, "runningMean")
    assert_close(g["runningVar"], rv, "runningVar")


def rand_batch(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    return rng.uniform(-1, 3, (n, 4, 6)).astype(dtype)


def test_gather_empty_statistics(client, rng):
    """CANN's code: no devices gives meanAll 0 and invstdAll NaN; the running statistics stay."""
    p = gather_call(rng, 3, 2)
    p.update(mean=np.zeros((0, 3), F32), invstd=np.zeros((0, 3), F32), counts=np.zeros(0, F32))
    before = p["runningMean"].copy(), p["runningVar"].copy()
    client.run(GATHER, **p)
    assert (p["meanAll"] == 0).all() and np.isnan(p["invstdAll"]).all()
    assert (p["runningMean"] == before[0]).all() and (p["runningVar"] == before[1]).all()


def test_gather_strided_views(client, rng):
    p = gather_call(rng, 4, 3)
    big = sentinel_like((8,), F32)
    run_big = np.zeros(12, F32)
    run_big[::3] = p["runningMean"]
    p.update(
        mean=np.asfortranarray(p["mean"]),
        counts=np.broadcast_to(np.float32(7), (3,)),
        meanAll=big[::2],
        runningMean=run_big[::3],
    )
    ref = gather_reference(p)
    client.run(GATHER, **p)
    check_gather(p, ref)
    assert (big[1::2] == -7.25).all() and (run_big.reshape(4, 3)[:, 1:] == 0).all()


GATHER_CASES = [
    ("null-input", set_(input=None), NULL, "input"),
    ("null-mean", set_(mean=None), NULL, "mean"),
    ("null-invstd", set_(invstd=None), NULL, "invstd"),
    ("null-counts", set_(counts=None), NULL, "counts"),
    ("null-meanAll", set_(meanAll=None), NULL, "meanAll"),
    ("null-invstdAll", set_(invstdAll=None), NULL, "invstdAll"),
    ("null-momentum", set_(momentum=None), NULL, "momentum"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("momentum-kind", set_(momentum=True), INVALID, "momentum"),
    ("dtype-input", cast("input", np.float64), INVALID, "input"),
    ("dtype-invstd", cast("invstd", np.int32), INVALID, "invstd"),
    ("dtype-runningVar", cast("runningVar", np.float64), INVALID, "runningVar"),
    ("dtype-counts", cast("counts", np.int32), INVALID, "counts"),
    ("dtype-invstdAll", cast("invstdAll", np.float64), INVALID, "invstdAll"),
    ("private-counts", lambda p: p.update(counts=retag(p["counts"], Format.NC1HWC0)), INVALID, "counts"),
    (
        "private-runningMean",
        lambda p: p.update(runningMean=retag(p["runningMean"], Format.FRACTAL_NZ)),
        INVALID,
        "runningMean",
    ),
    ("input-rank-1", reshape("input", (5,)), INVALID, "input"),
    ("mean-rank-1", reshape("mean", (20,)), INVALID, "mean"),
    ("invstd-rank-3", reshape("invstd", (4, 5, 1)), INVALID, "invstd"),
    ("invstd-devices", reshape("invstd", (3, 5)), INVALID, "invstd"),
    ("counts-devices", reshape("counts", (5,)), INVALID, "counts"),
    ("counts-rank-0", reshape("counts", ()), INVALID, "counts"),
    ("mean-channels", lambda p: p.update(mean=np.zeros((4, 4), F32), invstd=np.zeros((4, 4), F32)), INVALID, "mean"),
    ("invstd-channels", reshape("invstd", (4, 6)), INVALID, "invstd"),
    ("runningMean-shape", reshape("runningMean", (5, 1)), INVALID, "runningMean"),
    ("runningVar-shape", reshape("runningVar", (4,)), INVALID, "runningVar"),
    ("counts-rank-2", reshape("counts", (4, 1)), INVALID, "counts"),
    ("meanAll-shape", reshape("meanAll", (1, 5)), INVALID, "meanAll"),
    ("invstdAll-shape", reshape("invstdAll", (6,)), INVALID, "invstdAll"),
    ("running-overlap", lambda p: p.update(runningMean=np.broadcast_to(F32.type(1), (5,))), INVALID, "runningMean"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in GATHER_CASES], ids=[c[0] for c in GATHER_CASES])
def test_gather_error_table(client, rng, mutate, code, param):
    p = gather_call(rng, 5, 4)
    mutate(p)
    expect_error(client, GATHER, p, GATHER_WRITTEN, code, param)


# aclnnBatchNormElemt ---------------------------------------------------------------------------

ELEMT = "aclnnBatchNormElemt"


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "null-weight-bias"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4, 5), (6, 2), (2, 3, 2, 2, 2, 1, 2)], ids=str)
def test_elemt_matches_native_batch_norm(client, rng, shape, dtype, affine):
    p = elemt_call(rng, shape, dtype, affine)
    workspace_size, executor = client.get_workspace_size(ELEMT, **p)
    assert workspace_size >= 0
    client.execute(executor)
    assert_close(p["output"], elemt_reference(p), "output")


def test_elemt_mixed_dtypes(client, rng):
    """CANN's code checks each dtype on its own (its document asks them equal): FLOAT statistics
    with BF16 data, as aclnnBatchNormGatherStatsWithCounts hands them over, are accepted."""
    p = elemt_call(rng, (4, 3, 6), BF16)
    p.update(mean=p["mean"].astype(F32), invstd=p["invstd"].astype(F32), weight=p["weight"].astype(F16))
    client.run(ELEMT, **p)
    assert_close(p["output"], elemt_reference(p), "output")


def test_elemt_normalizes_with_gathered_statistics(client, rng):
    """Stats per half, gathered, then Elemt on each half = training-mode native_batch_norm of the batch."""
    import torch

    x = rng.uniform(-1, 3, (6, 3, 4)).astype(F32)
    halves = (x[:2], x[2:])
    stats = []
    for h in halves:
        p = stats_call(rng, h.shape)
        p["input"] = h
        client.run(STATS, **p)
        stats.append(p)
    g = gather_call(rng, 3, 2, running=False)
    g.update(
        input=x,
        mean=np.stack([s["mean"] for s in stats]),
        invstd=np.stack([s["invstd"] for s in stats]),
        counts=np.array([8, 16], F32),
    )
    client.run(GATHER, **g)
    e = elemt_call(rng, (6, 3, 4))
    ref = torch.ops.aten.native_batch_norm(
        torch.from_numpy(x.astype(np.float64)),
        torch.from_numpy(e["weight"].astype(np.float64)),
        torch.from_numpy(e["bias"].astype(np.float64)),
        None,
        None,
        True,
        0.1,
        e["eps"],
    )[0]
    for h, out in zip(halves, (ref[:2], ref[2:])):
        q = dict(e, input=h, mean=g["meanAll"], invstd=g["invstdAll"], output=sentinel_like(h.shape, F32))
        client.run(ELEMT, **q)
        assert_close(q["output"], out, "output")


def test_elemt_empty_input_writes_nothing(client, rng):
    p = elemt_call(rng, (0, 4, 3))
    client.run(ELEMT, **p)
    q = elemt_call(rng, (2, 4, 0))
    client.run(ELEMT, **q)


def test_elemt_strided_views(client, rng):
    p = elemt_call(rng, (4, 3, 5))
    big = sentinel_like((4, 3, 10), F32)
    p.update(
        input=np.ascontiguousarray(p["input"].transpose(2, 1, 0)).transpose(2, 1, 0),
        output=big[:, :, ::2],
        mean=np.broadcast_to(np.float32(0.25), (3,)),
    )
    client.run(ELEMT, **p)
    assert_close(p["output"], elemt_reference(p), "output")
    assert (big[:, :, 1::2] == -7.25).all()


ELEMT_CASES = [
    ("null-input", set_(input=None), NULL, "input"),
    ("null-mean", set_(mean=None), NULL, "mean"),
    ("null-invstd", set_(invstd=None), NULL, "invstd"),
    ("null-output", set_(output=None), NULL, "output"),
    ("null-eps", set_(eps=None), NULL, "eps"),
    ("eps-kind", set_(eps=[1]), INVALID, "eps"),
    ("dtype-input", cast("input", np.float64), INVALID, "input"),
    ("dtype-weight", cast("weight", np.int32), INVALID, "weight"),
    ("dtype-invstd", cast("invstd", np.float64), INVALID, "invstd"),
    ("dtype-output", cast("output", np.int32), INVALID, "output"),
    ("output-format", lambda p: p.update(output=retag(p["output"], Format.NCL)), INVALID, "output"),
    (
        "private-input",
        lambda p: p.update(input=retag(p["input"], Format.NC1HWC0), output=retag(p["output"], Format.NC1HWC0)),
        INVALID,
        "input",
    ),
    ("private-mean", lambda p: p.update(mean=retag(p["mean"], Format.FRACTAL_NZ)), INVALID, "mean"),
    ("rank-1", lambda p: p.update(input=np.zeros(4, F32), output=np.zeros(4, F32)), INVALID, "input"),
    ("output-rank-9", reshape("output", (3, 4, 5, 1, 1, 1, 1, 1, 1)), INVALID, "output"),
    ("output-shape", reshape("output", (3, 4, 6)), INVALID, "output"),
    (
        "channel-zero",
        lambda p: p.update(input=np.zeros((3, 0, 5), F32), output=np.zeros((3, 0, 5), F32)),
        INVALID,
        "input",
    ),
    ("bias-rank-2", reshape("bias", (4, 1)), INVALID, "bias"),
    ("invstd-rank-0", reshape("invstd", ()), INVALID, "invstd"),
    ("weight-shape", reshape("weight", (5,)), INVALID, "weight"),
    ("mean-shape", reshape("mean", (3,)), INVALID, "mean"),
]


@pytest.mark.parametrize("mutate,code,param", [c[1:] for c in ELEMT_CASES], ids=[c[0] for c in ELEMT_CASES])
def test_elemt_error_table(client, rng, mutate, code, param):
    p = elemt_call(rng)
    mutate(p)
    expect_error(client, ELEMT, p, ("output",), code, param)


def test_running_statistics_are_listed_as_inout(server_address):
    """ListOperators marks in/out tensors, which the client ships and writes back like outputs."""
    from aclnn_client import Client

    with Client(server_address) as c:
        params = {p["name"]: p for p in c.list_operators()[GATHER]}
    assert params["runningMean"]["inout"] and not params["runningMean"]["output"]
    assert params["meanAll"]["output"] and not params["meanAll"]["inout"]
