"""The executor store: single-use by default, repeatable on request, bounded, expiring."""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aclnn_client.errors import AclnnError, Status, invalid_error

from .registry import Operator, Plan

T = TypeVar("T")


class CapacityError(AclnnError):
    """The server cannot take more work of this kind now; retrying later may succeed."""


@dataclass
class ExecutorEntry:
    operator: Operator
    plan: Plan
    workspace_size: int
    data: dict[str, Any]  # input storage shipped with GetWorkspaceSize
    created: float
    owner: str | None = None  # the principal that created it; others cannot see it
    repeatable: bool = False
    executed: bool = False


class ExecutorStore:
    """Executors by id. Ids are random 128-bit tokens, so one client cannot guess another's."""

    # How many ended executors are remembered to say "already executed" rather than "unknown".
    _TOMBSTONES = 4096

    def __init__(self, ttl_s: float, max_executors: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_executors = max_executors
        self._clock = clock
        self._entries: dict[str, ExecutorEntry] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def add(
        self, operator: Operator, plan: Plan, workspace_size: int, data: dict[str, Any], owner: str | None = None
    ) -> str:
        with self._lock:
            self._expire()
            if len(self._entries) >= self.max_executors:
                raise CapacityError(
                    Status.INNER_CREATE_EXECUTOR,
                    f"executor limit reached ({self.max_executors} live): execute or destroy executors, or use Run",
                    "executor",
                )
            executor_id = secrets.token_hex(16)
            self._entries[executor_id] = ExecutorEntry(operator, plan, workspace_size, data, self._clock(), owner)
            return executor_id

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
            entry.executed = True
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
        del self._entries[executor_id]
        self._ended[executor_id] = why
        while len(self._ended) > self._TOMBSTONES:
            self._ended.popitem(last=False)

    def _expire(self) -> None:
        """Executors never executed expire ttl_s after creation."""
        deadline = self._clock() - self.ttl_s
        for executor_id in [i for i, e in self._entries.items() if not e.executed and e.created < deadline]:
            self._end(executor_id, f"expired (never executed within {self.ttl_s:g} s)")
