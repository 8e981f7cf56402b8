"""Server-side protobuf decoding of calls and encoding of results."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.tensor import BoolArray, IntArray, Tensor, Value
from aclnn_common.types import data_type_of

StorageResolver = Callable[[pb.StorageRef], Any]


def decode_tensor(message: pb.Tensor, resolve: StorageResolver) -> Tensor:
    """A tensor; bytes held on the server (`ref`) are looked up through `resolve`."""
    if message.HasField("data"):
        data = message.data
    else:
        data = resolve(message.ref) if message.HasField("ref") else None
    return Tensor(
        view_dims=tuple(message.view_dims),
        data_type=message.data_type,
        strides=tuple(message.strides),
        offset=message.offset,
        format=message.format,
        storage_dims=tuple(message.storage_dims),
        data=data,
    )


# A Value encoded in at most this many bytes, and no tensor's bytes, is decoded once and looked up by its
# encoding after that: a training loop sends the same descriptors (and attached ranges) call after call,
# and reading a tensor's fields out of protobuf costs ~5 us. Others (inline bytes, long arrays) are
# decoded each time, so the cache never holds a caller's tensor bytes.
_CACHED_VALUE_BYTES = 256


def decode_value(message: pb.Value, resolve: StorageResolver) -> Value:
    """A parameter value; a Value with no kind set is an explicit null pointer."""
    inline = message.WhichOneof("kind") == "tensor" and message.tensor.HasField("data")
    if not inline and message.ByteSize() <= _CACHED_VALUE_BYTES:
        value, ref = _decoded(message.SerializeToString())
        if ref is None:
            return value
        return Tensor(value.view_dims, value.data_type, value.strides, value.offset, value.format,
                      value.storage_dims, resolve(ref))  # fmt: skip
    return _decode_value(message, resolve)


@functools.lru_cache(maxsize=4096)
def _decoded(encoded: bytes) -> tuple[Value, pb.StorageRef | None]:
    """A small Value decoded, with the reference its bytes are resolved through per call (None: no bytes
    to resolve). Only immutable values are cached; the StorageRef is never handed out to be changed."""
    message = pb.Value.FromString(encoded)
    ref = message.tensor.ref if message.WhichOneof("kind") == "tensor" and message.tensor.HasField("ref") else None
    return _decode_value(message, lambda _: None), ref


def _decode_value(message: pb.Value, resolve: StorageResolver) -> Value:
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "tensor":
        return decode_tensor(message.tensor, resolve)
    if kind == "int_array":
        return IntArray(message.int_array.values)
    if kind == "bool_array":
        return BoolArray(message.bool_array.values)
    return getattr(message, kind)


def decode_params(params: Mapping[str, pb.Value], resolve: StorageResolver) -> dict[str, Value]:
    return {name: decode_value(value, resolve) for name, value in params.items()}


def output_tensor(
    array: np.ndarray, inline: bool = True, handle: str = "", attached: pb.ByteRange | None = None
) -> pb.OutputTensor:
    data = array.tobytes() if inline else b""
    return pb.OutputTensor(
        data_type=data_type_of(array.dtype), dims=array.shape, data=data, handle=handle, attached=attached
    )
