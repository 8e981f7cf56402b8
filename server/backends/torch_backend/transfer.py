"""Bytes between host arrays and the torch device.

An input is uploaded as the raw bytes of its storage span (from its first addressed element to its
last) and viewed on the device in its own dtype and strides, so that the conversion to the work
dtype happens there (fp16/bf16 travel at 2 bytes an element, a broadcast input as one copy). A
call's inputs share one device allocation and one pinned staging area, so a call of small tensors
is one host-to-device copy. Results are cast to their output dtypes on the device and come back the
same way.

On a CUDA device the staging memory is pinned, from torch's caching host allocator (reused from
call to call; it keeps a block until the copies queued from it have run), and large transfers go in
pieces: host threads copy a piece into (or out of) the staging memory while the copy engine moves
the piece before it, so the host copy and the transfer overlap. On the cpu device nothing is
copied on the way in: the tensors are the arrays' own memory.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

PIECE = 8 << 20  # bytes a host thread copies at a time; a transfer below this is one piece
ALIGN = 256  # byte alignment of each tensor in a shared staging area and device allocation

# Received bytes are read-only; torch warns that a tensor over them could be written. The formulas
# never write an input.
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)

_threads: concurrent.futures.ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def host_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that copy pieces between NumPy arrays and pinned memory (NumPy releases the GIL)."""
    global _threads
    with _threads_lock:
        if _threads is None:
            workers = max(2, min(8, len(os.sched_getaffinity(0))))
            _threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="aclnn-torch-copy")
        return _threads


_TORCH_DTYPES: dict[np.dtype, Any] = {}


def torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    """The torch dtype of a NumPy dtype (ml_dtypes' bfloat16 included; the names are the same)."""
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = getattr(torch, dtype.name)
    return found


class _Span:
    """Exposes a memory range to NumPy (np.asarray of it is a uint8 array over the range); keeps
    the array it lies in alive."""

    def __init__(self, owner: np.ndarray, address: int, nbytes: int) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, not owner.flags.writeable),
            "version": 3,
        }


def storage_span(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """The bytes a view addresses, from its first element to its last, as a uint8 array over the same
    memory, and the view's strides in elements. A view whose strides are not whole elements is
    copied first."""
    itemsize = a.itemsize
    if any(s % itemsize or s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    extent = sum((d - 1) * s for d, s in zip(a.shape, a.strides)) + itemsize if a.size else 0
    raw = np.asarray(_Span(a, a.ctypes.data, extent)) if extent else np.empty(0, np.uint8)
    return raw, tuple(s // itemsize for s in a.strides)


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def _pieces(start: int, nbytes: int) -> Iterator[tuple[int, int]]:
    for at in range(0, nbytes, PIECE):
        yield start + at, min(PIECE, nbytes - at)


def to_device(torch: Any, dst: Any, parts: list[tuple[int, np.ndarray]]) -> None:
    """Copies each (byte offset, uint8 array) into `dst`, a uint8 tensor on the device, on the current
    stream; returns once the host memory may be reused (the device copies may still be running)."""
    parts = [(offset, data) for offset, data in parts if data.nbytes]
    if not parts:
        return
    if dst.device.type == "cpu":
        host = dst.numpy()
        for offset, data in parts:
            host[offset : offset + data.nbytes] = data
        return
    low, high = min(o for o, _ in parts), max(o + d.nbytes for o, d in parts)
    pinned = torch.empty(high - low, dtype=torch.uint8, pin_memory=True)
    staged = pinned.numpy()
    pieces = [
        (at, data[at - offset : at - offset + size])
        for offset, data in parts
        for at, size in _pieces(offset, data.nbytes)
    ]
    if len(pieces) == 1 or high - low <= PIECE:  # small: one host copy, one transfer
        for at, data in pieces:
            staged[at - low : at - low + data.nbytes] = data
        dst[low:high].copy_(pinned, non_blocking=True)
        return
    threads = host_threads()
    copied = [threads.submit(np.copyto, staged[at - low : at - low + data.nbytes], data) for at, data in pieces]
    for (at, data), done in zip(pieces, copied):
        done.result()
        dst[at : at + data.nbytes].copy_(pinned[at - low : at - low + data.nbytes], non_blocking=True)


def to_host(torch: Any, parts: list[tuple[np.ndarray, Any]]) -> None:
    """Copies each uint8 device tensor (contiguous, 1-D) into its uint8 host array; returns once done."""
    parts = [(out, src) for out, src in parts if out.nbytes]
    if not parts:
        return
    if parts[0][1].device.type == "cpu":
        for out, src in parts:
            out[...] = src.numpy()
        return
    offsets, end = _layout([out.nbytes for out, _ in parts])
    pinned = torch.empty(end, dtype=torch.uint8, pin_memory=True)
    staged = pinned.numpy()
    stream = torch.cuda.current_stream()
    pieces = []
    for (out, src), offset in zip(parts, offsets):
        for at, size in _pieces(0, out.nbytes):
            pinned[offset + at : offset + at + size].copy_(src[at : at + size], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            pieces.append((done, out[at : at + size], staged[offset + at : offset + at + size]))
    if len(pieces) == 1:
        done, out, data = pieces[0]
        done.synchronize()
        out[...] = data
        return

    def drain(done: Any, out: np.ndarray, data: np.ndarray) -> None:
        done.synchronize()
        out[...] = data

    for job in [host_threads().submit(drain, *piece) for piece in pieces]:
        job.result()


def upload(torch: Any, device: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The arrays as tensors on the device, each in its own dtype and strides (see the module docstring)."""
    spans = {name: storage_span(a) for name, a in arrays.items()}
    if device.type == "cpu":  # the arrays' own memory (never written: inputs are read-only to formulas)
        return {
            name: _view(torch, torch.from_numpy(raw), arrays[name], strides) for name, (raw, strides) in spans.items()
        }
    offsets, end = _layout([raw.nbytes for raw, _ in spans.values()])
    memory = torch.empty(end, dtype=torch.uint8, device=device)
    to_device(torch, memory, [(offset, raw) for offset, (raw, _) in zip(offsets, spans.values())])
    return {
        name: _view(torch, memory[offset : offset + raw.nbytes], arrays[name], strides)
        for offset, (name, (raw, strides)) in zip(offsets, spans.items())
    }


def _view(torch: Any, raw: Any, a: np.ndarray, strides: tuple[int, ...]) -> Any:
    dtype = torch_dtype(torch, a.dtype)
    if not a.size:
        return torch.empty(a.shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).as_strided(a.shape, strides)


def download(torch: Any, results: list[tuple[np.ndarray, Any]]) -> None:
    """Writes each tensor (already of its array's dtype and shape) into its host array."""
    parts, scattered = [], []
    for out, value in results:
        src = value.contiguous().reshape(-1)
        if src.numel() == 1 and src.stride(0) != 1:  # one element keeps whatever stride it had (0 if expanded)
            src = src.as_strided((1,), (1,))
        src = src.view(torch.uint8)
        if out.flags.c_contiguous:
            parts.append((out.reshape(-1).view(np.uint8), src))
        else:
            staged = np.empty(out.nbytes, np.uint8)
            parts.append((staged, src))
            scattered.append((out, staged))
    to_host(torch, parts)
    for out, staged in scattered:
        out[...] = staged.view(out.dtype).reshape(out.shape)
