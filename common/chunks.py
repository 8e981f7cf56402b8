"""Tensor bytes outside unary messages: flat byte views, and gRPC's chunked upload/download streams."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._proto import aclnn_pb2 as pb
from .errors import malformed

# gRPC upload/download chunk size, from bench/chunks.py on loopback (2 cores): 1-2 MiB moved the
# most (~0.9-1.5 GB/s each way); 16 MiB half as much. The data channel needs no chunks.
CHUNK_BYTES = 1 << 20


# Copies of at least this many bytes go in two halves, one on a helper thread: NumPy copies without the
# GIL, and on a 2-core host two threads moved 16 MiB at 21-25 GB/s against 12-13 GB/s for one. A
# shared-memory call of 8 MiB tensors copies 24 MiB on the client (inputs in, its result out).
PARALLEL_COPY_BYTES = 4 << 20
_copier: tuple[int, ThreadPoolExecutor] | None = None  # with the pid it was made in (a fork's child has no threads)
_copier_lock = threading.Lock()


def copy_bytes(target: np.ndarray, source: object) -> None:
    """target[:] = source: a flat uint8 array and bytes of its size; large copies by two threads."""
    source = source if isinstance(source, np.ndarray) else np.frombuffer(source, np.uint8)
    if target.nbytes < PARALLEL_COPY_BYTES or (os.cpu_count() or 1) < 2:
        target[:] = source
        return
    half = (target.nbytes // 2) & ~4095  # page-aligned halves
    first = _copy_thread().submit(np.copyto, target[:half], source[:half])
    target[half:] = source[half:]
    first.result()


def _copy_thread() -> ThreadPoolExecutor:
    global _copier
    with _copier_lock:
        if _copier is None or _copier[0] != os.getpid():
            _copier = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="aclnn-copy"))
        return _copier[1]


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


def write_chunks(first: pb.BufferWrite, data: memoryview) -> Iterator[pb.BufferWrite]:
    """A WriteBuffer stream: `first` (naming the buffer, offset and size) with the first chunk, then the rest."""
    for offset in range(0, max(data.nbytes, 1), CHUNK_BYTES):
        message = first if offset == 0 else pb.BufferWrite()
        message.data = bytes(data[offset : offset + CHUNK_BYTES])
        yield message


def receive_into(view: np.ndarray, chunks: Iterable[pb.TensorChunk]) -> None:
    """Writes a downloaded result, chunk by chunk, straight into the caller's output view."""
    itemsize = view.dtype.itemsize
    flat = view.reshape(-1).view(np.uint8) if view.flags.c_contiguous else None
    received = 0
    for chunk in chunks:
        data = chunk.data
        if chunk.offset != received or received + len(data) > view.nbytes:
            raise malformed(f"a download chunk at byte {chunk.offset} of {len(data)} (expected byte {received})")
        if flat is not None:
            flat[received : received + len(data)] = np.frombuffer(data, np.uint8)
        else:  # a strided output view: chunks are whole elements, placed through the flat iterator
            if received % itemsize or len(data) % itemsize:
                raise malformed(f"a download chunk of {len(data)} bytes at byte {received}: not whole elements")
            first = received // itemsize
            view.flat[first : first + len(data) // itemsize] = np.frombuffer(data, view.dtype)
        received += len(data)
    if received != view.nbytes:
        raise malformed(f"a download of {received} of {view.nbytes} bytes")
