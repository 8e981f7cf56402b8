"""Device memory on the server (aclrtMalloc): pointers into it, and the host side of its transfers."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .errors import invalid_error
from .tensor import MAX_COUNT
from .types import torch_array


def buffer_size(nbytes: int) -> int:
    """A malloc's byte count: 1 to MAX_COUNT, else 161002 naming `size`. Every client checks it
    (the wire's unsigned field cannot carry a negative one) and so does the server."""
    if not 0 < nbytes <= MAX_COUNT:
        raise invalid_error("size", f"a device buffer holds 1 to 2^62 bytes, not {nbytes}")
    return nbytes


def byte_count(nbytes: int) -> int:
    """A transfer's or memset's byte count: 0 to MAX_COUNT, else 161002 naming `size`."""
    if not 0 <= nbytes <= MAX_COUNT:
        raise invalid_error("size", f"a byte count is 0 to 2^62, not {nbytes}")
    return nbytes


def byte_value(value: int) -> int:
    """memset's byte: 0 to 255, else 161002 naming `value`."""
    if not 0 <= value <= 255:
        raise invalid_error("value", f"memset sets bytes: 0 to 255, not {value}")
    return value


class DeviceBuffer:
    """A pointer into device memory on the server: an allocation (`Client.malloc`) and a byte offset.

    `buf + n` (or `buf.at(n)`) points `n` bytes further into the same allocation; a DeviceBuffer is
    valid wherever one is taken: `create_tensor(..., data=buf)` storage, either side of `memcpy`,
    `memset`. Its bytes are not addressable here: they move only through those calls.
    """

    __slots__ = ("client", "id", "offset", "replica", "size")

    def __init__(self, buffer_id: str, size: int, client: object, replica: int = 0, offset: int = 0) -> None:
        self.id, self.size, self.client, self.replica, self.offset = buffer_id, size, client, replica, offset

    @property
    def nbytes(self) -> int:
        """Bytes from this pointer to the end of its allocation."""
        return self.size - self.offset

    def at(self, offset: int) -> DeviceBuffer:
        """The pointer `offset` bytes further on (the same as `self + offset`)."""
        return self + offset

    def __add__(self, nbytes: int) -> DeviceBuffer:
        if not isinstance(nbytes, int | np.integer):
            return NotImplemented
        position = self.offset + int(nbytes)
        if not 0 <= position <= self.size:
            raise invalid_error("offset", f"byte {position} lies outside the {self.size}-byte allocation")
        return DeviceBuffer(self.id, self.size, self.client, self.replica, position)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceBuffer) and (self.id, self.offset) == (other.id, other.offset)

    def __hash__(self) -> int:
        return hash((self.id, self.offset))

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.id[:8]}+{self.offset}, size={self.size})"


def host_bytes(arg: Any, name: str) -> memoryview:
    """The bytes of a host source (NumPy array, CPU torch tensor, bytes-like): C-contiguous, not copied."""
    array = _host_array(arg, name)
    if array is None:
        try:
            return memoryview(arg).cast("B")
        except TypeError:
            raise invalid_error(
                name, f"expected a DeviceBuffer, a NumPy array or bytes, got {type(arg).__name__}"
            ) from None
    if not array.flags.c_contiguous:
        raise invalid_error(name, "a host array for memcpy must be C-contiguous")
    return memoryview(array.reshape(-1).view(np.uint8))


def host_target(arg: Any, name: str) -> np.ndarray:
    """A host destination's bytes as a writeable uint8 array (its own memory: written in place)."""
    array = _host_array(arg, name)
    if array is None:
        raise invalid_error(name, f"expected a DeviceBuffer or a NumPy array, got {type(arg).__name__}")
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise invalid_error(name, "a host array memcpy writes into must be C-contiguous and writeable")
    return array.reshape(-1).view(np.uint8)


def _host_array(arg: Any, name: str) -> np.ndarray | None:
    if isinstance(arg, np.ndarray):
        return arg
    if "torch" in sys.modules:
        try:
            return torch_array(arg)
        except TypeError as exc:
            raise invalid_error(name, str(exc)) from None
    return None
