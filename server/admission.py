"""Admission control: bounded concurrency, one call at a time per stream, memory from the ledger,
a bounded wait queue, deadlines and cancellation."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator

from aclnn_common.errors import Status

from .errors import CapacityError
from .ledger import RUNNING, Hold, MemoryLedger


class CallAbandoned(Exception):
    """The caller's deadline passed, or it cancelled, before the work ran: it is not run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "deadline" or "cancelled"


class Admission:
    """At most `max_concurrency` executions at once, each holding its bytes in the ledger, and
    never two of one stream at once; up to `max_queue` more wait their turn (for a slot, their
    stream or memory), the rest are refused at once."""

    # How often a waiting call looks at its caller's cancellation.
    _POLL_S = 0.05
    # A call without a deadline waits this long at most for memory or a slot, then is refused.
    MAX_WAIT_S = 60.0

    def __init__(self, max_concurrency: int, max_queue: int, ledger: MemoryLedger) -> None:
        self.max_concurrency, self.max_queue, self.ledger = max_concurrency, max_queue, ledger
        self.running = self.waiting = 0
        self._busy_streams: set[Hashable] = set()
        self._cond = ledger.condition  # a release in the ledger wakes waiting calls

    def _slot_free(self, stream: Hashable | None) -> bool:
        return self.running < self.max_concurrency and (stream is None or stream not in self._busy_streams)

    def _try_start(self, owner: str | None, nbytes: int, stream: Hashable | None) -> Hold | None:
        if not self._slot_free(stream):
            return None
        if not nbytes:
            return Hold(self.ledger, owner, 0, RUNNING)  # nothing to hold: the ledger is not involved
        return self.ledger.try_reserve(owner, nbytes, RUNNING)

    @contextlib.contextmanager
    def slot(
        self,
        nbytes: int,
        owner: str | None = None,
        stream: Hashable | None = None,
        deadline: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[tuple[float, Hold]]:
        """Holds an execution slot and `nbytes` of memory for the block; yields (seconds waited, the hold)."""
        started = time.monotonic()
        give_up = min(deadline if deadline is not None else float("inf"), started + self.MAX_WAIT_S)
        with self._cond:
            self._check_alive(deadline, cancelled, liveness_due=float("inf"))  # the deadline only
            hold = self._try_start(owner, nbytes, stream)
            if hold is None:
                hold = self._wait_for_start(owner, nbytes, stream, deadline, give_up, cancelled)
            self.running += 1
            if stream is not None:
                self._busy_streams.add(stream)
        try:
            yield time.monotonic() - started, hold
        finally:
            with self._cond:
                self.running -= 1
                self._busy_streams.discard(stream)
                self._cond.notify_all()

    def _wait_for_start(
        self,
        owner: str | None,
        nbytes: int,
        stream: Hashable | None,
        deadline: float | None,
        give_up: float,
        cancelled: Callable[[], bool],
    ) -> Hold:
        """Queued until a slot (and the stream's turn, and the memory) is free; the condition is held.

        The deadline is looked at on every wake-up, the caller's liveness once per poll interval
        (and before the call starts, when one has passed): under load every finished call wakes
        the queue, and asking a transport whether its peer is gone costs a system call, made
        with the lock held.
        """
        if self.waiting >= self.max_queue:
            raise self._busy()
        self.waiting += 1
        liveness_due = time.monotonic() + self._POLL_S
        try:
            while True:
                liveness_due = self._check_alive(deadline, cancelled, liveness_due)
                for_memory = self._slot_free(stream)  # else it waits for a slot or its stream's turn
                if for_memory and not self.ledger.waiting_helps(owner, nbytes):
                    raise self.ledger.refusal(owner, nbytes, "call", "op")  # no running call will free it
                now = time.monotonic()
                if now >= give_up:
                    raise self._busy()
                self.ledger.memory_waiters += for_memory
                try:
                    self._cond.wait(max(min(self._POLL_S, give_up - now), 0.0))
                finally:
                    self.ledger.memory_waiters -= for_memory
                hold = self._try_start(owner, nbytes, stream)
                if hold is not None:
                    try:
                        self._check_alive(deadline, cancelled, liveness_due)  # the wait may have outlived the caller
                    except CallAbandoned:
                        hold.release()
                        raise
                    return hold
        finally:
            self.waiting -= 1

    def _busy(self) -> CapacityError:
        return CapacityError(
            Status.INNER_CREATE_EXECUTOR,
            f"server busy: {self.running} running, {self.waiting} queued (max {self.max_queue}); retry shortly",
            "op",
        )

    def _check_alive(self, deadline: float | None, cancelled: Callable[[], bool], liveness_due: float) -> float:
        """CallAbandoned past the deadline, or once the caller is gone (asked only when `liveness_due`
        has come); returns when its liveness is due next."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise self._abandoned("deadline")
        if now < liveness_due:
            return liveness_due
        if cancelled():
            raise self._abandoned("cancelled")
        return now + self._POLL_S

    @staticmethod
    def _abandoned(reason: str) -> CallAbandoned:
        if reason == "deadline":
            return CallAbandoned(reason, "the call's deadline passed before it could run; it was not run")
        return CallAbandoned(reason, "the call was cancelled before it ran; it was not run")
