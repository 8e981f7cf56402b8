"""Admission control: bounded concurrency, one call at a time per stream, memory from the ledger
taken as one unit, a bounded wait queue served fairly across identities, deadlines and cancellation."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from aclnn_common.errors import Status

from .errors import CapacityError
from .ledger import Hold, MemoryLedger, Parts


class CallAbandoned(Exception):
    """The caller's deadline passed, or it cancelled, before the work ran: it is not run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "deadline" or "cancelled"


class _Waiter:
    """A call in the queue: what it needs, and what it was given (its holds, or a refusal)."""

    __slots__ = ("condition", "error", "held", "holds", "needs_slot", "owner", "parts", "stream")

    def __init__(
        self, owner: str | None, parts: Parts, stream: Hashable | None, held: int, needs_slot: bool, lock: Any
    ) -> None:
        self.owner, self.parts, self.stream, self.held, self.needs_slot = owner, parts, stream, held, needs_slot
        self.holds: dict[str, Hold] | None = None
        self.error: CapacityError | None = None
        self.condition = threading.Condition(lock)


class Admission:
    """At most `max_concurrency` executions at once, each holding its memory (all its parts, or
    none of them), and never two of one stream at once; up to `max_queue` more wait their turn
    (at most `max_queue_per_identity` of one identity), the rest are refused at once.

    A freed slot or freed memory goes to the identities in turn (round robin), so a tenant with
    many queued calls delays another's by at most one call each. Within an identity calls go in
    arrival order; one whose stream is busy lets the next pass, one that waits for memory does
    not, so a large call is never starved by small ones. A call that waits for memory that no
    running call will free is refused at once when it is its identity's only call here — unless
    later calls of its own identity, waiting too, hold memory it needs (their requests): then the
    latest of those is refused instead, so the oldest always goes ahead and calls of one identity
    cannot livelock each other. With other calls of its identity here it waits (their clients
    free what they kept once they end), up to its deadline or MAX_WAIT_S.
    """

    # How often a waiting call looks at its caller's cancellation.
    _POLL_S = 0.05
    # A call without a deadline waits this long at most for memory or a slot, then is refused.
    MAX_WAIT_S = 60.0

    def __init__(
        self, max_concurrency: int, max_queue: int, ledger: MemoryLedger, max_queue_per_identity: int | None = None
    ) -> None:
        self.max_concurrency, self.max_queue, self.ledger = max_concurrency, max_queue, ledger
        self.max_queue_per_identity = max_queue_per_identity or max(1, max_queue // 2)
        self.running = self.waiting = 0
        self._busy_streams: set[Hashable] = set()
        self._running_by_owner: collections.Counter[str | None] = collections.Counter()
        self._queues: dict[str | None, collections.deque[_Waiter]] = {}
        self._turns: collections.deque[str | None] = collections.deque()  # identities with waiting calls, in turn
        self._lock = ledger.condition  # memory given back to the ledger lets a queued call go (_dispatch)
        ledger.on_release = self._dispatch

    @contextlib.contextmanager
    def slot(
        self,
        parts: Parts,
        owner: str | None = None,
        stream: Hashable | None = None,
        deadline: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        held: int = 0,
    ) -> Iterator[tuple[float, dict[str, Hold]]]:
        """Holds an execution slot and memory of `parts` for the block; yields (seconds waited, the holds
        by kind). `held`: bytes the call holds already (its request), which a queued call of the same
        identity may need."""
        started = time.monotonic()
        with self._lock:
            _check_alive(deadline, cancelled, liveness_due=float("inf"))  # the deadline only
            holds = self._start_now(owner, parts, stream, needs_slot=True)
            if holds is None:
                waiter = _Waiter(owner, parts, stream, held, True, self._lock)
                holds = self._wait(waiter, deadline, started, cancelled)
        try:
            yield time.monotonic() - started, holds
        finally:
            self.finish(owner, stream)

    def try_start(self, owner: str | None, stream: Hashable | None, deadline: float | None) -> bool:
        """`slot`'s common case for a call that holds no memory, without its holds and context
        manager (a small call's fast lane): the slot, taken when one is free, nobody waits and the
        deadline has not passed; False when the call must go through `slot`. `finish` ends it."""
        if deadline is not None and time.monotonic() >= deadline:
            return False
        with self._lock:
            return self._start_now(owner, {}, stream, needs_slot=True) is not None

    def finish(self, owner: str | None, stream: Hashable | None) -> None:
        """Ends a slot `try_start` gave."""
        with self._lock:
            self._finished(owner, stream)

    def would_start(self, stream: Hashable | None) -> bool:
        """Whether a call on `stream` would take a slot at once now (nobody waits, a slot is free): a hint."""
        with self._lock:
            return not self._queues and self._slot_free(stream)

    def hold(
        self,
        parts: Parts,
        owner: str | None = None,
        deadline: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> dict[str, Hold]:
        """Memory of `parts` as one unit, in turn with waiting calls but without a slot (a call's
        reservation, taken before its bytes are sent); the caller releases the holds."""
        started = time.monotonic()
        with self._lock:
            _check_alive(deadline, cancelled, liveness_due=float("inf"))
            holds = self._start_now(owner, parts, None, needs_slot=False)
            if holds is None:
                holds = self._wait(_Waiter(owner, parts, None, 0, False, self._lock), deadline, started, cancelled)
        return holds

    def _finished(self, owner: str | None, stream: Hashable | None) -> None:
        self.running -= 1
        self._running_by_owner[owner] -= 1
        if not self._running_by_owner[owner]:
            del self._running_by_owner[owner]
        self._busy_streams.discard(stream)
        self._dispatch()

    def _start_now(
        self, owner: str | None, parts: Parts, stream: Hashable | None, needs_slot: bool
    ) -> dict[str, Hold] | None:
        """The holds of a call that may start at once (nobody waits before it, a slot and its memory are free)."""
        if self._queues or (needs_slot and not self._slot_free(stream)):
            return None
        holds = self._reserve(owner, parts)
        if holds is not None and needs_slot:
            self._started(owner, stream)
        return holds

    def _slot_free(self, stream: Hashable | None) -> bool:
        return self.running < self.max_concurrency and (stream is None or stream not in self._busy_streams)

    def _reserve(self, owner: str | None, parts: Parts) -> dict[str, Hold] | None:
        if not any(parts.values()):  # nothing to hold: the ledger is not involved
            return {kind: Hold(self.ledger, owner, 0, kind) for kind in parts}
        return self.ledger.try_reserve_parts(owner, parts)

    def _started(self, owner: str | None, stream: Hashable | None) -> None:
        self.running += 1
        self._running_by_owner[owner] += 1
        if stream is not None:
            self._busy_streams.add(stream)

    def _wait(
        self, waiter: _Waiter, deadline: float | None, started: float, cancelled: Callable[[], bool]
    ) -> dict[str, Hold]:
        """Queued until `_dispatch` gives the call its slot and memory, or refuses it; the lock is held.

        The deadline is looked at on every wake-up, the caller's liveness once per poll interval
        (and before the call starts, when one has passed): asking a transport whether its peer is
        gone costs a system call, made with the lock held.
        """
        queue = self._queues.get(waiter.owner)
        if self.waiting >= self.max_queue or (queue is not None and len(queue) >= self.max_queue_per_identity):
            raise self._busy(queue is not None and len(queue) >= self.max_queue_per_identity)
        if queue is None:
            queue = self._queues[waiter.owner] = collections.deque()
            self._turns.append(waiter.owner)
        queue.append(waiter)
        self.waiting += 1
        give_up = min(deadline if deadline is not None else float("inf"), started + self.MAX_WAIT_S)
        liveness_due = time.monotonic() + self._POLL_S
        try:
            self._dispatch()
            while waiter.holds is None:
                if waiter.error is not None:
                    raise waiter.error
                liveness_due = _check_alive(deadline, cancelled, liveness_due)
                now = time.monotonic()
                if now >= give_up:
                    raise self._busy(False)
                waiter.condition.wait(max(min(self._POLL_S, give_up - now), 0.0))
        except BaseException:
            if waiter.holds is not None:  # given its turn as it gave up
                self._give_back(waiter)
            else:
                self._leave(waiter)
                self._dispatch()
            raise
        try:
            _check_alive(deadline, cancelled, liveness_due)  # the wait may have outlived the caller
        except CallAbandoned:
            self._give_back(waiter)
            raise
        return waiter.holds

    def _give_back(self, waiter: _Waiter) -> None:
        """What a call was given as it gave up waiting."""
        for hold in waiter.holds.values():
            hold.release()
        if waiter.needs_slot:
            self._finished(waiter.owner, waiter.stream)

    def _leave(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.owner)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        self.waiting -= 1
        if not queue:
            del self._queues[waiter.owner]
            self._turns.remove(waiter.owner)

    def _dispatch(self) -> None:
        """Gives free slots and memory to waiting calls, one identity after another; the lock is held."""
        progress = True
        while progress and self._turns:
            progress = False
            for _ in range(len(self._turns)):
                if not self._turns:
                    return
                owner = self._turns[0]
                self._turns.rotate(-1)  # the next turn is the next identity's
                waiter = self._next_of(owner)
                if waiter is not None:
                    self._leave(waiter)
                    if waiter.needs_slot:
                        self._started(owner, waiter.stream)
                    waiter.condition.notify()
                    progress = True
                    break

    def _next_of(self, owner: str | None) -> _Waiter | None:
        """The identity's first call in arrival order that can have a slot (if it needs one) and its
        stream, given its memory; None when none can go now. A call whose memory is not free stops
        the identity's later calls that need memory too (those that need none, a reserved call among
        them, may pass: they take nothing it waits for)."""
        blocked = False
        for waiter in self._queues.get(owner, ()):
            if (waiter.needs_slot and not self._slot_free(waiter.stream)) or (blocked and any(waiter.parts.values())):
                continue
            waiter.holds = self._reserve(owner, waiter.parts)
            if waiter.holds is not None:
                return waiter
            if not self.ledger.waiting_helps(owner, waiter.parts):  # no running call will free it
                latest = self._latest_holding(self._queues[owner], waiter)
                if latest is not None or self._alone(owner):
                    self._refuse(latest or waiter)
                    return None
            blocked = True
        return None

    def _alone(self, owner: str | None) -> bool:
        """Whether an identity has one call here, queued, and none running: nothing of its own that
        ends by itself (and whose client may then free tensors) could make room for it."""
        return len(self._queues[owner]) == 1 and not self._running_by_owner.get(owner)

    @staticmethod
    def _latest_holding(queue: collections.deque[_Waiter], first: _Waiter) -> _Waiter | None:
        """The latest call after `first` in its identity's queue that holds memory already (its request)."""
        for waiter in reversed(queue):
            if waiter is first:
                return None
            if waiter.held:
                return waiter
        return None

    def _refuse(self, waiter: _Waiter) -> None:
        waiter.error = self.ledger.refusal(waiter.owner, waiter.parts, "op")
        self._leave(waiter)
        waiter.condition.notify()

    def _busy(self, own_share: bool) -> CapacityError:
        if own_share:
            message = f"this caller has {self.max_queue_per_identity} calls queued, its share of the queue"
        else:
            message = f"server busy: {self.running} running, {self.waiting} queued (max {self.max_queue})"
        return CapacityError(Status.INNER_CREATE_EXECUTOR, message + "; retry shortly", "op")


def _check_alive(deadline: float | None, cancelled: Callable[[], bool], liveness_due: float) -> float:
    """CallAbandoned past the deadline, or once the caller is gone (asked only when `liveness_due`
    has come); returns when its liveness is due next."""
    now = time.monotonic()
    if deadline is not None and now >= deadline:
        raise _abandoned("deadline")
    if now < liveness_due:
        return liveness_due
    if cancelled():
        raise _abandoned("cancelled")
    return now + Admission._POLL_S


def _abandoned(reason: str) -> CallAbandoned:
    if reason == "deadline":
        return CallAbandoned(reason, "the call's deadline passed before it could run; it was not run")
    return CallAbandoned(reason, "the call was cancelled before it ran; it was not run")
