"""The executor store: single-use by default, repeatable on request, bounded, expiring."""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aclnn_common.errors import Status, invalid_error

from .errors import CapacityError
from .registry import Operator, Plan

T = TypeVar("T")


@dataclass
class ExecutorEntry:
    operator: Operator
    plan: Plan
    workspace_size: int
    data: dict[str, Any]  # input storage shipped with GetWorkspaceSize (its bytes' holds follow them)
    created: float
    owner: str | None = None  # the principal that created it; others cannot see it
    session: str | None = None  # the client session it ends with
    repeatable: bool = False
    executed: bool = False
    last_used: float = 0.0


class ExecutorStore:
    """Executors by id. Ids are random 128-bit tokens, so one client cannot guess another's.

    An executor ends when destroyed, when its session ends (the client went away), or
    `ttl_s` after its last use when it has no session; one never executed ends `ttl_s`
    after its creation. Each owner may hold at most `max_per_owner` at once.
    """

    # How many ended executors are remembered to say "already executed" rather than "unknown".
    _TOMBSTONES = 4096

    def __init__(
        self,
        ttl_s: float,
        max_executors: int,
        max_per_owner: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_executors = max_executors
        self.max_per_owner = max_per_owner or max_executors
        self._per_owner: collections.Counter[str | None] = collections.Counter()
        self._clock = clock
        self._entries: dict[str, ExecutorEntry] = {}
        # Expiry without a scan: those never executed in creation order, executed ones without a
        # session in order of last use (each use moves one to the end); the others end with their session.
        self._unexecuted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._sessionless: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._by_session: dict[tuple[str | None, str], set[str]] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def add(
        self,
        operator: Operator,
        plan: Plan,
        workspace_size: int,
        data: dict[str, Any],
        owner: str | None = None,
        session: str | None = None,
    ) -> str:
        with self._lock:
            self._expire()
            for count, limit, whose in (
                (len(self._entries), self.max_executors, "live"),
                (self._per_owner[owner], self.max_per_owner, "live for this caller"),
            ):
                if count >= limit:
                    raise CapacityError(
                        Status.INNER_CREATE_EXECUTOR,
                        f"executor limit reached ({limit} {whose}): execute or destroy executors, or use Run",
                        "executor",
                    )
            executor_id = secrets.token_hex(16)
            now = self._clock()
            self._entries[executor_id] = ExecutorEntry(
                operator, plan, workspace_size, data, now, owner, session, last_used=now
            )
            self._per_owner[owner] += 1
            self._unexecuted[executor_id] = None
            if session:
                self._by_session.setdefault((owner, session), set()).add(executor_id)
            return executor_id

    def end_session(self, owner: str | None, session: str) -> None:
        """Ends every executor of an identity's session that ended (closed, or its lease lapsed)."""
        with self._lock:
            for executor_id in list(self._by_session.get((owner, session), ())):
                self._end(executor_id, "ended with its client session (the client went away)")

    def get(self, executor_id: str, owner: str | None = None) -> ExecutorEntry:
        with self._lock:
            return self._live(executor_id, owner)

    def begin_execute(
        self, executor_id: str, bind: Callable[[ExecutorEntry], T], owner: str | None = None
    ) -> tuple[ExecutorEntry, T]:
        """The entry to run and `bind(entry)`; a single-use executor leaves the store only if bind succeeds."""
        with self._lock:
            entry = self._live(executor_id, owner)
            bound = bind(entry)
            if not entry.repeatable:
                self._end(executor_id, "was already executed (executors are single-use unless made repeatable)")
            else:
                self._unexecuted.pop(executor_id, None)
                if not entry.session:
                    self._sessionless[executor_id] = None
                    self._sessionless.move_to_end(executor_id)
            entry.executed = True
            entry.last_used = self._clock()
            return entry, bound

    def set_repeatable(self, executor_id: str, owner: str | None = None) -> None:
        with self._lock:
            entry = self._live(executor_id, owner)
            if entry.executed:
                raise invalid_error("executor", "can only be made repeatable before its first execute")
            entry.repeatable = True

    def destroy(self, executor_id: str, owner: str | None = None) -> None:
        with self._lock:
            self._live(executor_id, owner)
            self._end(executor_id, "was destroyed")

    def _live(self, executor_id: str, owner: str | None) -> ExecutorEntry:
        self._expire()
        entry = self._entries.get(executor_id)
        if entry is not None and entry.owner is not None and entry.owner != owner:
            entry = None  # another client's executor: indistinguishable from an unknown one
        if entry is None:
            why = self._ended.get(executor_id, "is unknown")
            raise invalid_error("executor", f"executor {executor_id[:8]}... {why}")
        return entry

    def _end(self, executor_id: str, why: str) -> None:
        entry = self._entries.pop(executor_id)
        self._per_owner[entry.owner] -= 1
        if not self._per_owner[entry.owner]:
            del self._per_owner[entry.owner]
        self._unexecuted.pop(executor_id, None)
        self._sessionless.pop(executor_id, None)
        if entry.session:
            key = (entry.owner, entry.session)
            self._by_session[key].discard(executor_id)
            if not self._by_session[key]:
                del self._by_session[key]
        self._ended[executor_id] = why
        while len(self._ended) > self._TOMBSTONES:
            self._ended.popitem(last=False)

    def _expire(self) -> None:
        """Executors never executed expire ttl_s after creation; executed ones without a session
        (nothing else would end them) ttl_s after their last use. Only the expired are looked at."""
        deadline = self._clock() - self.ttl_s
        for queue, when, why in (
            (self._unexecuted, "created", f"expired (never executed within {self.ttl_s:g} s)"),
            (self._sessionless, "last_used", f"expired (unused for {self.ttl_s:g} s, and it belongs to no session)"),
        ):
            while queue:
                executor_id = next(iter(queue))
                if getattr(self._entries[executor_id], when) >= deadline:
                    break
                self._end(executor_id, why)
