"""The client's encoding of a call: descriptors of any NumPy view, and the descriptor cache."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from aclnn_common.binding import bind
from aclnn_common.tensor import Tensor, tensor_from_array
from aclnn_common.wire import encode_call, encode_value

OP = "aclnnLayerNormBackward"
OUTPUTS = frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"})

BASE = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
VIEWS = {
    "contiguous": BASE,
    "transposed": BASE.transpose(2, 0, 1),
    "stepped": BASE[::2, 1::2, ::3],
    "size-1 dim with an odd stride": as_strided(BASE, shape=(3, 1, 5), strides=(120, 7 * 4, 4)),
    "empty": BASE[:, :0],
    "empty, not contiguous": BASE[:, :0, ::2],
    "negative strides": BASE[::-1, :, ::-1],
    "broadcast (stride 0)": np.broadcast_to(BASE[0, 0], (3, 5)),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_a_view_is_described_over_the_span_it_addresses(name):
    array = VIEWS[name]
    tensor = tensor_from_array(array)
    shipped = array if min(array.strides, default=0) >= 0 else np.ascontiguousarray(array)
    strides = tuple(s // array.itemsize for s in shipped.strides)
    span = 0 if not shipped.size else 1 + sum((d - 1) * s for d, s in zip(shipped.shape, strides))
    assert (tensor.view_dims, tensor.strides, tensor.offset, tensor.storage_dims) == (array.shape, strides, 0, (span,))
    assert tensor.data.shape == (span,) and not tensor.data.flags.writeable
    rebuilt = as_strided(tensor.data, shape=tensor.view_dims, strides=[s * array.itemsize for s in strides])
    np.testing.assert_array_equal(rebuilt, array)
    assert tensor_from_array(array, storage=False) == tensor.without_data()


def test_outputs_are_bound_without_their_bytes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    params = dict(gradOut=x, input=x, mean=x[:, :1], rstd=x[:, :1], weightOptional=x[0], normalizedShape=[8],
                  outputMask=[True, True, True], gradInputOut=np.empty_like(x),
                  gradWeightOut=np.empty(8, np.float32), gradBiasOut=np.empty(8, np.float32))  # fmt: skip
    # An output given as a descriptor with storage (aclCreateTensor) is bound without it too.
    params["gradWeightOut"] = tensor_from_array(np.empty(8, np.float32))
    assert params["gradWeightOut"].data is not None
    values = bind(OP, params, OUTPUTS).values
    assert all(values[name].data is None for name in OUTPUTS)
    assert values["gradWeightOut"] == params["gradWeightOut"].without_data()
    assert all(values[name].data is not None for name in ("gradOut", "input", "mean", "rstd", "weightOptional"))


def test_cached_descriptors_are_copied_into_each_call():
    """A call built from the cache can be changed (staging adds bytes and refs) without changing the next."""
    tensor = tensor_from_array(np.ones((4, 8), np.float32))
    first = encode_call(OP, {"input": tensor}, storage=False)
    first.params["input"].tensor.data = b"changed"
    first.params["input"].tensor.view_dims.append(9)
    second = encode_call(OP, {"input": tensor}, storage=False)
    assert second.params["input"] == encode_value(tensor, storage=False)
    assert not second.params["input"].tensor.HasField("data")


def test_storage_is_encoded_unless_left_out():
    array = np.arange(6, dtype=np.float32)
    tensor = tensor_from_array(array)
    assert encode_call(OP, {"input": tensor}).params["input"].tensor.data == array.tobytes()
    assert not encode_call(OP, {"input": tensor}, storage=False).params["input"].tensor.HasField("data")


def test_a_hand_made_descriptor_with_lists_still_encodes():
    """Tensor fields that are lists cannot key the cache: such a descriptor is encoded directly."""
    tensor = Tensor([2, 3], 0, [3, 1], 0, 2, [6])
    message = encode_call(OP, {"input": tensor}, storage=False).params["input"].tensor
    assert (list(message.view_dims), list(message.strides), list(message.storage_dims)) == ([2, 3], [3, 1], [6])
