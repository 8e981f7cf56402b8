"""aclnnLayerNormBackward against PyTorch float64, through gRPC and LocalClient."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from layer_norm_cases import F32, layer_norm_call, layer_norm_reference
from oracle import BF16, FLOAT_DTYPES, assert_close, sentinel_like

from aclnn_client import create_tensor

OP = "aclnnLayerNormBackward"
OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")


def check_against_reference(p: dict) -> None:
    ref = layer_norm_reference(p)
    for name, r, enabled in zip(OUTPUTS, ref, p["outputMask"]):
        if enabled:
            assert_close(p[name], r.reshape(p[name].shape), name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("weight", ["same", "float32", None])
@pytest.mark.parametrize("shape,k", [((6, 4, 8), 1), ((3, 5, 7), 2), ((1, 16), 1), ((33,), 1), ((2, 3, 4, 5), 3)])
def test_matches_pytorch(client, rng, dtype, weight, shape, k):
    p = layer_norm_call(rng, shape, k, dtype, weight)
    client.run(OP, **p)
    check_against_reference(p)


@pytest.mark.parametrize("mask", list(itertools.product([True, False], repeat=3)), ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_output_mask(client, rng, mask, dtype):
    """Masked-off outputs may be null; the enabled ones match the reference."""
    p = layer_norm_call(rng, (5, 12), 1, dtype, mask=mask)
    workspace_size, executor = client.get_workspace_size(OP, **p)
    assert workspace_size >= 0
    client.execute(executor)
    check_against_reference(p)


def test_masked_off_outputs_are_neither_validated_nor_written(client, rng):
    p = layer_norm_call(rng, (4, 6))
    p["outputMask"] = [True, False, False]
    bogus = sentinel_like((3,), np.int32)  # wrong dtype and size: ignored when masked off
    p["gradWeightOut"], p["gradBiasOut"] = bogus, bogus
    client.run(OP, **p)
    assert (bogus == -7).all()
    check_against_reference(p)


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("stats_dtype", FLOAT_DTYPES, ids=str)
def test_mixed_stats_and_output_dtypes(client, rng, out_dtype, stats_dtype):
    p = layer_norm_call(rng, (4, 32), 1, BF16, "float32", stats_dtype=stats_dtype, out_dtype=out_dtype)
    client.run(OP, **p)
    check_against_reference(p)


def test_rank_8_and_gradweight_of_any_shape_with_n_elements(client, rng):
    p = layer_norm_call(rng, (2, 1, 2, 1, 2, 3, 2, 4), 2)
    p["gradWeightOut"] = sentinel_like((2, 4), F32)
    p["gradBiasOut"] = sentinel_like((8, 1), F32)
    client.run(OP, **p)
    check_against_reference(p)


def test_empty_rows_zero_fill_parameter_grads(client, rng):
    p = layer_norm_call(rng, (0, 8))
    client.run(OP, **p)
    assert p["gradInputOut"].shape == (0, 8)
    assert (p["gradWeightOut"] == 0).all() and (p["gradBiasOut"] == 0).all()


def test_empty_normalized_axis_writes_nothing(client, rng):
    p = layer_norm_call(rng, (3, 0))
    client.run(OP, **p)
    assert p["gradWeightOut"].size == 0 and p["gradInputOut"].size == 0


def test_strided_views_in_and_out(client, rng):
    """Transposed and broadcast inputs; outputs that are views into larger buffers."""
    base = layer_norm_call(rng, (8, 6))
    x_t = np.ascontiguousarray(base["input"].T).T  # same values, column-major strides
    g_b = np.broadcast_to(base["gradOut"][:1], (8, 6))  # stride 0 over rows
    big = sentinel_like((8, 12), F32)
    dw_big = sentinel_like((12,), F32)
    p = dict(base, input=x_t, gradOut=g_b, gradInputOut=big[:, ::2], gradWeightOut=dw_big[1::2])
    client.run(OP, **p)
    check_against_reference(dict(p, gradOut=np.ascontiguousarray(g_b)))
    assert (big[:, 1::2] == -7.25).all() and (dw_big[::2] == -7.25).all()


def test_create_tensor_output_writes_only_its_view(client, rng):
    p = layer_norm_call(rng, (4, 6))
    storage = sentinel_like(40, F32)
    p["gradInputOut"] = create_tensor([4, 6], 0, [1, 4], 10, 2, [40], storage)  # column-major, offset 10
    client.run(OP, **p)
    view = np.lib.stride_tricks.as_strided(storage[10:], (4, 6), (4, 16))
    assert_close(view.copy(), layer_norm_reference(p)[0], "gradInputOut")
    assert (storage[:10] == -7.25).all() and (storage[34:] == -7.25).all()


def test_long_reduction_meets_fp32_tolerance(client, rng):
    """gradWeight/gradBias sum 100 000 rows: blocked sums, not one long fp32 sum."""
    p = layer_norm_call(rng, (100_000, 4))
    p["gradOut"] = np.abs(p["gradOut"]) + 1.0  # same-sign terms make sequential fp32 error visible
    client.run(OP, **p)
    check_against_reference(p)


def test_deterministic_bit_identical(client, rng):
    p = layer_norm_call(rng, (64, 300), 1, BF16, "float32", out_dtype=F32)
    results = []
    for _ in range(3):
        client.run(OP, **p)
        results.append([p[n].tobytes() for n in OUTPUTS])
    assert results[0] == results[1] == results[2]


def test_nan_and_inf_propagate(client, rng):
    p = layer_norm_call(rng, (3, 4))
    p["gradOut"][1, 2] = np.nan
    p["input"][2, 0] = np.inf
    client.run(OP, **p)
    assert np.isnan(p["gradInputOut"][1]).all() and not np.isnan(p["gradInputOut"][0]).any()
    assert np.isnan(p["gradWeightOut"][2]) and np.isnan(p["gradBiasOut"][2])


def test_message_above_grpc_default_4mib(client, rng):
    p = layer_norm_call(rng, (1024, 2048))  # 8 MiB per tensor
    client.run(OP, **p)
    check_against_reference(p)
