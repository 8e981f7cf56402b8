"""Descriptors a Unix-socket peer passes: accepted only in a registration, and received, checked and
closed on a broker thread of the peer's identity, never on a shared thread or under a lock.

Closing a descriptor can block for as long as its file likes: the last close of a TCP socket with
SO_LINGER and unsent data waits for the linger time, a FUSE file's waits for its daemon. The
kernel does such a close itself in whichever thread receives a descriptor it has no room for, or
closes a socket whose queue still holds passed descriptors. So the Unix listener refuses passing
(SO_PASSRIGHTS off, inherited by every connection, Linux 6.16 and later: a peer's sendmsg with
SCM_RIGHTS fails with EPERM and nothing reaches the server). A registration turns it on for its
connection alone, on the identity's broker thread: that thread answers "send it", receives one
byte with room for one descriptor, turns passing off again and checks that nothing else came.
Whatever blocks there blocks that identity's registrations, nobody else's.

On older kernels passing cannot be refused: every read of a Unix socket then has room for as many
descriptors as one message can carry (SCM_MAX_FD), so the kernel never closes one in a shared
thread, and what arrives outside a registration goes, with its connection, to the broker to close.
"""

from __future__ import annotations

import array
import collections
import fcntl
import logging
import os
import select
import socket
import termios
import threading
import time
from collections.abc import Callable

log = logging.getLogger("aclnn_server")

SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)
_SCM_MAX_FD = 253  # the most descriptors one message carries (include/net/scm.h)
_INT = array.array("i").itemsize
# Room for every descriptor a message can carry (without SO_PASSRIGHTS), or for a registration's one.
ROOM_FOR_ALL = socket.CMSG_SPACE(_SCM_MAX_FD * _INT)
_ROOM_FOR_ONE = socket.CMSG_SPACE(_INT)
_CTRUNC = int(socket.MSG_CTRUNC)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
# Registrations of one identity waiting for its broker thread; beyond, they are refused (busy).
MAX_QUEUED_PER_IDENTITY = 4


def refuse_passing(listener: socket.socket) -> bool:
    """Turns descriptor passing off on a Unix listener (its connections inherit it); False when the
    kernel cannot (before Linux 6.16)."""
    try:
        listener.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
    except OSError:
        return False
    return listener.getsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS) == 0


def descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors in SCM_RIGHTS ancillary data (now open in this process)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds += received
    return fds


class Unexpected(Exception):
    """Descriptors arrived outside a registration (a kernel without SO_PASSRIGHTS): the connection
    and they go to the broker to be closed."""

    def __init__(self, fds: list[int]) -> None:
        super().__init__(f"{len(fds)} descriptors outside a registration")
        self.fds = fds


class Broker:
    """Runs descriptor work per identity: one thread at a time for an identity, its jobs in order,
    at most MAX_QUEUED_PER_IDENTITY waiting. A job that blocks (a close that lingers) stalls only its
    identity's later jobs; the thread leaves once its identity has nothing queued."""

    def __init__(self) -> None:
        self._queues: dict[str | None, collections.deque[Callable[[], None]]] = {}
        self._lock = threading.Lock()

    def submit(self, identity: str | None, job: Callable[[], None], always: bool = False) -> bool:
        """Queues `job` for `identity`'s thread; False when its queue is full (`always`: never refused,
        for closing what arrived uninvited)."""
        with self._lock:
            queue = self._queues.get(identity)
            if queue is None:
                queue = self._queues[identity] = collections.deque()
                thread = threading.Thread(target=self._run, args=(identity, queue), name="aclnn-descriptors")
                thread.daemon = True
                thread.start()
            elif len(queue) >= MAX_QUEUED_PER_IDENTITY and not always:
                return False
            queue.append(job)
            return True

    def close_later(self, identity: str | None, fds: list[int], sock: socket.socket | None = None) -> None:
        """Closes descriptors (and a socket whose queue may hold more) on the identity's thread."""

        def close() -> None:
            for fd in fds:
                os.close(fd)
            if sock is not None:
                sock.close()

        self.submit(identity, close, always=True)

    def _run(self, identity: str | None, queue: collections.deque[Callable[[], None]]) -> None:
        while True:
            with self._lock:
                if not queue:
                    del self._queues[identity]
                    return
                job = queue.popleft()
            try:
                job()
            except Exception:
                log.exception("data channel: descriptor work failed")


class Excess(Exception):
    """More than a registration's one byte arrived: the connection is out of step (it is closed)."""

    def __init__(self, fds: list[int], queued: int) -> None:
        super().__init__(f"{queued} bytes beyond a registration's descriptor")
        self.fds = fds


def receive_one(sock: socket.socket, passing_refused: bool, deadline: float) -> tuple[list[int], int]:
    """Receives a registration's descriptor on a connection the peer was just told to send it on:
    (the descriptors received, now open here; how many the peer passed: any beyond the room were
    closed by the kernel, in this thread). The caller closes all but the one it keeps.

    Raises ConnectionError when the peer closes, TimeoutError at the deadline, and Excess when
    anything came beyond the one byte.
    """
    readable = select.poll()
    readable.register(sock, select.POLLIN)
    try:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not readable.poll(remaining * 1000):
            raise TimeoutError("no descriptor before the deadline")
        room = _ROOM_FOR_ONE if passing_refused else ROOM_FOR_ALL
        data, ancillary, flags, _ = sock.recvmsg(1, room, _CLOEXEC)
    finally:
        if passing_refused:
            sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
    fds = descriptors(ancillary)
    queued = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, queued)
    if not data or queued[0]:  # the peer sends its byte, then waits: anything more breaks the protocol
        raise Excess(fds, queued[0])
    return fds, len(fds) + (1 if flags & _CTRUNC else 0)


def allow_passing(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 1)
