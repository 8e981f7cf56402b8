"""The server side of the data channel (protocol: aclnn_client/data_channel.py).

A TCP listener beside the gRPC port. A connection is admitted by a ticket that
the OpenDataChannel RPC issued (valid for a minute, for any number of connections), so
it carries that caller's identity and session (gRPC authenticated it); every request
then runs through AclnnService like an RPC. One thread serves one connection. When the
gRPC port has TLS (or mutual TLS), so does this one, from the same files.
"""

from __future__ import annotations

import logging
import secrets
import socket
import ssl
import threading
import time
from typing import Any

from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2

from aclnn_client._proto import aclnn_pb2 as pb
from aclnn_client.data_channel import (
    CALL,
    DOWNLOAD,
    MAGIC,
    METHODS,
    REPLY,
    REQUEST,
    TICKET_BYTES,
    UPLOAD,
    ConnectionLost,
    recv_exact,
    recv_into,
    send,
)
from aclnn_client.errors import invalid_error

from ..engine import CallContext
from .service import AclnnService, failure_status

log = logging.getLogger("aclnn_server")

_TICKET_TTL_S = 60.0
# A peer that stalls mid-request (or mid-handshake) is dropped after this long.
_STALL_S = 60.0


class _ProtocolError(Exception):
    """The peer broke the protocol: the connection is closed."""


def _status(code: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


class _SocketUpload:
    """An UPLOAD's bytes: room is confirmed to the client (the reservation held), then they are received."""

    def __init__(self, sock: socket.socket, total_size: int) -> None:
        self.sock, self.total_size = sock, total_size
        self.started = False

    def read_into(self, buffer: memoryview) -> None:
        self.started = True
        send(self.sock, REPLY.pack(1, 0))
        try:
            recv_into(self.sock, buffer)
        except ConnectionLost as exc:
            raise invalid_error("chunk", f"upload truncated: {exc}") from None


class DataChannelServer:
    """Listens on `host:port` (0: a free port) and serves admitted connections."""

    def __init__(
        self,
        service: AclnnService,
        host: str,
        port: int,
        max_connections: int,
        max_message_bytes: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.service = service
        self.tls = tls
        self.max_connections = max_connections
        self.max_message_bytes = max_message_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._tickets: dict[bytes, tuple[str | None, str | None, float]] = {}
        self._connections: dict[socket.socket, bool] = {}  # connection -> idle (waiting for a request)
        self._lock = threading.Lock()
        self._stopping = False
        service.issue_ticket = self.issue_ticket

    def issue_ticket(self, call: CallContext) -> tuple[int, bytes]:
        """A ticket admitting connections, for a while, as this caller and session."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, (_, _, expires) in self._tickets.items() if expires < now]:
                del self._tickets[stale]
            self._tickets[ticket] = (call.owner, call.session, now + _TICKET_TTL_S)
        return self.port, ticket

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def start(self) -> None:
        threading.Thread(target=self._accept, name="aclnn-data-accept", daemon=True).start()

    def stop(self, grace: float | None) -> None:
        """Stops accepting; idle connections close now, busy ones after their current request.

        Returns once every connection closed, or after `grace` seconds; `grace=None` (as
        grpc.Server.stop) closes busy connections at once too.
        """
        with self._lock:
            self._stopping = True
            closing = [sock for sock, idle in self._connections.items() if idle or grace is None]
        self._listener.close()
        for sock in closing:
            _shutdown(sock)
        deadline = time.monotonic() + (grace or 0)
        while self.open_connections and time.monotonic() < deadline:
            time.sleep(0.02)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(sock,), name="aclnn-data", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock.settimeout(_STALL_S)
                sock = self.tls.wrap_socket(sock, server_side=True)
            owner, session = self._admit(sock)
            while self._idle(sock, True):
                header = _next_header(sock)
                if header is None:
                    break  # the client closed the connection (or stop() did)
                self._idle(sock, False)
                sock.settimeout(_STALL_S)
                self._request(sock, owner, session, *REQUEST.unpack(header))
                sock.settimeout(None)
        except (OSError, ConnectionLost, _ProtocolError) as exc:
            log.debug("data channel connection closed: %s", exc)
        finally:
            with self._lock:
                self._connections.pop(sock, None)
            sock.close()

    def _idle(self, sock: socket.socket, idle: bool) -> bool:
        """Marks the connection idle or busy; False once the server stops (then it closes)."""
        with self._lock:
            if self._stopping:
                return False
            self._connections[sock] = idle
            return True

    def _admit(self, sock: socket.socket) -> tuple[str | None, str | None]:
        sock.settimeout(_STALL_S)
        hello = recv_exact(sock, len(MAGIC) + TICKET_BYTES)
        with self._lock:
            admitted = self._tickets.get(bytes(hello[len(MAGIC) :]))
            busy = len(self._connections) >= self.max_connections
            if admitted is not None and not busy:
                self._connections[sock] = False
        if hello[: len(MAGIC)] != MAGIC or admitted is None or admitted[2] < time.monotonic():
            self._fail(sock, _status(code_pb2.UNAUTHENTICATED, "unknown or expired data-channel ticket"))
            raise _ProtocolError("refused a connection without a valid ticket")
        if busy:
            self._fail(sock, _status(code_pb2.RESOURCE_EXHAUSTED, f"{self.max_connections} connections are open"))
            raise _ProtocolError("refused a connection over the limit")
        send(sock, REPLY.pack(1, 0))
        sock.settimeout(None)
        return admitted[0], admitted[1]

    def _request(
        self,
        sock: socket.socket,
        owner: str | None,
        session: str | None,
        kind: int,
        has_stream: int,
        stream: int,
        timeout_ms: int,
        length: int,
    ) -> None:
        call = CallContext(
            owner=owner,
            session=session,
            stream=stream if has_stream else None,
            deadline=time.monotonic() + timeout_ms / 1000 if timeout_ms else None,
        )
        request_id = secrets.token_hex(8)
        if kind == UPLOAD:
            upload = _SocketUpload(sock, length)
            try:
                reply = self.service.invoke("UploadTensor", upload, call, request_id)
            except Exception as exc:
                if upload.started:  # the rest of the bytes are still on their way: drop the connection
                    raise _ProtocolError(f"upload failed: {exc}") from None
                return self._fail(sock, failure_status(exc)[0])
            return send(sock, *_ok(reply.SerializeToString()))
        if length > self.max_message_bytes:
            self._fail(sock, _status(code_pb2.RESOURCE_EXHAUSTED, f"request of {length} bytes is over the limit"))
            raise _ProtocolError("request over the message limit")
        payload = memoryview(recv_exact(sock, length))
        if kind == DOWNLOAD:
            try:
                buffer = self.service.invoke("DownloadTensor", pb.TensorHandle.FromString(payload), call, request_id)
            except Exception as exc:
                return self._fail(sock, failure_status(exc)[0])
            send(sock, REPLY.pack(1, buffer.nbytes), buffer)
            return None
        if kind != CALL:
            raise _ProtocolError(f"unknown request kind {kind}")
        method = bytes(payload[1 : 1 + payload[0]]).decode(errors="replace") if length else ""
        if method not in METHODS:
            unknown = _status(code_pb2.UNIMPLEMENTED, f"method {method!r:.60} is not on the data channel")
            return self._fail(sock, unknown)
        try:
            request = METHODS[method][0].FromString(payload[1 + payload[0] :])
        except DecodeError:
            return self._fail(sock, _status(code_pb2.INVALID_ARGUMENT, f"{method} request does not parse"))
        try:
            reply = self.service.invoke(method, request, call, request_id)
        except Exception as exc:
            return self._fail(sock, failure_status(exc)[0])
        send(sock, *_ok(reply.SerializeToString()))
        return None

    @staticmethod
    def _fail(sock: socket.socket, status: status_pb2.Status) -> None:
        message = status.SerializeToString()
        send(sock, REPLY.pack(0, len(message)), message)


def _next_header(sock: socket.socket) -> bytes | None:
    """The next request header; None when the connection closes between requests."""
    first = sock.recv(REQUEST.size)
    if not first:
        return None
    return first + bytes(recv_exact(sock, REQUEST.size - len(first)))


def _ok(payload: bytes) -> tuple[bytes, bytes]:
    return REPLY.pack(1, len(payload)), payload


def _shutdown(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its thread
