"""Progress deadlines for gRPC streams and replies: a transfer that falls behind a minimum rate is cancelled.

gRPC's Python server gives a handler no timeout on the next message of a request stream, nor on a
response the client does not read: a client that announces an upload and goes quiet, or stops
reading a download, would hold a thread, a call slot and the bytes' memory for as long as it likes.
Each such transfer is watched: after a grace period it must have moved MIN_BYTES_PER_S bytes per
second since it started, else its RPC is cancelled (which wakes the handler waiting on it). The data
channel's transfers follow the same pace (progress_deadline).
"""

from __future__ import annotations

import threading
import time
from typing import Any

_INTERVAL_S = 0.25
# Beyond the grace period (the data channel's handshake timeout), a request's bytes must keep arriving,
# and a reply's leaving, at least this fast on average since the first: a peer that falls behind (a
# slow loris, a reader that stopped) is cut off; a 1 GiB tensor at this pace takes ~17 minutes.
MIN_BYTES_PER_S = 1 << 20


def progress_deadline(started: float, moved: int, grace_s: float, last: float) -> float:
    """When the next byte is due of a transfer that started at `started`, moved `moved` bytes and last
    moved some at `last`: it keeps MIN_BYTES_PER_S on average, and never stalls for longer than the
    grace period (bytes a buffer took at once earn no time to stall later)."""
    return min(started + grace_s + moved / MIN_BYTES_PER_S, last + grace_s)


class Transfer:
    """One watched transfer: `moved(n)` as bytes go; `overdue` once it was cancelled for falling behind."""

    __slots__ = ("context", "expected", "last", "moved_bytes", "overdue", "started")

    def __init__(self, context: Any, expected: int) -> None:
        self.context, self.expected = context, expected
        self.started, self.moved_bytes, self.overdue = time.monotonic(), 0, False
        self.last = self.started if not expected else float("inf")  # bytes out of sight: the average only

    def moved(self, nbytes: int) -> None:
        self.moved_bytes += nbytes
        self.last = time.monotonic()


class Progress:
    """The watchdog: one thread for every transfer of the server."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._transfers: set[Transfer] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="aclnn-progress", daemon=True).start()

    def watch(self, context: Any, expected: int = 0) -> Transfer:
        """Watches a transfer on `context` from now. `expected`: bytes it moves out of sight (a reply
        gRPC sends after the handler returned), counted as moving at the minimum rate."""
        transfer = Transfer(context, expected)
        with self._lock:
            self._transfers.add(transfer)
        return transfer

    def done(self, transfer: Transfer) -> None:
        with self._lock:
            self._transfers.discard(transfer)

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                overdue = [t for t in self._transfers if now > self._deadline(t)]
                self._transfers.difference_update(overdue)
            for transfer in overdue:
                transfer.overdue = True
                transfer.context.cancel()

    def _deadline(self, transfer: Transfer) -> float:
        moved = max(transfer.moved_bytes, transfer.expected)
        return progress_deadline(transfer.started, moved, self.grace_s, transfer.last)
