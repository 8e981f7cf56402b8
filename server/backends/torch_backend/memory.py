"""Device buffers as tensors on the torch device: the torch backend's DeviceMemory (server/buffers.py).

A buffer is a uint8 tensor from torch's caching allocator. Calls queued on client streams run on
views of it without anyone waiting for them (`launched` records an event per CUDA stream, and tells
torch's allocator which streams use the memory, so a buffer freed while they run is not reused
before they end). A transfer (write, read, copy, memset) runs on its thread's stream after the
work queued on its buffers (as CANN's synchronous copies, and a device's default stream) and
returns once done. On the cpu device a buffer is host memory the engine may address directly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aclnn_common.errors import Status

from ...errors import CapacityError
from .streams import DeviceStreams
from .transfer import to_device, to_host


@dataclass(eq=False)
class TorchBlock:
    """One buffer's memory, and the launches nobody waited for that use it."""

    tensor: Any
    # On the cpu device: the tensor's memory as one NumPy array, which every host view of the block
    # is a view of (so the buffer's hold in the ledger can follow it: server/buffers.py).
    host: np.ndarray | None = None
    # the CUDA stream's handle -> the event recorded after its last launch over the block
    pending: dict[int, Any] = field(default_factory=dict)
    # dtype -> the tensor's whole elements seen as that dtype, which calls' views are strided views of
    typed: dict[Any, Any] = field(default_factory=dict)

    def as_dtype(self, dtype: Any, itemsize: int) -> Any:
        view = self.typed.get(dtype)
        if view is None:
            view = self.typed[dtype] = self.tensor[: self.tensor.numel() // itemsize * itemsize].view(dtype)
        return view


class TorchMemory:
    """The DeviceMemory of the torch backend (see the module docstring)."""

    def __init__(self, torch: Any, device: Any, streams: DeviceStreams) -> None:
        self.torch, self.device, self.streams = torch, device, streams
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> TorchBlock:
        with self.streams.running(None) as stream:
            try:
                tensor = self.torch.zeros(nbytes, dtype=self.torch.uint8, device=self.device)
            except self.torch.cuda.OutOfMemoryError as exc:
                raise CapacityError(
                    Status.INNER_CREATE_EXECUTOR, f"the torch device has no room for {nbytes} bytes", "size"
                ) from exc
            self.streams.wait(stream)  # zeroed before any other stream reads it
        return TorchBlock(tensor, tensor.numpy() if self.device.type == "cpu" else None)

    def release(self, block: TorchBlock) -> None:
        # torch's allocator waits for the streams that used it
        block.tensor, block.host, block.pending, block.typed = None, None, {}, {}

    def write(self, block: TorchBlock, offset: int, data: np.ndarray) -> None:
        with self.streams.running(None) as stream:
            self.after_launches([block], stream)
            to_device(self.torch, block.tensor, [(offset, np.ascontiguousarray(data).reshape(-1).view(np.uint8))])
            self.streams.wait(stream)

    def read(self, block: TorchBlock, offset: int, out: np.ndarray) -> None:
        target = out if out.flags.c_contiguous else np.empty(out.nbytes, np.uint8)
        with self.streams.running(None) as stream:
            self.after_launches([block], stream)
            to_host(self.torch, [(target.reshape(-1).view(np.uint8), block.tensor[offset : offset + out.nbytes])])
        if target is not out:
            out[...] = target.reshape(out.shape)

    def copy(self, dst: TorchBlock, dst_offset: int, src: TorchBlock, src_offset: int, nbytes: int) -> None:
        with self.streams.running(None) as stream:
            self.after_launches([dst, src], stream)
            source = src.tensor[src_offset : src_offset + nbytes]
            if dst is src and abs(dst_offset - src_offset) < nbytes:  # overlapping ranges: through a copy
                source = source.clone()
            dst.tensor[dst_offset : dst_offset + nbytes].copy_(source)
            self.streams.wait(stream)

    def fill(self, block: TorchBlock, offset: int, nbytes: int, value: int) -> None:
        with self.streams.running(None) as stream:
            self.after_launches([block], stream)
            block.tensor[offset : offset + nbytes].fill_(value)
            self.streams.wait(stream)

    def host_array(self, block: TorchBlock) -> np.ndarray | None:
        """The cpu device's buffers are host memory; a CUDA device's are not."""
        return block.host

    def launched(self, blocks: Iterable[TorchBlock], stream: Any) -> None:
        """A launch nobody waits for was queued on `stream` over these blocks."""
        done = self.torch.cuda.Event()
        done.record(stream)
        with self._lock:
            for block in blocks:
                if stream.cuda_stream not in block.pending:
                    block.tensor.record_stream(stream)
                block.pending[stream.cuda_stream] = done

    def after_launches(self, blocks: Iterable[TorchBlock], stream: Any) -> None:
        """Orders what `stream` does next after the launches queued on the blocks."""
        if stream is None:
            return
        with self._lock:
            events = [done for block in blocks for done in block.pending.values()]
        for done in events:
            stream.wait_event(done)
