"""Client-side protobuf encoding: parameter values out, results and errors in."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ._proto import aclnn_pb2 as pb
from .chunks import byte_view
from .device import DeviceBuffer
from .errors import AclnnError, Status, malformed
from .tensor import BoolArray, IntArray, Tensor, Value
from .types import numpy_dtype

_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}


def encode_tensor(tensor: Tensor, storage: bool = True) -> pb.Tensor:
    message = pb.Tensor(
        data_type=tensor.data_type,
        format=tensor.format,
        view_dims=tensor.view_dims,
        strides=tensor.strides,
        offset=tensor.offset,
        storage_dims=tensor.storage_dims,
    )
    if isinstance(tensor.data, DeviceBuffer):  # a pointer into server memory: it always travels
        message.ref.device.buffer, message.ref.device.offset = tensor.data.id, tensor.data.offset
    elif storage and tensor.data is not None:
        message.data = byte_view(tensor.data).tobytes()
    return message


def encode_value(value: Value, storage: bool = True) -> pb.Value:
    """A value as protobuf; None becomes a Value with no kind set (an explicit null)."""
    if value is None:
        return pb.Value()
    if isinstance(value, Tensor):
        return pb.Value(tensor=encode_tensor(value, storage))
    if isinstance(value, BoolArray):
        return pb.Value(bool_array=pb.BoolArray(values=value))
    if isinstance(value, IntArray):
        return pb.Value(int_array=pb.IntArray(values=value))
    if isinstance(value, bool):
        return pb.Value(bool_value=value)
    if isinstance(value, int):
        return pb.Value(int_value=value)
    if isinstance(value, float):
        return pb.Value(double_value=value)
    return pb.Value(string_value=str(value))


def encode_call(op: str, values: Mapping[str, Value], storage: bool = True) -> pb.OpCall:
    """The call as protobuf; with `storage` False its tensors go without their bytes (the caller
    stages those)."""
    return pb.OpCall(op=op, params={name: _value_message(v, storage) for name, v in values.items()})


def _value_message(value: Value, storage: bool) -> pb.Value:
    """encode_value, from a cache for a tensor without bytes: a training loop sends the same
    descriptors call after call, and building one costs ~6 µs. The cached message is only ever
    copied (into the call's map), never handed out."""
    if not isinstance(value, Tensor) or (value.data is not None and (storage or isinstance(value.data, DeviceBuffer))):
        return encode_value(value, storage)
    key = (value.view_dims, value.data_type, value.strides, value.offset, value.format, value.storage_dims)
    try:
        return _described(key)
    except TypeError:  # an unhashable field (a hand-made Tensor): encoded as it is, or refused there
        return encode_value(value, storage=False)


@functools.lru_cache(maxsize=4096)
def _described(key: tuple) -> pb.Value:
    return encode_value(Tensor(*key))


def decode_output(output: pb.OutputTensor, data: bytes | memoryview | None = None) -> np.ndarray:
    """A result array over the message's bytes, or over `data` (its bytes sent beside it); no copy."""
    dtype = numpy_dtype(output.data_type)
    if dtype is None:
        raise AclnnError(Status.INNER, f"server returned unknown data type {output.data_type}")
    raw = output.data if data is None else data
    dims = tuple(output.dims)
    if any(d < 0 for d in dims) or len(raw) != int(np.prod(dims, dtype=object)) * dtype.itemsize:
        raise malformed(f"a result of {len(raw)} bytes for dims {list(dims)} of {dtype}")
    return np.frombuffer(raw, dtype=dtype).reshape(dims)


def decode_outputs(outputs: Mapping[str, pb.OutputTensor]) -> dict[str, np.ndarray]:
    return {name: decode_output(out) for name, out in outputs.items()}


def decode_status(status: status_pb2.Status) -> AclnnError:
    """The AclnnError a google.rpc.Status carries in its ErrorInfo detail (a runtime error without one,
    or with a status that is no failure code)."""
    code = _GRPC_CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == "aclnn":
            given = info.metadata.get("status", "")
            aclnn_code = int(given) if given.isdigit() and int(given) > 0 else Status.RUNTIME_ERROR
            return AclnnError(aclnn_code, status.message, info.metadata.get("param", ""), grpc_code=code)
    # Transport failures (server gone, deadline, ...) are runtime errors to the caller.
    return AclnnError(Status.RUNTIME_ERROR, f"{code.name}: {status.message}", grpc_code=code)


def decode_status_bytes(payload: bytes | memoryview) -> AclnnError:
    """The AclnnError of a serialized google.rpc.Status (a data-channel error reply)."""
    try:
        return decode_status(status_pb2.Status.FromString(payload))
    except DecodeError:
        return malformed("an error reply that is no google.rpc.Status")


def decode_error(error: grpc.RpcError) -> AclnnError:
    """The AclnnError a failed RPC carries in its google.rpc.Status."""
    try:
        status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    except (DecodeError, ValueError):  # details that do not parse, or name another code than the call's
        status = None
    if status is None:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        status = status_pb2.Status(code=code.value[0], message=details or "")
    return decode_status(status)
