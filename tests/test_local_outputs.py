"""In process, LocalClient computes results straight into the caller's output arrays when every
output allows it (BoundCall.destinations), else into fresh arrays that are copied after."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from batch_norm_forward_cases import OP as BN
from batch_norm_forward_cases import check, forward_call, forward_reference, snapshot
from layer_norm_cases import layer_norm_call
from test_layer_norm_backward import OP, OUTPUTS, check_against_reference

from aclnn_client import AclnnError, Status
from aclnn_server import LocalClient


@pytest.fixture
def local(backend: str):
    with LocalClient(backend=backend) as c:
        yield c


def test_outputs_are_computed_in_place(local, rng):
    """No output-sized allocation: the 32 MiB gradInputOut is the caller's array, written directly."""
    p = layer_norm_call(rng, (8192, 1024))
    scratch, executor = local.get_workspace_size(OP, **p)
    local.destroy_executor(executor)
    local.run(OP, **p)  # warm: plan cache, threads
    tracemalloc.start()  # NumPy reports its array buffers to tracemalloc
    try:
        local.run(OP, **p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    check_against_reference(p)
    assert peak <= scratch + (64 << 10) < p["gradInputOut"].nbytes  # the workspace (and a little change), no output


def test_in_out_tensors_do_not_prevent_computing_in_place(local, rng):
    """aclnnBatchNorm's running statistics are an input and an output: the caller's arrays still take
    every result directly (no output-sized allocation), the running statistics updated in place."""
    p = forward_call(rng, (64, 16, 4096))
    scratch, executor = local.get_workspace_size(BN, **p)
    local.destroy_executor(executor)
    local.run(BN, **dict(p, runningMean=p["runningMean"].copy(), runningVar=p["runningVar"].copy()))  # warm
    ref, before = forward_reference(p), snapshot(p)
    tracemalloc.start()
    try:
        local.run(BN, **p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    check(p, ref, before)
    assert peak <= scratch + (64 << 10) < p["output"].nbytes


def test_output_overlapping_an_input_gets_a_fresh_array(local, rng):
    """gradInputOut is gradOut shifted by one row in one buffer: written in place, each row of
    gradInput would overwrite the next row of gradOut before it is read."""
    p = layer_norm_call(rng, (1000, 700))  # several row blocks
    buffer = np.concatenate([p["gradOut"], np.zeros((1, 700), np.float32)])
    expected = dict(p)
    p["gradOut"], p["gradInputOut"] = buffer[:-1], buffer[1:]
    local.run(OP, **p)
    expected.update({name: p[name] for name in OUTPUTS})
    check_against_reference(expected)


def test_outputs_sharing_one_array(local, rng):
    """gradWeightOut and gradBiasOut in one array: disjoint halves run in place; overlapping ones
    get fresh arrays, copied in the order of the outputs (gradBias over gradWeight's tail)."""
    p = layer_norm_call(rng, (64, 50))
    both = np.full(100, -7.25, np.float32)
    p["gradWeightOut"], p["gradBiasOut"] = both[:50], both[50:]
    local.run(OP, **p)
    check_against_reference(p)
    weight, bias = both[:50].copy(), both[50:].copy()
    shared = np.full(75, -7.25, np.float32)
    p["gradWeightOut"], p["gradBiasOut"] = shared[:50], shared[25:]
    local.run(OP, **p)
    assert np.array_equal(shared[:25], weight[:25]) and np.array_equal(shared[25:], bias)


def test_a_refused_output_means_no_output_is_written(local, rng):
    """A read-only gradBiasOut fails the call (161002 naming it) and leaves the others untouched,
    although gradInputOut and gradWeightOut alone could have been computed in place."""
    p = layer_norm_call(rng, (64, 50))
    p["gradBiasOut"].flags.writeable = False
    before = {name: p[name].copy() for name in OUTPUTS}
    with pytest.raises(AclnnError) as err:
        local.run(OP, **p)
    assert err.value.code == Status.PARAM_INVALID and err.value.param == "gradBiasOut"
    for name in OUTPUTS:
        assert p[name].tobytes() == before[name].tobytes(), name


def test_strided_output_is_written_through_its_view(local, rng):
    """A non-contiguous output view cannot take a kernel's writes: computed fresh, then copied in."""
    p = layer_norm_call(rng, (40, 30))
    storage = np.full((40, 60), -7.25, np.float32)
    p["gradInputOut"] = storage[:, ::2]
    local.run(OP, **p)
    check_against_reference(p)
    assert (storage[:, 1::2] == -7.25).all()
