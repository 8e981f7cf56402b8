"""Descriptors a Unix-socket peer passes (SCM_RIGHTS): how many a read takes, and reading them out."""

from __future__ import annotations

import array
import socket

# Room for one descriptor: REGISTER_REGION passes one; the kernel closes any beyond the room.
FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)


def descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors in SCM_RIGHTS ancillary data (now open in this process)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds += received
    return fds
