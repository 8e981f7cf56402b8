"""Serving one data-channel request: received whole (an UPLOAD's bytes excepted), then run through
AclnnService like an RPC, and answered."""

from __future__ import annotations

import socket
import ssl
import time

import numpy as np
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.errors import AclnnError, invalid_error
from aclnn_common.framing import (
    ATTACHED,
    CALL,
    DOWNLOAD,
    HELD_MAILBOX_BYTES,
    IN_MAILBOX,
    MAILBOX,
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
    ConnectionLost,
    aligned,
)

from ...engine import CallContext
from ...ledger import Hold
from ...regions import RegionOffer, checked_memfd
from .. import repeats
from ..progress import MIN_BYTES_PER_S, progress_deadline
from ..service import AclnnService, failure_status, new_request_id, release
from .connection import Connection, Limits, ProtocolError
from .descriptors import Broker, Excess, allow_passing, receive_one
from .framing import drain, failure_parts, fill, ok, peer_closed, receive_into, send, status
from .mailbox import Mailbox

_CALLS = frozenset({CALL, CALL | IN_MAILBOX, CALL | ATTACHED, CALL | ATTACHED | IN_MAILBOX})
_KINDS = _CALLS | {UPLOAD, RESERVED_UPLOAD, DOWNLOAD, REGISTER_REGION, UNREGISTER_REGION, MAILBOX}
_KINDS |= {WRITE_BUFFER, READ_BUFFER}
# Requests that pass a descriptor: served on the identity's broker thread (see descriptors.py).
REGISTRATIONS = frozenset({REGISTER_REGION, MAILBOX})


class _SocketUpload:
    """An UPLOAD's bytes: room is confirmed to the client (the reservation held), then they are received."""

    def __init__(self, requests: Requests, conn: Connection, total_size: int, reservation: str = "") -> None:
        self.requests, self.conn, self.total_size, self.reservation = requests, conn, total_size, reservation
        self.started = False

    def read_into(self, buffer: memoryview) -> None:
        """Receives the bytes as fast as they come, as long as they keep up with progress.MIN_BYTES_PER_S."""
        self.started = True
        self.requests.send(self.conn, REPLY.pack(1, 0))
        sock, received = self.conn.sock, 0
        started = last = time.monotonic()
        allowance = self.requests.limits.handshake_timeout_s
        try:
            while received < buffer.nbytes:
                remaining = progress_deadline(started, received, allowance, last) - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{received} of {buffer.nbytes} bytes came, too slowly")
                sock.settimeout(remaining)
                count = receive_into(self.conn, buffer[received:])
                if count == 0:
                    raise ConnectionLost(f"connection closed after {received} of {buffer.nbytes} bytes")
                received, last = received + count, time.monotonic()
        except (ConnectionLost, TimeoutError) as exc:
            raise invalid_error("chunk", f"upload truncated: {exc}") from None
        finally:
            sock.setblocking(False)


class _SocketWrite:
    """A WRITE_BUFFER: its message, with the bytes inline or (none inline) raw after an accepting reply."""

    def __init__(self, requests: Requests, conn: Connection, message: pb.BufferWrite) -> None:
        self.buffer, self.offset, self.size, self.data = message.buffer, message.offset, message.size, message.data
        # Raw only when bytes are due and none came inline: an empty write's (inline) bytes field reads
        # as unset, and answering it as raw sent a second reply the client never waited for.
        self.raw = _SocketUpload(requests, conn, message.size) if message.size and not message.data else None

    @property
    def started(self) -> bool:
        return self.raw is not None and self.raw.started

    def read_into(self, target: memoryview) -> None:
        if self.raw is not None:
            return self.raw.read_into(target)
        if len(self.data) != target.nbytes:
            raise invalid_error("data", f"{len(self.data)} bytes inline for a write of {target.nbytes}")
        target[:] = self.data
        return None


def _wake_for_more(conn: Connection, allowance_s: float) -> None:
    """A large payload over TCP wakes a worker only once a good part of its rest has arrived (SO_RCVLOWAT),
    not for every segment: an 8 MiB request woke the server ~50 times. Back to one byte once it is in.
    Not under TLS: the mark counts ciphertext, and the TLS layer may hold part of a record it read
    already, so the rest of a request can be fewer bytes than the mark: no wake-up, and the connection
    cut at its progress deadline with the call lost."""
    if conn.unix or isinstance(conn.sock, ssl.SSLSocket):
        return  # a Unix socket's readiness ignores the low-water mark; large payloads come in a mailbox
    # Bytes unseen until the wake-up are no progress to the deadline: at the minimum pace they come in
    # half the grace period (a client above the pace was cut when the grace was short).
    most = min(_PAYLOAD_WAKE_BYTES, int(MIN_BYTES_PER_S * allowance_s / 2))
    lowat = min(conn.need - conn.got, most) if conn.refusal is None else 1
    if lowat > 1 or conn.lowat > 1:
        lowat = max(lowat, 1)
        if lowat != conn.lowat:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            conn.lowat = lowat


# How much of a large request's rest a TCP connection waits for before it wakes a worker.
_PAYLOAD_WAKE_BYTES = 1 << 20


class Requests:
    """Receives an admitted connection's requests and serves them through the service."""

    def __init__(self, service: AclnnService, limits: Limits, max_message_bytes: int, broker: Broker) -> None:
        self.service, self.limits, self.max_message_bytes = service, limits, max_message_bytes
        self.broker = broker

    def receive(self, conn: Connection) -> tuple[int, int, int, int, int] | None:
        """The request once all of it has arrived (an UPLOAD's bytes come later), else None."""
        if conn.header is None:
            if not fill(conn, self.limits.handshake_timeout_s):
                return None
            header = REQUEST.unpack_from(conn.buffer)
            kind, length = header[0], header[4]
            if kind not in _KINDS:
                raise ProtocolError(f"unknown request kind {kind}")
            in_mailbox = kind in _CALLS and bool(kind & IN_MAILBOX)
            if in_mailbox and (conn.mailbox is None or length > conn.mailbox.size):
                raise ProtocolError(f"a {length}-byte request in a mailbox the connection does not have")
            conn.header, early = header, conn.got - REQUEST.size  # payload bytes read with the header
            if early > (0 if kind == UPLOAD or in_mailbox else length):
                raise ProtocolError("bytes beyond the request")  # a client sends one request, then waits
            if kind == UPLOAD:
                return header
            copied = length  # what is received into the server's own memory
            if in_mailbox and not conn.mailbox.filled(length):
                holes = f"the mailbox has holes in the request's {length} bytes: write a payload before its call"
                conn.refusal, conn.discard = status(code_pb2.INVALID_ARGUMENT, holes), 0
            elif in_mailbox and kind & ATTACHED:
                copied, conn.attachment = _left_in_mailbox(conn.mailbox, length)
            if copied > self.max_message_bytes:  # attached bytes read in place are no message
                self.fail(conn, status(code_pb2.RESOURCE_EXHAUSTED, f"request of {length} bytes is over the limit"))
                raise ProtocolError("request over the message limit")
            if conn.refusal is None:
                self._room(conn, copied, early, 0 if in_mailbox else length - early)
            if in_mailbox and conn.refusal is None:
                # Copied out before anything parses it: the client may change its mailbox at any time.
                if conn.mailbox.read_into(conn.payload) != copied:
                    raise ProtocolError("the mailbox holds less than the request")
                conn.got = conn.need
        if not (drain(conn) if conn.refusal is not None else fill(conn, self.limits.handshake_timeout_s)):
            _wake_for_more(conn, self.limits.handshake_timeout_s)
            return None
        _wake_for_more(conn, self.limits.handshake_timeout_s)
        return conn.header

    def _room(self, conn: Connection, copied: int, early: int, to_come: int) -> None:
        """Where a request's `copied` bytes are received: the connection's buffer, or memory held for
        them (refused when the ledger has none now: then the `to_come` bytes are drained)."""
        if REQUEST.size + copied <= len(conn.buffer):
            conn.need = REQUEST.size + copied
            conn.payload = conn.buffer[REQUEST.size : conn.need]
            return
        try:
            conn.hold = self.service.ledger.reserve(conn.owner, copied, "request", "request")
        except AclnnError as exc:
            conn.refusal, conn.discard = failure_status(exc)[0], to_come
            return
        payload = np.empty(copied, np.uint8)
        conn.hold.follow(payload)  # held while any view of it lives (attached inputs are views)
        conn.payload = memoryview(payload)
        conn.payload[:early] = conn.buffer[REQUEST.size : conn.got]
        conn.buffer, conn.got, conn.need = conn.payload, early, copied

    def serve(self, conn: Connection, kind: int, has_stream: int, stream: int, timeout_ms: int, length: int) -> None:
        """Serves a whole request on this thread (an UPLOAD receives its bytes here, within a deadline)."""
        if conn.refusal is not None:
            return self.fail(conn, conn.refusal)
        call = self._call(conn, has_stream, stream, timeout_ms)
        try:
            return self._serve(conn, call, kind, length)
        finally:
            release(call)  # what the call held (its request, its outputs) until the reply is sent

    def _serve(self, conn: Connection, call: CallContext, kind: int, length: int) -> None:
        request_id = new_request_id()
        if kind in (UPLOAD, RESERVED_UPLOAD):
            if kind == UPLOAD:
                upload = _SocketUpload(self, conn, length)
            elif length > REGION.size:
                size = REGION.unpack_from(conn.payload)[0]
                upload = _SocketUpload(self, conn, size, bytes(conn.payload[REGION.size :]).decode(errors="replace"))
            else:
                return self.fail(
                    conn, status(code_pb2.INVALID_ARGUMENT, "RESERVED_UPLOAD needs a size and a reservation")
                )
            try:
                reply = self.service.invoke("UploadTensor", upload, call, request_id)
            except Exception as exc:
                if upload.started:  # the rest of the bytes are still on their way: drop the connection
                    raise ProtocolError(f"upload failed: {exc}") from None
                return self.fail(conn, failure_status(exc)[0])
            return self.send(conn, *ok(reply.SerializeToString()))
        payload = conn.payload
        if kind == WRITE_BUFFER:
            return self._write_buffer(conn, payload, call, request_id)
        try:  # a failure to send a reply (the peer fell behind) is not caught here: it closes the connection
            if kind == READ_BUFFER:
                buffer = self.service.invoke("ReadBuffer", pb.BufferRange.FromString(payload), call, request_id)
            elif kind == DOWNLOAD:
                buffer = self.service.invoke("DownloadTensor", pb.TensorHandle.FromString(payload), call, request_id)
            elif kind == UNREGISTER_REGION:
                self.service.invoke("UnregisterRegion", bytes(payload).decode(errors="replace"), call, request_id)
        except DecodeError:
            return self.fail(conn, status(code_pb2.INVALID_ARGUMENT, f"request of kind {kind} does not parse"))
        except Exception as exc:
            return self.fail(conn, failure_status(exc)[0])
        if kind in (READ_BUFFER, DOWNLOAD):
            return self.send(conn, REPLY.pack(1, buffer.nbytes), buffer)
        if kind == UNREGISTER_REGION:
            return self.send(conn, *ok(b""))
        if length and 1 + payload[0] > length:
            return self.fail(conn, status(code_pb2.INVALID_ARGUMENT, "the method's name runs past the request"))
        method = bytes(payload[1 : 1 + payload[0]]).decode(errors="replace") if length else ""
        if method not in METHODS:
            unknown = status(code_pb2.UNIMPLEMENTED, f"method {method!r:.60} is not on the data channel")
            return self.fail(conn, unknown)
        call.bytes_in = length  # the message and what is attached to it, received whole
        try:
            message = payload[1 + payload[0] :]
            if kind & ATTACHED:
                message, call.attachment = _attached(payload, 1 + payload[0])
                if conn.attachment is not None:  # the attached part, where the client wrote it
                    call.attachment = conn.attachment
                    call.attached_in_place = conn.mailbox.sealed  # not held with the mailbox: with the call
            request = METHODS[method][0].FromString(message)
            if method == "Run" and len(message) <= repeats.MAX_MESSAGE_BYTES:
                call.message = message  # its tensors and results lie beside it: it may repeat (repeats.py)
        except DecodeError:
            return self.fail(conn, status(code_pb2.INVALID_ARGUMENT, f"{method} request does not parse"))
        try:
            reply = self.service.invoke(method, request, call, request_id)
        except Exception as exc:
            return self.fail(conn, failure_status(exc)[0])
        if not kind & ATTACHED:
            return self.send(conn, *ok(reply.SerializeToString()))
        return self._send_attached(conn, reply.SerializeToString(), call.attached_results)

    def _send_attached(self, conn: Connection, message: bytes, results: list[tuple[int, memoryview]]) -> None:
        """A reply with results raw after its message (framing: ATTACHED), each at the offset _place gave it."""
        head = MESSAGE_LENGTH.pack(len(message)) + message
        start = aligned(len(head))
        parts: list[bytes | memoryview] = [head + bytes(start - len(head))]
        end = 0
        for offset, data in results:
            parts += [bytes(offset - end), data]
            end = offset + data.nbytes
        send(conn, [REPLY.pack(1, start + end), *parts], self.limits.handshake_timeout_s)

    def _write_buffer(self, conn: Connection, payload: memoryview, call: CallContext, request_id: str) -> None:
        """Serves a WRITE_BUFFER; one that fails after the client was told to send its bytes drops the connection."""
        try:
            write = _SocketWrite(self, conn, pb.BufferWrite.FromString(payload))
        except DecodeError:
            return self.fail(conn, status(code_pb2.INVALID_ARGUMENT, "WRITE_BUFFER request does not parse"))
        try:
            self.service.invoke("WriteBuffer", write, call, request_id)
        except Exception as exc:
            if write.started:  # the rest of the bytes are still on their way
                raise ProtocolError(f"write failed: {exc}") from None
            return self.fail(conn, failure_status(exc)[0])
        return self.send(conn, *ok(b""))

    def register(self, conn: Connection, kind: int, has_stream: int, stream: int, timeout_ms: int, length: int) -> None:
        """A registration (REGISTER_REGION, MAILBOX), on the identity's broker thread: the size is checked,
        the peer told to pass its memfd, the one descriptor received, checked, and kept or closed here.

        A refusal leaves the connection in step; a broken protocol raises (the caller closes it).
        """
        size = REGION.unpack(conn.payload)[0] if length == REGION.size else -1
        if kind == MAILBOX and not 0 < size <= MAILBOX_MAX_BYTES:
            return self.fail(conn, status(code_pb2.INVALID_ARGUMENT, f"a mailbox holds 1 to {MAILBOX_MAX_BYTES} bytes"))
        fds: list[int] = []
        passed = 0  # over TCP no descriptor can come: refused below, in step
        if conn.unix:
            if not conn.may_pass:
                allow_passing(conn.sock)  # for this one descriptor (receive_one turns it off again)
                conn.passing_allowed = True  # what came meanwhile may stay queued, descriptors and all
            self.send(conn, REPLY.pack(1, 0))  # send it
            deadline = time.monotonic() + self.limits.handshake_timeout_s
            try:
                fds, passed = receive_one(conn.sock, not conn.may_pass, deadline)
            except Excess as exc:
                self.broker.close_later(conn.identity, exc.fds)
                raise
        offer = RegionOffer(fds[0] if fds else None, size, passed)
        try:
            if kind == MAILBOX:
                if size > HELD_MAILBOX_BYTES:  # sealed against holes, mapped whole, not held
                    mailbox = Mailbox(checked_memfd(offer, holeless=True), size, sealed=True)
                else:
                    mailbox = Mailbox(checked_memfd(offer, punchable=True), size, self._mailbox_hold(conn, size))
                fds.pop(0)  # the connection keeps it
                if conn.mailbox is not None:
                    conn.mailbox.close()
                conn.mailbox, answer = mailbox, b""
            else:
                call = self._call(conn, has_stream, stream, timeout_ms)
                answer = self.service.invoke("RegisterRegion", offer, call, new_request_id()).encode()
        except Exception as exc:
            return self.fail(conn, failure_status(exc)[0])
        else:
            return self.send(conn, *ok(answer))
        finally:
            # Refused, extra, or mapped (the mapping holds its own): closed after the reply, and after
            # the connection is back with the loop, in the identity's queue (a close may linger).
            if fds:
                self.broker.close_later(conn.identity, fds)

    def _mailbox_hold(self, conn: Connection, size: int) -> Hold | None:
        """The ledger's hold for mapping all of a mailbox, if the identity's share has room for it now."""
        try:
            return self.service.ledger.try_reserve(conn.owner, size, "mailbox", "mailbox")
        except AclnnError:  # more than the identity may ever hold: only the mailbox's head is mapped
            return None

    @staticmethod
    def _call(conn: Connection, has_stream: int, stream: int, timeout_ms: int) -> CallContext:
        return CallContext(
            owner=conn.owner,
            session=conn.session,
            stream=stream if has_stream else None,
            deadline=time.monotonic() + timeout_ms / 1000 if timeout_ms else None,
            cancelled=lambda: peer_closed(conn.sock),
            holds=[],
            request=conn.hold,  # a small request needs none
            repeats=conn.repeats,
        )

    def fail(self, conn: Connection, failed: status_pb2.Status) -> None:
        self.send(conn, *failure_parts(failed))

    def send(self, conn: Connection, header: bytes, payload: bytes | memoryview = b"") -> None:
        send(conn, [header, payload], self.limits.handshake_timeout_s)


def _left_in_mailbox(mailbox: Mailbox, length: int) -> tuple[int, memoryview | None]:
    """How much of a CALL | ATTACHED payload in a mailbox to copy, and its attached part where the
    client wrote it (None: the mailbox is not mapped that far; all of it is copied). The message's
    length is read once here and checked; the message itself is parsed from the copy."""
    head = mailbox.view(0, min(length, 256 + MESSAGE_LENGTH.size))  # a method name has at most 255 bytes
    if head is None or not head.nbytes:
        return length, None
    start = 1 + head[0] + MESSAGE_LENGTH.size  # read once: the client may change it meanwhile
    if head.nbytes < start:
        return length, None
    end = start + MESSAGE_LENGTH.unpack_from(head, start - MESSAGE_LENGTH.size)[0]
    attached = mailbox.view(min(aligned(end), length), length) if end <= length else None
    return (length, None) if attached is None else (end, attached)


def _attached(payload: memoryview, start: int) -> tuple[memoryview, memoryview]:
    """A CALL | ATTACHED payload's message and attached part (framing: ATTACHED)."""
    if start + MESSAGE_LENGTH.size > payload.nbytes:
        raise DecodeError("no message length")
    end = start + MESSAGE_LENGTH.size + MESSAGE_LENGTH.unpack_from(payload, start)[0]
    if end > payload.nbytes:
        raise DecodeError("the message runs past the payload")
    return payload[start + MESSAGE_LENGTH.size : end], payload[min(aligned(end), payload.nbytes) :]
