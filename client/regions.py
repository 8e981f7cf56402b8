"""Shared memory for tensor bytes: sealed memfds this client creates and passes to servers."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Iterable

import numpy as np

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1 (fcntl has no name for it before Python 3.13)


class Region:
    """A shared-memory region this client created: a memfd sealed against shrinking and growing, mapped here.

    Servers receive its descriptor (over their Unix socket), never a name, and can trust its
    size: neither side can truncate it under the other.
    """

    def __init__(self, size: int, name: str = "aclnn-region", holeless: bool = False, results: bool = False) -> None:
        """`holeless`: sealed against writes too, once mapped here (F_SEAL_FUTURE_WRITE): this mapping
        still writes it, but nobody can punch a hole in it (a large mailbox: framing.HELD_MAILBOX_BYTES).
        `results`: every page allocated now (this process's memory) and no seal against further seals,
        for the server to seal against writes once it mapped the region: it then holds nothing for it
        (server/regions.py map_region), and no second server can map it writeable."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            if results:
                os.posix_fallocate(fd, 0, size)
            else:
                seals |= fcntl.F_SEAL_SEAL | (F_SEAL_FUTURE_WRITE if holeless else 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size, self.results = fd, size, results
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

    def acquire(self, size: int, results: bool = False) -> Region:
        """A free region of at least `size` bytes, of `results` regions or the others (a new one when none
        fits). Results' regions are made a power of two long: calls of growing sizes then make a few."""
        if results:
            size = 1 << (size - 1).bit_length()
        with self._lock:
            fits = [r for r in self._free if r.size >= size and r.results == results]
            if fits:
                region = min(fits, key=lambda r: r.size)
                self._free.remove(region)
                return region
        region = Region(max(size, 4096), "aclnn-results" if results else "aclnn-region", results=results)
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
