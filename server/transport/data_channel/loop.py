"""The data channel's event loop: listeners, one epoll set and the workers that wait on it, the
connection table.

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

import collections
import errno
import functools
import logging
import os
import select
import socket
import ssl
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from google.rpc import code_pb2, status_pb2

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.framing import MAGIC, MAILBOX_MAX_BYTES, REPLY, ConnectionLost

from ...config import OptionError, options_at_fault
from ...engine import CallContext
from ..auth import connection_user
from ..service import AclnnService, loggable
from .connection import Connection, Limits, ProtocolError
from .descriptors import Broker, Unexpected, refuse_passing
from .framing import failure, fill, send_now, status
from .housekeeping import keep_house, overdue
from .requests import REGISTRATIONS, Requests
from .tickets import Tickets

log = logging.getLogger("aclnn_server")

# The accept loop's pause after a failure (out of descriptors or memory: EMFILE, ENFILE, ENOBUFS,
# ENOMEM); it keeps listening.
_BACKOFF_S = 0.1
_SO_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_REGISTRATIONS_BUSY = status(
    code_pb2.RESOURCE_EXHAUSTED, "this caller's registrations are queued already: retry, or pass bytes another way"
)
# Asked of the kernel for a Unix-socket connection's replies (it doubles it, within net.core.wmem_max).
# It bounds kernel memory, not a hold: a reply's bytes are held until the socket took the last of them.
_UNIX_SEND_BUFFER = 2 << 20


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
        self._passing_refused = True
        self._made_directory: str | None = None
        try:
            if port is not None:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                listener = socket.socket(family, socket.SOCK_STREAM)
                self._listeners.append((listener, False))
                # A restarted server takes its port back at once, whatever connections linger in TIME_WAIT.
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with options_at_fault(host=host, data_port=port):
                    listener.bind((host, port))
                    listener.listen(socket.SOMAXCONN)
                self.port = listener.getsockname()[1]
            if unix_socket is not None:
                try:
                    self._listeners.append((self._unix_listener(unix_socket), True))
                except OSError as exc:
                    if unix_socket != "auto":
                        raise OptionError(f"--unix-socket {unix_socket}: {exc}") from exc
                    log.warning("no Unix socket for the data channel (%s): clients on this host use TCP", exc)
        except BaseException:
            self._close_listeners()
            raise
        self._tickets = Tickets()
        self._broker = Broker()
        self._requests = Requests(service, limits, max_message_bytes, self._broker)
        self._conns: dict[int, Connection] = {}
        self._handshaking = 0
        self._admitted = 0
        self._per_identity: collections.Counter[str | None] = collections.Counter()
        # Workers serving each identity's requests now, and its requests waiting for one of its own. An
        # identity holds at most half of them, and one that holds some takes another only while more
        # than _kept_free stay free: those are for identities that hold none, so that tenants whose
        # transfers keep the minimum pace cannot leave a newcomer without a worker (two used to).
        self._workers_per_identity = max(1, limits.workers // 2)
        self._kept_free = max(1, limits.workers // 8)
        self._busy: collections.Counter[str | None] = collections.Counter()
        self._busy_total = 0
        self._parked: dict[str | None, collections.deque[tuple[Connection, tuple[int, int, int, int, int]]]] = {}
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
            _remove_stale_directories()
            self._made_directory = tempfile.mkdtemp(prefix=_AUTO_PREFIX)
            # Others may reach the socket (tickets authenticate them) but not list or add files here.
            os.chmod(self._made_directory, 0o711)
            path = os.path.join(self._made_directory, _AUTO_SOCKET)
        else:
            path = os.path.abspath(setting)
            _remove_stale_socket(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._passing_refused = refuse_passing(listener)
        if not self._passing_refused:
            log.warning("this kernel cannot refuse passed descriptors (SO_PASSRIGHTS, Linux 6.16 and later)")
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
        ticket = self._tickets.issue(call.owner, call.session)
        mailbox_max = MAILBOX_MAX_BYTES if self.unix_path else 0
        return pb.DataChannelTicket(
            port=self.port,
            ticket=ticket,
            unix_path=self.unix_path or "",
            mailbox_max_bytes=mailbox_max,
            max_message_bytes=self.max_message_bytes,
        )

    def revoke(self, revoked: Callable[[str | None], bool]) -> None:
        """Ends what the callers `revoked` names hold here (a token withdrawn at SIGHUP): their tickets
        admit nobody now, and their connections serve no further request: idle and parked ones close
        now, busy ones when their current request is done."""
        self._tickets.revoke(revoked)
        closed = []
        with self._lock:
            for owner in [owner for owner in self._parked if revoked(owner)]:
                for conn, _ in self._parked.pop(owner):  # a parked request holds no worker (see _serve)
                    conn.revoked = True
                    closed += [conn] if self._close_locked(conn) else []
            for conn in list(self._conns.values()):
                if conn.admitted and revoked(conn.owner):
                    conn.revoked = True
                    if not conn.active:
                        closed += [conn] if self._close_locked(conn) else []
        for conn in closed:
            conn.let_go()

    @property
    def open_connections(self) -> int:
        """Admitted connections (connections still in their handshake are not counted)."""
        with self._lock:
            return self._admitted

    def start(self) -> None:
        for listener, unix in self._listeners:
            threading.Thread(target=self._accept, args=(listener, unix), name="aclnn-data-accept", daemon=True).start()
        threading.Thread(
            target=keep_house, args=(self._stopped, self._sweep), name="aclnn-data-housekeeping", daemon=True
        ).start()
        self._started, self._workers = True, self.limits.workers
        for _ in range(self.limits.workers):
            threading.Thread(target=self._work, name="aclnn-data", daemon=True).start()

    def stop(self, grace: float | None) -> None:
        """Stops accepting; idle connections close now, busy ones after their current request.

        Returns once every connection closed, or after `grace` seconds; `grace=None` (as
        grpc.Server.stop) closes busy connections at once too.
        """
        closed = []
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            parked = [conn for waiting in self._parked.values() for conn, _ in waiting]
            self._parked.clear()
            for conn in list(self._conns.values()):
                if not conn.active or conn in parked:
                    closed += [conn] if self._close_locked(conn) else []
                elif grace is None:
                    _shutdown(conn.sock)
        for conn in closed:
            conn.let_go()
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
            else:
                # A reply of a few MiB then leaves in one sendmsg: with the default (~208 KiB) a 4 MiB reply
                # took ~20 blocking rounds, each waking the client to drain it and then this worker again.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_SEND_BUFFER)
            sock.setblocking(False)
            if self.tls is not None and not unix:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as exc:
            log.debug("data channel connection dropped at accept: %s", exc)
            sock.close()
            return
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        conn = Connection(sock, unix, peer, deadline, may_pass=unix and not self._passing_refused)
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

    def _claim(self, fd: int) -> Connection | None:
        with self._lock:
            conn = self._conns.get(fd)
            if conn is None or conn.active:
                return None  # gone, or a stale event: the worker that has it re-arms it
            conn.active = True
            return conn

    def _turn(self, conn: Connection) -> None:
        """Whatever the connection is ready for: its handshake, its request (served once whole)."""
        while True:
            parked = None
            try:
                if conn.revoked:
                    raise ProtocolError("its caller's credentials were withdrawn")
                if not conn.admitted and not self._handshake(conn):
                    return self._rearm(conn)
                header = self._requests.receive(conn)
                if header is None:
                    return self._rearm(conn)
                if header[0] in REGISTRATIONS:
                    if self._broker.submit(conn.identity, functools.partial(self._register, conn, header)):
                        return None  # the broker's thread serves it, then re-arms or closes the connection
                    self._requests.fail(conn, _REGISTRATIONS_BUSY)
                else:
                    served, parked = self._serve(conn, header)
                    if not served:
                        return None  # parked until a worker of its identity is free
                if not self._next(conn):
                    self._rearm(conn)
                    return self._serve_parked(parked)
                self._serve_parked(parked)
                continue  # TLS read ahead: the next request may be here already
            except Unexpected as exc:
                self._close(conn, exc.fds)
            except (OSError, ConnectionLost, ProtocolError) as exc:
                log.debug("data channel connection closed: %s", exc)
                self._close(conn)
            except Exception:
                log.exception("data channel connection failed")
                self._close(conn)
            return self._serve_parked(parked)

    def _serve(
        self, conn: Connection, header: tuple[int, int, int, int, int]
    ) -> tuple[bool, tuple[Connection, tuple[int, int, int, int, int]] | None]:
        """Serves a whole request on this worker, within its identity's share of the workers (a request
        may hold one for a while: waiting in the queue, an upload's bytes, a reply a slow peer reads).
        Returns (False, None) when the identity has its share busy, or holds some while only the
        workers kept for identities holding none are free: the request is parked, for the next of its
        workers to finish. Else (True, the identity's next parked request, which this worker serves
        next: its count stays taken)."""
        owner = conn.owner
        with self._lock:
            busy = self._busy[owner]
            if busy >= self._workers_per_identity or (
                busy and self.limits.workers - self._busy_total <= self._kept_free
            ):
                self._parked.setdefault(owner, collections.deque()).append((conn, header))
                return False, None
            self._busy[owner] += 1
            self._busy_total += 1
        try:
            self._requests.serve(conn, *header)
        except BaseException:
            self._serve_parked(self._done_serving(owner))
            raise
        return True, self._done_serving(owner)

    def _done_serving(self, owner: str | None) -> tuple[Connection, tuple[int, int, int, int, int]] | None:
        """A worker of `owner` is free: the identity's next parked request, still counted busy, or None."""
        with self._lock:
            waiting = self._parked.get(owner)
            if waiting:
                parked = waiting.popleft()
                if not waiting:
                    del self._parked[owner]
                return parked
            self._busy[owner] -= 1
            self._busy_total -= 1
            if not self._busy[owner]:
                del self._busy[owner]
            return None

    def _serve_parked(self, parked: tuple[Connection, tuple[int, int, int, int, int]] | None) -> None:
        """Serves parked requests on this worker (their identity's count already taken), each connection
        re-armed (or its next request served) after, until its identity has none parked."""
        while parked is not None:
            conn, header = parked
            try:
                if conn.revoked:
                    raise ProtocolError("its caller's credentials were withdrawn")
                self._requests.serve(conn, *header)
                more = self._next(conn)
            except Exception as exc:
                log.debug("data channel connection closed: %s", exc)
                more = None
            parked = self._done_serving(conn.owner)
            if more is None:
                self._close(conn)
            elif more:
                self._turn(conn)
            else:
                self._rearm(conn)

    @staticmethod
    def _next(conn: Connection) -> bool:
        """Readies the connection for its next request; True when it may have arrived already (only TLS
        reads ahead: the peer sends nothing before it has its reply)."""
        conn.drop_request()
        conn.next_request()
        return isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending() > 0

    def _register(self, conn: Connection, header: tuple[int, int, int, int, int]) -> None:
        """A registration, on the identity's broker thread; then the connection goes back to the loop."""
        try:
            self._requests.register(conn, *header)
        except Exception as exc:
            log.debug("data channel connection closed during a registration: %s", exc)
            return self._close(conn)
        if self._next(conn):
            return self._turn(conn)
        return self._rearm(conn)

    def _rearm(self, conn: Connection) -> None:
        with self._lock:
            conn.active = False
            if not self._stopping and not conn.revoked:
                self._epoll.modify(conn.fd, conn.events | select.EPOLLONESHOT)
                return
            closed = self._close_locked(conn)
        if closed:
            conn.let_go()

    def _close(self, conn: Connection, fds: list[int] | None = None) -> None:
        """Closes a connection (and descriptors it passed uninvited, which only the broker closes)."""
        with self._lock:
            closed = self._close_locked(conn, fds)
        if closed:
            conn.let_go()

    def _close_locked(self, conn: Connection, fds: list[int] | None = None) -> bool:
        """Closes the connection's socket (True), unless closed already (False); the caller then lets go
        of what it held (Connection.let_go), after the lock."""
        if conn.closed:
            return False
        conn.closed = True
        del self._conns[conn.fd]
        if conn.admitted:
            self._admitted -= 1
            self._per_identity[conn.owner] -= 1
            if not self._per_identity[conn.owner]:
                del self._per_identity[conn.owner]
        else:
            self._handshaking -= 1
        try:
            self._epoll.unregister(conn.fd)  # before close: the number may be reused at once
        except OSError:
            pass
        if conn.passing_allowed:  # its queue may hold descriptors: the last close of each is the broker's
            self._broker.close_later(conn.identity, fds or [], conn.sock)
        else:
            conn.sock.close()  # nothing passed can be queued on it: this close never waits for a peer
        return True

    def _sweep(self) -> list[Connection]:
        """Closes the connections past their deadline or idle for too long; returns them."""
        with self._lock:
            expired = overdue(self._conns.values(), time.monotonic(), self.limits.idle_timeout_s)
            for conn in expired:
                self._close_locked(conn)
        for conn in expired:
            conn.let_go()
        return expired

    # Handshake ------------------------------------------------------------------------------

    def _handshake(self, conn: Connection) -> bool:
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
        if not fill(conn, self.limits.handshake_timeout_s):
            return False
        refusal = self._admit(conn, bytes(conn.buffer))
        if refusal is not None:
            send_now(conn, failure(refusal))
            raise ProtocolError(f"refused: {refusal.message}")
        send_now(conn, REPLY.pack(1, 0))
        conn.next_request()
        return True

    def _admit(self, conn: Connection, hello: bytes) -> status_pb2.Status | None:
        """Admits the connection as its ticket's caller; else the status it is refused with."""
        holder = self._tickets.holder(hello[len(MAGIC) :]) if hello[: len(MAGIC)] == MAGIC else None
        if holder is None:
            return status(code_pb2.UNAUTHENTICATED, "unknown or expired data-channel ticket")
        owner, session = holder
        # A local user's ticket admits that user only, on the Unix socket and on the TCP port alike.
        if (owner or "").startswith("uid:") and owner != _local_user(conn):
            return status(code_pb2.PERMISSION_DENIED, "the ticket was issued to another local user")
        with self._lock:
            if self._admitted >= self.limits.max_connections:
                return status(code_pb2.RESOURCE_EXHAUSTED, f"{self.limits.max_connections} connections are open")
            if self._per_identity[owner] >= self.limits.max_per_identity:
                return status(
                    code_pb2.RESOURCE_EXHAUSTED,
                    f"this caller has {self.limits.max_per_identity} connections open "
                    "(--data-max-connections-per-tenant)",
                )
            conn.admitted, conn.owner, conn.session, conn.deadline = True, owner, session, None
            self._handshaking -= 1
            self._admitted += 1
            self._per_identity[owner] += 1
        if conn.peer is not None:  # every connection a line: a debugging aid, not a record (a client makes many)
            log.debug(
                "data channel: Unix-socket peer pid=%d uid=%d gid=%d admitted as %s", *conn.peer, loggable(owner or "-")
            )
        return None


def _local_user(conn: Connection) -> str | None:
    """`uid:N` of the local user at the connection's far end: the Unix socket's peer, or the owner of a
    loopback TCP connection's client end; None for a peer on another host."""
    if conn.peer is not None:
        return f"uid:{conn.peer[1]}"
    uid = None if conn.unix else connection_user(conn.sock)
    return None if uid is None else f"uid:{uid}"


_AUTO_PREFIX, _AUTO_SOCKET = "aclnn-serve-", "data.sock"  # --unix-socket auto's directory and socket
_STALE_AFTER_S = 60.0  # younger, a directory may be a server's that is still starting (not listening yet)


def _remove_stale_directories() -> None:
    """Removes the `auto` socket directories of this user's servers that died without a word (SIGKILL,
    a crash): each left under the temp dir, its socket answering nobody. Another user's, a live
    server's or a young one are left alone; so is anything that is not just such a directory."""
    base = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(base) if name.startswith(_AUTO_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(base, name)
        try:
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            if time.time() - info.st_mtime < _STALE_AFTER_S or os.listdir(directory) != [_AUTO_SOCKET]:
                continue
            _remove_stale_socket(os.path.join(directory, _AUTO_SOCKET))  # refuses a socket someone listens on
            os.rmdir(directory)
        except OSError:
            continue  # alive, changed meanwhile, or not ours to remove


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
