"""Accuracy where fp32 alone falls short, and the one answer for non-finite cases, on every backend.

Each call runs on the numpy, cpu and torch backends. Accuracy: data far from zero with a small spread
(the rounded mean corrected), values near fp32's range limits (no intermediate overflows or
underflows: the reference repeats such a call in fp64), gradients that are exactly zero. Non-finite
cases follow IEEE arithmetic on the documented formulas (docs/operators.md, "Non-finite values"):
an Inf in a row makes its mean Inf; BatchNorm's s multiplies the sums; an empty batch gives zeros.
No backend prints a RuntimeWarning.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from batch_norm_cases import bn_call
from batch_norm_forward_cases import forward_call
from group_norm_cases import group_norm_backward_call, group_norm_call
from layer_norm_cases import layer_norm_call
from layer_norm_forward_cases import layer_norm_forward_call
from oracle import BF16, assert_close, sentinel_like, t64
from rms_norm_cases import rms_norm_call, rms_norm_grad_call, rms_norm_grad_reference
from sync_batch_norm_cases import elemt_call, reduce_call, reduce_reference, stats_call
from test_backend_agreement import backend_clients
from test_layer_norm_grad import lng_call

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


@pytest.fixture(scope="module")
def clients():
    yield from backend_clients()


def run_everywhere(clients: dict, op: str, p: dict) -> dict[str, dict[str, np.ndarray]]:
    """The call on each backend (fresh copies of its outputs), with RuntimeWarnings as errors:
    backend -> output name -> result."""
    results = {}
    for name, client in clients.items():
        q = {k: (v.copy(order="K") if isinstance(v, np.ndarray) else v) for k, v in p.items()}  # layouts kept
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            client.run(op, **q)
        results[name] = q
    return results


def same_everywhere(results: dict, name: str) -> np.ndarray:
    """The backends' results for `name`, checked equal in their non-finite entries; numpy's."""
    first = results["numpy"][name].astype(np.float64)
    for backend, q in results.items():
        got = q[name].astype(np.float64)
        assert np.array_equal(np.isnan(got), np.isnan(first)), f"{backend} {name}: NaN elsewhere than numpy"
        inf = np.isinf(first)
        assert np.array_equal(got[inf], first[inf]) and not np.isinf(got[~inf]).any(), f"{backend} {name}: ±Inf"
    return first


# --- the rounded mean (issue: LayerNorm and GroupNorm centred on an uncorrected fp32 mean) ------


@pytest.mark.parametrize("out_dtype", [F32, F16])
def test_layer_norm_far_from_zero_small_spread(clients, rng, out_dtype):
    """x = 1000.2 + 0.01·i: fp32's mean is off by 3e-5, which rstd ≈ 43 made an error of 1.3e-3
    (the bound is 1.1e-4), and FLOAT16 outputs Inf where the result is 34,347·w."""
    p = layer_norm_forward_call(rng, (3, 8), 1, F32, weight=None, bias=False, out_dtype=out_dtype)
    p["input"] = (1000.2 + 0.01 * np.arange(24, dtype=np.float64).reshape(3, 8)).astype(np.float32)
    p["eps"] = 0.0
    results = run_everywhere(clients, "aclnnLayerNorm", p)
    ref = torch.ops.aten.native_layer_norm(t64(p["input"]), [8], None, None, 0.0)
    for q in results.values():
        for name, r in zip(("out", "meanOutOptional", "rstdOutOptional"), ref):
            assert_close(q[name], r.reshape(q[name].shape), name)


def test_group_norm_far_from_zero_small_spread(clients, rng):
    p = group_norm_call(rng, (2, 4, 6), 2, F32, gamma=False, beta=False)
    p["self"] = (-5000.3 + 0.01 * rng.standard_normal((2, 4, 6))).astype(np.float32)
    results = run_everywhere(clients, "aclnnGroupNorm", p)
    ref = torch.ops.aten.native_group_norm(t64(p["self"]), None, None, 2, 4, 6, 2, p["eps"])
    for q in results.values():
        for name, r in zip(("out", "meanOut", "rstdOut"), ref):
            assert_close(q[name], r.reshape(q[name].shape), name)


# --- intermediates out of fp32's range (finite inputs) --------------------------------------------


@pytest.mark.parametrize("scale", [5e19, 3e37, 1e-30])
def test_rms_norm_and_layer_norm_near_the_range_limits(clients, rng, scale):
    """x² overflows (beyond 1.8e19) or underflows (1e-30, eps 0) in fp32: y is still about ±1."""
    x = (rng.uniform(-1, 1, (4, 9)) * scale).astype(np.float32)
    p = rms_norm_call(rng, (4, 9), 1, F32)
    p.update(x=x, epsilon=0.0)
    results = run_everywhere(clients, "aclnnRmsNorm", p)
    y = torch.nn.functional.rms_norm(t64(x), [9], t64(p["gamma"]), 0.0)
    for q in results.values():
        assert_close(q["yOut"], y, "yOut")
    p = layer_norm_forward_call(rng, (4, 9), 1, F32)
    p.update(input=x, eps=0.0)
    results = run_everywhere(clients, "aclnnLayerNorm", p)
    ref = torch.ops.aten.native_layer_norm(t64(x), [9], t64(p["weightOptional"]), t64(p["biasOptional"]), 0.0)
    for q in results.values():
        assert_close(q["out"], ref[0], "out")


def test_batch_norm_stats_of_tiny_values(clients, rng):
    """Values near 1e-30 with eps 0: the squares underflow in fp32 (a negative variance, NaN)."""
    p = stats_call(rng, (5, 3, 4))
    p.update(input=(rng.uniform(1, 2, (5, 3, 4)) * 1e-30).astype(np.float32), eps=0.0)
    results = run_everywhere(clients, "aclnnBatchNormStats", p)
    x = p["input"].astype(np.float64)
    mean, var = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    for q in results.values():
        assert_close(q["mean"], mean, "mean")
        assert_close(q["invstd"], 1 / np.sqrt(var), "invstd")


def test_huge_gradients_round_to_inf_not_nan(clients, rng):
    """Results beyond fp32's range are ±Inf (their rounding), never the NaN of an overflowed
    intermediate: GroupNormBackward, RmsNormGrad, BatchNormReduceBackward."""
    p = group_norm_backward_call(rng, (2, 4, 5), 2, F32)
    p["gradOut"] = p["gradOut"] * np.float32(1e36)
    results = run_everywhere(clients, "aclnnGroupNormBackward", p)
    ref = torch.ops.aten.native_group_norm_backward(
        t64(p["gradOut"]).reshape(2, 4, 5), t64(p["input"]).reshape(2, 4, 5), t64(p["mean"]), t64(p["rstd"]),
        t64(p["gamma"]), 2, 4, 5, 2, [True, True, True],
    )  # fmt: skip
    for name, r in zip(("gradInput", "gradGammaOut", "gradBetaOut"), ref):
        got = same_everywhere(results, name)
        with np.errstate(over="ignore"):
            expected = r.numpy().reshape(got.shape).astype(np.float32).astype(np.float64)
        assert np.array_equal(np.isinf(got), np.isinf(expected)) and not np.isnan(got).any(), name
    p = rms_norm_grad_call(rng, (3, 40), 1, F32)
    p["dy"] = p["dy"] * np.float32(3e37)
    results = run_everywhere(clients, "aclnnRmsNormGrad", p)
    for name, r in zip(("dxOut", "dgammaOut"), rms_norm_grad_reference(p)):
        got = same_everywhere(results, name)
        with np.errstate(over="ignore"):
            expected = r.numpy().reshape(got.shape).astype(np.float32).astype(np.float64)
        assert np.array_equal(got[np.isinf(expected)], expected[np.isinf(expected)]), name
        assert not np.isnan(got).any(), name
        finite = np.isfinite(expected)
        assert_close(results["numpy"][name][finite], r.numpy().reshape(got.shape)[finite], name)
    p = reduce_call(rng, (40, 3, 30))
    p["gradOut"] = p["gradOut"] * np.float32(3e37)
    results = run_everywhere(clients, "aclnnBatchNormReduceBackward", p)
    for name, r in reduce_reference(p).items():
        got = same_everywhere(results, name)
        with np.errstate(over="ignore"):
            expected = r.astype(np.float32).astype(np.float64)
        assert np.array_equal(np.isinf(got), np.isinf(expected)) and not np.isnan(got).any(), name


def exact_row_gradient(g: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray) -> np.ndarray:
    """rstd·(g − mean(g) − x̂·mean(g·x̂)), x̂ = (x − mean)·rstd, along the rows in exact rationals
    (of the inputs' fp64 values), rounded to fp64 once (±Inf past its range)."""
    out = np.empty(g.shape)
    for i in range(g.shape[0]):
        r, mu = Fraction(float(rstd[i, 0])), Fraction(float(mean[i, 0]))
        gs, xhat = [Fraction(float(v)) for v in g[i]], [(Fraction(float(v)) - mu) * r for v in x[i]]
        n = len(gs)
        dot, mean_g = sum(a * b for a, b in zip(gs, xhat)) / n, sum(gs) / n
        for j in range(n):
            value = r * (gs[j] - mean_g - xhat[j] * dot)
            out[i, j] = float(value) if abs(value) < 2**1000 else math.copysign(math.inf, value)
    return out


@pytest.mark.parametrize("op", ["aclnnLayerNormBackward", "LayerNormGrad"])
def test_statistics_far_beyond_the_data_keep_the_gradient(clients, rng, op):
    """A mean ~2^75 beyond the inputs (statistics that are not the input's own, from the long fuzz):
    x̂ overflows fp32, and in the fp64 repeat x − mean loses x, so every x̂ of a row was the same and
    the x̂ term of gradInput cancelled; the exact gradient keeps it (here ±Inf), as every backend now
    does (a mean far enough to lose x in fp32 without overflowing is a documented limit)."""
    g = np.array([[-0.2578125, 0.2578125], [0.5, -0.5]], np.float32)  # each row sums to 0
    x = np.array([[-0.451171875, -1.390625], [0.25, 1.75]], np.float32)
    mean = np.array([[-3.681786e22], [2.5e22]], np.float32)
    if op == "aclnnLayerNormBackward":
        rstd = np.array([[8.5112205e22], [4.0e22]], np.float32)
        p = layer_norm_call(rng, (2, 2), 1, F32, mask=(True, False, False))
        p.update(gradOut=g, input=x, mean=mean, rstd=rstd, weightOptional=None)
        out = "gradInputOut"
    else:  # rstd = (variance + 1e-12)^-1/2 is at most 10^6: a mean far enough for x̂ to overflow fp32
        mean = mean * np.float32(1e13)
        p = lng_call(rng, (2, 2), (2, 1), (2,), F32, mask=(True, False, False))
        p.update(dy=g, x=x, mean=mean, variance=np.zeros((2, 1), np.float32), gamma=np.ones(2, np.float32))
        rstd, out = (np.zeros((2, 1)) + 1e-12) ** -0.5, "pd_x"
    with np.errstate(over="ignore"):
        expected = exact_row_gradient(g, x, mean, rstd).astype(np.float32).astype(np.float64)
    assert np.isinf(expected).all()  # the case is what it says: the x̂ term dominates and overflows
    got = same_everywhere(run_everywhere(clients, op, p), out)
    np.testing.assert_array_equal(got, expected)


# --- exactly zero gradients -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_layer_norm_backward_constant_row_gradient_is_exactly_zero(clients, rng, dtype):
    """g·w constant along a row and x̂ = 0: gradInput is 0 (it was 2.4e-3 on numpy, bound 1e-5)."""
    p = layer_norm_call(rng, (5, 37), 1, dtype, weight=None)
    p["gradOut"] = np.repeat(rng.uniform(-3, 3, (5, 1)), 37, axis=1).astype(dtype)
    p["input"] = np.repeat(rng.uniform(-3, 3, (5, 1)), 37, axis=1).astype(dtype)
    p["mean"] = p["input"][:, :1].copy()
    p["rstd"] = np.full((5, 1), 316.2, dtype)
    results = run_everywhere(clients, "aclnnLayerNormBackward", p)
    for backend, q in results.items():
        assert not q["gradInputOut"].astype(np.float32).any(), backend


def test_group_norm_backward_constant_group_gradient_is_exactly_zero(clients, rng):
    p = group_norm_backward_call(rng, (3, 4, 33), 2, F32, gamma=False)
    p["gradOut"] = np.repeat(rng.uniform(-3, 3, (3, 1, 1)), 4, axis=1).repeat(33, axis=2).astype(np.float32)
    p["input"] = np.full((3, 4, 33), 0.7, np.float32)
    p["mean"] = np.full((3, 2), 0.7, np.float32)
    p["rstd"] = np.full((3, 2), 316.2, np.float32)
    results = run_everywhere(clients, "aclnnGroupNormBackward", p)
    for backend, q in results.items():
        assert not q["gradInput"].any(), backend


# --- non-finite values: one answer everywhere ------------------------------------------------------


def test_one_inf_makes_the_mean_inf(clients, rng):
    """IEEE: Σx/n with one +Inf is +Inf; the variance (Inf − Inf) and everything normalized are NaN."""
    p = layer_norm_forward_call(rng, (3, 6), 1, F32)
    p["input"][1, 2] = np.inf
    results = run_everywhere(clients, "aclnnLayerNorm", p)
    mean = same_everywhere(results, "meanOutOptional")
    assert mean[1, 0] == np.inf and np.isfinite(mean[[0, 2]]).all()
    assert np.isnan(same_everywhere(results, "rstdOutOptional")[1]).all()
    assert np.isnan(same_everywhere(results, "out")[1]).all()
    p = group_norm_call(rng, (2, 4, 3), 2, F32)
    p["self"][1, 3, 0] = -np.inf
    results = run_everywhere(clients, "aclnnGroupNorm", p)
    assert same_everywhere(results, "meanOut")[1, 1] == -np.inf
    p = stats_call(rng, (4, 3, 5))
    p["input"][2, 1, 3] = np.inf
    results = run_everywhere(clients, "aclnnBatchNormStats", p)
    assert same_everywhere(results, "mean")[1] == np.inf and np.isnan(same_everywhere(results, "invstd")[1])
    q = forward_call(rng, (4, 3, 5))
    q["input"][0, 2, 4] = np.inf
    results = run_everywhere(clients, "aclnnBatchNorm", q)
    assert same_everywhere(results, "saveMean")[2] == np.inf


def test_infinite_mean_normalizes_to_inf(clients, rng):
    """(x − (−Inf))·invstd·w + b is +Inf (w, invstd > 0): aclnnBatchNormElemt and inference BatchNorm."""
    p = elemt_call(rng, (2, 3, 4))
    p["mean"][1] = -np.inf
    results = run_everywhere(clients, "aclnnBatchNormElemt", p)
    out = same_everywhere(results, "output")
    assert (out[:, 1] == np.inf).all() and np.isfinite(out[:, [0, 2]]).all()
    q = forward_call(rng, (2, 3, 4), training=False)
    q["runningMean"][1] = -np.inf
    results = run_everywhere(clients, "aclnnBatchNorm", q)
    assert (same_everywhere(results, "output")[:, 1] == np.inf).all()


def test_batch_norm_backward_infinite_invstd(clients, rng):
    """s multiplies the sums (gradWeight = s·Σg·(x − μ)), as PyTorch's kernel: ±Inf by the sum's sign;
    with an empty batch the documented zeros (not 0·Inf)."""
    p = bn_call(rng, (4, 3, 5))
    p["saveInvstd"][1] = np.inf
    results = run_everywhere(clients, "aclnnBatchNormBackward", p)
    g, x = p["gradOut"].astype(np.float64), p["input"].astype(np.float64)
    dot = (g[:, 1] * (x[:, 1] - p["saveMean"][1])).sum()
    assert same_everywhere(results, "gradWeight")[1] == np.copysign(np.inf, dot)
    assert np.isinf(same_everywhere(results, "gradInput")[:, 1]).all()  # x̂·Σg·x̂/n dominates
    empty = bn_call(rng, (0, 3, 5))
    empty["saveInvstd"][:] = np.inf
    results = run_everywhere(clients, "aclnnBatchNormBackward", empty)
    assert not same_everywhere(results, "gradWeight").any()


def test_group_norm_backward_infinite_rstd(clients, rng):
    """x̂ = (x − μ)·rstd per element: an infinite rstd gives ±Inf/NaN alike everywhere."""
    p = group_norm_backward_call(rng, (2, 4, 3), 2, F32)
    p["rstd"][0, 1] = np.inf
    results = run_everywhere(clients, "aclnnGroupNormBackward", p)
    for name in ("gradInput", "gradGammaOut", "gradBetaOut"):
        same_everywhere(results, name)


def test_zero_variance_with_eps_zero(clients, rng):
    """invstd = 1/√(0 + 0) = Inf (aten's kernel answers 0 and output = bias); the output is NaN (0·Inf)."""
    p = forward_call(rng, (4, 2, 3))
    p["input"][:, 1] = 2.5
    p["eps"] = 0.0
    results = run_everywhere(clients, "aclnnBatchNorm", p)
    assert same_everywhere(results, "saveInvstd")[1] == np.inf
    assert np.isnan(same_everywhere(results, "output")[:, 1]).all()


def test_large_mean_keeps_the_bias(clients, rng):
    """x = 3e9 constant with eps 1e-12: aten's folded x·s + (β − μ·s) lost β (0.3 came out 0.5)."""
    p = forward_call(rng, (4, 2, 3))
    p.update(input=np.full((4, 2, 3), 3e9, np.float32), eps=1e-12, bias=np.array([0.3, -0.7], np.float32))
    results = run_everywhere(clients, "aclnnBatchNorm", p)
    for q in results.values():
        assert_close(q["output"], np.broadcast_to(np.array([0.3, -0.7])[None, :, None], (4, 2, 3)), "output")
    q = group_norm_call(rng, (2, 2, 3), 2, F32)
    q.update(self=np.full((2, 2, 3), 3e9, np.float32), eps=1e-12, beta=np.array([0.3, -0.7], np.float32))
    results = run_everywhere(clients, "aclnnGroupNorm", q)
    for r in results.values():
        assert_close(r["out"], np.broadcast_to(np.array([0.3, -0.7])[None, :, None], (2, 2, 3)), "out")


def test_strided_whole_tensor_rows(clients):
    """normalizedShape covering a whole non-contiguous tensor (one row): numpy and cpu answered 561000."""
    x = np.arange(6, dtype=np.float32).reshape(3, 2).T
    p = dict(input=x, normalizedShape=[2, 3], weightOptional=None, biasOptional=None, eps=1e-5,
             out=sentinel_like((2, 3), F32), meanOutOptional=sentinel_like((1, 1), F32),
             rstdOutOptional=sentinel_like((1, 1), F32))  # fmt: skip
    results = run_everywhere(clients, "aclnnLayerNorm", p)
    ref = torch.ops.aten.native_layer_norm(t64(x), [2, 3], None, None, 1e-5)
    for q in results.values():
        assert_close(q["out"], ref[0], "out")
    g = np.ones((3, 2), np.float32).T
    p = dict(gradOut=g, input=x, normalizedShape=[2, 3], mean=ref[1].numpy().astype(np.float32),
             rstd=ref[2].numpy().astype(np.float32), weightOptional=None, biasOptional=None,
             outputMask=[True, True, True], gradInputOut=sentinel_like((2, 3), F32),
             gradWeightOut=sentinel_like((2, 3), F32), gradBiasOut=sentinel_like((2, 3), F32))  # fmt: skip
    run_everywhere(clients, "aclnnLayerNormBackward", p)
    p = rms_norm_call(np.random.default_rng(0), (2, 3), 2, F32)
    p["x"] = x
    run_everywhere(clients, "aclnnRmsNorm", p)
    p = rms_norm_grad_call(np.random.default_rng(0), (2, 3), 2, F32)
    p.update(x=x, dy=g)
    results = run_everywhere(clients, "aclnnRmsNormGrad", p)
    for name, r in zip(("dxOut", "dgammaOut"), rms_norm_grad_reference(p)):
        for q in results.values():
            assert_close(q[name], r, name)
