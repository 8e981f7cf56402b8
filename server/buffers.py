"""Device buffers (aclrtMalloc): memory that lives on the server between calls, in the backend's own memory.

A buffer belongs to one client session and its creator's identity: its id is a random 128-bit
name, and to any other session or identity it does not exist. Its bytes are held in the memory
ledger as a stored tensor (kind `buffer`) until its memory is released, which is when it was freed
(or its session ended) and no queued or running call uses it any more: freeing a buffer that
queued calls still use is safe.

The memory itself is the backend's (`DeviceMemory`): host memory for numpy/cpu, tensors on the
torch device, NPU memory from the NPU backend's caching allocator. A backend offers its own with a
`device_memory()` method; without one, buffers are host memory.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from aclnn_common.device import buffer_size
from aclnn_common.errors import Status, invalid_error

from .descriptors import TensorDesc
from .errors import CapacityError
from .ledger import Hold, MemoryLedger

# Each buffer costs the server some bookkeeping besides its bytes: an identity keeps at most this
# many at once, and each holds at least _GRANULE bytes in the ledger.
MAX_BUFFERS_PER_IDENTITY = 16384
_GRANULE = 512


class DeviceMemory(Protocol):
    """A backend's memory for device buffers. Offsets and sizes are bytes, already bounds-checked."""

    def allocate(self, nbytes: int) -> Any:
        """A block of `nbytes`, zero-filled (no tenant may read what another left behind)."""

    def release(self, block: Any) -> None: ...

    def write(self, block: Any, offset: int, data: np.ndarray) -> None:
        """Host -> device: `data` (uint8) into the block at `offset`."""

    def read(self, block: Any, offset: int, out: np.ndarray) -> None:
        """Device -> host: `out.nbytes` bytes from `offset` into `out` (uint8)."""

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> None: ...

    def fill(self, block: Any, offset: int, nbytes: int, value: int) -> None: ...

    def host_array(self, block: Any) -> np.ndarray | None:
        """The block as a uint8 NumPy array when the host can address it (calls then compute on it in
        place, and transfers move bytes straight in and out); None for memory on a device."""


class HostMemory:
    """numpy/cpu backends: buffers are host memory (NumPy arrays)."""

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)  # calloc: large ones are fresh zero pages, faulted in on use

    def release(self, block: np.ndarray) -> None:
        pass  # the array goes with its last reference (a view a transfer still sends included)

    def write(self, block: np.ndarray, offset: int, data: np.ndarray) -> None:
        block[offset : offset + data.nbytes] = data

    def read(self, block: np.ndarray, offset: int, out: np.ndarray) -> None:
        out[...] = block[offset : offset + out.nbytes]

    def copy(self, dst: np.ndarray, dst_offset: int, src: np.ndarray, src_offset: int, nbytes: int) -> None:
        dst[dst_offset : dst_offset + nbytes] = src[src_offset : src_offset + nbytes]  # NumPy handles overlap

    def fill(self, block: np.ndarray, offset: int, nbytes: int, value: int) -> None:
        block[offset : offset + nbytes] = value

    def host_array(self, block: np.ndarray) -> np.ndarray:
        return block


def _memory_keeper(memory: DeviceMemory, block: Any) -> object | None:
    """The object that keeps a block's host memory alive (every view of it refers to it: the NumPy
    array at the base of its views, or the torch tensor under them), or None for memory on a device."""
    keeper = memory.host_array(block)
    while isinstance(keeper, np.ndarray) and keeper.base is not None:
        keeper = keeper.base
    return keeper


@dataclass(eq=False)
class Buffer:
    """One allocation. `uses` keeps its memory alive (calls queued or running on it, transfers);
    `pending` counts the queued calls, which transfers without a stream wait for."""

    id: str
    owner: str | None
    session: str
    size: int
    block: Any
    # Released with the buffer's free, for device memory; None when the ledger's hold follows the
    # memory itself (host memory, which a view in a reply still being sent keeps alive past the free).
    hold: Hold | None
    uses: int = 0
    pending: int = 0
    freed: bool = False


@dataclass(frozen=True)
class ResidentStorage:
    """A tensor's storage in a device buffer, starting `offset` bytes in (StorageRef.device)."""

    buffer: Buffer
    offset: int

    def check_fits(self, desc: TensorDesc) -> None:
        """161002 naming the tensor when its storage does not lie inside the buffer, or starts between elements."""
        end = self.offset + desc.storage_nbytes
        if end > self.buffer.size:
            raise invalid_error(
                desc.name,
                f"storage of {desc.storage_nbytes} bytes at byte {self.offset} of a device buffer ends past its "
                f"{self.buffer.size} bytes",
            )
        if self.offset % desc.dtype.itemsize:
            raise invalid_error(
                desc.name, f"device storage must start at a multiple of {desc.dtype.itemsize} bytes, not {self.offset}"
            )


class BufferStore:
    """The live buffers by id; each identity's count capped, their bytes in the ledger."""

    def __init__(
        self,
        ledger: MemoryLedger,
        memory: Callable[[], DeviceMemory],
        max_per_identity: int = MAX_BUFFERS_PER_IDENTITY,
    ) -> None:
        self.ledger = ledger
        self._memory_factory = memory
        self._memory: DeviceMemory | None = None
        self.max_per_identity = max_per_identity
        self._buffers: dict[str, Buffer] = {}
        self._per_owner: collections.Counter[str | None] = collections.Counter()
        self._cond = threading.Condition()

    @property
    def memory(self) -> DeviceMemory:
        if self._memory is None:
            self._memory = self._memory_factory()  # the backend's, once it has loaded
        return self._memory

    def __len__(self) -> int:
        with self._cond:
            return len(self._buffers)

    def malloc(self, owner: str | None, session: str | None, nbytes: int) -> Buffer:
        if not session:
            raise invalid_error("session", "device buffers need an x-aclnn-session id in the call's metadata")
        buffer_size(nbytes)
        with self._cond:
            count = self._per_owner[owner]
        if count >= self.max_per_identity:
            raise CapacityError(
                Status.INNER_CREATE_EXECUTOR, f"this caller holds {count} device buffers: free some first", "size"
            )
        hold = self.ledger.reserve(owner, -(-nbytes // _GRANULE) * _GRANULE, "buffer", "size")
        try:
            block = self.memory.allocate(nbytes)
        except BaseException:
            hold.release()
            raise
        keeper = _memory_keeper(self.memory, block)
        if keeper is not None:
            hold.follow(keeper)
        buffer = Buffer(secrets.token_hex(16), owner, session, nbytes, block, None if keeper is not None else hold)
        with self._cond:
            self._buffers[buffer.id] = buffer
            self._per_owner[owner] += 1
        return buffer

    def get(self, owner: str | None, session: str | None, buffer_id: str, param: str = "buffer") -> Buffer:
        """The caller's live buffer; another session's or identity's is as unknown as a made-up id."""
        with self._cond:
            buffer = self._buffers.get(buffer_id)
        if buffer is None or buffer.owner != owner or buffer.session != session:
            raise invalid_error(param, f"device buffer {buffer_id[:8]!r}... is unknown or freed")
        return buffer

    def slice(
        self, owner: str | None, session: str | None, buffer_id: str, offset: int, param: str = "buffer"
    ) -> ResidentStorage:
        buffer = self.get(owner, session, buffer_id, param)
        if offset > buffer.size:
            raise invalid_error(param, f"byte offset {offset} lies past the device buffer's {buffer.size} bytes")
        return ResidentStorage(buffer, offset)

    def check_range(self, storage: ResidentStorage, nbytes: int, param: str) -> None:
        # The engine's own guard: no client sends a negative count (clients check theirs; the wire's are unsigned).
        if nbytes < 0:
            raise invalid_error(param, f"a byte count is 0 or more, not {nbytes}")
        if storage.offset + nbytes > storage.buffer.size:
            raise invalid_error(
                param,
                f"{nbytes} bytes at byte {storage.offset} end past the device buffer's {storage.buffer.size} bytes",
            )

    def free(self, owner: str | None, session: str | None, buffer_id: str) -> None:
        buffer = self.get(owner, session, buffer_id)
        with self._cond:
            if self._buffers.pop(buffer.id, None) is None:
                raise invalid_error("buffer", f"device buffer {buffer_id[:8]!r}... is unknown or freed")
            self._drop(buffer)

    def end_session(self, owner: str | None, session: str) -> None:
        """Frees every buffer of an identity's session that ended (calls using one keep its memory until they end)."""
        with self._cond:
            for buffer in [b for b in self._buffers.values() if (b.owner, b.session) == (owner, session)]:
                del self._buffers[buffer.id]
                self._drop(buffer)

    def close(self) -> None:
        with self._cond:
            for buffer in list(self._buffers.values()):
                self._drop(buffer)
            self._buffers.clear()

    def _drop(self, buffer: Buffer) -> None:
        """Marks a buffer freed (it left the table); its memory goes now, or when its last use ends."""
        buffer.freed = True
        self._per_owner[buffer.owner] -= 1
        if not self._per_owner[buffer.owner]:
            del self._per_owner[buffer.owner]
        if not buffer.uses:
            self._release(buffer)

    def _release(self, buffer: Buffer) -> None:
        block, buffer.block = buffer.block, None
        if block is not None:
            if buffer.hold is not None:
                buffer.hold.release()
            self.memory.release(block)
        self._cond.notify_all()

    # Uses -------------------------------------------------------------------------------------

    def use(self, storages: Iterable[tuple[str, ResidentStorage]], queued: bool = False) -> list[Buffer]:
        """Takes a use of each named storage's buffer (161002 naming the tensor when it was freed);
        `queued`: the use is a call waiting on a stream, which transfers without a stream wait for."""
        with self._cond:
            buffers = []
            for name, storage in storages:
                if storage.buffer.freed:
                    raise invalid_error(name, "its device buffer was freed")
                buffers.append(storage.buffer)
            for buffer in buffers:
                buffer.uses += 1
                buffer.pending += queued
            return buffers

    def done(self, buffers: Iterable[Buffer], queued: bool = False) -> None:
        with self._cond:
            for buffer in buffers:
                buffer.uses -= 1
                buffer.pending -= queued
                if buffer.freed and not buffer.uses:
                    self._release(buffer)
            self._cond.notify_all()

    def wait_unqueued(self, buffers: Iterable[Buffer], deadline: float | None) -> None:
        """Waits until no queued call uses these buffers (a transfer or call without a stream, as on a
        device's default stream); past the deadline it is RESOURCE_EXHAUSTED (retry after synchronize)."""
        buffers = list(buffers)
        with self._cond:
            while any(b.pending for b in buffers):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CapacityError(
                        Status.INNER_CREATE_EXECUTOR,
                        "queued calls still use the device buffer at the deadline; retry after synchronize",
                        "buffer",
                    )
                self._cond.wait(None if remaining is None else min(remaining, 1.0))
