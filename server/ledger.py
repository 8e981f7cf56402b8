"""One memory ledger: every byte the server holds for callers passes it before it is allocated.

Messages being received, uploads, results kept for a later download, executor data, call
outputs and workspaces are all `Hold`s against one budget, and each identity's holds
against its own share of it, so that no tenant can starve the others. A hold that could
never fit is the caller's error (161002 naming the tensor); one that does not fit now is
`CapacityError` (RESOURCE_EXHAUSTED with a retry hint).
"""

from __future__ import annotations

import collections
import threading

from aclnn_client.errors import Status, invalid_error

from .executors import CapacityError

# Kinds of hold that end by themselves within a call (waiting for them can help); the others
# (uploads, kept results, executor data) end only when their owner frees them or goes away.
TRANSIENT = frozenset({"call", "message", "request"})


class Hold:
    """Bytes reserved in the ledger for one owner, until `release()` (idempotent)."""

    __slots__ = ("kind", "ledger", "nbytes", "owner")

    def __init__(self, ledger: MemoryLedger, owner: str | None, nbytes: int, kind: str) -> None:
        self.ledger, self.owner, self.nbytes, self.kind = ledger, owner, nbytes, kind

    def release(self) -> None:
        self.shrink(0)

    def shrink(self, nbytes: int) -> None:
        """Keeps only `nbytes` of the hold (a workspace freed, a message smaller than reserved)."""
        if nbytes < self.nbytes:
            self.ledger._give_back(self, self.nbytes - nbytes)

    def split(self, nbytes: int, kind: str) -> Hold:
        """Moves `nbytes` of this hold into a new one of another kind (a result kept after its call)."""
        taken = min(nbytes, self.nbytes)
        with self.ledger.condition:
            self.ledger._move(self, -taken)
            part = Hold(self.ledger, self.owner, 0, kind)
            self.ledger._move(part, taken)
        return part

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class MemoryLedger:
    """`budget_bytes` for everyone, at most `tenant_bytes` of it for one identity."""

    def __init__(self, budget_bytes: int, tenant_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.tenant_bytes = min(tenant_bytes or budget_bytes, budget_bytes)
        self.held = 0
        self._by_owner: collections.Counter[str | None] = collections.Counter()
        self._by_kind: collections.Counter[str] = collections.Counter()
        self._transient_by_owner: collections.Counter[str | None] = collections.Counter()
        # Admission waits on this too: a release may let a queued call run.
        self.condition = threading.Condition()

    def reserve(self, owner: str | None, nbytes: int, kind: str, param: str = "") -> Hold:
        """A hold of `nbytes` now, or CapacityError (retry later), or 161002 (never fits)."""
        with self.condition:
            hold = self.try_reserve(owner, nbytes, kind, param)
            if hold is None:
                raise self.refusal(owner, nbytes, param)
            return hold

    def try_reserve(self, owner: str | None, nbytes: int, kind: str, param: str = "") -> Hold | None:
        """A hold if it fits now, else None; 161002 when it could never fit."""
        self.check_possible(nbytes, param)
        with self.condition:
            if not self._fits(owner, nbytes):
                return None
            hold = Hold(self, owner, 0, kind)
            self._move(hold, nbytes)
            return hold

    def check_possible(self, nbytes: int, param: str) -> None:
        """161002 naming `param` when `nbytes` exceed what one identity may ever hold."""
        if nbytes > self.tenant_bytes:
            limit = "memory budget" if self.tenant_bytes == self.budget_bytes else "per-tenant memory share"
            raise invalid_error(
                param or "op", f"cannot hold {nbytes} bytes: more than the server's {limit} of {self.tenant_bytes}"
            )

    def waiting_helps(self, owner: str | None, nbytes: int) -> bool:
        """Whether holds that end by themselves (running calls, messages) stand in the way of `owner`."""
        with self.condition:
            if self._by_owner[owner] + nbytes > self.tenant_bytes:
                return self._transient_by_owner[owner] > 0
            return self._transient_by_owner.total() > 0

    def refusal(self, owner: str | None, nbytes: int, param: str) -> CapacityError:
        with self.condition:
            mine, total = self._by_owner[owner], self.held
        whose = (
            f"this caller holds {mine} of its {self.tenant_bytes}-byte share"
            if mine + nbytes > self.tenant_bytes
            else f"{total} of {self.budget_bytes} bytes are held"
        )
        return CapacityError(
            Status.INNER_CREATE_EXECUTOR,
            f"cannot hold {nbytes} more bytes now: {whose} (free tensors or executors, or retry shortly)",
            param or "op",
        )

    def held_by(self, owner: str | None) -> int:
        with self.condition:
            return self._by_owner[owner]

    def held_by_kind(self) -> dict[str, int]:
        with self.condition:
            return {kind: n for kind, n in self._by_kind.items() if n}

    def _fits(self, owner: str | None, nbytes: int) -> bool:
        return self.held + nbytes <= self.budget_bytes and self._by_owner[owner] + nbytes <= self.tenant_bytes

    def _move(self, hold: Hold, nbytes: int) -> None:
        """Adds `nbytes` (negative: removes) to a hold and the totals; the caller holds the condition."""
        hold.nbytes += nbytes
        self.held += nbytes
        self._by_owner[hold.owner] += nbytes
        self._by_kind[hold.kind] += nbytes
        if hold.kind in TRANSIENT:
            self._transient_by_owner[hold.owner] += nbytes
        for counter in (self._by_owner, self._transient_by_owner):
            if counter.get(hold.owner) == 0:
                del counter[hold.owner]

    def _give_back(self, hold: Hold, nbytes: int) -> None:
        with self.condition:
            self._move(hold, -min(nbytes, hold.nbytes))
            self.condition.notify_all()
