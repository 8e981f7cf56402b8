"""The torch backend meets SPEC 1.5's tolerances where aten's fp32 kernels alone would not.

Degenerate LayerNorm rows (a normalized size of 1, where x = mean: gradInput is exactly zero, but
aten's folded formula leaves rstd-scaled rounding, about 3e-5 for rstd ≈ 316) and long column
reductions over tiny rows (parameter gradients summing 10^6 rows), against the float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_norm_cases import BN_OUTPUTS, bn_call, bn_reference
from conftest import TORCH_DEVICE
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import BF16, assert_close
from test_layer_norm_grad import check as check_layer_norm_grad
from test_layer_norm_grad import lng_call

from aclnn_server import LocalClient
from aclnn_server.backends.torch_backend import TorchBackend

LN_OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")


@pytest.fixture(scope="module")
def client():
    with LocalClient(TorchBackend(TORCH_DEVICE)) as c:
        yield c


def check_layer_norm(p: dict) -> None:
    for name, ref in zip(LN_OUTPUTS, layer_norm_reference(p)):
        assert_close(p[name], ref, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape,k", [((64, 1), 1), ((6, 5, 1), 1), ((8, 1, 1), 2), ((100_000, 1), 1)])
def test_normalized_size_one_gives_exactly_zero_gradient(client, rng, dtype, shape, k):
    p = layer_norm_call(rng, shape, k, dtype=dtype)  # mean = x, rstd = 1/sqrt(eps) ≈ 316
    client.run("aclnnLayerNormBackward", **p)
    assert not np.any(p["gradInputOut"].astype(np.float32)), "gradInput of a one-element row must be exactly 0"
    check_layer_norm(p)


@pytest.mark.parametrize("shape", [(1_000_000, 2), (250_000, 2, 2)])
def test_layer_norm_long_columns(client, rng, shape):
    """gradWeight/gradBias sum a million same-sign, off-centre rows: accumulated in fp64."""
    p = layer_norm_call(rng, shape, k=len(shape) - 1)
    p["gradOut"] = np.abs(p["gradOut"]) + 1
    p["input"] = p["input"] + np.float32(3)
    client.run("aclnnLayerNormBackward", **p)
    check_layer_norm(p)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(1_000_000, 2), (500_000, 2, 1), (4, 2, 250_000)])
def test_batch_norm_long_channels(client, rng, shape, training):
    p = bn_call(rng, shape, training=training)
    p["gradOut"] = np.abs(p["gradOut"]) + 1
    p["input"] = p["input"] + np.float32(3)
    client.run("aclnnBatchNormBackward", **p)
    for name, ref in zip(BN_OUTPUTS, bn_reference(p)):
        assert_close(p[name], ref, name)


@pytest.mark.parametrize(
    "x_shape,mean_shape,gamma_shape",
    [((1_000_000, 2), (1_000_000, 1), (2,)), ((500_000, 2, 1), (500_000, 2, 1), (2, 1))],
)
def test_layer_norm_grad_long_columns(client, rng, x_shape, mean_shape, gamma_shape):
    p = lng_call(rng, x_shape, mean_shape, gamma_shape)
    p["dy"] = np.abs(p["dy"]) + 1
    p["x"] = p["x"] + np.float32(3)
    client.run("LayerNormGrad", **p)
    check_layer_norm_grad(p)
