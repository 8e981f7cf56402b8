"""One memory ledger: every byte the server holds for callers passes it before it is allocated.

Messages being received, uploads, results kept for a later download, executor data, call
outputs and workspaces are all `Hold`s against one budget, and each identity's holds
against its own share of it, so that no tenant can starve the others. A hold on memory that
others may view (an upload an executor reads, a mapped region, a kept result) follows that
memory: it ends when the last reference to it does, not when its owner lets go of its name. A hold that could
never fit is the caller's error (161002 naming the tensor); one that does not fit now is
`CapacityError` (RESOURCE_EXHAUSTED with a retry hint).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping

from aclnn_common.errors import Status, invalid_error

from .errors import CapacityError

# Running calls' holds end by themselves (waiting for them can help); the others (messages
# of calls that wait too, uploads, kept results, executor data) end only with their call, or
# when their owner frees them or goes away.
RUNNING = "call"
# Tensors kept between calls, and the mailboxes mapped for a connection's calls.
STORED = frozenset({"upload", "result", "executor", "region", "buffer", "mailbox"})
# Small allocations are not held, so that a small call never takes the ledger's lock, which every
# other call contends for. A received message or a call's outputs up to SMALL_HOLD_BYTES: at most
# one per call in flight or connection. A workspace up to SMALL_WORKSPACE_BYTES: only running calls
# have one, at most --max-concurrency of them.
SMALL_HOLD_BYTES = 64 << 10
Parts = Mapping[str, int]  # bytes by kind, held together
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

    def follow(self, memory: object) -> None:
        """Ends the hold when `memory` (the object owning the bytes: an array, a mapping) is garbage,
        that is once the last view of it is gone, whoever keeps one (an executor, a reply in transit)."""
        weakref.finalize(memory, self.release)

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
        # Admission's lock too: memory given back may let a queued call run (on_release, the lock held).
        self.condition = threading.Condition(threading.RLock())
        self.on_release: Callable[[], None] = lambda: None

    def reserve(self, owner: str | None, nbytes: int, kind: str, param: str = "") -> Hold:
        """A hold of `nbytes` now, or CapacityError (retry later), or 161002 (never fits)."""
        return self.reserve_parts(owner, {kind: nbytes}, param)[kind]

    def try_reserve(self, owner: str | None, nbytes: int, kind: str, param: str = "") -> Hold | None:
        """A hold if it fits now, else None; 161002 when it could never fit."""
        holds = self.try_reserve_parts(owner, {kind: nbytes}, param)
        return None if holds is None else holds[kind]

    def reserve_parts(self, owner: str | None, parts: Parts, param: str = "") -> dict[str, Hold]:
        """Holds of several kinds taken as one (all or none): now, or CapacityError, or 161002."""
        with self.condition:
            holds = self.try_reserve_parts(owner, parts, param)
            if holds is None:
                raise self.refusal(owner, parts, param)
            return holds

    def try_reserve_parts(self, owner: str | None, parts: Parts, param: str = "") -> dict[str, Hold] | None:
        """Holds of several kinds taken as one, if all fit now; else None; 161002 when they never could."""
        self.check_possible(parts, param)
        with self.condition:
            if self._blocker(owner, parts) is not None:
                return None
            holds = {}
            for kind, nbytes in parts.items():
                holds[kind] = Hold(self, owner, 0, kind)
                self._move(holds[kind], nbytes)
            return holds

    def check_possible(self, parts: Parts, param: str) -> None:
        """161002 naming `param` when `parts` exceed what one identity may ever hold (or hold stored)."""
        stored = sum(n for kind, n in parts.items() if kind in STORED)
        for nbytes, kind in ((sum(parts.values()), RUNNING), (stored, next(iter(STORED)))):
            limit = self._limits(kind)[1]
            if nbytes > limit:
                scope = "memory share per tenant" if self.tenant_bytes < self.budget_bytes else "memory budget"
                scope += " for stored tensors" if kind in STORED else ""
                message = f"cannot hold {nbytes} bytes: more than the server's {scope} ({limit})"
                raise invalid_error(param or "op", message)

    def waiting_helps(self, owner: str | None, parts: Parts) -> bool:
        """Whether calls in flight (running, or reserved), which end by themselves, hold memory that
        `owner` waits for: its own when its share is what is full."""
        with self.condition:
            if self._blocker(owner, parts) in ("share", "stored share"):
                return self._running_by_owner.get(owner, 0) > 0
            return bool(self._running_by_owner)

    def refusal(self, owner: str | None, parts: Parts, param: str) -> CapacityError:
        nbytes = sum(parts.values())
        kind = next((k for k in parts if k in STORED), RUNNING)
        with self.condition:
            blocker = self._blocker(owner, parts) or "budget"
            mine = (self._stored_by_owner if blocker == "stored share" else self._by_owner).get(owner, 0)
            total = self.held if blocker == "budget" else self._stored_total()
        budget, share = self._limits(kind if blocker.startswith("stored") else RUNNING)
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

    def _blocker(self, owner: str | None, parts: Parts) -> str | None:
        """What stops holds of `parts` now: "budget", "share", "stored", "stored share", or None."""
        nbytes = sum(parts.values())
        if self.held + nbytes > self.budget_bytes:
            return "budget"
        if self._by_owner.get(owner, 0) + nbytes > self.tenant_bytes:
            return "share"
        stored = sum(n for kind, n in parts.items() if kind in STORED)
        if stored:
            budget, share = self._limits(next(iter(STORED)))
            if self._stored_total() + stored > budget:
                return "stored"
            if self._stored_by_owner.get(owner, 0) + stored > share:
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
            self.on_release()
