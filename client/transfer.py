"""Moving tensor bytes outside unary messages: chunked streams and shared memory (sealed memfds)."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from ._proto import aclnn_pb2 as pb

# gRPC upload/download chunk size, from bench/chunks.py on loopback (2 cores): 1-2 MiB moved the
# most (~0.9-1.5 GB/s each way); 16 MiB half as much. The data channel needs no chunks.
CHUNK_BYTES = 1 << 20


def byte_view(data: object) -> memoryview:
    """A flat, read-only byte view of a storage (NumPy array or bytes-like) without copying."""
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


def to_chunks(data: memoryview, chunk_bytes: int | None = None) -> Iterator[pb.TensorChunk]:
    """The bytes as in-order TensorChunks (one empty chunk for no bytes); one chunk is copied at a time.

    Uploads (client) and downloads (server) both stream this way, in CHUNK_BYTES by default.
    """
    total, chunk_bytes = data.nbytes, chunk_bytes or CHUNK_BYTES
    for offset in range(0, max(total, 1), chunk_bytes):
        yield pb.TensorChunk(total_size=total, offset=offset, data=bytes(data[offset : offset + chunk_bytes]))


def receive_into(view: np.ndarray, chunks: Iterable[pb.TensorChunk]) -> None:
    """Writes a downloaded result, chunk by chunk, straight into the caller's output view."""
    itemsize = view.dtype.itemsize
    flat = view.reshape(-1).view(np.uint8) if view.flags.c_contiguous else None
    received = 0
    for chunk in chunks:
        data = chunk.data
        if chunk.offset != received or received + len(data) > view.nbytes:
            raise ValueError(f"download out of order at byte {chunk.offset} (expected {received})")
        if flat is not None:
            flat[received : received + len(data)] = np.frombuffer(data, np.uint8)
        else:  # a strided output view: chunks are whole elements, placed through the flat iterator
            first = received // itemsize
            view.flat[first : first + len(data) // itemsize] = np.frombuffer(data, view.dtype)
        received += len(data)
    if received != view.nbytes:
        raise ValueError(f"download truncated: {received} of {view.nbytes} bytes")


class Region:
    """A shared-memory region this client created: a memfd sealed against shrinking and growing, mapped here.

    Servers receive its descriptor (over their Unix socket), never a name, and can trust its
    size: neither side can truncate it under the other.
    """

    def __init__(self, size: int, name: str = "aclnn-region") -> None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        self.array = np.ndarray((size,), np.uint8, buffer=self.map)

    def close(self) -> None:
        del self.array
        try:
            self.map.close()
        except BufferError:
            pass  # results still viewed by the caller: the mapping goes with them
        os.close(self.fd)


class RegionPool:
    """Regions reused across calls; `acquire` hands out one at least `size` bytes long."""

    def __init__(self) -> None:
        self._free: list[Region] = []
        self.all: list[Region] = []
        self._lock = threading.Lock()

    def acquire(self, size: int) -> Region:
        """A free region of at least `size` bytes (a new one when none fits)."""
        with self._lock:
            fits = [r for r in self._free if r.size >= size]
            if fits:
                region = min(fits, key=lambda r: r.size)
                self._free.remove(region)
                return region
        region = Region(max(size, 4096))
        with self._lock:
            self.all.append(region)
        return region

    def release(self, regions: Iterable[Region]) -> None:
        with self._lock:
            self._free.extend(regions)

    def retire(self, regions: Iterable[Region]) -> None:
        """Takes regions out of the pool for good (the caller closes them)."""
        with self._lock:
            for region in regions:
                self.all.remove(region)

    def close(self) -> list[Region]:
        with self._lock:
            regions, self.all, self._free = self.all, [], []
        for region in regions:
            region.close()
        return regions
