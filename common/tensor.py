"""Tensor descriptors (aclCreateTensor) and the other parameter values a call carries.

These are the transport-neutral values of a call: the gRPC client encodes them as
protobuf, LocalClient hands them to the server core as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .types import Format, data_type_of

# Element counts and byte lengths above this are refused (SPEC 1.4 rule 3): it keeps every byte offset
# and stride within int64. A device buffer holds at most this many bytes.
MAX_COUNT = 2**62


@dataclass(frozen=True)
class Tensor:
    """An aclTensor descriptor plus its storage. Built by `create_tensor`; never validated here."""

    view_dims: tuple[int, ...]
    data_type: int
    strides: tuple[int, ...]
    offset: int
    format: int
    storage_dims: tuple[int, ...]
    data: Any = None  # the storage: a NumPy array or bytes-like, or None (outputs need none)

    def without_data(self) -> Tensor:
        return Tensor(self.view_dims, self.data_type, self.strides, self.offset, self.format, self.storage_dims)


class IntArray(tuple):
    """aclIntArray (INT64 values)."""


class BoolArray(tuple):
    """aclBoolArray."""


Value = Tensor | IntArray | BoolArray | bool | int | float | str | None


def create_tensor(
    view_dims: Any,
    data_type: int,
    strides: Any,
    offset: int,
    fmt: int,
    storage_dims: Any,
    data: Any = None,
) -> Tensor:
    """Mirrors aclCreateTensor: strides and offset in elements, `data` holds the storage.

    Nothing is checked here: the server is the one validation authority, so an
    inconsistent descriptor travels as given and is rejected there with 161002.
    """
    return Tensor(
        tuple(int(d) for d in view_dims),
        int(data_type),
        tuple(int(s) for s in strides),
        int(offset),
        int(fmt),
        tuple(int(d) for d in storage_dims),
        data,
    )


def tensor_from_array(array: np.ndarray, storage: bool = True) -> Tensor:
    """Describes a NumPy array as an ND tensor over the storage span its view addresses; with
    `storage` False, the descriptor alone (an output's).

    Any view with non-negative element strides is sent as it is (no copy); a view
    that aclCreateTensor cannot express (negative or non-element strides) is
    sent as a contiguous copy.
    """
    itemsize, byte_strides = array.itemsize, array.strides
    for s in byte_strides:
        if s < 0 or s % itemsize:
            array = np.ascontiguousarray(array)
            byte_strides = array.strides
            break
    data_type = data_type_of(array.dtype)
    strides = tuple([s // itemsize for s in byte_strides])
    contiguous = array.flags.c_contiguous
    if contiguous or not array.size:  # a dense span: size-1 dims (whatever their stride) add nothing
        span = array.size
    else:
        span = 1 + sum([(d - 1) * s for d, s in zip(array.shape, strides)])
    if not storage:
        data = None
    elif contiguous:  # the common case, and cheaper than as_strided
        data = array.reshape(-1)
        data.flags.writeable = False
    else:
        data = as_strided(array, shape=(span,), strides=(itemsize,), writeable=False)
    return Tensor(array.shape, data_type, strides, 0, Format.ND, (span,), data)
