"""Client sessions, and the bytes that live in them between calls: uploaded tensors (handles) and
shared-memory regions.

A session is the `x-aclnn-session` metadata of an identity's calls: two identities naming the same
session id have two sessions, neither of which can reach the other. Its lease is renewed by every
call that names it; when it lapses (the client went away) its handles and regions are dropped and
`on_session_end(owner, session)` ends whatever else lives in it (executors, device buffers). That
is the one place a session ends, whichever call or thread notices the lapse. An identity keeps at
most `max_per_identity` sessions; the bytes of handles and regions are held in the ledger and
follow their memory: they are given back when the last view goes, not when the name does.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from aclnn_common.errors import Status, invalid_error

from .errors import CapacityError
from .ledger import Hold, MemoryLedger
from .regions import MAX_REGIONS_PER_IDENTITY, MappedRegion

# Session ids are the client's: ours are 32 hex digits; anything longer than this is refused.
MAX_SESSION_ID = 128
SessionKey = tuple[str | None, str]  # (owner, session id)


@dataclass
class Session:
    expires: float
    handles: dict[str, memoryview] = field(default_factory=dict)
    regions: dict[str, MappedRegion] = field(default_factory=dict)
    ended: bool = False  # closed or lapsed: what a call still makes for it must end too (`ended`)


class Storage:
    """Sessions with their handles and regions, each identity's capped."""

    def __init__(
        self,
        session_ttl_s: float,
        ledger: MemoryLedger,
        on_session_end: Callable[[str | None, str], None] = lambda owner, session: None,
        clock: Callable[[], float] = time.monotonic,
        max_per_identity: int = 256,
    ) -> None:
        self.session_ttl_s = session_ttl_s
        self.ledger = ledger
        self.max_per_identity = max_per_identity
        self._on_session_end = on_session_end
        self._clock = clock
        # In expiry order: every touch renews by the same TTL, so the lapsed ones are at the front.
        self._sessions: collections.OrderedDict[SessionKey, Session] = collections.OrderedDict()
        self._per_identity: collections.Counter[str | None] = collections.Counter()
        self._mapped: collections.Counter[str | None] = collections.Counter()  # regions with a view alive
        self._inodes: set[tuple[int, int]] = set()  # memfds mapped now (each at most once)
        self._unfetched: set[str] = set()  # handles of kept results not downloaded yet (see `unfetched`)
        # Reentrant: a region's last view may be dropped by a thread that holds it (see _unmapped).
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, with lapsed sessions ended first; their executors and buffers end after it is released."""
        with self._lock:
            ended = []
            now = self._clock()
            while self._sessions:
                key, session = next(iter(self._sessions.items()))
                if session.expires >= now:
                    break
                self._drop(key)
                ended.append(key)
            yield
        for owner, session_id in ended:
            self._on_session_end(owner, session_id)

    def reap(self) -> None:
        """Ends the sessions whose lease lapsed (also when no call arrives to notice)."""
        with self._locked():
            pass

    def counts(self) -> tuple[int, int]:
        """(live handles, mapped regions) over all sessions."""
        with self._locked():
            sessions = self._sessions.values()
            return sum(len(s.handles) for s in sessions), sum(len(s.regions) for s in sessions)

    def close(self) -> None:
        with self._lock:
            for key in list(self._sessions):
                self._drop(key)

    # Sessions -----------------------------------------------------------------------------

    def _session(self, session_id: str | None, owner: str | None, create: bool = True) -> Session:
        """The caller's session, its lease renewed; made if new (within the identity's cap), or (not
        `create`: a lookup) an empty one that is not kept."""
        if not session_id:
            raise invalid_error("session", "handles and regions need an x-aclnn-session id in the call's metadata")
        if len(session_id) > MAX_SESSION_ID:
            raise invalid_error("session", f"x-aclnn-session ids are at most {MAX_SESSION_ID} characters")
        key = (owner, session_id)
        session = self._sessions.get(key)
        if session is None and not create:
            return Session(0.0)
        if session is None:
            if self._per_identity[owner] >= self.max_per_identity:
                raise CapacityError(
                    Status.INNER_CREATE_EXECUTOR,
                    f"this caller has {self.max_per_identity} sessions (--max-tenant-sessions): "
                    "reuse one, or let idle ones lapse",
                    "session",
                )
            session = self._sessions[key] = Session(0.0)
            self._per_identity[owner] += 1
        else:
            self._sessions.move_to_end(key)
        session.expires = self._clock() + self.session_ttl_s
        return session

    def touch(self, session_id: str | None, owner: str | None, create: bool = False) -> Session | None:
        """Renews a session's lease (any call naming it), and returns it; `create`: makes it if new (a
        call about to keep something in it: an executor, a reservation, a device buffer). A call that
        keeps nothing makes no session: it gets an empty one, not kept (None without a session id)."""
        if not session_id:
            return None
        with self._locked():
            return self._session(session_id, owner, create)

    def ended(self, session: Session) -> bool:
        """Whether a session a call made or renewed (`touch`) has ended since: an object the call added
        to a store after that was not among those its end ended."""
        with self._locked():
            return session.ended

    def end(self, session_id: str | None, owner: str | None) -> None:
        """Ends a session now (its client closed): as if its lease had lapsed."""
        ended = False
        with self._locked():
            if (owner, session_id) in self._sessions:
                self._drop((owner, session_id))
                ended = True
        if ended and session_id:
            self._on_session_end(owner, session_id)

    def _drop(self, key: SessionKey) -> None:
        """Drops a session with the names of its handles and regions (their memory goes with its last view)."""
        session = self._sessions.pop(key)
        session.ended = True
        self._unfetched.difference_update(session.handles)
        session.handles.clear()  # a call that looked its session up still sees them go
        session.regions.clear()
        self._per_identity[key[0]] -= 1
        if not self._per_identity[key[0]]:
            del self._per_identity[key[0]]

    # Handles ------------------------------------------------------------------------------

    def reserve(self, session_id: str | None, owner: str | None, size: int, hold: Hold | None = None) -> memoryview:
        """A buffer for an upload of `size` bytes, held in the ledger (by `hold`, from a reservation, or a
        hold taken now) for as long as it is referenced.

        Not zeroed: an upload becomes a handle only once it filled every byte (and a large
        NumPy allocation is backed by huge pages, faulting in far faster than a bytearray).
        """
        with self._locked():
            self._session(session_id, owner)
        if hold is None:
            hold = self.ledger.reserve(owner, size, "upload", "chunk")
        buffer = np.empty(size, np.uint8)
        hold.follow(buffer)
        return memoryview(buffer)

    def add_handle(self, session_id: str | None, owner: str | None, buffer: memoryview, result: bool = False) -> str:
        """Keeps `buffer` as a handle of the session (its hold follows the buffer's memory); a call's kept
        `result` counts as unfetched until it is downloaded, freed or its session ends."""
        with self._locked():
            handle = secrets.token_hex(16)
            self._session(session_id, owner).handles[handle] = buffer
            if result:
                self._unfetched.add(handle)
            return handle

    def handle(self, session_id: str | None, owner: str | None, handle: str, fetched: bool = False) -> memoryview:
        """A handle's bytes (`fetched`: a download of them, after which a result no longer counts as unfetched)."""
        with self._locked():
            buffer = self._session(session_id, owner, create=False).handles.get(handle)
            if buffer is not None and fetched:
                self._unfetched.discard(handle)
        if buffer is None:
            raise invalid_error("handle", f"tensor handle {handle[:8]}... is unknown or freed")
        return buffer

    @property
    def unfetched(self) -> int:
        """Kept results not downloaded yet: what calls that ran still owe their clients (a drain waits for them)."""
        with self._locked():
            return len(self._unfetched)

    def free_handle(self, session_id: str | None, owner: str | None, handle: str) -> None:
        with self._locked():
            buffer = self._session(session_id, owner, create=False).handles.pop(handle, None)
            if buffer is not None:
                self._unfetched.discard(handle)
        if buffer is None:
            raise invalid_error("handle", f"tensor handle {handle[:8]}... is unknown or freed")

    # Regions ------------------------------------------------------------------------------

    def register_region(
        self, session_id: str | None, owner: str | None, mapping: mmap.mmap, inode: tuple[int, int], held: bool = True
    ) -> str:
        """Keeps a mapped region (regions.map_region) in the session; returns its id there.

        Its bytes are held in the ledger against the owner's share (the server may fault its
        pages in) until its last view goes, unless not `held` (its pages are all its creator's);
        an identity keeps at most MAX_REGIONS_PER_IDENTITY mapped at once, and a memfd is mapped
        at most once at a time.
        """
        try:
            with self._locked():
                self._session(session_id, owner)
                if self._mapped[owner] >= MAX_REGIONS_PER_IDENTITY:
                    raise CapacityError(
                        Status.INNER_CREATE_EXECUTOR,
                        f"this caller has {self._mapped[owner]} regions mapped: unregister some first",
                        "region",
                    )
                if inode in self._inodes:
                    raise invalid_error("region", "this memfd is registered already (or a call still uses it)")
                hold = (
                    self.ledger.reserve(owner, len(mapping), "region", "region")
                    if held
                    else Hold(self.ledger, owner, 0, "region")
                )
                self._mapped[owner] += 1
                self._inodes.add(inode)
        except BaseException:
            mapping.close()
            raise
        region = MappedRegion(mapping, inode, hold, lambda: self._unmapped(owner, inode))
        region_id = secrets.token_hex(16)
        with self._locked():
            self._session(session_id, owner).regions[region_id] = region
        return region_id

    def _unmapped(self, owner: str | None, inode: tuple[int, int]) -> None:
        """A region's last view went (in whichever thread dropped it: maybe one holding the lock already)."""
        with self._lock:
            self._mapped[owner] -= 1
            if not self._mapped[owner]:
                del self._mapped[owner]
            self._inodes.discard(inode)

    def unregister_region(self, session_id: str | None, owner: str | None, region_id: str) -> None:
        with self._locked():
            region = self._session(session_id, owner, create=False).regions.pop(region_id, None)
        if region is None:
            raise invalid_error("region", f"{region_id[:8]!r}... is not registered")

    def lookup(self, session_id: str | None, owner: str | None) -> Session:
        """The session, its lease renewed: its regions as they are registered and unregistered (a call
        looks it up once: see region_slice); an empty one, not kept, for a session that has none."""
        with self._locked():
            return self._session(session_id, owner, create=False)


def region_slice(regions: Mapping[str, MappedRegion], region_id: str, offset: int, size: int) -> memoryview:
    """Bytes [offset, offset + size) of one of a session's `regions`, checked against its bounds."""
    region = regions.get(region_id)
    if region is None:
        raise invalid_error("region", f"{region_id[:8]!r}... is not registered")
    if offset + size > len(region):
        raise invalid_error("region", f"[{offset}, {offset + size}) lies outside the region ({len(region)} bytes)")
    return region.slice(offset, size)
