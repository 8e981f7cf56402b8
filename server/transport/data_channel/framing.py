"""Frames on a data-channel connection: a request's bytes read without blocking, replies sent."""

from __future__ import annotations

import socket
import ssl
import time

from google.rpc import status_pb2

from aclnn_common.framing import REPLY, ConnectionLost

from ..progress import progress_deadline
from .connection import Connection, ProtocolError
from .descriptors import ROOM_FOR_ALL, Unexpected, descriptors

# Plain ints once: IntFlag arithmetic is Python code (~2 us an operation, on every request).
_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_COALESCE_BYTES = 64 << 10


def status(code: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


def failure_parts(failed: status_pb2.Status) -> tuple[bytes, bytes]:
    message = failed.SerializeToString()
    return REPLY.pack(0, len(message)), message


def failure(failed: status_pb2.Status) -> bytes:
    return b"".join(failure_parts(failed))


def ok(payload: bytes) -> tuple[bytes, bytes]:
    return REPLY.pack(1, len(payload)), payload


def receive_into(conn: Connection, view: memoryview) -> int:
    """One read into `view`: the count read (0: closed); BlockingIOError when nothing is there."""
    if conn.may_pass:  # room for every descriptor a message carries: none is closed in this thread
        count, ancillary, _, _ = conn.sock.recvmsg_into([view], ROOM_FOR_ALL, _CLOEXEC)
        if ancillary:
            raise Unexpected(descriptors(ancillary))
        return count
    return conn.sock.recv_into(view)


def fill(conn: Connection, allowance_s: float) -> bool:
    """Reads what has arrived into the rest of `conn.buffer`; True once `conn.need` bytes are there.
    Never blocks. The request's first bytes start its deadline (`allowance_s` from then)."""
    view = conn.buffer
    while conn.got < conn.need:
        try:
            count = receive_into(conn, view[conn.got :])
        except (BlockingIOError, ssl.SSLWantReadError):
            return False
        if count == 0:
            raise ConnectionLost("closed by the peer" if conn.got else "closed by the peer between requests")
        now = time.monotonic()
        if conn.deadline is None:  # the request's first bytes: the rest must keep coming (housekeeping)
            conn.started, conn.received = now, 0
        conn.received += count
        conn.deadline = progress_deadline(conn.started, conn.received, allowance_s, now)
        conn.got += count
    return True


def drain(conn: Connection) -> bool:
    """Reads and drops a refused payload (the connection stays in step); True once all is gone."""
    while conn.discard:
        try:
            count = receive_into(conn, conn.own_buffer[: min(conn.discard, len(conn.own_buffer))])
        except (BlockingIOError, ssl.SSLWantReadError):
            return False
        if count == 0:
            raise ConnectionLost("closed by the peer")
        conn.discard -= count
    return True


def send(conn: Connection, parts: list[bytes | memoryview], allowance_s: float) -> None:
    """Sends a reply's parts in order (a header, a message, arrays' bytes): at once when the socket
    takes them (small replies), else as fast as the peer reads, as long as it keeps up with
    progress.MIN_BYTES_PER_S (else TimeoutError: the caller closes the connection). A plain socket
    takes all the parts with one sendmsg, no copy; TLS, which has none, one part at a time."""
    views = [memoryview(part).cast("B") for part in parts]
    nbytes = sum(view.nbytes for view in views)
    if isinstance(conn.sock, ssl.SSLSocket) and nbytes <= _COALESCE_BYTES:
        views = [memoryview(b"".join(views))]
    views = [view for view in views if view.nbytes]
    sock, moved = conn.sock, 0
    started = last = time.monotonic()
    blocking = False
    try:
        while views:
            try:
                sent = sock.send(views[0]) if isinstance(sock, ssl.SSLSocket) else sock.sendmsg(views)
            except (BlockingIOError, ssl.SSLWantWriteError):
                sent = 0
            if sent:
                moved, last = moved + sent, time.monotonic()
            while views and sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            if views:
                views[0] = views[0][sent:]
                remaining = progress_deadline(started, moved, allowance_s, last) - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the peer read {moved} of {nbytes} bytes too slowly")
                sock.settimeout(remaining)  # the socket is full: wait for room
                blocking = True
    finally:
        if blocking:
            sock.setblocking(False)


def send_now(conn: Connection, data: bytes) -> None:
    """A short answer during the handshake: the socket takes it at once, or the peer is not reading."""
    try:
        sent = conn.sock.send(data)
    except (BlockingIOError, ssl.SSLWantWriteError):
        sent = 0
    if sent != len(data):
        raise ProtocolError("the peer does not read")


def peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed the connection: it sends nothing while it waits for its reply, so
    readable with no bytes to read means closed. The raw socket is peeked (under TLS too)."""
    try:
        return socket.socket.recv(sock, 1, _PEEK_NOW) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
