"""A connection's mailbox: the sealed memfd its large requests arrive in, which the server only reads."""

from __future__ import annotations

import ctypes
import mmap
import os

_MAPPED_MAILBOX_BYTES = 64 << 10


class Mailbox:
    """A connection's mailbox: the client's sealed memfd (checked_memfd), which the server only reads.

    Its first _MAPPED_MAILBOX_BYTES are mapped read-only, so a small request (the common one) is one
    copy: a pread reads a memfd page by page, 24-32 us for a 37 KB request here. Larger payloads are
    read with pread, which never fills a hole. The seals keep the memfd from shrinking under the
    mapping (no SIGBUS). Reading a hole through the mapping fills it with a page charged to the
    server, so a connection's mapping can cost the server at most _MAPPED_MAILBOX_BYTES, what its own
    buffer costs (BUFFER_BYTES), and no longer than the mailbox lives: closing it punches the head
    out of the memfd (the mailbox goes with its connection; a memfd sealed against writes, which
    could not be punched, is refused as a mailbox).
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        try:  # Python's mapping holds a duplicate of the descriptor: two per mailbox
            self._map: mmap.mmap | None = mmap.mmap(fd, min(size, _MAPPED_MAILBOX_BYTES), prot=mmap.PROT_READ)
        except OSError:  # a memfd this cannot map (hugetlb pages): everything is read with pread
            self._map = None
        self._head = memoryview(self._map if self._map is not None else b"")

    def read_into(self, payload: memoryview) -> int:
        """Copies the mailbox's first payload.nbytes bytes into `payload`; the count read."""
        if payload.nbytes <= self._head.nbytes:
            payload[:] = self._head[: payload.nbytes]
            return payload.nbytes
        return _read_mailbox(self.fd, payload)

    def close(self) -> None:
        self._head.release()
        if self._map is not None:
            self._map.close()
        _libc.fallocate(self.fd, _PUNCH_HOLE, 0, min(self.size, _MAPPED_MAILBOX_BYTES))
        os.close(self.fd)


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
