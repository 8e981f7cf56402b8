"""Bytes that live on the server between calls: uploaded tensors (handles) and shared-memory regions.

Both belong to a client session (the `x-aclnn-session` metadata, bound to the caller's
identity). A session's lease is renewed by every call that names it; when it lapses
(the client went away) its handles are freed, its regions unmapped and its executors
ended. Handle bytes are held in the memory ledger, against their owner's share.
"""

from __future__ import annotations

import mmap
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from aclnn_common.errors import Status, invalid_error

from .errors import CapacityError
from .ledger import Hold, MemoryLedger
from .regions import MAX_REGIONS_PER_IDENTITY, MappedRegion


@dataclass
class Session:
    owner: str | None
    expires: float
    handles: dict[str, tuple[memoryview, Hold]] = field(default_factory=dict)
    regions: dict[str, MappedRegion] = field(default_factory=dict)


class Storage:
    """Sessions with their handles and regions; handle bytes are held in the ledger."""

    def __init__(
        self,
        session_ttl_s: float,
        ledger: MemoryLedger,
        on_session_end: Callable[[str], None] = lambda session_id: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session_ttl_s = session_ttl_s
        self.ledger = ledger
        self._on_session_end = on_session_end
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._ended: list[str] = []  # lapsed sessions whose executors and buffers `reap` has yet to end

    def reap(self) -> None:
        """Frees the handles and unmaps the regions of sessions whose lease lapsed; ends their executors."""
        with self._lock:
            self._reap()
            ended, self._ended = self._ended, []
        for session_id in ended:
            self._on_session_end(session_id)

    def counts(self) -> tuple[int, int]:
        """(live handles, mapped regions) over all sessions."""
        with self._lock:
            self._reap()
            return sum(len(s.handles) for s in self._sessions.values()), sum(
                len(s.regions) for s in self._sessions.values()
            )

    # Sessions -----------------------------------------------------------------------------

    def _session(self, session_id: str | None, owner: str | None) -> Session:
        if not session_id:
            raise invalid_error("session", "handles and regions need an x-aclnn-session id in the call's metadata")
        self._reap()
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(owner, 0.0)
        elif session.owner != owner:
            raise invalid_error("session", "belongs to another client")
        session.expires = self._clock() + self.session_ttl_s
        return session

    def touch(self, session_id: str | None, owner: str | None) -> None:
        """Renews a session's lease (KeepAlive, or any call naming it)."""
        if session_id:
            with self._lock:
                self._session(session_id, owner)

    def _reap(self) -> None:
        now = self._clock()
        ended = [i for i, s in self._sessions.items() if s.expires < now]
        for session_id in ended:
            self._close(self._sessions.pop(session_id))
        self._ended += ended  # whichever call noticed, the next `reap` ends the rest of them

    def _close(self, session: Session) -> None:
        for _, hold in session.handles.values():
            hold.release()
        session.handles.clear()
        for region in session.regions.values():
            _unmap(region)
        session.regions.clear()

    def close(self) -> None:
        with self._lock:
            for session in self._sessions.values():
                self._close(session)
            self._sessions.clear()

    # Handles ------------------------------------------------------------------------------

    def reserve(self, session_id: str | None, owner: str | None, size: int) -> tuple[memoryview, Hold]:
        """A buffer for an upload of `size` bytes, held in the ledger (the caller releases the hold
        if the upload fails).

        Not zeroed: an upload becomes a handle only once it filled every byte (and a large
        NumPy allocation is backed by huge pages, faulting in far faster than a bytearray).
        """
        with self._lock:
            self._session(session_id, owner)
        hold = self.ledger.reserve(owner, size, "upload", "chunk")
        return memoryview(np.empty(size, np.uint8)), hold

    def add_handle(self, session_id: str | None, owner: str | None, buffer: memoryview, hold: Hold) -> str:
        """Keeps `buffer` as a handle of the session; `hold` (its bytes in the ledger) goes with it."""
        with self._lock:
            session = self._session(session_id, owner)
            handle = secrets.token_hex(16)
            session.handles[handle] = buffer, hold
            return handle

    def handle(self, session_id: str | None, owner: str | None, handle: str) -> memoryview:
        with self._lock:
            kept = self._session(session_id, owner).handles.get(handle)
        if kept is None:
            raise invalid_error("handle", f"tensor handle {handle[:8]}... is unknown or freed")
        return kept[0]

    def free_handle(self, session_id: str | None, owner: str | None, handle: str) -> None:
        with self._lock:
            kept = self._session(session_id, owner).handles.pop(handle, None)
        if kept is None:
            raise invalid_error("handle", f"tensor handle {handle[:8]}... is unknown or freed")
        kept[1].release()

    # Regions ------------------------------------------------------------------------------

    def register_region(self, session_id: str | None, owner: str | None, region: mmap.mmap) -> str:
        """Keeps a mapped region (regions.map_region) in the session; returns its id there.

        Its bytes are held in the ledger against the owner's share (the server may fault its
        pages in), and an identity keeps at most MAX_REGIONS_PER_IDENTITY at once.
        """
        try:
            with self._lock:
                self._session(session_id, owner)
                count = sum(len(s.regions) for s in self._sessions.values() if s.owner == owner)
            if count >= MAX_REGIONS_PER_IDENTITY:
                raise CapacityError(
                    Status.INNER_CREATE_EXECUTOR,
                    f"this caller has {count} regions registered: unregister some first",
                    "region",
                )
            hold = self.ledger.reserve(owner, len(region), "region", "region")
        except BaseException:
            region.close()
            raise
        region_id = secrets.token_hex(16)
        with self._lock:
            self._session(session_id, owner).regions[region_id] = MappedRegion(region, hold)
        return region_id

    def unregister_region(self, session_id: str | None, owner: str | None, region_id: str) -> None:
        with self._lock:
            region = self._session(session_id, owner).regions.pop(region_id, None)
        if region is None:
            raise invalid_error("region", f"{region_id[:8]!r}... is not registered")
        _unmap(region)

    def region_slice(
        self, session_id: str | None, owner: str | None, region_id: str, offset: int, size: int
    ) -> memoryview:
        """Bytes [offset, offset + size) of a registered region, checked against its bounds."""
        with self._lock:
            region = self._session(session_id, owner).regions.get(region_id)
        if region is None:
            raise invalid_error("region", f"{region_id[:8]!r}... is not registered")
        if offset + size > len(region):
            raise invalid_error("region", f"[{offset}, {offset + size}) lies outside the region ({len(region)} bytes)")
        return memoryview(region.map)[offset : offset + size]


def _unmap(region: MappedRegion) -> None:
    region.close()  # the mapping itself goes with the last view of a call still using it
