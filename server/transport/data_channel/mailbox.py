"""A connection's mailbox: the sealed memfd its large requests arrive in, which the server only reads."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref

import numpy as np

from ...ledger import Hold

log = logging.getLogger("aclnn_server")

_MAPPED_MAILBOX_BYTES = 64 << 10
_NOTHING = np.empty(0, np.uint8)


class Mailbox:
    """A connection's mailbox: the client's sealed memfd (checked_memfd), which the server only reads.

    With a `hold` (the ledger's, for all of it) the whole mailbox is mapped read-only: a request is
    copied out of the mapping (a pread reads a memfd page by page, ~4x slower), and a call's attached
    tensors are not copied at all (`view`): the server computes on them where the client wrote them.
    Without one (the identity's share is full) only its first _MAPPED_MAILBOX_BYTES are, so a small
    request (the common one) is still one copy, and larger payloads are read with pread, which never
    fills a hole. The seals keep the memfd from shrinking under the mapping (no SIGBUS).

    Reading a hole through the mapping fills it with a page charged to the server: the whole
    mapping is held in the ledger (the head alone, 64 KiB, counts as the connection's fixed cost,
    like its buffer, BUFFER_BYTES) for as long as the mapping lives, which is until the mailbox is
    closed and the last view of it (a call's input) is gone. Then the mapped range is punched out
    of the memfd, the hold ended and the mapping closed (a memfd sealed against writes, which could
    not be punched, is refused as a mailbox).

    A `sealed` mailbox (one above HELD_MAILBOX_BYTES, sealed against writes: no hole can be punched in
    it) is mapped whole without a hold: its requests are read only where `filled` found no hole, so
    the server never fills a page of it, and there is nothing to punch when it goes.
    """

    def __init__(self, fd: int, size: int, hold: Hold | None = None, sealed: bool = False) -> None:
        self.fd, self.size, self.sealed = fd, size, sealed
        self._filled = 0  # a sealed mailbox's first bytes found without holes (none can appear later)
        mapped = size if hold is not None or sealed else min(size, _MAPPED_MAILBOX_BYTES)
        try:  # Python's mapping holds a duplicate of the descriptor: two per mailbox
            mapping: mmap.mmap | None = mmap.mmap(fd, mapped, prot=mmap.PROT_READ)
        except OSError:  # a memfd this cannot map (hugetlb pages): everything is read with pread
            mapping = None
        self._bytes = _NOTHING
        self._mapped = mapping is not None
        if mapping is None:
            if hold is not None:
                hold.release()
        else:
            # Every view handed out is a view of this array: the mapping (and its hold) last as long as it.
            self._bytes = np.frombuffer(mapping, np.uint8)
            weakref.finalize(self._bytes, _unmapped, mapping, fd, hold, not sealed)

    def filled(self, end: int) -> bool:
        """Whether the mailbox's first `end` bytes hold no hole (always, for one the ledger holds). A
        sealed mailbox's holes can only be filled, never made again: each byte is looked at once."""
        if not self.sealed or end <= self._filled:
            return True
        try:
            self._filled = min(os.lseek(self.fd, self._filled, os.SEEK_HOLE), self.size)
        except OSError:  # ENXIO: at or past the end, where there is nothing to look at
            return False
        return end <= self._filled

    def read_into(self, payload: memoryview) -> int:
        """Copies the mailbox's first payload.nbytes bytes into `payload`; the count read."""
        if payload.nbytes <= self._bytes.nbytes:
            np.frombuffer(payload, np.uint8)[:] = self._bytes[: payload.nbytes]
            return payload.nbytes
        return _read_mailbox(self.fd, payload)

    def view(self, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) of the mailbox where the client wrote them (read-only, not copied), or None
        when they are not mapped. The client may change them at any time: only what it sends for its
        own calls' computation is read this way, never anything the server parses or checks."""
        if end > self._bytes.nbytes:
            return None
        return memoryview(self._bytes[start:end])

    def close(self) -> None:
        """The connection is done with it: the mapping goes with its last view (at once, between calls)."""
        self._bytes = _NOTHING
        if not self._mapped:
            os.close(self.fd)


def _unmapped(mapping: mmap.mmap, fd: int, hold: Hold | None, punch: bool) -> None:
    """The last view of a mailbox's mapping is gone: the mapped range is punched out of the memfd (but
    a sealed one's, which the server never filled), the descriptor closed, the hold ended; the mapping
    closes with the last reference to it (this call's)."""
    if punch and _libc.fallocate(fd, _PUNCH_HOLE, 0, len(mapping)) != 0:  # checked_memfd's seals rule this out
        log.warning("a mailbox's pages could not be given back: %s", os.strerror(ctypes.get_errno()))
    os.close(fd)
    if hold is not None:
        hold.release()


def _read_mailbox(fd: int, payload: memoryview) -> int:
    """pread of a mailbox's payload. Up to _GIL_HELD_READ_BYTES without releasing the GIL: such a read
    is a copy of a few µs from the page cache, and releasing the GIL for it (os.preadv always does)
    hands the GIL to another busy worker on every call under load."""
    if payload.nbytes > _GIL_HELD_READ_BYTES:
        return os.preadv(fd, [payload], 0)
    count = _pread(fd, (ctypes.c_char * payload.nbytes).from_buffer(payload), payload.nbytes, 0)
    if count < 0:
        raise OSError(ctypes.get_errno(), "pread of a mailbox")
    return count


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_GIL_HELD_READ_BYTES = 1 << 20
_pread = ctypes.PyDLL(None, use_errno=True).pread  # PyDLL: the call keeps the GIL
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
