"""One memory ledger: every byte the server holds for callers passes it before it is allocated.

Messages being received, uploads, results kept for a later download, executor data, call
outputs and workspaces are all `Hold`s against one budget, and each identity's holds
against its own share of it, so that no tenant can starve the others. A hold that could
never fit is the caller's error (161002 naming the tensor); one that does not fit now is
`CapacityError` (RESOURCE_EXHAUSTED with a retry hint).
"""

from __future__ import annotations

import threading

from aclnn_common.errors import Status, invalid_error

from .errors import CapacityError

# Running calls' holds end by themselves (waiting for them can help); the others (messages
# of calls that wait too, uploads, kept results, executor data) end only with their call, or
# when their owner frees them or goes away.
RUNNING = "call"
# Tensors kept between calls.
STORED = frozenset({"upload", "result", "executor", "region", "buffer"})
# Small allocations are not held, so that a small call never takes the ledger's lock, which every
# other call contends for. A received message or a call's outputs up to SMALL_HOLD_BYTES: at most
# one per call in flight or connection. A workspace up to SMALL_WORKSPACE_BYTES: only running calls
# have one, at most --max-concurrency of them.
SMALL_HOLD_BYTES = 64 << 10
SMALL_WORKSPACE_BYTES = 1 << 20


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
    """`budget_bytes` for everyone, at most `tenant_bytes` of it for one identity.

    Stored tensors (uploads, kept results, executor data) may take at most three quarters of
    either, so that calls always have room to run: a call whose inputs were uploaded first
    could otherwise wait forever for memory that other calls' uploads hold.
    """

    def __init__(self, budget_bytes: int, tenant_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.tenant_bytes = min(tenant_bytes or budget_bytes, budget_bytes)
        self.held = 0
        # Plain dicts, not Counters: these are updated several times per call (Counter's methods are Python).
        self._by_owner: dict[str | None, int] = {}
        self._by_kind: dict[str, int] = {}
        self._stored_by_owner: dict[str | None, int] = {}
        self._running_by_owner: dict[str | None, int] = {}
        # Admission waits on this too: a release may let a queued call run. Only calls waiting for
        # memory (counted here) are woken by a release; a freed slot wakes the others.
        self.condition = threading.Condition()
        self.memory_waiters = 0

    def reserve(self, owner: str | None, nbytes: int, kind: str, param: str = "") -> Hold:
        """A hold of `nbytes` now, or CapacityError (retry later), or 161002 (never fits)."""
        with self.condition:
            hold = self.try_reserve(owner, nbytes, kind, param)
            if hold is None:
                raise self.refusal(owner, nbytes, kind, param)
            return hold

    def try_reserve(self, owner: str | None, nbytes: int, kind: str, param: str = "") -> Hold | None:
        """A hold if it fits now, else None; 161002 when it could never fit."""
        self.check_possible(nbytes, param, kind)
        with self.condition:
            if self._blocker(owner, nbytes, kind) is not None:
                return None
            hold = Hold(self, owner, 0, kind)
            self._move(hold, nbytes)
            return hold

    def check_possible(self, nbytes: int, param: str, kind: str = RUNNING) -> None:
        """161002 naming `param` when `nbytes` exceed what one identity may ever hold (of this kind)."""
        limit = self._limits(kind)[1]
        if nbytes > limit:
            scope = "memory share per tenant" if self.tenant_bytes < self.budget_bytes else "memory budget"
            scope += " for stored tensors" if kind in STORED else ""
            raise invalid_error(param or "op", f"cannot hold {nbytes} bytes: more than the server's {scope} ({limit})")

    def waiting_helps(self, owner: str | None, nbytes: int) -> bool:
        """Whether running calls, which end by themselves, hold memory that `owner` waits for."""
        with self.condition:
            if self._blocker(owner, nbytes, RUNNING) == "share":
                return self._running_by_owner.get(owner, 0) > 0
            return bool(self._running_by_owner)

    def refusal(self, owner: str | None, nbytes: int, kind: str, param: str) -> CapacityError:
        with self.condition:
            blocker = self._blocker(owner, nbytes, kind) or "budget"
            mine = (self._stored_by_owner if blocker == "stored share" else self._by_owner).get(owner, 0)
            total = self.held if blocker == "budget" else self._stored_total()
        budget, share = self._limits(kind)
        whose = {
            "share": f"this caller holds {mine} of its {share}-byte share",
            "stored share": f"this caller's stored tensors hold {mine} of the {share} bytes they may",
            "budget": f"{total} of {budget} bytes are held",
            "stored": f"stored tensors hold {total} of the {budget} bytes they may",
        }[blocker]
        return CapacityError(
            Status.INNER_CREATE_EXECUTOR,
            f"cannot hold {nbytes} more bytes now: {whose} (free tensors or executors, or retry shortly)",
            param or "op",
        )

    def held_by(self, owner: str | None) -> int:
        with self.condition:
            return self._by_owner.get(owner, 0)

    def held_by_kind(self) -> dict[str, int]:
        with self.condition:
            return {kind: n for kind, n in self._by_kind.items() if n}

    def _limits(self, kind: str) -> tuple[int, int]:
        """(budget, tenant share) for holds of this kind."""
        if kind in STORED:
            return self.budget_bytes * 3 // 4, self.tenant_bytes * 3 // 4
        return self.budget_bytes, self.tenant_bytes

    def _stored_total(self) -> int:
        return sum(self._by_kind.get(kind, 0) for kind in STORED)

    def _blocker(self, owner: str | None, nbytes: int, kind: str) -> str | None:
        """What stops a hold of `nbytes` now: "budget", "share", "stored", "stored share", or None."""
        if self.held + nbytes > self.budget_bytes:
            return "budget"
        if self._by_owner.get(owner, 0) + nbytes > self.tenant_bytes:
            return "share"
        if kind in STORED:
            budget, share = self._limits(kind)
            if self._stored_total() + nbytes > budget:
                return "stored"
            if self._stored_by_owner.get(owner, 0) + nbytes > share:
                return "stored share"
        return None

    def _move(self, hold: Hold, nbytes: int) -> None:
        """Adds `nbytes` (negative: removes) to a hold and the totals; the caller holds the condition."""
        hold.nbytes += nbytes
        self.held += nbytes
        self._by_kind[hold.kind] = self._by_kind.get(hold.kind, 0) + nbytes
        owner = hold.owner
        counters = [self._by_owner]
        if hold.kind == RUNNING:
            counters.append(self._running_by_owner)
        elif hold.kind in STORED:
            counters.append(self._stored_by_owner)
        for counter in counters:
            left = counter.get(owner, 0) + nbytes
            if left:
                counter[owner] = left
            else:
                counter.pop(owner, None)  # no identity lingers in the ledger once it holds nothing

    def _give_back(self, hold: Hold, nbytes: int) -> None:
        with self.condition:
            self._move(hold, -min(nbytes, hold.nbytes))
            if self.memory_waiters:
                self.condition.notify_all()
