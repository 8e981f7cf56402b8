"""Streams as on CANN: calls queued per (identity, session, stream), in submission order, streams concurrently.

A call on device memory whose outputs stay there is queued on its stream and its caller goes on
at once (aclnnX returns once the kernel is queued). Each stream with work has a worker thread that
runs its calls one after another; other streams run meanwhile. Workers outlive their stream's
work: one that ran out of work waits (WORKER_IDLE_S) to serve the next stream that gets some, so
a stream's next call is handed to a waiting thread rather than to a new one (starting a thread
cost ~220 us on a loaded 2-core host, a hand-off ~30 us). Each stream with work still has a
thread of its own: a tenant's busy stream never waits for another's. A queued call that fails keeps its
failure on the stream, and later calls queued there are skipped (their inputs may be the failed
call's outputs) until the failure surfaces, once: at the stream's synchronize, or at the next call
made on it. A call whose caller waits for its result (outputs to send back) runs in its turn too,
on the caller's thread when the stream is idle. So does a queued call that only launches work on
a device stream (`launch`: the backend's device orders it and the caller is not held up by the
kernel), as CANN's aclnnX launches on its caller's thread; its failure stays on the stream like
any queued call's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from aclnn_common.errors import AclnnError, Status

from .admission import CallAbandoned
from .errors import CapacityError

# Each stream with work holds a thread, each queued call its buffers' memory: one identity keeps
# at most this many streams (with work or an unreported failure) and queued calls at once.
MAX_STREAMS_PER_IDENTITY = 64
MAX_QUEUED_PER_IDENTITY = 1024
# How long a worker without work waits for a stream that gets some before its thread ends.
WORKER_IDLE_S = 10.0

StreamKey = tuple[Hashable, Hashable, int]  # owner, session, the client's stream id


@dataclass
class _Item:
    work: Callable[[], Any]
    done: Callable[[], None]  # runs once the item ran or was dropped (gives back its buffers)
    future: concurrent.futures.Future | None  # a caller waits for this one's result


@dataclass
class _Stream:
    items: collections.deque[_Item] = field(default_factory=collections.deque)
    busy: bool = False  # an item runs (on the worker, or inline on its caller's thread)
    failure: BaseException | None = None  # the first failure of a queued call, not yet reported
    skipped: int = 0  # queued calls not run since that failure


class StreamQueues:
    """The streams with work; see the module docstring."""

    def __init__(self, max_streams: int = MAX_STREAMS_PER_IDENTITY, max_queued: int = MAX_QUEUED_PER_IDENTITY) -> None:
        self.max_streams, self.max_queued = max_streams, max_queued
        self._streams: dict[StreamKey, _Stream] = {}
        self._queued: collections.Counter[Hashable] = collections.Counter()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._wake = threading.Condition(lock)  # idle workers wait here for a stream in _unserved
        self._unserved: collections.deque[tuple[StreamKey, _Stream]] = collections.deque()
        self._idle = 0  # workers waiting on _wake
        self._closed = False

    def active(self, key: StreamKey) -> bool:
        """Whether the stream has queued or running work, or a failure to report."""
        return key in self._streams  # idle streams leave the table

    def working(self) -> int:
        """Streams with queued or running work (a failure waiting to be reported is none)."""
        with self._cond:
            return sum(1 for stream in self._streams.values() if stream.items or stream.busy)

    def call(
        self,
        key: StreamKey,
        work: Callable[[], Any],
        done: Callable[[], None],
        wait: bool,
        deadline: float | None,
        cancelled: Callable[[], bool] = lambda: False,
        launch: bool = False,
    ) -> Any:
        """Runs `work` after the stream's earlier calls; `done` runs once it ran or was dropped.

        `wait`: the caller gets its result or failure. Otherwise it is queued (None at once) and a
        failure stays on the stream; `launch`: such a call only launches device work, and runs on
        the caller's thread when the stream is idle. Either way the stream's earlier failure, if
        any, is raised instead, and the call is not made. A caller whose calls fill its share of
        the queue waits for room until its `deadline` or until it is `cancelled`: then the call is
        refused, never queued.
        """
        try:
            with self._cond:
                stream = self._stream(key)
                if stream.failure is not None:
                    raise self._report(key, stream)
                inline = (wait or launch) and not stream.busy and not stream.items
                if inline:
                    stream.busy = True
                else:
                    self._wait_for_room(key[0], deadline, cancelled)
                    item = _Item(work, done, concurrent.futures.Future() if wait else None)
                    stream.items.append(item)
                    self._queued[key[0]] += 1
                    if not stream.busy:
                        stream.busy = True
                        self._start_worker(key, stream)
        except BaseException:
            done()
            raise
        if inline and not wait:  # launched here; a failure is the stream's, as a queued call's
            try:
                work()
            except BaseException as exc:
                with self._cond:
                    stream.failure = exc
            finally:
                done()
                self._finish(key, stream)
            return None
        if inline:
            try:
                return work()
            finally:
                done()
                self._finish(key, stream)
        if item.future is not None:
            return item.future.result()
        return None

    def synchronize(self, owner: Hashable, session: Hashable, stream_id: int | None, deadline: float | None) -> None:
        """Waits for the stream's calls (all of the session's streams when `stream_id` is None) and
        raises the first failure among them, once."""
        with self._cond:
            while True:
                keys = [k for k in self._streams if k[:2] == (owner, session) and stream_id in (None, k[2])]
                if not any(self._streams[k].busy for k in keys):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CallAbandoned("deadline", "the deadline passed while the stream's calls still ran")
                self._cond.wait(None if remaining is None else min(remaining, 1.0))
            failures = [self._report(k, self._streams[k]) for k in keys if self._streams[k].failure is not None]
        if failures:
            raise failures[0]

    def end_session(self, owner: str | None, session: Hashable) -> None:
        """Drops the queued calls of an identity's session that ended (a running one finishes) and its failures."""
        dropped = []
        with self._cond:
            for key in [k for k in self._streams if k[:2] == (owner, session)]:
                stream = self._streams.pop(key)
                dropped += stream.items
                self._queued[key[0]] -= len(stream.items)
                stream.items.clear()
            self._tidy_counts()
            self._cond.notify_all()
        for item in dropped:
            if item.future is not None:
                item.future.set_exception(AclnnError(Status.RUNTIME_ERROR, "the client session ended"))
            item.done()

    def close(self) -> None:
        """Lets idle workers end now (busy ones end once their stream has run out of work)."""
        with self._cond:
            self._closed = True
            self._wake.notify_all()

    # internals (the condition held unless said otherwise) ----------------------------------------

    def _stream(self, key: StreamKey) -> _Stream:
        stream = self._streams.get(key)
        if stream is None:
            count = sum(1 for k in self._streams if k[0] == key[0])
            if count >= self.max_streams:
                raise CapacityError(
                    Status.INNER_CREATE_EXECUTOR,
                    f"this caller has work on {count} streams: synchronize some first",
                    "stream",
                )
            stream = self._streams[key] = _Stream()
        return stream

    def _wait_for_room(self, owner: Hashable, deadline: float | None, cancelled: Callable[[], bool]) -> None:
        """Back-pressure, as a device's full launch queue: the caller waits while its queued calls are at
        the cap; past its deadline it is refused as busy, and once gone it is not queued (asked each second)."""
        while self._queued[owner] >= self.max_queued:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CapacityError(
                    Status.INNER_CREATE_EXECUTOR,
                    f"this caller has {self._queued[owner]} calls queued: synchronize, or retry shortly",
                    "stream",
                )
            if cancelled():
                raise CallAbandoned("cancelled", "the call was cancelled while its stream's queue was full: not run")
            self._cond.wait(1.0 if remaining is None else min(remaining, 1.0))

    def _report(self, key: StreamKey, stream: _Stream) -> AclnnError:
        """The stream's failure as its caller sees it, cleared (reported once)."""
        failure, skipped = stream.failure, stream.skipped
        stream.failure, stream.skipped = None, 0
        if not stream.busy and not stream.items and self._streams.get(key) is stream:
            del self._streams[key]
        code = failure.code if isinstance(failure, AclnnError) else Status.RUNTIME_ERROR
        param = failure.param if isinstance(failure, AclnnError) else ""
        message = failure.message if isinstance(failure, AclnnError) else str(failure)
        after = f"; {skipped} calls queued after it were not run" if skipped else ""
        return AclnnError(code, f"a call queued on stream {key[2]} failed: {message}{after}", param)

    def _finish(self, key: StreamKey, stream: _Stream) -> None:
        """An inline call ended: the worker takes what was queued meanwhile, else the stream goes idle."""
        with self._cond:
            if stream.items:
                self._start_worker(key, stream)
                return
            stream.busy = False
            if stream.failure is None and self._streams.get(key) is stream:
                del self._streams[key]
            self._cond.notify_all()

    def _start_worker(self, key: StreamKey, stream: _Stream) -> None:
        """Hands a stream with work to an idle worker, or to a new one when none waits."""
        self._unserved.append((key, stream))
        if self._idle >= len(self._unserved):  # one waiting worker for each stream not yet taken
            self._wake.notify()
        else:
            threading.Thread(target=self._serve, name="aclnn-stream", daemon=True).start()

    def _serve(self) -> None:
        """A worker: drains the streams handed to it, then waits WORKER_IDLE_S for another (not holding
        the condition while a call runs)."""
        while True:
            with self._cond:
                while not self._unserved:
                    if self._closed:
                        return
                    self._idle += 1
                    try:
                        woken = self._wake.wait(WORKER_IDLE_S)
                    finally:
                        self._idle -= 1
                    if not woken and not self._unserved:
                        return
                key, stream = self._unserved.popleft()
            self._drain(key, stream)

    def _tidy_counts(self) -> None:
        for owner in [o for o, n in self._queued.items() if n <= 0]:
            del self._queued[owner]

    def _drain(self, key: StreamKey, stream: _Stream) -> None:
        """The stream's worker: runs its items in order until none is left (not holding the condition)."""
        while True:
            with self._cond:
                if not stream.items:
                    stream.busy = False
                    if stream.failure is None and self._streams.get(key) is stream:
                        del self._streams[key]
                    self._cond.notify_all()
                    return
                item = stream.items.popleft()
                self._queued[key[0]] -= 1
                self._tidy_counts()
                self._cond.notify_all()
                failure = None
                if stream.failure is not None:
                    if item.future is not None:  # the next call made on the stream: it gets the failure
                        failure = self._report(key, stream)
                    else:
                        stream.skipped += 1
                        failure = stream.failure
            try:
                if failure is not None:
                    if item.future is not None:
                        item.future.set_exception(failure)
                    continue
                try:
                    result = item.work()
                except BaseException as exc:
                    if item.future is not None:
                        item.future.set_exception(exc)
                    else:
                        with self._cond:
                            stream.failure = stream.failure or exc
                else:
                    if item.future is not None:
                        item.future.set_result(result)
            finally:
                item.done()
