"""The shared tensor-descriptor checks (SPEC 1.4) and safe NumPy views over received bytes.

Every number in a descriptor comes from the client, so each is bounded before it is
used: the server never reads or writes outside a buffer and never allocates memory
sized by an unchecked number.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from aclnn_common.errors import invalid_error
from aclnn_common.tensor import MAX_COUNT, Tensor
from aclnn_common.types import DataType, Format, numpy_dtype

MAX_RANK = 8


@dataclass(frozen=True)
class TensorDesc:
    """A validated descriptor: every addressed element lies inside its storage."""

    name: str
    data_type: DataType
    format: Format
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    storage_size: int  # elements

    # Cached: the engine and backends read these many times per call (the dataclass is frozen).
    @functools.cached_property
    def dtype(self) -> np.dtype:
        return numpy_dtype(self.data_type)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def byte_offset(self) -> int:
        return self.offset * self.dtype.itemsize

    @functools.cached_property
    def byte_strides(self) -> tuple[int, ...]:
        """The view's strides in bytes; size-1 dims address nothing, so their (unbounded) strides are dropped."""
        itemsize = self.dtype.itemsize
        return tuple(s * itemsize if d > 1 else 0 for d, s in zip(self.shape, self.strides))

    @property
    def storage_nbytes(self) -> int:
        return self.storage_size * self.dtype.itemsize

    def view(self, data: Any, writeable: bool = False) -> np.ndarray:
        """A NumPy view of this descriptor over storage bytes: read-only over received bytes;
        `writeable` over a device buffer's host memory that a call's results go into."""
        try:
            if isinstance(data, np.ndarray):  # in process: the caller's memory, not a copy
                buffer = data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else None
            else:
                buffer = np.frombuffer(data, dtype=np.uint8)
        except (TypeError, ValueError):
            buffer = None
        if buffer is None:
            raise invalid_error(self.name, "storage must be bytes or a C-contiguous NumPy array")
        if buffer.nbytes != self.storage_nbytes:
            raise invalid_error(
                self.name,
                f"storage of {self.storage_size} {self.data_type.name} elements needs "
                f"{self.storage_nbytes} bytes, received {buffer.nbytes}",
            )
        if self.numel == 0:
            return np.ndarray(self.shape, self.dtype, buffer=buffer[:0], strides=(0,) * self.rank)
        view = np.ndarray(self.shape, self.dtype, buffer, self.byte_offset, self.byte_strides)
        view.flags.writeable = writeable
        return view


def _bounded_product(name: str, what: str, values: tuple[int, ...]) -> int:
    product = 1
    for v in values:
        product *= v
        if product > MAX_COUNT:
            raise invalid_error(name, f"{what} element count overflows (above 2^62)")
    return product


def validate_tensor(name: str, value: Any, output: bool) -> TensorDesc:
    """Checks one non-null tensor descriptor (SPEC 1.4 rules 1-5); 161002 naming it on failure."""
    if not isinstance(value, Tensor):
        raise invalid_error(name, f"expected a tensor, got {type(value).__name__}")
    dtype = numpy_dtype(value.data_type)
    if dtype is None:
        raise invalid_error(name, f"unknown data type {value.data_type}")
    if value.format not in Format._value2member_map_:
        raise invalid_error(name, f"unknown format {value.format}")
    shape, strides, storage_dims = value.view_dims, value.strides, value.storage_dims
    if len(shape) > MAX_RANK:
        raise invalid_error(name, f"rank {len(shape)} exceeds {MAX_RANK}")
    if len(storage_dims) > MAX_RANK:
        raise invalid_error(name, f"storage rank {len(storage_dims)} exceeds {MAX_RANK}")
    if len(strides) != len(shape):
        raise invalid_error(name, f"{len(strides)} strides for {len(shape)} view dims")
    for what, numbers in (("view dim", shape), ("stride", strides), ("storage dim", storage_dims)):
        if any(n < 0 or n > MAX_COUNT for n in numbers):
            raise invalid_error(name, f"{what}s must lie in [0, 2^62], got {list(numbers)}")
    if not 0 <= value.offset <= MAX_COUNT:
        raise invalid_error(name, f"offset must lie in [0, 2^62], got {value.offset}")
    storage_size = _bounded_product(name, "storage", storage_dims)
    if storage_size * dtype.itemsize > MAX_COUNT:
        raise invalid_error(name, "storage byte length overflows (above 2^62)")
    numel = _bounded_product(name, "view", shape)
    if numel:
        last = value.offset + sum((d - 1) * s for d, s in zip(shape, strides))
        if last > storage_size - 1:
            raise invalid_error(name, f"view addresses element {last} but the storage holds {storage_size} elements")
        if output:
            _check_no_self_overlap(name, shape, strides)
    return TensorDesc(name, DataType(value.data_type), Format(value.format), shape, strides, value.offset, storage_size)


def _check_no_self_overlap(name: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """An output must not write one storage element twice (SPEC 1.4 rule 5)."""
    reach = 0
    for stride, dim in sorted((s, d) for d, s in zip(shape, strides) if d > 1):
        if stride <= reach:
            raise invalid_error(name, f"output view writes some storage elements twice (strides {list(strides)})")
        reach += (dim - 1) * stride
