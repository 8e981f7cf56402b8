"""Hostile tensor descriptors (SPEC 1.4): each rejected with 161002 naming the tensor.

The server must never read or write outside a buffer, nor allocate memory sized by
an unchecked number, and it keeps serving afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import Untouched, assert_close

from aclnn_client import AclnnError, DataType, Format, create_tensor

OP = "aclnnLayerNormBackward"
FLOAT, ND = DataType.FLOAT, Format.ND
BIG = 2**40


def input_tensor(view=(4, 8), strides=(8, 1), offset=0, storage=(32,), data=None, dtype=FLOAT, fmt=ND, nbytes=None):
    """A hand-made descriptor for `input`; data defaults to exactly the storage's bytes."""
    if data is None:
        count = int(np.prod(storage)) if all(0 <= d < 2**20 for d in storage) else 0
        data = bytes(nbytes if nbytes is not None else 4 * count)
    return create_tensor(view, dtype, strides, offset, fmt, storage, data)


HOSTILE_INPUTS = {
    "view-past-storage": input_tensor(offset=1),
    "view-past-storage-by-stride": input_tensor(strides=(9, 1)),
    "negative-stride": input_tensor(strides=(-8, 1), offset=31),
    "negative-offset": input_tensor(offset=-1),
    "negative-dim": input_tensor(view=(4, -8)),
    "negative-storage-dim": input_tensor(storage=(-32,)),
    "strides-count": input_tensor(strides=(8,)),
    "rank-9": input_tensor(view=(1,) * 7 + (4, 8), strides=(0,) * 7 + (8, 1)),
    "storage-rank-9": input_tensor(storage=(1,) * 8 + (32,)),
    "overflowing-view": input_tensor(view=(BIG, BIG, 8), strides=(0, 0, 1), storage=(8,)),
    "overflowing-storage": input_tensor(storage=(2**31, 2**31, 8)),
    "storage-bytes-overflow": input_tensor(storage=(2**61,), view=(4, 8)),
    "int64-extremes": input_tensor(view=(4, 8), strides=(2**63 - 1, 1), storage=(32,)),
    "unknown-dtype": input_tensor(dtype=99),
    "string-dtype": input_tensor(dtype=13),
    "int4-dtype": input_tensor(dtype=29),
    "unknown-format": input_tensor(fmt=99),
}


def assert_invalid(call, param: str) -> AclnnError:
    with pytest.raises(AclnnError) as info:
        call()
    assert (info.value.code, info.value.param) == (161002, param), str(info.value)
    return info.value


def assert_still_serving(client, rng) -> None:
    p = layer_norm_call(rng, (3, 5))
    client.run(OP, **p)
    assert_close(p["gradInputOut"], layer_norm_reference(p)[0])


@pytest.mark.parametrize("hostile", HOSTILE_INPUTS.values(), ids=HOSTILE_INPUTS.keys())
def test_hostile_input_descriptor(client, rng, hostile):
    p = layer_norm_call(rng, (4, 8))
    p["input"] = hostile
    untouched = Untouched(p["gradInputOut"], p["gradWeightOut"], p["gradBiasOut"])
    assert_invalid(lambda: client.get_workspace_size(OP, **p), "input")
    assert_invalid(lambda: client.run(OP, **p), "input")
    untouched.check()
    assert_still_serving(client, rng)


@pytest.mark.parametrize("nbytes", [0, 4 * 32 - 1, 4 * 32 + 4, 4 * 64])
def test_storage_bytes_must_match_descriptor(client, rng, nbytes):
    """Short or long data passes planning (descriptors only) and fails at execute, spending nothing."""
    p = layer_norm_call(rng, (4, 8))
    p["input"] = input_tensor(nbytes=nbytes)
    _, executor = client.get_workspace_size(OP, **p)
    untouched = Untouched(p["gradInputOut"], p["gradWeightOut"], p["gradBiasOut"])
    assert_invalid(lambda: client.execute(executor), "input")
    assert_invalid(lambda: client.run(OP, **p), "input")
    untouched.check()
    p["input"] = input_tensor(data=np.ascontiguousarray(p["gradOut"]).tobytes())
    executor.call.values["input"] = p["input"]  # the caller fixes the bytes: the executor was not spent
    client.execute(executor)


def test_size_one_dims_ignore_their_strides(client, rng):
    """A huge stride on a size-1 dim addresses nothing: valid, and no byte-offset overflow."""
    p = layer_norm_call(rng, (1, 8))
    x = p["input"]
    p["input"] = create_tensor([1, 8], FLOAT, [2**62, 1], 0, ND, [8], x.tobytes())
    client.run(OP, **p)
    assert_close(p["gradInputOut"], layer_norm_reference(dict(p, input=x))[0])


@pytest.mark.parametrize(
    "strides,storage",
    [((0, 1), (8,)), ((1, 1), (16,)), ((4, 1), (32,))],
    ids=["stride-0", "overlapping-rows", "rows-overlap-by-half"],
)
def test_output_must_not_write_an_element_twice(client, rng, strides, storage):
    p = layer_norm_call(rng, (4, 8))
    buf = np.zeros(storage, np.float32)
    p["gradInputOut"] = create_tensor([4, 8], FLOAT, strides, 0, ND, storage, buf)
    assert_invalid(lambda: client.run(OP, **p), "gradInputOut")
    assert not buf.any()


def test_output_view_past_its_storage(client, rng):
    p = layer_norm_call(rng, (4, 8))
    buf = np.zeros(31, np.float32)
    p["gradInputOut"] = create_tensor([4, 8], FLOAT, [8, 1], 0, ND, [31], buf)
    assert_invalid(lambda: client.run(OP, **p), "gradInputOut")
    assert not buf.any()


def test_outputs_beyond_memory_budget_are_refused_before_allocation(client, rng):
    """Broadcast inputs may describe 2^40 elements; their output would be 4 TiB: refused."""
    rows = 2**20
    p = {
        "gradOut": create_tensor([rows, rows], FLOAT, [0, 0], 0, ND, [1], bytes(4)),
        "input": create_tensor([rows, rows], FLOAT, [0, 0], 0, ND, [1], bytes(4)),
        "normalizedShape": [rows],
        "mean": create_tensor([rows], FLOAT, [0], 0, ND, [1], bytes(4)),
        "rstd": create_tensor([rows], FLOAT, [0], 0, ND, [1], bytes(4)),
        "outputMask": [True, False, False],
        "gradInputOut": create_tensor([rows, rows], FLOAT, [rows, 1], 0, ND, [rows * rows], np.zeros(1, np.float32)),
    }
    error = assert_invalid(lambda: client.get_workspace_size(OP, **p), "gradOut")
    assert "cannot hold" in str(error) and "memory" in str(error)
    assert_still_serving(client, rng)
