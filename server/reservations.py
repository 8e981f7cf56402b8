"""Call reservations: a call's memory taken as one unit before any of its bytes are sent (ReserveCall).

A call that uploads its inputs first used to hold their bytes while it waited for the memory of
its outputs, and clients of one identity, each holding part of what the next one needed, could
refuse each other forever. A reservation holds everything the call will hold — its uploads, its
outputs (kept ones as stored tensors), its workspace — from the moment admission grants it, in turn
with every other waiting call; the uploads and the call then draw on it and wait for nothing but a
slot. An unused reservation ends by itself after TTL_S (each upload renews it), with its session,
or when released.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aclnn_common.errors import Status, invalid_error

from .errors import CapacityError
from .ledger import Hold

TTL_S = 30.0
# Reservations of one identity alive at once: each holds memory within its share, this bounds their count.
MAX_PER_IDENTITY = 64


@dataclass
class Reservation:
    holds: dict[str, Hold]  # by kind: "upload" (what uploads take), "call" and "result" (what the call takes)
    uploads: list[int]  # sizes of the uploads still to come
    expires: float = field(default=0.0)
    method: str = "Run"  # the call it is for: "Run" or "Execute" (a draining server admits no other with it)

    def release(self) -> None:
        for hold in self.holds.values():
            hold.release()


class Reservations:
    """Live reservations by (owner, session, id), expired in order without a scan."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._live: collections.OrderedDict[tuple[str | None, str | None, str], Reservation] = collections.OrderedDict()
        self._per_identity: collections.Counter[str | None] = collections.Counter()
        self._by_session: dict[tuple[str | None, str | None], set[str]] = {}
        self._lock = threading.Lock()

    def add(
        self,
        owner: str | None,
        session: str | None,
        holds: dict[str, Hold],
        uploads: Sequence[int],
        method: str = "Run",
    ) -> str:
        """Keeps granted holds as a reservation for a `method` call; returns its id."""
        reservation_id = secrets.token_hex(16)
        with self._lock:
            expired = self._expire()
            refused = self._per_identity[owner] >= MAX_PER_IDENTITY
            if not refused:
                reservation = Reservation(holds, list(uploads), self._clock() + TTL_S, method)
                self._live[(owner, session, reservation_id)] = reservation
                self._per_identity[owner] += 1
                self._by_session.setdefault((owner, session), set()).add(reservation_id)
        _release(expired)
        if refused:
            for hold in holds.values():
                hold.release()
            raise CapacityError(
                Status.INNER_CREATE_EXECUTOR,
                f"this caller has {MAX_PER_IDENTITY} reservations: use or release some first",
                "reservation",
            )
        return reservation_id

    def upload(self, owner: str | None, session: str | None, reservation_id: str, size: int) -> Hold:
        """The hold of one of the reservation's uploads (of exactly `size` bytes); 161002 naming `chunk`
        when it has none of that size (or is unknown: ended, or another's)."""
        with self._lock:
            expired = self._expire()
            key = (owner, session, reservation_id)
            reservation = self._live.get(key)
            found = reservation is not None and size in reservation.uploads
            if found:
                reservation.uploads.remove(size)
                reservation.expires = self._clock() + TTL_S
                self._live.move_to_end(key)
                hold = reservation.holds["upload"].split(size, "upload")
        _release(expired)
        if not found:
            raise invalid_error(
                "chunk", f"reservation {reservation_id[:8]}... has no upload of {size} bytes (used, or ended)"
            )
        return hold

    def holds(self, owner: str | None, session: str | None, reservation_id: str, method: str | None = None) -> bool:
        """Whether the reservation is live (its call has begun: it goes on while the server drains), and
        for a `method` call when one is named."""
        self.reap()  # a draining server's reaper has stopped: a lapsed one is no call begun
        with self._lock:
            reservation = self._live.get((owner, session, reservation_id))
        return reservation is not None and method in (None, reservation.method)

    def __len__(self) -> int:
        self.reap()
        with self._lock:
            return len(self._live)

    def take(self, owner: str | None, session: str | None, reservation_id: str) -> dict[str, Hold] | None:
        """The holds a call runs on ("call", "result"), the reservation ended; None when it is unknown."""
        with self._lock:
            reservation = self._remove((owner, session, reservation_id))
        if reservation is None:
            return None
        reservation.holds.pop("upload").release()  # uploads that never came
        return reservation.holds

    def release(self, owner: str | None, session: str | None, reservation_id: str) -> None:
        with self._lock:
            reservation = self._remove((owner, session, reservation_id))
        if reservation is not None:
            reservation.release()

    def end_session(self, owner: str | None, session: str) -> None:
        with self._lock:
            ids = list(self._by_session.get((owner, session), ()))
            ended = [self._remove((owner, session, reservation_id)) for reservation_id in ids]
        _release(ended)

    def reap(self) -> None:
        with self._lock:
            expired = self._expire()
        _release(expired)

    def _remove(self, key: tuple[str | None, str | None, str]) -> Reservation | None:
        reservation = self._live.pop(key, None)
        if reservation is not None:
            self._per_identity[key[0]] -= 1
            if not self._per_identity[key[0]]:
                del self._per_identity[key[0]]
            mine = self._by_session[key[:2]]
            mine.discard(key[2])
            if not mine:
                del self._by_session[key[:2]]
        return reservation

    def _expire(self) -> list[Reservation]:
        """Removes the lapsed reservations (the lock held); the caller releases them after the lock."""
        now, expired = self._clock(), []
        while self._live:
            key, reservation = next(iter(self._live.items()))
            if reservation.expires >= now:
                break
            expired.append(self._remove(key))
        return expired


def _release(reservations: list[Reservation | None]) -> None:
    for reservation in reservations:
        if reservation is not None:
            reservation.release()
