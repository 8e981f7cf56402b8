"""Admission control: bounded concurrency, a bounded wait queue, a memory budget, deadlines."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from aclnn_client.errors import Status

from .executors import CapacityError


class CallAbandoned(Exception):
    """The caller's deadline passed, or it cancelled, before the work ran: it is not run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "deadline" or "cancelled"


class Admission:
    """At most `max_concurrency` executions at once, holding at most `memory_budget` bytes
    between them; up to `max_queue` more wait their turn, the rest are refused at once."""

    # How often a waiting call looks at its caller's cancellation.
    _POLL_S = 0.05

    def __init__(self, max_concurrency: int, max_queue: int, memory_budget: int) -> None:
        self.max_concurrency, self.max_queue, self.memory_budget = max_concurrency, max_queue, memory_budget
        self.running = self.waiting = self.bytes_held = 0
        self._cond = threading.Condition()

    def _fits(self, nbytes: int) -> bool:
        # A call alone may use the whole budget: the engine already refused calls larger than it.
        return self.running < self.max_concurrency and (
            self.running == 0 or self.bytes_held + nbytes <= self.memory_budget
        )

    @contextlib.contextmanager
    def slot(
        self, nbytes: int, deadline: float | None = None, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[float]:
        """Holds an execution slot for the block; yields the seconds spent waiting for it."""
        started = time.monotonic()
        with self._cond:
            if not self._fits(nbytes):
                if self.waiting >= self.max_queue:
                    raise CapacityError(
                        Status.INNER_CREATE_EXECUTOR,
                        f"server busy: {self.running} running, {self.waiting} queued (max {self.max_queue}); "
                        "retry shortly",
                        "op",
                    )
                self.waiting += 1
                try:
                    while not self._fits(nbytes):
                        self._check_alive(deadline, cancelled)
                        remaining = self._POLL_S if deadline is None else min(self._POLL_S, deadline - time.monotonic())
                        self._cond.wait(max(remaining, 0.0))
                finally:
                    self.waiting -= 1
            self._check_alive(deadline, cancelled)
            self.running += 1
            self.bytes_held += nbytes
        try:
            yield time.monotonic() - started
        finally:
            with self._cond:
                self.running -= 1
                self.bytes_held -= nbytes
                self._cond.notify_all()

    @staticmethod
    def _check_alive(deadline: float | None, cancelled: Callable[[], bool]) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise CallAbandoned("deadline", "the call's deadline passed before it could run; it was not run")
        if cancelled():
            raise CallAbandoned("cancelled", "the call was cancelled before it ran; it was not run")
