"""The cpu backend's RMSNorm, GroupNorm-backward and BatchNorm kernels: used (not the reference), within
the SPEC tolerances of the float64 oracle, bit-identical across thread counts, views gathered."""

from __future__ import annotations

import logging

import numba
import numpy as np
import pytest
from batch_norm_cases import DATA_TYPES, tagged
from batch_norm_forward_cases import WRITTEN, check, forward_call, forward_reference, snapshot, with_format
from group_norm_cases import group_norm_backward_call, group_norm_backward_reference
from oracle import BF16, FLOAT_DTYPES, assert_close, sentinel_like
from rms_norm_cases import rms_norm_call, rms_norm_grad_call, rms_norm_grad_reference, rms_norm_reference

from aclnn_client import Format, create_tensor
from aclnn_server import LocalClient

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
FWD, BWD, GNB, BN = "aclnnRmsNorm", "aclnnRmsNormGrad", "aclnnGroupNormBackward", "aclnnBatchNorm"
GN_OUTPUTS = ("gradInput", "gradGammaOut", "gradBetaOut")


@pytest.fixture(scope="module")
def cpu() -> LocalClient:
    c = LocalClient(backend="cpu")
    yield c
    c.close()


@pytest.fixture
def no_fallback(caplog):
    """Fails the test when any of these operators ran on the NumPy reference."""
    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        yield
    notes = [r.message for r in caplog.get_records("call") if "runs on the NumPy reference" in r.message]
    assert not [n for n in notes if any(op in n for op in (FWD, BWD, GNB, BN))], notes


def run_bits(client: LocalClient, op: str, p: dict, outputs: tuple[str, ...]) -> bytes:
    client.run(op, **p)
    return b"".join(p[name].tobytes() for name in outputs if p[name] is not None)


def across_threads(client: LocalClient, op: str, p: dict, outputs: tuple[str, ...]) -> bytes:
    """The call at 1 thread, then twice at every thread: each must give the same bytes."""
    threads = numba.get_num_threads()
    try:
        results = []
        for n in (1, numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            results.append(run_bits(client, op, p, outputs))
    finally:
        numba.set_num_threads(threads)
    assert results[0] == results[1] == results[2]
    return results[0]


def test_kernels_registered(cpu):
    kernels = cpu.engine.backend.kernels
    assert {FWD, BWD, GNB, BN} <= set(kernels)


# Rows longer than a ROW_BLOCK with ragged lanes; two normalized dims; more rows than tasks.
RMS_SHAPES = [((37, 2051), 1), ((300, 4, 5), 2), ((5000, 16), 1)]


@pytest.mark.parametrize("gamma", ["same", "float"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_rms_norm(cpu, rng, no_fallback, dtype, gamma):
    for shape, k in RMS_SHAPES:
        p = rms_norm_call(rng, shape, k, dtype, gamma)
        across_threads(cpu, FWD, p, ("yOut", "rstdOut"))
        y, rstd = rms_norm_reference(p)
        assert_close(p["yOut"], y, "yOut")
        assert_close(p["rstdOut"], rstd, "rstdOut")


@pytest.mark.parametrize("gamma", ["same", "float"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_rms_norm_grad(cpu, rng, no_fallback, dtype, gamma):
    for shape, k in RMS_SHAPES:
        p = rms_norm_grad_call(rng, shape, k, dtype, gamma)
        across_threads(cpu, BWD, p, ("dxOut", "dgammaOut"))
        dx, dgamma = rms_norm_grad_reference(p)
        assert_close(p["dxOut"], dx, "dxOut")
        assert_close(p["dgammaOut"], dgamma.reshape(p["dgammaOut"].shape), "dgammaOut")


GN_CASES = [  # shape, group, gamma, outputMask
    ((3, 6, 4, 5), 3, True, (True, True, True)),
    ((4, 64, 33, 40), 8, False, (True, True, True)),  # channel rows longer than a ROW_BLOCK
    ((2, 8, 7), 4, True, (False, True, True)),
    ((5, 6), 2, True, (True, False, True)),  # HxW = 1
]


@pytest.mark.parametrize("stats", ["same", "float"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_group_norm_backward(cpu, rng, no_fallback, dtype, stats):
    for shape, group, gamma, mask in GN_CASES:
        p = group_norm_backward_call(rng, shape, group, dtype, dtype if stats == "same" else F32, gamma, mask)
        across_threads(cpu, GNB, p, GN_OUTPUTS)
        for name, ref in zip(GN_OUTPUTS, group_norm_backward_reference(p)):
            if p[name] is not None:
                assert_close(p[name], ref.reshape(p[name].shape), name)


def test_rms_strided_views_gathered(cpu, rng, no_fallback):
    """Column-major x (gathered rows), a broadcast dy (row stride 0), a strided output."""
    p = rms_norm_grad_call(rng, (40, 70), 1, BF16)
    big = sentinel_like((40, 140), BF16)
    q = dict(p, x=np.ascontiguousarray(p["x"].T).T, dy=np.broadcast_to(p["dy"][:1], (40, 70)), dxOut=big[:, ::2])
    cpu.run(BWD, **q)
    dx, dgamma = rms_norm_grad_reference(dict(q, dy=np.ascontiguousarray(q["dy"])))
    assert_close(q["dxOut"], dx, "dxOut")
    assert_close(q["dgammaOut"], dgamma, "dgammaOut")
    assert (big[:, 1::2].astype(np.float32) == -7.25).all()
    f = rms_norm_call(rng, (40, 70), 1, F16)
    f["x"] = np.ascontiguousarray(f["x"].T).T
    cpu.run(FWD, **f)
    y, rstd = rms_norm_reference(f)
    assert_close(f["yOut"], y, "yOut")
    assert_close(f["rstdOut"], rstd, "rstdOut")


def test_group_norm_backward_strided_views(cpu, rng, no_fallback):
    """Channel-last memory seen as NCHW (HxW rows gathered) and a channel-strided input."""
    p = group_norm_backward_call(rng, (2, 8, 5, 6), 4, F32)
    x_nhwc = np.ascontiguousarray(np.moveaxis(p["input"], 1, -1))
    wide = np.zeros((2, 16, 5, 6), F32)
    wide[:, ::2] = p["gradOut"]
    q = dict(p, input=np.moveaxis(x_nhwc, -1, 1), gradOut=wide[:, ::2])
    cpu.run(GNB, **q)
    for name, ref in zip(GN_OUTPUTS, group_norm_backward_reference(p)):
        assert_close(q[name], ref.reshape(q[name].shape), name)


def test_unmergeable_view_falls_back(cpu, rng, caplog):
    """RMSNorm leading dims that do not merge into rows run on the reference, still correct."""
    p = rms_norm_call(rng, (4, 3, 8), 1)
    big = rms_norm_call(rng, (4, 6, 8), 1)["x"]
    p["x"] = big[:, :3, :]  # strides (48, 8, 1): [4, 3] does not merge into 12 rows
    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        cpu.run(FWD, **p)
    assert any(f"{FWD} runs on the NumPy reference (a layout" in r.message for r in caplog.records)
    y, rstd = rms_norm_reference(p)
    assert_close(p["yOut"], y, "yOut")
    assert_close(p["rstdOut"], rstd, "rstdOut")


def test_empty_inputs(cpu, rng):
    q = rms_norm_grad_call(rng, (0, 3, 8))
    cpu.run(BWD, **q)
    assert (q["dgammaOut"] == 0).all()
    p = group_norm_backward_call(rng, (0, 6, 4), 3)
    cpu.run(GNB, **p)
    assert (p["gradGammaOut"] == 0).all() and (p["gradBetaOut"] == 0).all()


def test_workspace_reports_kernel_scratch(cpu, rng):
    p = rms_norm_grad_call(rng, (1000, 64))
    size, executor = cpu.get_workspace_size(BWD, **p)
    cpu.destroy_executor(executor)
    assert 4 * 64 * 32 <= size < 1000 * 64 * 4  # column partials, well under one input
    g = group_norm_backward_call(rng, (4, 32, 16, 16), 8)
    size, executor = cpu.get_workspace_size(GNB, **g)
    cpu.destroy_executor(executor)
    assert 2 * 8 * 4 * 32 <= size < 4 * 32 * 256 * 4


# BatchNorm: [L, C, T] channel tasks (rows longer than a ROW_BLOCK, T = 1 with C = 1) and the
# channel-last kernel ([L, C]: NHWC, NDHWC, and NC with more rows than tasks).
BN_CASES = [  # shape, format (None: ND), channel axis
    ((4, 3, 5, 2), None, 1),
    ((3, 8, 33, 40), Format.NCHW, 1),
    ((300, 1), None, 1),
    ((5000, 6), Format.NC, 1),
    ((4, 9, 7, 5), Format.NHWC, 3),
    ((2, 3, 4, 5, 6), Format.NDHWC, 4),
]


def bn_run_bits(client: LocalClient, p: dict, fmt: int | None) -> bytes:
    """The call on fresh copies of the running statistics: the same inputs every time."""
    q = dict(p, **{n: p[n].copy() for n in ("runningMean", "runningVar") if p[n] is not None})
    client.run(BN, **(q if fmt is None else with_format(q, fmt)))
    return b"".join(q[n].tobytes() for n in WRITTEN if q[n] is not None)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("params", ["same", "float"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm(cpu, rng, no_fallback, dtype, params, training):
    """Against PyTorch float64 and against the NumPy reference: within tolerance in training (the
    sums run in another order), bit-identical in inference (the same fp32 coefficients and
    arithmetic); the same bytes at 1 thread and at every thread."""
    threads = numba.get_num_threads()
    with LocalClient(backend="numpy") as numpy_client:
        for shape, fmt, axis in BN_CASES:
            p = forward_call(rng, shape, axis, dtype, training, params=None if params == "same" else F32)
            ref, before = forward_reference(p, axis), snapshot(p)
            try:
                bits = []
                for n in (1, numba.config.NUMBA_NUM_THREADS):
                    numba.set_num_threads(n)
                    bits.append(bn_run_bits(cpu, p, fmt))
            finally:
                numba.set_num_threads(threads)
            assert bits[0] == bits[1], (shape, fmt)
            cpu.run(BN, **(p if fmt is None else with_format(p, fmt)))
            check(p, ref, before)
            if not training:
                assert bn_run_bits(numpy_client, p, fmt) == bits[0], (shape, fmt)


def test_batch_norm_strided_views(cpu, rng, no_fallback):
    """Gathered rows: column-major and T-strided NCL (channel tasks over strided rows), a channel-strided
    NHWC view and NC input (the channel-last kernel's rows gathered)."""
    p = forward_call(rng, (6, 4, 70), dtype=BF16, params=F32)
    run_checked_cpu(cpu, p, 1, dict(p, input=np.asfortranarray(p["input"])))
    wide = np.zeros((6, 4, 140), BF16)
    wide[:, :, ::2] = p["input"]
    run_checked_cpu(cpu, p, 1, dict(p, input=wide[:, :, ::2]))
    q = forward_call(rng, (2, 3, 4, 5), 3, training=False)
    storage = np.zeros((2, 3, 4, 10), F32)
    storage[..., ::2] = q["input"]
    view = create_tensor((2, 3, 4, 5), DATA_TYPES[F32], [120, 40, 10, 2], 0, Format.NHWC, [240], storage.reshape(-1))
    run_checked_cpu(cpu, q, 3, dict(q, input=view, output=tagged(q["output"], Format.NHWC)))
    r = forward_call(rng, (300, 5), dtype=F16)
    wide = np.zeros((300, 10), F16)
    wide[:, ::2] = r["input"]
    run_checked_cpu(cpu, r, 1, dict(r, input=wide[:, ::2]))


def run_checked_cpu(client: LocalClient, p: dict, axis: int, call: dict) -> None:
    ref, before = forward_reference(p, axis), snapshot(p)
    client.run(BN, **call)
    check(p, ref, before)


def test_batch_norm_output_dtype_other_than_input_falls_back(cpu, rng, caplog):
    p = forward_call(rng, (4, 3, 5), dtype=BF16, out_dtype=F32)
    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        run_checked_cpu(cpu, p, 1, p)
    assert any(f"{BN} runs on the NumPy reference (a layout" in r.message for r in caplog.records)


def test_batch_norm_zero_variance_without_eps(cpu, rng, no_fallback):
    """A constant channel with eps = 0: invstd is +inf and its output NaN, as in the reference (no
    division error inside the kernel), for both kernels; the other channels are unaffected."""
    for shape in ((4, 3, 5), (6, 3)):
        p = forward_call(rng, shape, params=F32)
        p["input"][:, 1] = 2.0
        p["eps"] = 0.0
        cpu.run(BN, **p)
        assert np.isinf(p["saveInvstd"][1]) and np.isnan(p["output"][:, 1]).all()
        assert np.isfinite(p["output"][:, ::2]).all() and p["runningVar"][1] != 0


def test_batch_norm_empty_input(cpu, rng, no_fallback):
    p = forward_call(rng, (0, 3, 4))
    cpu.run(BN, **p)
    assert (p["saveMean"] == 0).all() and np.isnan(p["saveInvstd"]).all()


def test_batch_norm_workspace(cpu, rng):
    p = forward_call(rng, (8, 32, 16, 16))
    size, executor = cpu.get_workspace_size(BN, **p)
    cpu.destroy_executor(executor)
    assert 4 * 8 * 32 <= size < 8 * 32 * 256 * 4  # per-channel vectors, well under one input
