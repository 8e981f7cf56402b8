"""The server side of the data channel (protocol: aclnn_common/framing.py).

Listeners beside the gRPC port: TCP (with the gRPC port's TLS when it has it) and a Unix
domain socket for clients on this host, which also takes shared-memory regions (memfds
passed with SCM_RIGHTS). A connection is admitted by a ticket that the OpenDataChannel RPC
issued (valid for a minute, for any number of connections), so it carries that caller's
identity and session (gRPC authenticated it); every request then runs through
AclnnService like an RPC.

No thread belongs to a connection. One accept thread per listener only accepts. Every
connection then sits in one epoll set, armed for one event at a time (EPOLLONESHOT), and a
bounded pool of workers waits on that set: the worker a connection wakes advances its
handshake (TLS, then MAGIC and the ticket) or reads its request without blocking, and only
a whole request is served, on that worker, which then re-arms the connection. A peer that
trickles bytes holds a descriptor, never a thread, and a housekeeping thread (every quarter
second) closes it at its deadline: the handshake's, the request's, or the idle timeout.
Workers that wait on the set themselves, rather than one loop thread handing
ready connections to a pool, save a thread hand-off per call, so a small call costs what it
did with a thread per connection; re-arming from any thread is what EPOLLONESHOT is for.

TLS takes the same non-blocking steps (SSLSocket.do_handshake on a non-blocking socket,
driven by readiness like the ticket): a slow TLS peer is a slow peer like any other, within
the same handshake deadline, and no thread ever waits for a handshake's bytes.
"""

from __future__ import annotations

import array
import collections
import ctypes
import errno
import logging
import mmap
import os
import secrets
import select
import socket
import ssl
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.errors import AclnnError, invalid_error
from aclnn_common.framing import (
    CALL,
    DOWNLOAD,
    IN_MAILBOX,
    MAGIC,
    MAILBOX,
    MAILBOX_MAX_BYTES,
    METHODS,
    REGION,
    REGISTER_REGION,
    REPLY,
    REQUEST,
    TICKET_BYTES,
    UNREGISTER_REGION,
    UPLOAD,
    ConnectionLost,
)

from ..engine import CallContext
from ..regions import RegionOffer, checked_memfd
from .service import AclnnService, failure_status, new_request_id

log = logging.getLogger("aclnn_server")

_TICKET_TTL_S = 60.0
# Beyond the base allowance (the handshake timeout), a request's bytes must arrive, and a reply's
# leave, at least this fast: a 1 GiB tensor gets ~17 minutes, a slow-loris peer a few seconds.
_MIN_BYTES_PER_S = 1 << 20
_HOUSEKEEPING_S = 0.25
# The accept loop's pause after a failure (out of descriptors or memory: EMFILE, ENFILE, ENOBUFS,
# ENOMEM); it keeps listening.
_BACKOFF_S = 0.1
_KINDS = frozenset({CALL, CALL | IN_MAILBOX, UPLOAD, DOWNLOAD, REGISTER_REGION, UNREGISTER_REGION, MAILBOX})
_WITH_DESCRIPTOR = frozenset({REGISTER_REGION, MAILBOX})
# Plain ints once: IntFlag arithmetic is Python code (~2 us an operation, on every request).
_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_CTRUNC = int(socket.MSG_CTRUNC)
_COALESCE_BYTES = 64 << 10
# Each admitted connection's own buffer: a request this small arrives in one read, into memory the
# connection holds anyway (at most max_connections of them); a larger one is held in the ledger first.
_BUFFER_BYTES = REQUEST.size + (64 << 10)
# Room for one descriptor: REGISTER_REGION passes one; the kernel closes any beyond the room.
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)
_SO_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class Limits:
    """What one listener lets its peers hold (the server options data_*)."""

    max_connections: int = 128  # admitted connections, all identities together
    max_per_identity: int = 16  # admitted connections of one identity (a ticket's owner)
    max_handshakes: int = 64  # connections not admitted yet; beyond, new ones are closed at once
    handshake_timeout_s: float = 5.0  # to finish TLS and present a ticket; also each request's base allowance
    idle_timeout_s: float = 60.0  # an admitted connection without a request is closed after this
    workers: int = 16  # threads serving requests (a queued call holds one while it waits)


class _ProtocolError(Exception):
    """The peer broke the protocol (or was refused): the connection is closed."""


def _status(code: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


class _Conn:
    """One connection's state between its events; a worker owns it while `active`."""

    def __init__(self, sock: socket.socket, unix: bool, peer: tuple[int, int, int] | None, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.unix = unix
        self.peer = peer  # (pid, uid, gid) of a Unix-socket peer, from SO_PEERCRED
        self.tls_pending = isinstance(sock, ssl.SSLSocket)
        self.admitted = False
        self.owner: str | None = None
        self.session: str | None = None
        self.deadline: float | None = deadline  # of the handshake, or of the request being received
        self.idle_since = time.monotonic()
        self.events = select.EPOLLIN
        self.active = False  # a worker handles it now
        self.closed = False
        self.buffer = memoryview(bytearray(len(MAGIC) + TICKET_BYTES))  # what is being received
        self.got = 0
        self.need = len(self.buffer)  # bytes of `buffer` the current step waits for
        self.own_buffer = self.buffer  # the connection's buffer, once admitted
        self.header: tuple[int, int, int, int, int] | None = None
        self.payload: memoryview = self.buffer
        self.hold: Any = None  # the ledger's hold on a large request's payload
        self.refusal: status_pb2.Status | None = None  # the answer once a refused payload is drained
        self.discard = 0  # bytes of a refused payload still to drain
        self.fds: list[int] = []  # descriptors received with the request (Unix socket)
        self.fds_truncated = False  # it came with more descriptors than that
        self.mailbox: _Mailbox | None = None  # where large CALL payloads come in (Unix socket)

    def next_request(self) -> None:
        """Waits for a request header, into the connection's own buffer (made at admission)."""
        if len(self.own_buffer) < _BUFFER_BYTES:
            self.own_buffer = memoryview(bytearray(_BUFFER_BYTES))
        self.buffer, self.got, self.need, self.header, self.deadline = self.own_buffer, 0, REQUEST.size, None, None
        self.refusal, self.discard = None, 0
        self.idle_since = time.monotonic()

    def drop_request(self) -> None:
        """Gives back what the request holds: its memory, descriptors it brought."""
        if self.hold is not None:
            self.hold.release()
            self.hold = None
        for fd in self.fds:
            os.close(fd)
        self.fds, self.fds_truncated = [], False


class _SocketUpload:
    """An UPLOAD's bytes: room is confirmed to the client (the reservation held), then they are received."""

    def __init__(self, server: DataChannelServer, conn: _Conn, total_size: int) -> None:
        self.server, self.conn, self.total_size = server, conn, total_size
        self.started = False

    def read_into(self, buffer: memoryview) -> None:
        self.started = True
        self.server._send(self.conn, REPLY.pack(1, 0))
        deadline = time.monotonic() + self.server.limits.handshake_timeout_s + buffer.nbytes / _MIN_BYTES_PER_S
        sock, received = self.conn.sock, 0
        try:
            while received < buffer.nbytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{received} of {buffer.nbytes} bytes arrived before the deadline")
                sock.settimeout(remaining)
                count = sock.recv_into(buffer[received:])
                if count == 0:
                    raise ConnectionLost(f"connection closed after {received} of {buffer.nbytes} bytes")
                received += count
        except (ConnectionLost, TimeoutError) as exc:
            raise invalid_error("chunk", f"upload truncated: {exc}") from None
        finally:
            sock.setblocking(False)


class DataChannelServer:
    """Listens on TCP `host:port` (0: a free port; None: no TCP) and on a Unix socket, and serves
    admitted connections.

    `unix_socket`: a path, "auto" (a fresh directory of its own under the temp directory), or
    None (no Unix socket).
    """

    def __init__(
        self,
        service: AclnnService,
        host: str,
        port: int | None,
        max_message_bytes: int,
        limits: Limits,
        tls: ssl.SSLContext | None = None,
        unix_socket: str | None = None,
    ) -> None:
        self.service = service
        self.tls = tls
        self.limits = limits
        self.max_message_bytes = max_message_bytes
        self._listeners: list[tuple[socket.socket, bool]] = []
        self.port = 0
        self.unix_path: str | None = None
        self._unix_inode = 0
        self._made_directory: str | None = None
        try:
            if port is not None:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                listener = socket.socket(family, socket.SOCK_STREAM)
                self._listeners.append((listener, False))
                # A restarted server takes its port back at once, whatever connections linger in TIME_WAIT.
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((host, port))
                listener.listen(socket.SOMAXCONN)
                self.port = listener.getsockname()[1]
            if unix_socket is not None:
                try:
                    self._listeners.append((self._unix_listener(unix_socket), True))
                except OSError as exc:
                    if unix_socket != "auto":
                        raise
                    log.warning("no Unix socket for the data channel (%s): clients on this host use TCP", exc)
        except BaseException:
            self._close_listeners()
            raise
        self._tickets: dict[bytes, tuple[str | None, str | None, float]] = {}
        self._conns: dict[int, _Conn] = {}
        self._handshaking = 0
        self._admitted = 0
        self._per_identity: collections.Counter[str | None] = collections.Counter()
        self._lock = threading.Lock()
        self._stopping = False
        self._refusing = False  # the handshake cap is being hit (warned once per episode)
        self._stopped = threading.Event()
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)  # level-triggered: wakes every worker at stop
        self._started = False
        self._workers = 0  # running; the last to leave closes the epoll set
        service.issue_ticket = self.issue_ticket

    def _unix_listener(self, setting: str) -> socket.socket:
        if setting == "auto":
            self._made_directory = tempfile.mkdtemp(prefix="aclnn-serve-")
            # Others may reach the socket (tickets authenticate them) but not list or add files here.
            os.chmod(self._made_directory, 0o711)
            path = os.path.join(self._made_directory, "data.sock")
        else:
            path = os.path.abspath(setting)
            _remove_stale_socket(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            self.unix_path, self._unix_inode = path, os.stat(path).st_ino
            os.chmod(path, 0o666)
            listener.listen(socket.SOMAXCONN)
        except BaseException:
            listener.close()
            self._remove_unix_path()
            self.unix_path = self._made_directory = None
            raise
        return listener

    def issue_ticket(self, call: CallContext) -> pb.DataChannelTicket:
        """A ticket admitting connections, for a while, as this caller and session; and where to use it."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, (_, _, expires) in self._tickets.items() if expires < now]:
                del self._tickets[stale]
            self._tickets[ticket] = (call.owner, call.session, now + _TICKET_TTL_S)
        return pb.DataChannelTicket(port=self.port, ticket=ticket, unix_path=self.unix_path or "")

    @property
    def open_connections(self) -> int:
        """Admitted connections (connections still in their handshake are not counted)."""
        with self._lock:
            return self._admitted

    def start(self) -> None:
        for listener, unix in self._listeners:
            threading.Thread(target=self._accept, args=(listener, unix), name="aclnn-data-accept", daemon=True).start()
        threading.Thread(target=self._housekeeping, name="aclnn-data-housekeeping", daemon=True).start()
        self._started, self._workers = True, self.limits.workers
        for _ in range(self.limits.workers):
            threading.Thread(target=self._work, name="aclnn-data", daemon=True).start()

    def stop(self, grace: float | None) -> None:
        """Stops accepting; idle connections close now, busy ones after their current request.

        Returns once every connection closed, or after `grace` seconds; `grace=None` (as
        grpc.Server.stop) closes busy connections at once too.
        """
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            for conn in list(self._conns.values()):
                if not conn.active:
                    self._close_locked(conn)
                elif grace is None:
                    _shutdown(conn.sock)
        self._close_listeners()
        self._stopped.set()
        os.write(self._wake_w, b"x")  # workers with nothing to finish leave
        if not self._started:
            self._close_epoll()  # no worker will
        deadline = time.monotonic() + (grace or 0)
        while self._conns and time.monotonic() < deadline:
            time.sleep(0.02)

    def _close_listeners(self) -> None:
        for listener, _ in self._listeners:
            _shutdown(listener)  # wakes the accept thread (close alone would not)
            listener.close()
        self._remove_unix_path()

    def _remove_unix_path(self) -> None:
        """Removes the socket file (while it is still ours, not a successor's) and the directory made for it."""
        if self.unix_path is not None:
            try:
                if os.stat(self.unix_path).st_ino == self._unix_inode:
                    os.unlink(self.unix_path)
            except OSError:
                pass
        if self._made_directory is not None:
            try:
                os.rmdir(self._made_directory)
            except OSError:
                pass

    # Accepting ------------------------------------------------------------------------------

    def _accept(self, listener: socket.socket, unix: bool) -> None:
        """Accepts until stop(); out of descriptors or memory it pauses and tries again, never gives up."""
        trouble = False
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EINTR):
                    continue
                if not trouble:
                    log.warning("data channel cannot accept connections (%s): retrying every %g s", exc, _BACKOFF_S)
                    trouble = True
                time.sleep(_BACKOFF_S)
                continue
            if trouble:
                log.warning("data channel accepts connections again")
                trouble = False
            self._add(sock, unix)

    def _add(self, sock: socket.socket, unix: bool) -> None:
        """Puts a new connection in its handshake, unless too many are there already (then closes it)."""
        try:
            peer = _SO_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)) if unix else None
            if not unix:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            if self.tls is not None and not unix:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as exc:
            log.debug("data channel connection dropped at accept: %s", exc)
            sock.close()
            return
        conn = _Conn(sock, unix, peer, time.monotonic() + self.limits.handshake_timeout_s)
        with self._lock:
            full = self._handshaking >= self.limits.max_handshakes
            if not (full or self._stopping):
                self._refusing = False
                self._handshaking += 1
                self._conns[conn.fd] = conn
                self._epoll.register(conn.fd, select.EPOLLIN | select.EPOLLONESHOT)
                return
            warn, self._refusing = full and not self._refusing, full
        if warn:
            log.warning(
                "data channel: %d connections are in their handshake (data_max_handshakes): closing new ones",
                self.limits.max_handshakes,
            )
        sock.close()

    # Workers --------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                for fd, _ in self._epoll.poll(None, 1):
                    if fd == self._wake_r:
                        return
                    conn = self._claim(fd)
                    if conn is not None:
                        self._turn(conn)
        finally:
            with self._lock:
                self._workers -= 1
                last = not self._workers
            if last:
                self._close_epoll()

    def _close_epoll(self) -> None:
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _claim(self, fd: int) -> _Conn | None:
        with self._lock:
            conn = self._conns.get(fd)
            if conn is None or conn.active:
                return None  # gone, or a stale event: the worker that has it re-arms it
            conn.active = True
            return conn

    def _turn(self, conn: _Conn) -> None:
        """Whatever the connection is ready for: its handshake, its request (served once whole)."""
        try:
            if not conn.admitted and not self._handshake(conn):
                return self._rearm(conn)
            while True:
                header = self._receive(conn)
                if header is None:
                    return self._rearm(conn)
                self._serve(conn, *header)
                conn.drop_request()
                conn.next_request()
                # The peer sends nothing before it has its reply; only TLS may have read ahead.
                if not (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
                    return self._rearm(conn)
        except (OSError, ConnectionLost, _ProtocolError) as exc:
            log.debug("data channel connection closed: %s", exc)
        except Exception:
            log.exception("data channel connection failed")
        self._close(conn)
        return None

    def _rearm(self, conn: _Conn) -> None:
        with self._lock:
            conn.active = False
            if self._stopping:
                self._close_locked(conn)
            else:
                self._epoll.modify(conn.fd, conn.events | select.EPOLLONESHOT)

    def _close(self, conn: _Conn) -> None:
        with self._lock:
            self._close_locked(conn)

    def _close_locked(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.fd]
        if conn.admitted:
            self._admitted -= 1
            self._per_identity[conn.owner] -= 1
            if not self._per_identity[conn.owner]:
                del self._per_identity[conn.owner]
        else:
            self._handshaking -= 1
        conn.drop_request()
        if conn.mailbox is not None:
            conn.mailbox.close()
        try:
            self._epoll.unregister(conn.fd)  # before close: the number may be reused at once
        except OSError:
            pass
        conn.sock.close()

    def _housekeeping(self) -> None:
        """Closes connections past their deadline (handshake, request) or idle for too long, until stop()."""
        while not self._stopped.wait(_HOUSEKEEPING_S):
            now = time.monotonic()
            idle_limit = now - self.limits.idle_timeout_s
            with self._lock:
                expired = [
                    c
                    for c in self._conns.values()
                    if not c.active and (now > c.deadline if c.deadline is not None else c.idle_since < idle_limit)
                ]
                for conn in expired:
                    self._close_locked(conn)
            for conn in expired:
                log.debug("data channel connection closed: %s", "too slow" if conn.deadline is not None else "idle")

    # Handshake ------------------------------------------------------------------------------

    def _handshake(self, conn: _Conn) -> bool:
        """Advances TLS, then reads MAGIC and the ticket; True once admitted (refusals raise)."""
        if conn.tls_pending:
            try:
                conn.sock.do_handshake()
            except ssl.SSLWantReadError:
                conn.events = select.EPOLLIN
                return False
            except ssl.SSLWantWriteError:
                conn.events = select.EPOLLOUT
                return False
            conn.tls_pending, conn.events = False, select.EPOLLIN
        if not self._fill(conn):
            return False
        refusal = self._admit(conn, bytes(conn.buffer))
        if refusal is not None:
            self._send_now(conn, _failure(refusal))
            raise _ProtocolError(f"refused: {refusal.message}")
        self._send_now(conn, REPLY.pack(1, 0))
        conn.next_request()
        return True

    def _admit(self, conn: _Conn, hello: bytes) -> status_pb2.Status | None:
        """Admits the connection as its ticket's caller; else the status it is refused with."""
        with self._lock:
            ticket = self._tickets.get(hello[len(MAGIC) :]) if hello[: len(MAGIC)] == MAGIC else None
            if ticket is None or ticket[2] < time.monotonic():
                return _status(code_pb2.UNAUTHENTICATED, "unknown or expired data-channel ticket")
            owner, session, _ = ticket
            if conn.peer is not None and (owner or "").startswith("uid:") and owner != f"uid:{conn.peer[1]}":
                return _status(code_pb2.PERMISSION_DENIED, "the ticket was issued to another local user")
            if self._admitted >= self.limits.max_connections:
                return _status(code_pb2.RESOURCE_EXHAUSTED, f"{self.limits.max_connections} connections are open")
            if self._per_identity[owner] >= self.limits.max_per_identity:
                return _status(
                    code_pb2.RESOURCE_EXHAUSTED,
                    f"this caller has {self.limits.max_per_identity} connections open "
                    "(--data-max-connections-per-tenant)",
                )
            conn.admitted, conn.owner, conn.session, conn.deadline = True, owner, session, None
            self._handshaking -= 1
            self._admitted += 1
            self._per_identity[owner] += 1
        if conn.peer is not None:
            log.info("data channel: Unix-socket peer pid=%d uid=%d gid=%d admitted as %s", *conn.peer, owner or "-")
        return None

    # Requests -------------------------------------------------------------------------------

    def _fill(self, conn: _Conn) -> bool:
        """Reads what has arrived into the rest of `conn.buffer`; True once `conn.need` bytes are there.
        Never blocks."""
        view = conn.buffer
        while conn.got < conn.need:
            try:
                if conn.unix:
                    count, ancillary, flags, _ = conn.sock.recvmsg_into([view[conn.got :]], _FD_SPACE)
                    if ancillary:
                        conn.fds += _descriptors(ancillary)
                    if flags & _CTRUNC:
                        conn.fds_truncated = True  # more than room for (closed by the kernel)
                else:
                    count = conn.sock.recv_into(view[conn.got :])
            except (BlockingIOError, ssl.SSLWantReadError):
                return False
            if count == 0:
                raise ConnectionLost("closed by the peer" if conn.got else "closed by the peer between requests")
            if conn.deadline is None:  # the request's first bytes: the whole of it must follow in time
                conn.deadline = time.monotonic() + self.limits.handshake_timeout_s
            conn.got += count
        return True

    def _drain(self, conn: _Conn) -> bool:
        """Reads and drops a refused payload (the connection stays in step); True once all is gone."""
        while conn.discard:
            try:
                count = conn.sock.recv_into(conn.own_buffer, min(conn.discard, len(conn.own_buffer)))
            except (BlockingIOError, ssl.SSLWantReadError):
                return False
            if count == 0:
                raise ConnectionLost("closed by the peer")
            conn.discard -= count
        return True

    def _receive(self, conn: _Conn) -> tuple[int, int, int, int, int] | None:
        """The request once all of it has arrived (an UPLOAD's bytes come later), else None."""
        if conn.header is None:
            if not self._fill(conn):
                return None
            header = REQUEST.unpack_from(conn.buffer)
            kind, length = header[0], header[4]
            if kind not in _KINDS:
                raise _ProtocolError(f"unknown request kind {kind}")
            if kind not in _WITH_DESCRIPTOR:
                conn.drop_request()  # descriptors only come with a registration
            in_mailbox = kind == CALL | IN_MAILBOX
            if in_mailbox and (conn.mailbox is None or length > conn.mailbox.size):
                raise _ProtocolError(f"a {length}-byte request in a mailbox the connection does not have")
            conn.header, early = header, conn.got - REQUEST.size  # payload bytes read with the header
            if early > (0 if kind == UPLOAD or in_mailbox else length):
                raise _ProtocolError("bytes beyond the request")  # a client sends one request, then waits
            if kind == UPLOAD:
                return header
            if length > self.max_message_bytes:
                self._fail(conn, _status(code_pb2.RESOURCE_EXHAUSTED, f"request of {length} bytes is over the limit"))
                raise _ProtocolError("request over the message limit")
            conn.deadline += length / _MIN_BYTES_PER_S
            if REQUEST.size + length <= len(conn.buffer):
                conn.need = REQUEST.size + length
                conn.payload = conn.buffer[REQUEST.size : conn.need]
            else:
                try:
                    conn.hold = self.service.ledger.reserve(conn.owner, length, "request", "request")
                except AclnnError as exc:
                    conn.refusal, conn.discard = failure_status(exc)[0], 0 if in_mailbox else length - early
                else:
                    conn.payload = memoryview(np.empty(length, np.uint8))
                    conn.payload[:early] = conn.buffer[REQUEST.size : conn.got]
                    conn.buffer, conn.got, conn.need = conn.payload, early, length
            if in_mailbox and conn.refusal is None:
                # Copied out before anything parses it: the client may change its mailbox at any time.
                if conn.mailbox.read_into(conn.payload) != length:
                    raise _ProtocolError("the mailbox holds less than the request")
                conn.got = conn.need
        if not (self._drain(conn) if conn.refusal is not None else self._fill(conn)):
            return None
        return conn.header

    def _serve(self, conn: _Conn, kind: int, has_stream: int, stream: int, timeout_ms: int, length: int) -> None:
        """Serves a whole request on this thread (an UPLOAD receives its bytes here, within a deadline)."""
        if conn.refusal is not None:
            return self._fail(conn, conn.refusal)
        call = CallContext(
            owner=conn.owner,
            session=conn.session,
            stream=stream if has_stream else None,
            deadline=time.monotonic() + timeout_ms / 1000 if timeout_ms else None,
            cancelled=lambda: _peer_closed(conn.sock),
            holds=[conn.hold] if conn.hold is not None else [],  # a small request needs none
        )
        request_id = new_request_id()
        if kind == UPLOAD:
            upload = _SocketUpload(self, conn, length)
            try:
                reply = self.service.invoke("UploadTensor", upload, call, request_id)
            except Exception as exc:
                if upload.started:  # the rest of the bytes are still on their way: drop the connection
                    raise _ProtocolError(f"upload failed: {exc}") from None
                return self._fail(conn, failure_status(exc)[0])
            return self._send(conn, *_ok(reply.SerializeToString()))
        payload = conn.payload
        try:
            if kind == DOWNLOAD:
                buffer = self.service.invoke("DownloadTensor", pb.TensorHandle.FromString(payload), call, request_id)
                return self._send(conn, REPLY.pack(1, buffer.nbytes), buffer)
            if kind == REGISTER_REGION:
                size = REGION.unpack(payload)[0] if length == REGION.size else -1
                offer = RegionOffer(conn.fds, size, conn.fds_truncated)
                region_id = self.service.invoke("RegisterRegion", offer, call, request_id)
                return self._send(conn, *_ok(region_id.encode()))
            if kind == UNREGISTER_REGION:
                self.service.invoke("UnregisterRegion", bytes(payload).decode(errors="replace"), call, request_id)
                return self._send(conn, *_ok(b""))
            if kind == MAILBOX:
                return self._take_mailbox(conn, REGION.unpack(payload)[0] if length == REGION.size else -1)
        except DecodeError:
            return self._fail(conn, _status(code_pb2.INVALID_ARGUMENT, "DOWNLOAD request does not parse"))
        except Exception as exc:
            return self._fail(conn, failure_status(exc)[0])
        method = bytes(payload[1 : 1 + payload[0]]).decode(errors="replace") if length else ""
        if method not in METHODS:
            unknown = _status(code_pb2.UNIMPLEMENTED, f"method {method!r:.60} is not on the data channel")
            return self._fail(conn, unknown)
        try:
            request = METHODS[method][0].FromString(payload[1 + payload[0] :])
        except DecodeError:
            return self._fail(conn, _status(code_pb2.INVALID_ARGUMENT, f"{method} request does not parse"))
        try:
            reply = self.service.invoke(method, request, call, request_id)
        except Exception as exc:
            return self._fail(conn, failure_status(exc)[0])
        return self._send(conn, *_ok(reply.SerializeToString()))

    def _take_mailbox(self, conn: _Conn, size: int) -> None:
        """Keeps the memfd the connection passed as its mailbox (in place of one it had). The server
        only ever reads it (see _Mailbox)."""
        if not 0 < size <= MAILBOX_MAX_BYTES:
            too_large = _status(code_pb2.INVALID_ARGUMENT, f"a mailbox holds 1 to {MAILBOX_MAX_BYTES} bytes")
            return self._fail(conn, too_large)
        try:
            fd = checked_memfd(RegionOffer(conn.fds, size, conn.fds_truncated))
        except AclnnError as exc:
            return self._fail(conn, failure_status(exc)[0])
        conn.fds.remove(fd)  # the connection keeps it; drop_request closes what else came
        if conn.mailbox is not None:
            conn.mailbox.close()
        conn.mailbox = _Mailbox(fd, size)
        return self._send(conn, *_ok(b""))

    def _fail(self, conn: _Conn, status: status_pb2.Status) -> None:
        self._send(conn, *_failure_parts(status))

    def _send(self, conn: _Conn, header: bytes, payload: bytes | memoryview = b"") -> None:
        """Sends a reply: at once when the socket takes it (small replies), else within a deadline for its size."""
        nbytes = len(header) + memoryview(payload).nbytes
        parts = [header + bytes(payload)] if nbytes <= _COALESCE_BYTES else [header, memoryview(payload).cast("B")]
        sock = conn.sock
        for part in parts:
            try:
                sent = sock.send(part)
            except (BlockingIOError, ssl.SSLWantWriteError):
                sent = 0
            if sent < len(part):
                sock.settimeout(self.limits.handshake_timeout_s + nbytes / _MIN_BYTES_PER_S)
                try:
                    sock.sendall(memoryview(part)[sent:])
                finally:
                    sock.setblocking(False)

    @staticmethod
    def _send_now(conn: _Conn, data: bytes) -> None:
        """A short answer during the handshake: the socket takes it at once, or the peer is not reading."""
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, ssl.SSLWantWriteError):
            sent = 0
        if sent != len(data):
            raise _ProtocolError("the peer does not read")


def _failure_parts(status: status_pb2.Status) -> tuple[bytes, bytes]:
    message = status.SerializeToString()
    return REPLY.pack(0, len(message)), message


def _failure(status: status_pb2.Status) -> bytes:
    return b"".join(_failure_parts(status))


def _ok(payload: bytes) -> tuple[bytes, bytes]:
    return REPLY.pack(1, len(payload)), payload


class _Mailbox:
    """A connection's mailbox: the client's sealed memfd (checked_memfd), which the server only reads.

    Its first _MAPPED_MAILBOX_BYTES are mapped read-only, so a small request (the common one) is one
    copy: a pread reads a memfd page by page, 24-32 us for a 37 KB request here. Larger payloads are
    read with pread. The seals keep the memfd from shrinking under the mapping (no SIGBUS). Reading
    a hole through the mapping fills it with a page charged to the server, so a connection's mapping
    can cost the server at most _MAPPED_MAILBOX_BYTES, what its own buffer costs (_BUFFER_BYTES).
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
        os.close(self.fd)


_MAPPED_MAILBOX_BYTES = 64 << 10


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


_GIL_HELD_READ_BYTES = 1 << 20
_pread = ctypes.PyDLL(None, use_errno=True).pread  # PyDLL: the call keeps the GIL
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors in SCM_RIGHTS ancillary data (now open in this process)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds += received
    return fds


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed the connection: it sends nothing while it waits for its reply, so
    readable with no bytes to read means closed. The raw socket is peeked (under TLS too)."""
    try:
        return socket.socket.recv(sock, 1, _PEEK_NOW) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _remove_stale_socket(path: str) -> None:
    """Removes a socket file left by a server that died; refuses to replace anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nothing listens: left behind
        return
    finally:
        probe.close()
    raise OSError(f"another server listens on {path}")


def _shutdown(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or already closed
