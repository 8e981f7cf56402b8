"""Housekeeping: which data-channel connections are past their deadline or idle for too long."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from .connection import Connection

log = logging.getLogger("aclnn_server")

INTERVAL_S = 0.25


def overdue(conns: Iterable[Connection], now: float, idle_timeout_s: float) -> list[Connection]:
    """Connections no worker holds that are past their deadline (handshake, request) or idle too long."""
    idle_limit = now - idle_timeout_s
    return [
        c for c in conns if not c.active and (now > c.deadline if c.deadline is not None else c.idle_since < idle_limit)
    ]


def keep_house(stopped: threading.Event, sweep: Callable[[], list[Connection]]) -> None:
    """Runs `sweep` (which closes the overdue connections it returns) every INTERVAL_S until `stopped`."""
    while not stopped.wait(INTERVAL_S):
        for conn in sweep():
            log.debug("data channel connection closed: %s", "too slow" if conn.deadline is not None else "idle")
