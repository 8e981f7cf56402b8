"""Shared-memory regions: memfds that a client on this host passed over the Unix socket.

The server maps only descriptors it received (SCM_RIGHTS), never a name, so no caller can
reach another's memory, or any file, by naming it. A region must be a memfd sealed against
shrinking and growing: a client that could truncate it under a call would kill the server
with SIGBUS on the next access.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from dataclasses import dataclass

from aclnn_common.errors import invalid_error

from .ledger import Hold

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# Each mapped region keeps a descriptor open (Python's mmap holds a duplicate) and one of the
# process's memory maps: an identity may keep this many at once.
MAX_REGIONS_PER_IDENTITY = 256


@dataclass
class RegionOffer:
    """What a REGISTER_REGION request brought: its descriptors and the size the client declared."""

    fds: list[int]
    size: int
    truncated: bool = False  # it came with more descriptors than were received (the kernel closed the rest)


class MappedRegion:
    """A mapped region in a session; its bytes are held in the ledger (the server may fault its pages in)."""

    __slots__ = ("hold", "map")

    def __init__(self, region: mmap.mmap, hold: Hold) -> None:
        self.map, self.hold = region, hold

    def __len__(self) -> int:
        return len(self.map)

    def close(self) -> None:
        self.hold.release()
        try:
            self.map.close()
        except BufferError:
            pass  # a call still uses it: the mapping goes with the call's last view


def map_region(offer: RegionOffer) -> mmap.mmap:
    """Maps the offered memfd read-write after checking it; 161002 naming `region` when it is unfit.

    The caller keeps (and closes) the descriptor: the mapping does not need it.
    """
    fd = checked_memfd(offer)
    try:
        return mmap.mmap(fd, offer.size)
    except (OSError, ValueError) as exc:
        raise invalid_error("region", f"the memfd cannot be mapped read-write: {exc}") from None


def checked_memfd(offer: RegionOffer) -> int:
    """The offer's one descriptor, once it is a memfd sealed against shrinking and growing that
    holds the declared size; 161002 naming `region` when it is not."""
    if len(offer.fds) != 1 or offer.truncated:
        count = f"more than {len(offer.fds)}" if offer.truncated else len(offer.fds)
        raise invalid_error(
            "region", f"a registration passes exactly one memfd (SCM_RIGHTS over the Unix socket), got {count}"
        )
    fd = offer.fds[0]
    try:
        info = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise invalid_error("region", f"the descriptor cannot be inspected: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or not target.startswith("/memfd:"):
        raise invalid_error("region", "the descriptor is not a memfd (regions are never opened by name)")
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
        raise invalid_error(
            "region", "the memfd must be sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)"
        )
    if not 0 < offer.size <= info.st_size:
        raise invalid_error("region", f"a region of {offer.size} bytes was declared; the memfd holds {info.st_size}")
    return fd
