"""Data-channel tickets: issued by the OpenDataChannel RPC to an authenticated caller, they admit
connections as that caller and session for a while."""

from __future__ import annotations

import secrets
import threading
import time

from aclnn_common.framing import TICKET_BYTES

_TICKET_TTL_S = 60.0


class Tickets:
    """Tickets by their bytes, each with its owner, session and expiry."""

    def __init__(self) -> None:
        self._tickets: dict[bytes, tuple[str | None, str | None, float]] = {}
        self._lock = threading.Lock()

    def issue(self, owner: str | None, session: str | None) -> bytes:
        """A fresh ticket admitting connections as `owner` and `session` for a minute."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, (_, _, expires) in self._tickets.items() if expires < now]:
                del self._tickets[stale]
            self._tickets[ticket] = (owner, session, now + _TICKET_TTL_S)
        return ticket

    def holder(self, ticket: bytes) -> tuple[str | None, str | None] | None:
        """The (owner, session) a live ticket admits as; None when it is unknown or expired."""
        with self._lock:
            found = self._tickets.get(ticket)
        if found is None or found[2] < time.monotonic():
            return None
        return found[0], found[1]
