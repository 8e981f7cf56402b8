"""Shared-memory regions: memfds that a client on this host passed over the Unix socket.

The server maps only descriptors it received (SCM_RIGHTS), never a name, so no caller can
reach another's memory, or any file, by naming it. A region must be a memfd sealed against
shrinking and growing: a client that could truncate it under a call would kill the server
with SIGBUS on the next access.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from aclnn_common.errors import invalid_error

from .ledger import Hold

# F_SEAL_SEAL too: a client that could add F_SEAL_FUTURE_WRITE later would stop the server from
# giving back (MADV_REMOVE, a punched hole) the pages it faulted into the memfd, which stay charged
# to the server for as long as the client keeps its descriptor.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Each mapped region keeps a descriptor open (Python's mmap holds a duplicate) and one of the
# process's memory maps: an identity may keep this many at once (counted until the last view goes).
MAX_REGIONS_PER_IDENTITY = 256


@dataclass
class RegionOffer:
    """What a registration brought: the one descriptor received (None if none came), how many the
    peer passed (those beyond one were closed), and the size the client declared."""

    fd: int | None
    size: int
    passed: int = 1


class MappedRegion:
    """A mapped memfd of a session. Every view handed out is a view of `array`, so the mapping, its
    bytes in the ledger and the pages the server faulted into the memfd all last exactly as long as
    the last view (an executor's input, a call in flight), however the region ended: unregistered,
    or with its session. Then its pages are given back (MADV_REMOVE: the memfd's contents go too,
    so nothing the server faulted in stays charged to it in a memfd the client keeps), the hold
    ends, and `gone` runs; the mapping closes with the last reference to it."""

    __slots__ = ("array", "inode")

    def __init__(self, mapping: mmap.mmap, inode: tuple[int, int], hold: Hold, gone: Callable[[], None]) -> None:
        self.array, self.inode = np.frombuffer(mapping, np.uint8), inode
        weakref.finalize(self.array, _released, mapping, hold, gone)

    def __len__(self) -> int:
        return self.array.nbytes

    def slice(self, offset: int, size: int) -> memoryview:
        return memoryview(self.array[offset : offset + size])


def _released(mapping: mmap.mmap, hold: Hold, gone: Callable[[], None]) -> None:
    try:
        mapping.madvise(mmap.MADV_REMOVE)
    except OSError:
        pass  # a memfd that does not let go of its pages (sealed against writes) still holds them
    hold.release()
    gone()


def map_region(offer: RegionOffer) -> tuple[mmap.mmap, tuple[int, int], bool]:
    """Maps the offered memfd read-write after checking it; with its inode (device, number) and whether
    the region must be held in the ledger. 161002 naming `region` when it is unfit. The caller keeps
    (and closes) the descriptor.

    A memfd sealed against further seals is held: the server may fault its pages in (and gives them
    back when it goes). One left for the server to seal (against shrinking and growing only: a
    client's result region) is sealed here, once mapped, against writes through new mappings and
    further seals, then must have every page allocated (st_blocks; fallocate counts, though SEEK_HOLE
    still sees such pages as holes until written): none can be given back later (nobody can punch a
    hole), so the server never faults a page of it in and holds nothing for it. Its creator reads and
    writes it through the mapping it made before."""
    fd = checked_memfd(offer, server_seals=True)
    info = os.fstat(fd)
    try:
        mapping = mmap.mmap(fd, offer.size)
    except (OSError, ValueError) as exc:
        raise invalid_error("region", f"the memfd cannot be mapped read-write: {exc}") from None
    held = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL)
    try:
        if not held:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            allocated = os.fstat(fd)
            if allocated.st_blocks * 512 < -(-allocated.st_size // mmap.PAGESIZE) * mmap.PAGESIZE:
                raise invalid_error(
                    "region", "a memfd left for the server to seal must have every page allocated (it has holes)"
                )
    except OSError as exc:
        mapping.close()
        raise invalid_error("region", f"the memfd cannot be sealed: {exc.strerror}") from None
    except BaseException:
        mapping.close()
        raise
    return mapping, (info.st_dev, info.st_ino), held


def checked_memfd(
    offer: RegionOffer, punchable: bool = False, holeless: bool = False, server_seals: bool = False
) -> int:
    """The offer's one descriptor, once it is a memfd (on the kernel's internal tmpfs, not hugetlbfs)
    sealed against shrinking, growing and further seals that holds the declared size; 161002 naming
    `region` when not. `server_seals`: or sealed against shrinking and growing only, for the server
    to seal (map_region).

    F_GET_SEALS comes first: it answers at once for any descriptor (EINVAL for all but memfds and
    tmpfs files), so nothing that could block (a FUSE file's fstat) is ever asked of another kind.
    hugetlbfs memfds are refused: a hole punched in one after it was checked would SIGBUS the
    server's next access to that page when the huge page pool is empty. `punchable`: refused too
    when sealed against writes (the server could not give back pages it faulted into it; F_SEAL_SEAL
    keeps such a seal from coming later). `holeless`: refused unless sealed against writes (then
    nobody can punch a hole in it; its creator may still write through a mapping made before the seal).
    """
    if offer.fd is None or offer.passed != 1:
        raise invalid_error(
            "region",
            f"a registration passes exactly one memfd (SCM_RIGHTS over the Unix socket), got {offer.passed}",
        )
    fd = offer.fd
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise invalid_error("region", "the descriptor is not a memfd (regions are never opened by name)") from None
    if _filesystem(fd) != _TMPFS_MAGIC:
        raise invalid_error("region", "the memfd is not on tmpfs (hugetlb memfds are refused)")
    try:
        info = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise invalid_error("region", f"the descriptor cannot be inspected: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or not target.startswith("/memfd:"):
        raise invalid_error("region", "the descriptor is not a memfd (regions are never opened by name)")
    left_to_seal = server_seals and seals == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & _SEALS != _SEALS and not left_to_seal:
        raise invalid_error(
            "region",
            "the memfd must be sealed against shrinking and growing, and against further seals "
            "(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)",
        )
    if punchable and seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise invalid_error("region", "the memfd must not be sealed against writes")
    if holeless and not seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise invalid_error(
            "region", "a mailbox this large must be sealed against writes (F_SEAL_FUTURE_WRITE, after mapping it)"
        )
    if not 0 < offer.size <= info.st_size:
        raise invalid_error("region", f"a region of {offer.size} bytes was declared; the memfd holds {info.st_size}")
    return fd


_TMPFS_MAGIC = 0x01021994
_F_SEAL_FUTURE_WRITE = 0x0010
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)


def _filesystem(fd: int) -> int:
    """The magic number of the filesystem a descriptor's file lives on (statfs's f_type)."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) first
    if _libc.fstatfs(fd, buffer) != 0:
        raise invalid_error("region", f"the descriptor cannot be inspected: {os.strerror(ctypes.get_errno())}")
    return ctypes.c_long.from_buffer(buffer).value
