"""Device buffers in NPU memory: blocks of the backend's caching allocator, moved with aclrtMemcpy / aclrtMemset.

CANN's synchronous copies are not ordered after kernels queued on other streams, so a transfer
first waits for the queued work that uses its buffers (StreamPool.quiesce): the host reads what
the queued calls wrote and never overwrites what they still read. That work's failures stay its
client streams', reported at their synchronize. A buffer freed while queued work uses it goes back
to the allocator once that work has run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .acl import ACL_MEMCPY_DEVICE_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, Acl
from .streams import DeviceBlock, StreamPool


class NpuMemory:
    """The DeviceMemory of the NPU backend (server/buffers.py). `enter` makes the backend's context
    current on the calling thread (and refuses a closed backend)."""

    def __init__(self, acl: Acl, alloc: Callable[[int], int], streams: StreamPool, enter: Callable[[], None]) -> None:
        self.acl, self._alloc, self.streams, self._enter = acl, alloc, streams, enter

    def allocate(self, nbytes: int) -> DeviceBlock:
        self._enter()
        block = DeviceBlock(self._alloc(nbytes), nbytes)
        try:
            self.acl.memset(block.ptr, nbytes, 0)  # a cached block holds what its last user left
        except BaseException:
            self.streams.release(block)
            raise
        return block

    def release(self, block: DeviceBlock) -> None:
        self.streams.release(block)

    def write(self, block: DeviceBlock, offset: int, data: np.ndarray) -> None:
        if data.nbytes:
            data = np.ascontiguousarray(data)
            self._quiesce(block)
            self.acl.memcpy(block.ptr + offset, data.ctypes.data, data.nbytes, ACL_MEMCPY_HOST_TO_DEVICE)

    def read(self, block: DeviceBlock, offset: int, out: np.ndarray) -> None:
        if not out.nbytes:
            return
        target = out if out.flags.c_contiguous else np.empty(out.nbytes, np.uint8)
        self._quiesce(block)
        self.acl.memcpy(target.ctypes.data, block.ptr + offset, out.nbytes, ACL_MEMCPY_DEVICE_TO_HOST)
        if target is not out:
            out[...] = target.reshape(out.shape)

    def copy(self, dst: DeviceBlock, dst_offset: int, src: DeviceBlock, src_offset: int, nbytes: int) -> None:
        if not nbytes:
            return
        self._quiesce(dst, src)
        to, start = dst.ptr + dst_offset, src.ptr + src_offset
        if dst is not src or to >= start + nbytes or start >= to + nbytes:
            self.acl.memcpy(to, start, nbytes, ACL_MEMCPY_DEVICE_TO_DEVICE)
            return
        staging = DeviceBlock(self._alloc(nbytes), nbytes)  # overlapping ranges: through a second block
        try:
            self.acl.memcpy(staging.ptr, start, nbytes, ACL_MEMCPY_DEVICE_TO_DEVICE)
            self.acl.memcpy(to, staging.ptr, nbytes, ACL_MEMCPY_DEVICE_TO_DEVICE)
        finally:
            self.streams.release(staging)

    def fill(self, block: DeviceBlock, offset: int, nbytes: int, value: int) -> None:
        if nbytes:
            self._quiesce(block)
            self.acl.memset(block.ptr + offset, nbytes, value)

    def host_array(self, block: DeviceBlock) -> None:
        return None  # device memory: the engine stages host bytes and calls write/read

    def _quiesce(self, *blocks: DeviceBlock) -> None:
        self._enter()
        self.streams.quiesce(blocks)
