"""Data-channel tickets: issued by the OpenDataChannel RPC to an authenticated caller, they admit
connections as that caller and session for a while."""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable

from aclnn_common.framing import TICKET_BYTES

_TICKET_TTL_S = 60.0
# Live tickets of one identity: a client asks for one per server, and again when it expires; beyond
# this many, an identity's oldest ticket is forgotten (its connections stay, new ones need a new one).
MAX_PER_IDENTITY = 16


class Tickets:
    """Tickets by their bytes, each with its owner, session and expiry: at most MAX_PER_IDENTITY per
    identity, and expired ones dropped without a scan (they expire in the order they were issued)."""

    def __init__(self) -> None:
        self._tickets: collections.OrderedDict[bytes, tuple[str | None, str | None, float]] = collections.OrderedDict()
        self._by_owner: dict[str | None, collections.deque[bytes]] = {}
        self._lock = threading.Lock()

    def issue(self, owner: str | None, session: str | None) -> bytes:
        """A fresh ticket admitting connections as `owner` and `session` for a minute."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            while self._tickets:
                oldest, (_, _, expires) = next(iter(self._tickets.items()))
                if expires >= now:
                    break
                self._forget(oldest)
            mine = self._by_owner.setdefault(owner, collections.deque())
            if len(mine) >= MAX_PER_IDENTITY:
                self._forget(mine[0])
            self._tickets[ticket] = (owner, session, now + _TICKET_TTL_S)
            self._by_owner.setdefault(owner, collections.deque()).append(ticket)
        return ticket

    def _forget(self, ticket: bytes) -> None:
        owner = self._tickets.pop(ticket)[0]
        mine = self._by_owner[owner]
        mine.remove(ticket)  # the oldest of the owner's, first in its deque
        if not mine:
            del self._by_owner[owner]

    def revoke(self, revoked: Callable[[str | None], bool]) -> None:
        """Forgets every ticket of the owners `revoked` names (their credentials were withdrawn)."""
        with self._lock:
            for owner in [owner for owner in self._by_owner if revoked(owner)]:
                for ticket in list(self._by_owner[owner]):
                    self._forget(ticket)

    def holder(self, ticket: bytes) -> tuple[str | None, str | None] | None:
        """The (owner, session) a live ticket admits as; None when it is unknown or expired."""
        with self._lock:
            found = self._tickets.get(ticket)
        if found is None or found[2] < time.monotonic():
            return None
        return found[0], found[1]
