"""The forward norms (aclnnBatchNorm too), RMSNorm, GroupNorm and SyncBatchNorm's helpers on the torch and npu backends.

The conformance suites (tests/conformance.py) already run these operators on both backends; here
each call (aclnnLayerNorm, the RMSNorm and GroupNorm pairs, aclnnBatchNormStats, ...GatherStatsWithCounts,
...Elemt) is proved to reach the backend's own implementation: the NumPy reference is replaced by one
that fails, and on the fake CANN the call log shows GetWorkspaceSize, the launch and the kernel with
the operator's name, with every CANN object released afterwards.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable

import numpy as np
import pytest
import test_batch_norm_reduce_backward
import test_group_norm
import test_layer_norm_forward
import test_rms_norm
import test_sync_batch_norm
from batch_norm_forward_cases import check, forward_call, forward_reference, snapshot
from conftest import TORCH_DEVICE
from group_norm_cases import group_norm_backward_call, group_norm_call
from layer_norm_forward_cases import layer_norm_forward_call
from oracle import BF16, assert_close
from rms_norm_cases import rms_norm_call, rms_norm_grad_call
from sync_batch_norm_cases import (
    elemt_call,
    elemt_reference,
    gather_call,
    gather_reference,
    reduce_call,
    stats_call,
    stats_reference,
)

from aclnn_server import LocalClient
from aclnn_server.backends.torch_backend import TorchBackend
from aclnn_server.ops import OPERATORS

F16 = np.dtype(np.float16)


def _checked(p: dict, check: Callable[[dict], None]) -> tuple[dict, Callable[[], None]]:
    return p, lambda: check(p)


def _gather(rng: np.random.Generator, dtype: np.dtype) -> tuple[dict, Callable[[], None]]:
    """The reference is taken before the call: runningMean/runningVar are updated in place."""
    p = gather_call(rng, 5, 4, dtype)
    ref = gather_reference(p)
    return p, lambda: test_sync_batch_norm.check_gather(p, ref)


def _stats(rng: np.random.Generator, dtype: np.dtype) -> tuple[dict, Callable[[], None]]:
    p = stats_call(rng, (4, 3, 5, 2), dtype)
    return p, lambda: [assert_close(p[n], r, n) for n, r in zip(("mean", "invstd"), stats_reference(p))]


def _elemt(rng: np.random.Generator, dtype: np.dtype) -> tuple[dict, Callable[[], None]]:
    p = elemt_call(rng, (3, 4, 5), dtype)
    return p, lambda: assert_close(p["output"], elemt_reference(p), "output")


def _batch_norm(rng: np.random.Generator, dtype: np.dtype) -> tuple[dict, Callable[[], None]]:
    """Training: the reference is taken before the call (runningMean/runningVar change in place)."""
    p = forward_call(rng, (4, 3, 5, 2), dtype=dtype)
    ref, before = forward_reference(p), snapshot(p)
    return p, lambda: check(p, ref, before)


# operator -> (rng, dtype) -> (a valid call, the check of its outputs)
CASES: dict[str, Callable[[np.random.Generator, np.dtype], tuple[dict, Callable[[], None]]]] = {
    "aclnnLayerNorm": lambda rng, dt: _checked(
        layer_norm_forward_call(rng, (6, 4, 8), 2, dt), test_layer_norm_forward.check
    ),
    "aclnnRmsNorm": lambda rng, dt: _checked(rms_norm_call(rng, (6, 4, 8), 2, dt), test_rms_norm.check_forward),
    "aclnnRmsNormGrad": lambda rng, dt: _checked(
        rms_norm_grad_call(rng, (6, 4, 8), 1, dt), test_rms_norm.check_backward
    ),
    "aclnnGroupNorm": lambda rng, dt: _checked(
        group_norm_call(rng, (3, 6, 4, 5), 3, dt), test_group_norm.check_forward
    ),
    "aclnnGroupNormBackward": lambda rng, dt: _checked(
        group_norm_backward_call(rng, (3, 6, 4, 5), 3, dt), test_group_norm.check_backward
    ),
    "aclnnBatchNormStats": _stats,
    "aclnnBatchNormGatherStatsWithCounts": _gather,
    "aclnnBatchNormElemt": _elemt,
    "aclnnBatchNormReduceBackward": lambda rng, dt: _checked(
        reduce_call(rng, (4, 3, 5, 2), dt), test_batch_norm_reduce_backward.check
    ),
    "aclnnBatchNorm": _batch_norm,
}
DTYPES = [np.float32, F16, BF16]


@pytest.fixture
def no_reference(monkeypatch):
    """Every operator of CASES fails if its NumPy reference runs."""

    def boom(**_: object) -> None:
        raise AssertionError("the NumPy reference ran")

    for name in CASES:
        monkeypatch.setitem(OPERATORS, name, dataclasses.replace(OPERATORS[name], compute=boom))


@pytest.fixture(scope="module")
def torch_client():
    with LocalClient(TorchBackend(TORCH_DEVICE)) as c:
        yield c


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", CASES)
def test_torch_backend_computes_it(torch_client, no_reference, rng, op, dtype):
    p, check = CASES[op](rng, dtype)
    torch_client.run(op, **p)
    check()


@pytest.mark.parametrize("mask", [(True, False, True), (False, True, False), (False, False, True)])
def test_torch_group_norm_backward_honours_the_mask(torch_client, no_reference, rng, mask):
    p = group_norm_backward_call(rng, (2, 6, 3), 3, mask=mask)
    torch_client.run("aclnnGroupNormBackward", **p)
    test_group_norm.check_backward(p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", CASES)
def test_npu_backend_runs_it_through_aclnn(fake, npu_backend, no_reference, rng, caplog, op, dtype):
    p, check = CASES[op](rng, dtype)
    before = fake.snapshot()
    misuse = fake.misuse[0]
    calls = fake.calls(op + "GetWorkspaceSize"), fake.calls(op)
    fake.clear_log()
    with caplog.at_level(logging.WARNING, logger="aclnn_server.npu"), LocalClient(npu_backend) as client:
        client.run(op, **p)
    check()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert fake.calls(op + "GetWorkspaceSize") > calls[0] and fake.calls(op) == calls[1] + 1
    log = fake.log()
    prepare = next(i for i, line in enumerate(log) if line.startswith(op + "GetWorkspaceSize"))
    launch = next(i for i, line in enumerate(log) if line.startswith(op + " executor="))
    kernel = next(i for i, line in enumerate(log) if line.startswith(f"kernel {op} "))
    assert prepare < launch < kernel
    assert log[kernel].endswith("-> 0")
    gc.collect()
    after = fake.snapshot()
    assert {k: after[k] for k in ("tensor", "intArray", "boolArray", "executor")} == {
        k: before[k] for k in ("tensor", "intArray", "boolArray", "executor")
    }
    assert fake.misuse[0] == misuse, fake.misuse[1]


@pytest.mark.parametrize("flags", [(True, False, True), (False, True, False), (False, False, True)], ids=str)
def test_reduce_backward_flags_reach_each_backend(torch_client, fake, npu_backend, no_reference, rng, flags):
    """inputG/weightG/biasG: a disabled output is a null pointer to CANN and None to torch; only the
    enabled ones are written."""
    for client in (torch_client, LocalClient(npu_backend)):
        p = reduce_call(rng, (3, 4, 5), flags=flags)
        off = {n: np.full(4, -7.25, np.float32) for n in ("sumDy", "gradWeight") if p[n] is None}
        client.run("aclnnBatchNormReduceBackward", **{**p, **off})
        test_batch_norm_reduce_backward.check(p)
        assert all((o == -7.25).all() for o in off.values())


@pytest.mark.parametrize("mask", [(True, False, True), (False, True, False), (False, False, True)])
def test_npu_group_norm_backward_honours_the_mask(fake, npu_backend, no_reference, rng, mask):
    p = group_norm_backward_call(rng, (2, 6, 3), 3, mask=mask)
    with LocalClient(npu_backend) as client:
        client.run("aclnnGroupNormBackward", **p)
    test_group_norm.check_backward(p)


def test_npu_layer_norm_null_statistics_and_affine(fake, npu_backend, no_reference, rng):
    """Null weight, bias, meanOut and rstdOut reach CANN as null pointers."""
    p = layer_norm_forward_call(rng, (5, 7), 1, weight=None, stats=False)
    with LocalClient(npu_backend) as client:
        client.run("aclnnLayerNorm", **p)
    test_layer_norm_forward.check(p)


def test_npu_empty_inputs(fake, npu_backend, no_reference, rng):
    """CANN's empty-tensor results come from the fake's kernels too: mean 0, rstd NaN, zero gradients."""
    p = group_norm_call(rng, (2, 4, 0), 2)
    q = group_norm_backward_call(rng, (0, 4, 3), 2)
    with LocalClient(npu_backend) as client:
        client.run("aclnnGroupNorm", **p)
        client.run("aclnnGroupNormBackward", **q)
    assert (p["meanOut"] == 0).all() and np.isnan(p["rstdOut"]).all()
    assert not q["gradGammaOut"].any() and not q["gradBetaOut"].any()


def test_torch_workspace_counts_float64_copies(torch_client, rng):
    """The ops computed in float64 on the cpu announce 8-byte copies of every input and output."""
    p = rms_norm_call(rng, (6, 4, 8), 1)
    numel = sum(v.size for v in p.values() if isinstance(v, np.ndarray))
    size, executor = torch_client.get_workspace_size("aclnnRmsNorm", **p)
    torch_client.execute(executor)
    assert size >= 8 * 3 * numel
