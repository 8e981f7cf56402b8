"""ACL streams lent to client streams, so that no two client streams ever have work on one ACL stream.

A client stream is the engine's key (identity, session, stream id). Calls on device memory are
launched without waiting for them, as aclnnX returns once its kernel is queued, so an ACL stream
holds a client stream's unfinished work until something synchronizes it. The pool keeps each
client stream's work, and its failures, apart:

- An ACL stream is bound to one client stream at a time, and all of a client stream's launches go
  to its ACL stream, so they run in order. The binding outlives a synchronize (a client stream
  keeps its ACL stream while nobody else needs it) and moves only when the ACL stream is wanted
  elsewhere.
- Whoever synchronizes an ACL stream that holds a client stream's work (that client stream's own
  synchronize, a transfer of a buffer the work uses, or another client stream taking the ACL
  stream over) records a failure for that client stream, never for itself: it surfaces at the
  client stream's synchronize, or at the next call made on it. The end of a session waits for its
  work and drops its failures. An ACL stream
  whose work failed is replaced by a fresh one, so that no fault state passes to its next user.
- Calls waited for (host tensors, or no client stream) launch and synchronize while holding the
  ACL stream's lock: their failure is their own.
- What queued work uses lives until its ACL stream is synchronized: the workspace, the CANN
  executor and its tensors (`releases`), and device buffers freed meanwhile (DeviceBlock).
- Caps: at most `max_streams` ACL streams in all, at most `max_per_identity` of them bound to one
  identity's client streams (beyond, a client stream takes over its identity's least recently used
  ACL stream, an idle one first, synchronizing it if it has work), and at most `max_queued`
  launches queued on one ACL stream (the launch that fills it waits for them, as a device's full
  launch queue holds its caller back).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from aclnn_common.errors import AclnnError

from ...streams import StreamKey
from .acl import Acl

log = logging.getLogger("aclnn_server.npu")

MAX_STREAMS = 64
MAX_STREAMS_PER_IDENTITY = 16
MAX_QUEUED = 1024


@dataclass(eq=False)
class DeviceBlock:
    """A device buffer's memory: `size` bytes at `ptr`, from the caching allocator."""

    ptr: int
    size: int
    streams: set[AclStream] = field(default_factory=set)  # ACL streams whose unsynchronized work uses it
    released: bool = False  # its buffer is gone: back to the allocator once `streams` is empty


@dataclass(eq=False)
class AclStream:
    """One ACL stream and the work launched on it since it was last synchronized."""

    handle: int
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while launching on it or synchronizing it
    key: StreamKey | None = None  # the client stream bound to it; its unsynchronized launches are this one's
    launches: int = 0
    releases: list[Callable[[], None]] = field(default_factory=list)  # run once those launches have run
    blocks: set[DeviceBlock] = field(default_factory=set)  # device buffers they use
    used: int = 0  # when it was last lent: the least recently used is taken over first


class StreamPool:
    """The ACL streams of one backend, lent to client streams (see the module docstring)."""

    def __init__(
        self,
        acl: Acl,
        free_block: Callable[[int], None],
        initial: int = 4,
        max_streams: int = MAX_STREAMS,
        max_per_identity: int = MAX_STREAMS_PER_IDENTITY,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.acl = acl
        self._free_block = free_block  # returns a device block's memory to the allocator
        self.max_streams = max(1, initial, max_streams)
        self.max_per_identity = max(1, max_per_identity)
        self.max_queued = max(1, max_queued)
        self._lock = threading.Lock()  # taken after a stream's lock, never before
        self._streams: list[AclStream] = []
        self._bound: dict[StreamKey, AclStream] = {}
        self._failures: dict[StreamKey, AclnnError] = {}  # found by someone else, not reported yet
        self._clock = itertools.count(1)
        self._closed = False
        try:
            for _ in range(max(1, initial)):
                self._streams.append(AclStream(acl.create_stream()))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._streams)

    # Lending -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lend(self, key: StreamKey | None) -> Iterator[AclStream]:
        """`key`'s ACL stream (for None, an idle one), locked, with no other client stream's work on it.

        A failure recorded for `key` is raised instead: the next call made on a stream reports it.
        """
        stream = self._acquire(key)
        try:
            yield stream
        finally:
            stream.lock.release()

    def launched(
        self, stream: AclStream, blocks: Iterable[DeviceBlock], releases: Iterable[Callable[[], None]]
    ) -> None:
        """A launch that nobody waits for was queued on the stream lent to its client stream: the device
        buffers it uses, and what to release once it has run."""
        with self._lock:
            stream.launches += 1
            stream.releases.extend(releases)
            for block in blocks:
                stream.blocks.add(block)
                block.streams.add(stream)
            full = stream.launches >= self.max_queued
        if full:
            self._drain_for(stream)

    def finish(self, stream: AclStream) -> None:
        """Synchronizes the lent stream for a caller that waits for what it launched: the failure is the caller's."""
        failure = self._drain(stream)
        if failure is not None:
            raise failure

    def quiesce(self, blocks: Collection[DeviceBlock]) -> None:
        """Waits for the queued work that uses these device buffers; its failures stay its client streams'."""
        with self._lock:
            streams = {s for block in blocks for s in block.streams}
        for stream in streams:
            with stream.lock:
                if any(stream in block.streams for block in blocks):
                    self._drain_for(stream)

    def release(self, block: DeviceBlock) -> None:
        """The block's buffer is gone: its memory goes back to the allocator now, or once the work using it has run."""
        with self._lock:
            if self._closed:
                return  # close() freed all device memory
            block.released = True
            if block.streams:
                return
        self._free_block(block.ptr)

    # Client streams ------------------------------------------------------------------------------

    def synchronize(self, owner: Hashable, session: Hashable, stream_id: int | None) -> None:
        """Waits for a client stream's work (every stream of the session when `stream_id` is None) and
        raises the first failure found on it since it was last reported, once."""

        def matches(key: StreamKey | None) -> bool:
            return key is not None and key[:2] == (owner, session) and stream_id in (None, key[2])

        with self._lock:
            streams = [s for s in self._streams if matches(s.key) and s.launches]
        for stream in streams:
            with stream.lock:
                if matches(stream.key):
                    self._drain_for(stream)
        with self._lock:
            failures = [(key, self._failures.pop(key)) for key in [k for k in self._failures if matches(k)]]
        if failures:
            key, failure = failures[0]
            raise AclnnError(failure.code, f"a call queued on stream {key[2]} failed on the device: {failure.message}")

    def end_session(self, owner: Hashable, session: Hashable) -> None:
        """An identity's session ended: its work is waited for, its failures dropped, its ACL streams unbound."""
        with self._lock:
            streams = [s for s in self._streams if s.key is not None and s.key[:2] == (owner, session)]
        for stream in streams:
            with stream.lock:
                if stream.key is None or stream.key[:2] != (owner, session):
                    continue
                failure = self._drain(stream) if stream.launches else None
                if failure is not None:
                    log.info("a call of an ended session failed on the device: %s", failure.message)
                with self._lock:
                    self._unbind(stream)
        with self._lock:
            for key in [k for k in self._failures if k[1] == session]:
                del self._failures[key]

    def close(self) -> None:
        """Waits for all work, releases what it used, destroys the ACL streams."""
        for stream in self._streams:
            with stream.lock:
                failure = self._drain(stream, renew=False) if stream.launches else None
                if failure is not None:
                    log.warning("queued work failed on the device at close: %s", failure.message)
                try:
                    self.acl.destroy_stream(stream.handle)
                except AclnnError as exc:
                    log.warning("destroying an ACL stream: %s", exc.message)
        with self._lock:
            self._closed = True
            self._streams.clear()
            self._bound.clear()
            self._failures.clear()

    # internals ---------------------------------------------------------------------------------

    def _acquire(self, key: StreamKey | None) -> AclStream:
        while True:
            with self._lock:
                failure = self._failures.pop(key, None) if key is not None else None
                if failure is not None:
                    raise AclnnError(
                        failure.code, f"an earlier call queued on this stream failed on the device: {failure.message}"
                    )
                stream = self._bound.get(key) if key is not None else None
                if stream is None:
                    stream = self._choose(key)
                stream.used = next(self._clock)
            stream.lock.acquire()
            try:
                if self._settle(stream, key):
                    return stream
            except BaseException:
                stream.lock.release()
                raise
            stream.lock.release()  # the choice went stale meanwhile: choose again

    def _choose(self, key: StreamKey | None) -> AclStream:
        """The stream to lend `key`, which has none bound (the pool's lock held)."""
        if key is not None:
            mine = [s for s in self._streams if s.key is not None and s.key[0] == key[0]]
            if len(mine) >= self.max_per_identity:
                return min(mine, key=self._cost)
        unbound = [s for s in self._streams if s.key is None and not s.lock.locked()]
        if unbound:
            return unbound[0]
        idle = [s for s in self._streams if not s.launches and not s.lock.locked()]
        if idle:
            return min(idle, key=self._cost)
        if len(self._streams) < self.max_streams:
            try:
                stream = AclStream(self.acl.create_stream())
            except AclnnError as exc:
                log.warning("could not add an ACL stream: %s", exc.message)
            else:
                self._streams.append(stream)
                return stream
        return min(self._streams, key=self._cost)

    @staticmethod
    def _cost(stream: AclStream) -> tuple[bool, bool, int]:
        """Which stream to take over first: one not in use, then one without work, least recently used."""
        return stream.lock.locked(), stream.launches > 0, stream.used

    def _settle(self, stream: AclStream, key: StreamKey | None) -> bool:
        """With the stream locked: makes it `key`'s, first synchronizing another client stream's work on
        it; False when the choice went stale (`key` got a stream meanwhile, or lost this one)."""
        with self._lock:
            bound = self._bound.get(key) if key is not None else None
            if bound is not None:
                return bound is stream
        if stream.launches:
            self._drain_for(stream)  # another client stream's work (a stream with `key`'s is bound to it)
        if key is None:
            return True
        with self._lock:
            if key in self._bound:
                return False
            self._unbind(stream)
            stream.key = key
            self._bound[key] = stream
        return True

    def _unbind(self, stream: AclStream) -> None:
        if stream.key is not None and self._bound.get(stream.key) is stream:
            del self._bound[stream.key]
        stream.key = None

    def _drain_for(self, stream: AclStream) -> None:
        """Synchronizes a (locked) stream for the client stream whose work it holds: a failure is recorded for it."""
        key = stream.key
        failure = self._drain(stream) if stream.launches else None
        if failure is not None and key is not None:
            with self._lock:
                self._failures.setdefault(key, failure)

    def _drain(self, stream: AclStream, renew: bool = True) -> AclnnError | None:
        """Synchronizes a (locked) stream and releases what its launches used; their failure, if any."""
        failure = None
        try:
            self.acl.synchronize(stream.handle)
        except AclnnError as exc:
            failure = exc
        with self._lock:
            releases, stream.releases = stream.releases, []
            blocks, stream.blocks = stream.blocks, set()
            stream.launches = 0
            freed = []
            for block in blocks:
                block.streams.discard(stream)
                if block.released and not block.streams:
                    freed.append(block.ptr)
        for release in releases:
            try:
                release()
            except Exception:  # one failed release must not keep the others
                log.exception("releasing what a launch used failed")
        for ptr in freed:
            self._free_block(ptr)
        if failure is not None and renew:
            self._renew(stream)
        return failure

    def _renew(self, stream: AclStream) -> None:
        """Replaces a (locked) stream whose work failed with a fresh one."""
        try:
            handle = self.acl.create_stream()
        except AclnnError as exc:
            log.warning("keeping an ACL stream whose work failed: no new one: %s", exc.message)
            return
        old, stream.handle = stream.handle, handle
        try:
            self.acl.destroy_stream(old)
        except AclnnError as exc:
            log.warning("destroying an ACL stream whose work failed: %s", exc.message)
