"""Server-side protobuf decoding of calls and encoding of results."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.errors import invalid_error
from aclnn_common.tensor import BoolArray, IntArray, Tensor, Value
from aclnn_common.types import data_type_of

StorageResolver = Callable[[pb.StorageRef, str], Any]  # a tensor's StorageRef, and its parameter's name


def decode_tensor(message: pb.Tensor, resolve: StorageResolver, name: str) -> Tensor:
    """Parameter `name`'s tensor; bytes held on the server (`ref`) are looked up through `resolve`."""
    if message.HasField("data") and message.HasField("ref"):  # two storages: which one the call reads is no guess
        raise invalid_error(name, "a tensor's storage is its inline data or its ref, not both")
    if message.HasField("data"):
        data = message.data
    else:
        data = resolve(message.ref, name) if message.HasField("ref") else None
    return Tensor(
        view_dims=tuple(message.view_dims),
        data_type=message.data_type,
        strides=tuple(message.strides),
        offset=message.offset,
        format=message.format,
        storage_dims=tuple(message.storage_dims),
        data=data,
    )


# Small Values, and small calls whose tensors carry no bytes inline, are decoded once and looked up by
# their encoding after that: a training loop sends the same descriptors (and attached ranges) call after
# call, and reading a tensor's fields out of protobuf costs ~5 us. Only each tensor's storage is resolved
# per call. Others (inline bytes, long arrays) are decoded each time: the caches never hold a caller's
# tensor bytes, and at most _VALUES_KEPT x 256 B + _CALLS_KEPT x 2 KiB of encodings.
_CACHED_VALUE_BYTES = 256
_VALUES_KEPT = 1024
_CACHED_CALL_BYTES = 2048
_CALLS_KEPT = 256
_Layout = tuple[tuple[str, Value, pb.StorageRef | None], ...]  # name, value (storage aside), its StorageRef
_calls: dict[bytes, _Layout] = {}
_calls_lock = threading.Lock()


def decode_call(request: pb.OpCall, resolve: StorageResolver) -> dict[str, Value]:
    """A call's parameter values (as decode_params), from its layout when it was decoded before."""
    # Tested first, before ByteSize serializes the message to measure it: inline bytes can be megabytes.
    if _carries_bytes(request.params):
        return decode_params(request.params, resolve)
    if request.reservation or request.ByteSize() > _CACHED_CALL_BYTES:  # uploads: names made for this call
        return decode_params(request.params, resolve)
    encoded = request.SerializeToString()
    layout = _calls.get(encoded)
    if layout is None:
        layout = _layout(request.params)
        if layout is None:  # a handle
            return decode_params(request.params, resolve)
        with _calls_lock:
            if len(_calls) >= _CALLS_KEPT:
                del _calls[next(iter(_calls))]  # the oldest
            _calls[encoded] = layout
    return {name: value if ref is None else _with_storage(value, resolve(ref, name)) for name, value, ref in layout}


def _carries_bytes(params: Mapping[str, pb.Value]) -> bool:
    """Whether a tensor of the call carries its bytes inline (never kept: see above)."""
    return any(m.WhichOneof("kind") == "tensor" and m.tensor.HasField("data") for m in params.values())


def _layout(params: Mapping[str, pb.Value]) -> _Layout | None:
    """The call's values decoded with their storage aside; None when a tensor carries its bytes inline,
    or names an upload or a kept result (a handle, made for one call: its layout would not repeat)."""
    layout = []
    for name, message in params.items():
        parts = _parts(message)
        if parts is None or (parts[1] is not None and parts[1].WhichOneof("kind") == "handle"):
            return None
        layout.append((name, *parts))
    return tuple(layout)


def decode_value(message: pb.Value, resolve: StorageResolver, name: str) -> Value:
    """Parameter `name`'s value; a Value with no kind set is an explicit null pointer."""
    parts = _parts(message)
    if parts is None:
        return _decode_value(message, resolve, name)
    value, ref = parts
    return value if ref is None else _with_storage(value, resolve(ref, name))


def _parts(message: pb.Value) -> tuple[Value, pb.StorageRef | None] | None:
    """A Value decoded with its storage aside (decoded once when small), and the StorageRef of that
    storage (None: no storage); None when it is a tensor with its bytes inline."""
    if message.WhichOneof("kind") == "tensor" and message.tensor.HasField("data"):
        return None
    if message.ByteSize() <= _CACHED_VALUE_BYTES:
        return _decoded(message.SerializeToString())
    return _without_storage(message)


@functools.lru_cache(maxsize=_VALUES_KEPT)
def _decoded(encoded: bytes) -> tuple[Value, pb.StorageRef | None]:
    """Only immutable values are cached; a StorageRef is only ever read."""
    return _without_storage(pb.Value.FromString(encoded))


def _without_storage(message: pb.Value) -> tuple[Value, pb.StorageRef | None]:
    ref = None
    if message.WhichOneof("kind") == "tensor" and message.tensor.HasField("ref"):
        ref = pb.StorageRef()
        ref.CopyFrom(message.tensor.ref)  # its own: a kept layout holds nothing of the request it came in
    return _decode_value(message, lambda _ref, _name: None, ""), ref


def _with_storage(tensor: Tensor, data: Any) -> Tensor:
    return Tensor(tensor.view_dims, tensor.data_type, tensor.strides, tensor.offset, tensor.format,
                  tensor.storage_dims, data)  # fmt: skip


def _decode_value(message: pb.Value, resolve: StorageResolver, name: str) -> Value:
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "tensor":
        return decode_tensor(message.tensor, resolve, name)
    if kind == "int_array":
        return IntArray(message.int_array.values)
    if kind == "bool_array":
        return BoolArray(message.bool_array.values)
    return getattr(message, kind)


def decode_params(params: Mapping[str, pb.Value], resolve: StorageResolver) -> dict[str, Value]:
    return {name: decode_value(value, resolve, name) for name, value in params.items()}


def output_tensor(
    array: np.ndarray, inline: bool = True, handle: str = "", attached: pb.ByteRange | None = None
) -> pb.OutputTensor:
    data = array.tobytes() if inline else b""
    return pb.OutputTensor(
        data_type=data_type_of(array.dtype), dims=array.shape, data=data, handle=handle, attached=attached
    )
