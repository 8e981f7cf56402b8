"""One data-channel connection's state between its events, and what a listener lets peers hold."""

from __future__ import annotations

import select
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any

from google.rpc import status_pb2

from aclnn_common.framing import MAGIC, REQUEST, TICKET_BYTES

from .mailbox import Mailbox

# Each admitted connection's own buffer: a request this small arrives in one read, into memory the
# connection holds anyway (at most max_connections of them); a larger one is held in the ledger first.
BUFFER_BYTES = REQUEST.size + (64 << 10)


@dataclass(frozen=True)
class Limits:
    """What one listener lets its peers hold (the server options data_*)."""

    max_connections: int = 128  # admitted connections, all identities together
    max_per_identity: int = 16  # admitted connections of one identity (a ticket's owner)
    max_handshakes: int = 64  # connections not admitted yet; beyond, new ones are closed at once
    handshake_timeout_s: float = 5.0  # to finish TLS and present a ticket; also each request's base allowance
    idle_timeout_s: float = 60.0  # an admitted connection without a request is closed after this
    workers: int = 16  # threads serving requests (a queued call holds one while it waits)


class ProtocolError(Exception):
    """The peer broke the protocol (or was refused): the connection is closed."""


class Connection:
    """One connection's state between its events; a worker owns it while `active`."""

    def __init__(
        self, sock: socket.socket, unix: bool, peer: tuple[int, int, int] | None, deadline: float, may_pass: bool
    ) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.unix = unix
        self.peer = peer  # (pid, uid, gid) of a Unix-socket peer, from SO_PEERCRED
        # The peer can pass descriptors unasked (a Unix socket on a kernel without SO_PASSRIGHTS):
        # every read has room for them, and the socket is closed on the broker's thread.
        self.may_pass = may_pass
        # Its queue may hold passed descriptors (it could pass them, if only for one registration): the
        # socket's last close is then the broker's, never a worker's under the loop's lock.
        self.passing_allowed = may_pass
        self.tls_pending = isinstance(sock, ssl.SSLSocket)
        self.admitted = False
        self.owner: str | None = None
        self.session: str | None = None
        self.deadline: float | None = deadline  # of the handshake, or the next byte of the request being received
        self.started = 0.0  # when the request's first byte came
        self.received = 0  # its bytes so far (the progress its deadline follows)
        self.idle_since = time.monotonic()
        self.events = select.EPOLLIN
        self.active = False  # a worker handles it now
        self.closed = False
        self.revoked = False  # its caller lost its credentials: no further request is served
        self.buffer = memoryview(bytearray(len(MAGIC) + TICKET_BYTES))  # what is being received
        self.got = 0
        self.need = len(self.buffer)  # bytes of `buffer` the current step waits for
        self.own_buffer = self.buffer  # the connection's buffer, once admitted
        self.header: tuple[int, int, int, int, int] | None = None
        self.payload: memoryview = self.buffer
        self.hold: Any = None  # the ledger's hold on a large request's payload
        self.refusal: status_pb2.Status | None = None  # the answer once a refused payload is drained
        self.discard = 0  # bytes of a refused payload still to drain
        self.mailbox: Mailbox | None = None  # where large CALL payloads come in (Unix socket)
        self.attachment: memoryview | None = None  # a call's attached part left in the mailbox (not copied)
        # Runs served again from the first like them (transport/repeats.py): a connection's calls are its
        # client's, in its session, one at a time, so the store needs no session of its own on the server.
        self.repeats: dict[bytes, Any] = {}
        self.lowat = 1  # the socket's SO_RCVLOWAT: raised while a large payload arrives over TCP

    def next_request(self) -> None:
        """Waits for a request header, into the connection's own buffer (made at admission)."""
        if len(self.own_buffer) < BUFFER_BYTES:
            self.own_buffer = memoryview(bytearray(BUFFER_BYTES))
        self.buffer, self.got, self.need, self.header, self.deadline = self.own_buffer, 0, REQUEST.size, None, None
        self.refusal, self.discard = None, 0
        self.idle_since = time.monotonic()

    @property
    def identity(self) -> str | None:
        """Whose the connection is: its ticket's owner once admitted, else the local user that connected."""
        if self.admitted or self.peer is None:
            return self.owner
        return f"uid:{self.peer[1]}"

    def drop_request(self) -> None:
        """Lets go of the request's payload: its hold ends with the last view of it (Hold.follow)."""
        self.hold, self.attachment = None, None
        self.payload = self.buffer = self.own_buffer

    def let_go(self) -> None:
        """Lets go of what a closed connection held: its request and its mailbox. Never under the
        loop's lock: the last view of a mapped mailbox punches it out of the memfd (~30 ms per 64 MiB
        here), which would stall every connection's worker."""
        self.drop_request()
        self.repeats.clear()
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
