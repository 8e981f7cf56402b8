"""The cpu backend (Numba kernels): reproducible bits, agreement with the NumPy reference, fallbacks."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys

import numba
import numpy as np
import pytest
from layer_norm_cases import F32, layer_norm_call, layer_norm_reference
from oracle import BF16, FLOAT_DTYPES, assert_close, rand, sentinel_like

from aclnn_server import LocalClient
from aclnn_server.backends import create_backend
from aclnn_server.backends.cpu import CpuBackend
from aclnn_server.ops import OPERATORS
from aclnn_server.registry import Operator, Plan

LN = "aclnnLayerNormBackward"
LN_OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")
F16 = np.dtype(np.float16)


@pytest.fixture(scope="module")
def cpu() -> LocalClient:
    c = LocalClient(backend="cpu")
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference() -> LocalClient:
    c = LocalClient(backend="numpy")
    yield c
    c.close()


def run_bits(client: LocalClient, op: str, p: dict, outputs: tuple[str, ...]) -> list[bytes]:
    client.run(op, **p)
    return [p[name].tobytes() for name in outputs if p[name] is not None]


def ln_case(rng, dtype=F32, out_dtype=None, shape=(301, 1100)) -> dict:
    return layer_norm_call(rng, shape, 1, dtype, "float32", out_dtype=out_dtype)


def bn_case(rng, dtype=F32, shape=(3, 5, 7, 9), training=True) -> dict:
    from batch_norm_cases import bn_call

    return bn_call(rng, shape, 1, dtype, "float32", training=training)


def test_auto_picks_cpu_when_numba_imports():
    assert create_backend("auto").name == "cpu"
    assert create_backend("cpu").name == "cpu"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_bit_identical_across_repeats_and_thread_counts(cpu, rng, dtype):
    p = ln_case(rng, dtype)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run_bits(cpu, LN, p, LN_OUTPUTS)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = [run_bits(cpu, LN, p, LN_OUTPUTS) for _ in range(3)]
    finally:
        numba.set_num_threads(threads)
    assert many[0] == many[1] == many[2] == one


def test_batch_norm_bit_identical_across_thread_counts(cpu, rng):
    if "aclnnBatchNormBackward" not in OPERATORS:
        pytest.skip("aclnnBatchNormBackward is not registered yet")
    p = bn_case(rng, BF16)
    outputs = ("gradInput", "gradWeight", "gradBias")
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run_bits(cpu, "aclnnBatchNormBackward", p, outputs)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = [run_bits(cpu, "aclnnBatchNormBackward", p, outputs) for _ in range(2)]
    finally:
        numba.set_num_threads(threads)
    assert many[0] == many[1] == one


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_layer_norm_agrees_with_reference_every_dtype(cpu, reference, rng, dtype, out_dtype):
    p = ln_case(rng, dtype, out_dtype, shape=(37, 2051))  # rows longer than a ROW_BLOCK, ragged lanes
    q = {k: (v.copy() if isinstance(v, np.ndarray) and k in LN_OUTPUTS else v) for k, v in p.items()}
    cpu.run(LN, **p)
    reference.run(LN, **q)
    ref = layer_norm_reference(p)
    for name, r in zip(LN_OUTPUTS, ref):
        assert_close(p[name], r.reshape(p[name].shape), name)
        assert_close(p[name], q[name].astype(np.float64), name)  # and the NumPy backend's numbers


def test_strided_inputs_gathered_rows_and_broadcast(cpu, rng):
    base = ln_case(rng, BF16, F32, shape=(40, 70))
    x_t = np.ascontiguousarray(base["input"].T).T  # column-major: rows are gathered
    g_b = np.broadcast_to(base["gradOut"][:1], (40, 70))  # row stride 0
    wide = np.zeros((40, 140), BF16)
    wide[:, ::2] = base["input"]
    for x, g in ((x_t, g_b), (wide[:, ::2], base["gradOut"])):
        p = dict(base, input=x, gradOut=g)
        for name in LN_OUTPUTS:
            p[name] = sentinel_like(base[name].shape, F32)
        cpu.run(LN, **p)
        ref = layer_norm_reference(dict(p, input=np.ascontiguousarray(x), gradOut=np.ascontiguousarray(g)))
        for name, r in zip(LN_OUTPUTS, ref):
            assert_close(p[name], r.reshape(p[name].shape), name)


def test_unmergeable_view_falls_back_to_numpy(cpu, rng, caplog):
    """Leading dims that do not merge into rows run on the reference, logged once."""
    big = rand(rng, (4, 6, 5), F32)
    p = layer_norm_call(rng, (4, 3, 5), 1)
    p["input"] = big[:, :3, :]  # strides (30, 5, 1): [4, 3] does not merge into 12 rows
    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        cpu.run(LN, **p)
        cpu.run(LN, **p)
    notes = [r.message for r in caplog.records if "NumPy reference" in r.message]
    assert len(notes) <= 1  # once per backend (an earlier test in this process may have logged it)
    for name, r in zip(LN_OUTPUTS, layer_norm_reference(p)):
        assert_close(p[name], r.reshape(p[name].shape), name)


def test_operator_without_kernel_falls_back(caplog):
    calls = []
    fake = Operator(
        "FakeOp", OPERATORS[LN].signature, OPERATORS[LN].validate, lambda plan: 7, lambda **a: calls.append(a)
    )
    backend = CpuBackend()
    plan = Plan(inputs={}, outputs={})
    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        assert backend.workspace_size(fake, plan) == 7
        backend.compute(fake, plan, {"x": 1})
        backend.compute(fake, plan, {"x": 2})
    assert calls == [{"x": 1}, {"x": 2}]
    assert sum("FakeOp runs on the NumPy reference" in r.message for r in caplog.records) == 1


def test_workspace_size_counts_the_kernels_scratch(cpu, rng):
    p = ln_case(rng, F32, shape=(1000, 64))
    size, executor = cpu.get_workspace_size(LN, **p)
    cpu.destroy_executor(executor)
    assert 2 * 4 * 64 * 32 <= size < 1000 * 64 * 4  # column partials, well under one input


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm_agrees_with_reference(cpu, reference, rng, dtype, training):
    if "aclnnBatchNormBackward" not in OPERATORS:
        pytest.skip("aclnnBatchNormBackward is not registered yet")
    from batch_norm_cases import bn_reference

    p = bn_case(rng, dtype, training=training)
    outputs = ("gradInput", "gradWeight", "gradBias")
    cpu.run("aclnnBatchNormBackward", **p)
    for name, r in zip(outputs, bn_reference(p)):
        assert_close(p[name], np.asarray(r).reshape(p[name].shape), name)


def channel_last_call(rng, shape, dtype, training=True, channel_stride=1) -> tuple[dict, dict]:
    """A channel-last BatchNorm call (NHWC or NDHWC by rank), its input's channels `channel_stride`
    apart; (the call, the same call on plain arrays for the reference and the results)."""
    from batch_norm_cases import DATA_TYPES, bn_call, tagged

    from aclnn_client import Format, create_tensor

    fmt = Format.NHWC if len(shape) == 4 else Format.NDHWC
    p = bn_call(rng, shape, len(shape) - 1, dtype, "float32", training=training)
    wide = np.zeros((*shape[:-1], shape[-1] * channel_stride), dtype)
    wide[..., ::channel_stride] = p["input"]
    strides = [s // wide.itemsize for s in wide[..., ::channel_stride].strides]
    x = create_tensor(shape, DATA_TYPES[np.dtype(dtype)], strides, 0, fmt, [wide.size], wide.reshape(-1))
    q = dict(p, gradOut=tagged(p["gradOut"], fmt), input=x, gradInput=tagged(p["gradInput"], fmt))
    return q, p


BN_OUTPUTS = ("gradInput", "gradWeight", "gradBias")


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_channel_last_batch_norm_runs_its_kernel(cpu, rng, caplog, dtype, training):
    """NHWC with L = 4608 (tasks of more than one fp32 sub-block), NDHWC, and channels at a
    stride (gathered rows) agree with the float64 reference, without a fallback."""
    from batch_norm_cases import bn_reference

    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        for shape, stride in (((2, 48, 48, 5), 1), ((2, 3, 4, 5, 7), 1), ((3, 4, 5, 6), 2)):
            q, p = channel_last_call(rng, shape, dtype, training, stride)
            cpu.run("aclnnBatchNormBackward", **q)
            for name, r in zip(BN_OUTPUTS, bn_reference(p, len(shape) - 1)):
                assert_close(p[name], np.asarray(r).reshape(p[name].shape), name)
    assert not [r for r in caplog.records if "aclnnBatchNormBackward runs on the NumPy reference" in r.message]


def test_channel_last_batch_norm_bit_identical_across_thread_counts(cpu, rng):
    q, p = channel_last_call(rng, (3, 40, 50, 6), F16)
    threads = numba.get_num_threads()
    try:
        runs = []
        for n in (1, numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            cpu.run("aclnnBatchNormBackward", **q)
            runs.append([p[name].tobytes() for name in BN_OUTPUTS])
    finally:
        numba.set_num_threads(threads)
    assert runs[0] == runs[1] == runs[2]


def test_bf16_outputs_round_to_nearest_even_and_keep_nan(cpu, rng):
    p = ln_case(rng, F32, BF16, shape=(8, 33))
    p["gradOut"][3, 4] = np.nan
    q = {k: (v.copy() if isinstance(v, np.ndarray) and k in LN_OUTPUTS else v) for k, v in p.items()}
    cpu.run(LN, **p)
    LocalClient(backend="numpy").run(LN, **q)
    assert np.isnan(p["gradInputOut"][3]).all() and not np.isnan(p["gradInputOut"][[0, 1, 2, 4]]).any()
    assert_close(p["gradInputOut"][:3], q["gradInputOut"][:3].astype(np.float64))


def test_small_calls_run_on_one_thread_and_restore_the_setting(cpu, rng):
    threads = numba.get_num_threads()
    p = ln_case(rng, F32, shape=(4, 8))
    cpu.run(LN, **p)
    assert numba.get_num_threads() == threads
    for name, r in zip(LN_OUTPUTS, layer_norm_reference(p)):
        assert_close(p[name], r.reshape(p[name].shape), name)


# --- output masks: every mask, dtype and layout on the kernels (not the reference) ------------------

MASKS = list(itertools.product([True, False], repeat=3))


def strided(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """The same values as a view with every other element of `axis` skipped (rows gathered)."""
    shape = list(a.shape)
    shape[axis] *= 2
    wide = np.full(shape, -3.5, a.dtype)
    index = [slice(None)] * a.ndim
    index[axis] = slice(None, None, 2)
    wide[tuple(index)] = a
    return wide[tuple(index)]


@pytest.fixture
def kernels_only(caplog):
    """Fails the test when a call ran on the NumPy reference instead of a kernel."""
    with caplog.at_level(logging.INFO, logger="aclnn_server"):
        yield
    notes = [r.message for r in caplog.get_records("call") if "runs on the NumPy reference" in r.message]
    assert not notes, notes


def check_masked(p: dict, names: tuple[str, ...], refs) -> None:
    for name, ref in zip(names, refs):
        if p[name] is not None:
            assert_close(p[name], np.asarray(ref).reshape(p[name].shape), name)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "channel-last", "channel-last-strided"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_batch_norm_backward_every_mask(cpu, rng, kernels_only, dtype, layout):
    """Each of the 8 masks in training and inference; a masked-off gradInput in fp16/bf16 took a
    placeholder no compiled signature accepted (561000)."""
    from batch_norm_cases import bn_call, bn_reference

    shape = (3, 4, 5, 6)
    for training in (True, False):
        for mask in MASKS:
            if layout.startswith("channel-last"):
                q, p = channel_last_call(rng, shape, dtype, training, 2 if layout.endswith("strided") else 1)
                q["outputMask"] = p["outputMask"] = list(mask)
                for name, on in zip(BN_OUTPUTS, mask):
                    if not on:
                        q[name] = p[name] = None
                axis = 3
            else:
                p = bn_call(rng, shape, 1, dtype, "float32", training=training, mask=mask)
                q = dict(p, input=strided(p["input"])) if layout == "strided" else p
                axis = 1
            cpu.run("aclnnBatchNormBackward", **q)
            check_masked(p, BN_OUTPUTS, bn_reference(p, axis))


@pytest.mark.parametrize("layout", ["contiguous", "column-major", "strided"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_layer_norm_backward_every_mask(cpu, rng, kernels_only, dtype, layout):
    for mask in MASKS:
        p = layer_norm_call(rng, (37, 70), 1, dtype, "float32", mask=mask)
        x = {"contiguous": p["input"], "column-major": np.asfortranarray(p["input"]), "strided": strided(p["input"])}
        cpu.run(LN, **dict(p, input=x[layout]))
        check_masked(p, LN_OUTPUTS, layer_norm_reference(p))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_layer_norm_grad_every_mask(cpu, rng, kernels_only, dtype, layout):
    from test_layer_norm_grad import lng_call, lng_reference

    for mask in MASKS:
        p = lng_call(rng, (6, 5, 40), (6, 5, 1), (40,), dtype, mask=mask)
        cpu.run("LayerNormGrad", **(dict(p, x=strided(p["x"])) if layout == "strided" else p))
        ref = lng_reference(p)
        check_masked(p, ("pd_x", "pd_gamma", "pd_beta"), (ref["pd_x"], ref["pd_gamma"], ref["pd_beta"]))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_group_norm_backward_every_mask(cpu, rng, kernels_only, dtype, layout):
    from group_norm_cases import group_norm_backward_call, group_norm_backward_reference

    for mask in MASKS:
        p = group_norm_backward_call(rng, (3, 6, 4, 5), 3, dtype, F32, mask=mask)
        cpu.run("aclnnGroupNormBackward", **(dict(p, input=strided(p["input"])) if layout == "strided" else p))
        check_masked(p, ("gradInput", "gradGammaOut", "gradBetaOut"), group_norm_backward_reference(p))


def test_layout_check_reads_no_data():
    """Whether a view merges into the kernel's shape is decided from its descriptor alone: NumPy's
    shape setter, asked for a shape the strides cannot give, copied the probe first, reading through
    made-up strides far outside its one element (a SIGSEGV, seen under the fuzz)."""
    probe = (
        "from aclnn_server.backends.cpu._jit import _layout_ready\n"
        "print(_layout_ready((3, 4, 5), (1 << 38, 0, 1 << 34), (12, 5)), _layout_ready((3, 4, 5), (20, 5, 1), (12, 5)))"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout.split()) == (0, ["False", "True"]), run.stderr[-2000:]
