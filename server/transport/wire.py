"""Server-side protobuf decoding of calls and encoding of results."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aclnn_client._proto import aclnn_pb2 as pb
from aclnn_client.tensor import BoolArray, IntArray, Tensor, Value
from aclnn_client.types import data_type_of


def decode_tensor(message: pb.Tensor) -> Tensor:
    return Tensor(
        view_dims=tuple(message.view_dims),
        data_type=message.data_type,
        strides=tuple(message.strides),
        offset=message.offset,
        format=message.format,
        storage_dims=tuple(message.storage_dims),
        data=message.data if message.HasField("data") else None,
    )


def decode_value(message: pb.Value) -> Value:
    """A parameter value; a Value with no kind set is an explicit null pointer."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "tensor":
        return decode_tensor(message.tensor)
    if kind == "int_array":
        return IntArray(message.int_array.values)
    if kind == "bool_array":
        return BoolArray(message.bool_array.values)
    return getattr(message, kind)


def decode_params(params: Mapping[str, pb.Value]) -> dict[str, Value]:
    return {name: decode_value(value) for name, value in params.items()}


def encode_outputs(outputs: Mapping[str, np.ndarray]) -> dict[str, pb.OutputTensor]:
    return {
        name: pb.OutputTensor(data_type=data_type_of(array.dtype), dims=array.shape, data=array.tobytes())
        for name, array in outputs.items()
    }
