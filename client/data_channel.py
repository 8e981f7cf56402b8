"""The data channel: tensor bytes and unary calls over a connection beside gRPC.

gRPC in Python copies every message several times and frames it in HTTP/2; a large
tensor moves at well under 1 GB/s that way, a small call pays ~0.5 ms. The data channel
carries the same protobuf messages, and raw tensor bytes straight from and into NumPy
buffers (`sendall` / `recv_into`, no copies), at several GB/s over loopback. It runs over
TCP (with gRPC's TLS when gRPC has it) and, for a client on the server's host, over the
server's Unix domain socket, which also takes shared-memory regions.

The protocol is in aclnn_common/framing.py.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.chunks import copy_bytes
from aclnn_common.errors import AclnnError, Status, malformed
from aclnn_common.framing import (
    ATTACHED,
    CALL,
    DOWNLOAD,
    HELD_MAILBOX_BYTES,
    IN_MAILBOX,
    MAGIC,
    MAILBOX,
    MAILBOX_FROM,
    MAILBOX_MAX_BYTES,
    MESSAGE_LENGTH,
    METHODS,
    READ_BUFFER,
    REGION,
    REGISTER_REGION,
    REPLY,
    REQUEST,
    RESERVED_UPLOAD,
    UNREGISTER_REGION,
    UPLOAD,
    WRITE_BUFFER,
    WRITE_INLINE_BYTES,
    ConnectionLost,
    aligned,
)
from aclnn_common.liveness import tcp_keepalive
from aclnn_common.wire import decode_status_bytes

from .regions import Region

log = logging.getLogger("aclnn_client")

# A connection's mailbox is made on its first payload above MAILBOX_FROM: at least this large (the
# payload's size rounded up to a power of two, above HELD_MAILBOX_BYTES to a multiple of
# _MAILBOX_STEP_BYTES: every page of such a mailbox is allocated, for the connection's life), and
# replaced by a larger one as payloads grow.
_MAILBOX_START_BYTES = 256 << 10
_MAILBOX_STEP_BYTES = 16 << 20
# The largest mailbox a server takes that does not say (DataChannelTicket.mailbox_max_bytes unset).
UNSAID_MAILBOX_MAX_BYTES = 64 << 20
# The largest payload sent through the Unix socket when no mailbox can be had, to a server that does
# not state its message limit (DataChannelTicket.max_message_bytes): its default (--max-message-bytes).
_SOCKET_PAYLOAD_BYTES = 64 << 20

# A mailbox's registration refused as busy is asked again this many times in all, after 5, 10, 20, 40 ms.
_REGISTER_TRIES = 5
_REGISTER_BACKOFF_S = 0.005
# Payloads up to this size are sent in one piece with their header (one syscall, one small copy).
_COALESCE_BYTES = 64 << 10
# Strided downloads are scattered through a bounce buffer of this size.
_BOUNCE_BYTES = 4 << 20
# A reply is at most the server's message limit (it keeps or places results beyond it) and this much
# more; an error reply, a google.rpc.Status, at most this: a length beyond is no reply of a server of
# ours, and would have been buffered whole.
_REPLY_ROOM_BYTES = 1 << 20
_ERROR_REPLY_BYTES = 1 << 20
# A pooled connection idle longer than this is checked before use: the server may have closed it
# (it reaps idle connections, or restarted). Busier ones skip the check: a closed one fails its call.
_CHECK_IDLE_S = 0.5


class NoConnection(Exception):
    """No connection could be opened or admitted: nothing of the request was sent (gRPC can carry it).

    `refused`: the server answered (it is full now), so the channel stays; else it is unreachable
    (gone, or restarted elsewhere) and the caller asks for a new channel.
    """

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


# The deadline (time.monotonic()) of the exchange this thread is in, or None: each receive and send of
# it gets what is left, since a socket's timeout bounds one operation alone (a peer sending a byte a
# second held a call for ever).
_thread_deadline = threading.local()


@contextlib.contextmanager
def _within(seconds: float | None) -> Iterator[None]:
    """Bounds this thread's socket operations to `seconds` from now in all (and to any bound already set)."""
    outer = getattr(_thread_deadline, "at", None)
    deadline = outer if seconds is None else time.monotonic() + seconds
    _thread_deadline.at = deadline if outer is None else min(deadline, outer)
    try:
        yield
    finally:
        _thread_deadline.at = outer


def _arm(sock: socket.socket) -> None:
    """Gives the socket's next operation what is left of this thread's deadline (TimeoutError: none)."""
    deadline = getattr(_thread_deadline, "at", None)
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        sock.settimeout(left)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket; ConnectionLost if the peer closes first."""
    received, total = 0, view.nbytes
    while received < total:
        _arm(sock)
        count = sock.recv_into(view[received:], total - received)
        if count == 0:
            raise ConnectionLost(f"connection closed after {received} of {total} bytes")
        received += count


def recv_exact(sock: socket.socket, size: int) -> memoryview:
    """`size` bytes from the socket; memory is committed as they arrive, so a claimed size costs nothing."""
    buffer = memoryview(np.empty(size, np.uint8))
    recv_into(sock, buffer)
    return buffer


def send(sock: socket.socket, header: bytes, payload: bytes | memoryview = b"") -> None:
    _arm(sock)  # sendall's timeout bounds it in all
    if len(payload) <= _COALESCE_BYTES:
        sock.sendall(header + bytes(payload))
    else:
        sock.sendall(header)
        sock.sendall(payload)


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Sends the parts in order: a plain socket takes them with sendmsg (no copy), TLS one at a time."""
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            _arm(sock)
            sock.sendall(part)
        return
    views = [view for view in (memoryview(part).cast("B") for part in parts) if view.nbytes]
    while views:
        _arm(sock)
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views:
            views[0] = views[0][sent:]


class Attachments:
    """Tensor bytes a call sends raw after its message (framing: ATTACHED), and its reply's raw part.

    `add` places a tensor's bytes (read from the caller's memory when the call is sent, not
    copied now) and returns the range its StorageRef names.
    """

    def __init__(self) -> None:
        self.parts: list[tuple[int, memoryview]] = []  # (offset, bytes), in order
        self.size = 0
        self.received: memoryview | None = None  # the reply's raw part

    def add(self, data: memoryview) -> pb.ByteRange:
        offset = aligned(self.size)
        self.parts.append((offset, data))
        self.size = offset + data.nbytes
        return pb.ByteRange(offset=offset, size=data.nbytes)

    def result(self, where: pb.ByteRange) -> memoryview:
        """A result's bytes in the reply's raw part."""
        if self.received is None or where.offset + where.size > self.received.nbytes:
            raise ConnectionLost(f"a result at {where.offset}+{where.size} beyond the reply's attached bytes")
        return self.received[where.offset : where.offset + where.size]

    def fold_into(self, request: pb.OpCall | pb.ExecuteRequest) -> None:
        """Puts the bytes back inside the message, and results back inline, for gRPC (which has no raw part)."""
        data = {offset: part for offset, part in self.parts}
        if isinstance(request, pb.OpCall):
            for value in request.params.values():
                if value.WhichOneof("kind") == "tensor" and value.tensor.ref.WhichOneof("kind") == "attached":
                    value.tensor.data = bytes(data[value.tensor.ref.attached.offset])
                    value.tensor.ClearField("ref")
        else:
            for name, ref in list(request.input_refs.items()):
                if ref.WhichOneof("kind") == "attached":
                    request.inputs[name] = bytes(data[ref.attached.offset])
                    del request.input_refs[name]
        for name in [name for name, placement in request.placements.items() if placement.attached]:
            del request.placements[name]


class _Connection:
    """A pooled connection, and over the Unix socket its mailbox once it has one."""

    __slots__ = ("mailbox", "mailbox_refused", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.mailbox: Region | None = None
        self.mailbox_refused = False  # the server refused one: this connection sends its payloads inline

    def close(self) -> None:
        self.sock.close()
        if self.mailbox is not None:
            self.mailbox.close()


def _lost(reason: object, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> AclnnError:
    return AclnnError(Status.RUNTIME_ERROR, f"{code.name}: data channel: {reason}", grpc_code=code)


class DataChannel:
    """Pooled connections to one server's data channel; one exchange per connection at a time.

    `address` is (host, port) for TCP, or the path of the server's Unix socket. Over the Unix
    socket the channel also registers shared-memory regions (and remembers their ids).
    """

    def __init__(
        self,
        address: tuple[str, int] | str,
        ticket: bytes,
        open_ticket: Callable[[], bytes],
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,  # the name its certificate must show (default: the address's host)
        mailbox_max_bytes: int = MAILBOX_MAX_BYTES,  # the largest mailbox the server takes (its ticket says)
        max_message_bytes: int = 0,  # the largest request it takes in its own memory (its ticket says; 0: unsaid)
        max_connections: int = 32,
        connect_timeout: float = 5.0,  # seconds to reach the server before the client settles for gRPC
    ) -> None:
        self.address, self.tls = address, tls
        self.unix = isinstance(address, str)
        self.mailbox_max_bytes = min(mailbox_max_bytes, MAILBOX_MAX_BYTES)
        self.max_message_bytes = max_message_bytes
        self._socket_payload_bytes = max_message_bytes or _SOCKET_PAYLOAD_BYTES  # what it receives in its memory
        self._server_hostname = server_hostname or (None if self.unix else address[0])
        self._ticket, self._open_ticket = ticket, open_ticket
        self._connect_timeout = connect_timeout
        self._idle: list[tuple[_Connection, float]] = []  # with the time each went idle
        # More threads than connections wait for one: the server serves a bounded number anyway.
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._closed = False
        self._regions: dict[object, str] = {}  # region -> its id on this server

    def __str__(self) -> str:
        return self.address if self.unix else f"{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn, _ in idle:
            conn.close()

    def warm(self) -> None:
        """Opens one connection into the pool now; raises what opening it raised."""
        self._checkin(_Connection(self._connect()))

    def call(
        self,
        method: str,
        request: object,
        stream: int | None,
        timeout: float | None,
        attachments: Attachments | None = None,
    ) -> object:
        """A unary call; the reply message, or the AclnnError the server answered with. With
        `attachments`, their bytes go raw after the message, and the reply's raw part is kept there.
        `request` is a message, or one serialized already (bytes)."""
        name = method.encode()
        # Deterministic: equal requests (a kept layout's copy, say) are equal bytes, which is what the
        # server's decode cache and repeats go by (map entries are otherwise in no fixed order).
        message = request if isinstance(request, bytes) else request.SerializeToString(deterministic=True)
        if attachments is None:
            kind, head, parts = CALL, bytes([len(name)]) + name + message, []
        else:
            kind, head = CALL | ATTACHED, bytes([len(name)]) + name + MESSAGE_LENGTH.pack(len(message)) + message
            start = aligned(len(head))
            head += bytes(start - len(head))
            parts = [(start + offset, data) for offset, data in attachments.parts]
        size = len(head) + (attachments.size if attachments is not None else 0)
        with self._connection(timeout) as conn:
            mailbox = self._mailbox(conn, size, timeout) if self.unix and size > MAILBOX_FROM else None
            if mailbox is None and self.unix and size > self._socket_payload_bytes:
                raise self._no_mailbox(size)
            if mailbox is not None:
                mailbox.map[: len(head)] = head
                for offset, data in parts:
                    copy_bytes(mailbox.array[offset : offset + data.nbytes], data)
                send(conn.sock, _header(kind | IN_MAILBOX, stream, timeout, size))
            elif not parts:
                send(conn.sock, _header(kind, stream, timeout, size), head)
            else:
                pieces: list[bytes | memoryview] = [_header(kind, stream, timeout, size) + head]
                end = len(head)
                for offset, data in parts:
                    pieces += [bytes(offset - end), data]
                    end = offset + data.nbytes
                send_parts(conn.sock, pieces)
            reply = self._reply(conn.sock)
        if attachments is not None:
            if reply.nbytes < MESSAGE_LENGTH.size:
                raise _lost("a reply too short to hold its message's length")
            end = MESSAGE_LENGTH.size + MESSAGE_LENGTH.unpack_from(reply)[0]
            if end > reply.nbytes:
                raise _lost("a reply whose message runs past its length")
            reply, attachments.received = reply[MESSAGE_LENGTH.size : end], reply[min(aligned(end), reply.nbytes) :]
        try:
            return METHODS[method][1].FromString(reply)
        except DecodeError:
            raise malformed(f"a {method} reply that does not parse") from None

    def upload(self, data: memoryview, timeout: float | None, reservation: str = "") -> str:
        """Stores the bytes on the server (in the memory of a call's reservation, if given); returns their handle."""
        with self._connection(timeout) as conn:
            sock = conn.sock
            if reservation:
                payload = REGION.pack(data.nbytes) + reservation.encode()
                send(sock, _header(RESERVED_UPLOAD, None, timeout, len(payload)), payload)
            else:
                send(sock, _header(UPLOAD, None, timeout, data.nbytes))
            self._reply(sock)  # the server holds room for the bytes
            send(sock, b"", data)
            reply = self._reply(sock)
        try:
            return pb.TensorHandle.FromString(reply).handle
        except DecodeError:
            raise malformed("an UPLOAD reply that does not parse") from None

    def download(self, handle: str, view: np.ndarray, timeout: float | None) -> None:
        """Receives a handle's bytes straight into `view` (through a bounce buffer when strided)."""
        self._receive(DOWNLOAD, pb.TensorHandle(handle=handle), view, timeout)

    def read_buffer(self, request: pb.BufferRange, target: np.ndarray, timeout: float | None) -> None:
        """Device -> host: the range's bytes straight into `target`."""
        self._receive(READ_BUFFER, request, target, timeout)

    def write_buffer(self, request: pb.BufferWrite, data: memoryview, timeout: float | None) -> None:
        """Host -> device: small writes carry their bytes in the request, larger ones follow it raw."""
        inline = data.nbytes <= WRITE_INLINE_BYTES
        if inline:
            request.data = bytes(data)
        payload = request.SerializeToString()
        with self._connection(timeout) as conn:
            send(conn.sock, _header(WRITE_BUFFER, None, timeout, len(payload)), payload)
            if not inline:
                self._reply(conn.sock)  # the server takes the bytes
                send(conn.sock, b"", data)
            self._reply(conn.sock)

    def _receive(self, kind: int, request: object, view: np.ndarray, timeout: float | None) -> None:
        """A request answered by raw bytes, received into `view`."""
        payload = request.SerializeToString()
        with self._connection(timeout) as conn:
            sock = conn.sock
            send(sock, _header(kind, None, timeout, len(payload)), payload)
            size = self._reply_header(sock)
            if size != view.nbytes:
                raise ConnectionLost(f"reply of {size} bytes for a {view.nbytes}-byte destination")
            if view.flags.c_contiguous:
                recv_into(sock, memoryview(view.reshape(-1).view(np.uint8)))
                return
            step = max(1, _BOUNCE_BYTES // view.itemsize)
            bounce = np.empty(min(step, view.size), view.dtype)
            for first in range(0, view.size, step):
                part = bounce[: min(step, view.size - first)]
                recv_into(sock, memoryview(part.view(np.uint8)))
                view.flat[first : first + part.size] = part

    # Shared-memory regions (Unix socket) -----------------------------------------------------

    def region_id(self, region: object, fd: int, size: int, timeout: float | None) -> str:
        """The region's id on this server, registering it (its descriptor passed along) on first use."""
        with self._lock:
            known = self._regions.get(region)
        if known is not None:
            return known
        with self._connection(timeout) as conn:
            try:
                region_id = bytes(self._pass_memfd(conn.sock, REGISTER_REGION, fd, size, timeout)).decode("ascii")
            except UnicodeDecodeError:
                raise malformed("a region id that is not ASCII") from None
        with self._lock:
            self._regions[region] = region_id
        return region_id

    def unregister(self, region: object, timeout: float | None) -> None:
        """Forgets a region here and asks the server to drop it (it unmaps once no call uses it)."""
        with self._lock:
            region_id = self._regions.pop(region, None)
        if region_id is None:
            return
        payload = region_id.encode()
        with self._connection(timeout) as conn:
            send(conn.sock, _header(UNREGISTER_REGION, None, timeout, len(payload)), payload)
            self._reply(conn.sock)

    def registered(self) -> list[object]:
        with self._lock:
            return list(self._regions)

    def forget_regions(self) -> None:
        """The server lost them (restarted, or our session's lease lapsed): register again on next use."""
        with self._lock:
            self._regions.clear()

    def _mailbox(self, conn: _Connection, size: int, timeout: float | None) -> Region | None:
        """A mailbox of the connection's for `size` bytes (a larger one is passed to the server now);
        None: the bytes go through the socket."""
        if conn.mailbox is not None and size <= conn.mailbox.size:
            return conn.mailbox
        if size > self.mailbox_max_bytes or conn.mailbox_refused:
            return None
        wanted = size
        size = max(_MAILBOX_START_BYTES, 1 << (wanted - 1).bit_length())
        if size > HELD_MAILBOX_BYTES:
            size = -(-wanted // _MAILBOX_STEP_BYTES) * _MAILBOX_STEP_BYTES
        try:
            mailbox = Region(size, "aclnn-mailbox", holeless=size > HELD_MAILBOX_BYTES)
        except OSError:  # no memory for it now, or a kernel before Linux 5.1 (no F_SEAL_FUTURE_WRITE)
            return None  # this payload goes through the socket
        try:
            self._register_mailbox(conn, mailbox, timeout)
        except AclnnError as error:
            mailbox.close()
            # A server that takes no mailbox, or not one this large; busy (the identity's other
            # registrations are queued): this payload goes through the socket, the next one asks again.
            conn.mailbox_refused = error.grpc_code != grpc.StatusCode.RESOURCE_EXHAUSTED
            if not conn.mailbox_refused and wanted > self._socket_payload_bytes:
                raise  # busy, and more than the socket carries: the call is answered as busy (asked again)
            return None
        except BaseException:
            mailbox.close()
            raise
        if conn.mailbox is not None:
            conn.mailbox.close()
        conn.mailbox = mailbox
        return mailbox

    def _no_mailbox(self, size: int) -> AclnnError:
        """A payload larger than the socket carries, and no mailbox for it (no memory for one now, a
        kernel without the seal, or the connection's refused; a busy server is answered as it is):
        from now on this channel's calls attach no more than the socket carries, and this one is
        answered as busy, so that it is staged again with its largest tensors uploaded. Nothing of it
        was sent."""
        if self.mailbox_max_bytes > self._socket_payload_bytes:
            self.mailbox_max_bytes = self._socket_payload_bytes
            log.warning(
                "data channel %s: no mailbox could be made for a %d-byte call: calls attach at most %d bytes "
                "from now on, and upload their largest tensors beyond",
                self,
                size,
                self._socket_payload_bytes,
            )
        return _lost(f"no mailbox for a {size}-byte call", grpc.StatusCode.RESOURCE_EXHAUSTED)

    def _register_mailbox(self, conn: _Connection, mailbox: Region, timeout: float | None) -> None:
        """Passes the mailbox; while the server is busy with the identity's other registrations (one at
        a time, a few queued: clients of one identity starting together), asks again shortly."""
        for attempt in range(_REGISTER_TRIES):
            try:
                self._pass_memfd(conn.sock, MAILBOX, mailbox.fd, mailbox.size, timeout)
                return
            except AclnnError as error:
                if error.grpc_code != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt + 1 == _REGISTER_TRIES:
                    raise
            time.sleep(_REGISTER_BACKOFF_S * 2**attempt)

    def _pass_memfd(self, sock: socket.socket, kind: int, fd: int, size: int, timeout: float | None) -> memoryview:
        """A registration: the request, then (once the server asks for it) the memfd with one byte."""
        payload = REGION.pack(size)
        send(sock, _header(kind, None, timeout, len(payload)), payload)
        self._reply(sock)  # the server is ready for the descriptor (a refusal raises: nothing was passed)
        _arm(sock)
        socket.send_fds(sock, [b"\0"], [fd])
        return self._reply(sock)

    # Connections ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _connection(self, timeout: float | None) -> Iterator[_Connection]:
        """A pooled connection for one exchange: back to the pool if it stayed in step, else closed."""
        if not self._slots.acquire(timeout=-1 if timeout is None else timeout):
            raise _lost("no free connection before the deadline", grpc.StatusCode.DEADLINE_EXCEEDED)
        try:
            yield from self._exchange(timeout)
        finally:
            self._slots.release()

    def _exchange(self, timeout: float | None) -> Iterator[_Connection]:
        with _within(timeout):  # the call's deadline bounds the whole exchange, its connection's admission too
            yield from self._in_step(self._checkout(), timeout)

    def _in_step(self, conn: _Connection, timeout: float | None) -> Iterator[_Connection]:
        """The exchange on `conn`: back to the pool if it stayed in step, else closed."""
        if timeout is None and conn.sock.gettimeout() is not None:
            conn.sock.settimeout(None)
        try:
            yield conn
        except AclnnError:
            self._checkin(conn)  # an error reply leaves the connection in step
            raise
        except TimeoutError:
            conn.close()
            raise _lost("deadline exceeded", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except (OSError, ConnectionLost) as exc:
            conn.close()
            raise _lost(exc) from None
        except BaseException:
            conn.close()
            raise
        self._checkin(conn)

    def _checkout(self) -> _Connection:
        """An idle pooled connection the server has not closed (it reaps idle ones), else a new one."""
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            if time.monotonic() - since < _CHECK_IDLE_S:
                return conn
            readable = select.poll()
            readable.register(conn.sock, select.POLLIN)
            if not readable.poll(0):
                return conn  # nothing to read while idle: still open and in step
            conn.close()  # closed by the server (or out of step)
        return _Connection(self._connect())

    def _checkin(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def _connect(self) -> socket.socket:
        """A new connection, admitted by the current ticket (by a fresh one once that expired).

        NoConnection when none could be had: `refused` when the server answered that it is full
        (or closed the connection before admitting it: too many handshakes), else unreachable.
        """
        for attempt in range(2):
            try:
                sock = self._open()
            except OSError as exc:
                raise NoConnection(f"cannot connect to {self}: {exc}", refused=False) from None
            try:
                with _within(self._connect_timeout):  # admission in all, not each byte of its reply
                    send(sock, MAGIC + self._ticket)
                    self._reply(sock)
                return sock
            except AclnnError as error:
                sock.close()
                if error.grpc_code == grpc.StatusCode.UNAUTHENTICATED and not attempt:
                    self._ticket = self._open_ticket()
                    continue
                busy = error.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
                raise NoConnection(f"{self} refused the connection: {error.message}", refused=busy) from None
            except (OSError, ConnectionLost) as exc:
                sock.close()
                raise NoConnection(f"{self} closed the connection before admitting it: {exc}", refused=True) from None
            except BaseException:
                sock.close()
                raise
        raise AssertionError("unreachable")

    def _open(self) -> socket.socket:
        if self.unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self._connect_timeout)
                sock.connect(self.address)
            except BaseException:
                sock.close()
                raise
            return sock
        sock = socket.create_connection(self.address, timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tcp_keepalive(sock)  # a server host that is gone fails the call (common/liveness.py)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self._server_hostname)
        except BaseException:
            sock.close()
            raise
        return sock

    def _reply_header(self, sock: socket.socket) -> int:
        """The length of an ok reply; an error reply is raised as its AclnnError."""
        ok, length = REPLY.unpack(recv_exact(sock, REPLY.size))
        if not ok:
            if length > _ERROR_REPLY_BYTES:
                raise ConnectionLost(f"an error reply of {length} bytes")
            raise decode_status_bytes(recv_exact(sock, length))
        return length

    def _reply(self, sock: socket.socket) -> memoryview:
        """An ok reply's payload; an error reply is raised as its AclnnError.

        The server sends a reply of up to _COALESCE_BYTES in one piece and nothing after it until
        the next request, so one read usually takes header and payload together (one system call
        fewer per call than reading the header first).
        """
        first = memoryview(np.empty(_COALESCE_BYTES, np.uint8))
        got = 0
        while got < REPLY.size:
            _arm(sock)
            count = sock.recv_into(first[got:])
            if count == 0:
                raise ConnectionLost(f"connection closed after {got} bytes of a reply")
            got += count
        ok, length = REPLY.unpack_from(first)
        end = REPLY.size + length
        if got > end:
            raise ConnectionLost("bytes beyond the reply")
        if length > (self._socket_payload_bytes + _REPLY_ROOM_BYTES if ok else _ERROR_REPLY_BYTES):
            raise ConnectionLost(f"a{'' if ok else 'n error'} reply of {length} bytes, over what the server sends")
        if end <= first.nbytes:
            payload = first[REPLY.size : end]
        else:  # a large reply: a buffer of its size, committed as its bytes arrive
            payload = memoryview(np.empty(length, np.uint8))
            payload[: got - REPLY.size] = first[REPLY.size : got]
        recv_into(sock, payload[got - REPLY.size :])
        if not ok:
            raise decode_status_bytes(payload)
        return payload


def _header(kind: int, stream: int | None, timeout: float | None, length: int) -> bytes:
    timeout_ms = 0 if timeout is None else max(1, min(int(timeout * 1000), 2**32 - 1))
    return REQUEST.pack(kind, stream is not None, stream or 0, timeout_ms, length)
