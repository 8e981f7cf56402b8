"""grpc.health.v1 for this server: open to anyone (probes carry no token), so nothing a caller does
through it may hold up other calls or keep memory.

grpc_health's own servicer sent a Watch's first answer holding its lock, which a cancelled watch's
close callback (on gRPC's one serving thread) waits for: two clients watching and cancelling hung
every call of the server, and its shutdown. It also kept every service name ever watched. Here an
answer goes out with no lock held, only the server's own services are known (another is NOT_FOUND,
never stored), and at most MAX_WATCHES watches are open at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_WATCHES = 64
Send = Callable[[health_pb2.HealthCheckResponse], None]


class HealthService(health_pb2_grpc.HealthServicer):
    """`services`' statuses, NOT_SERVING until `set`."""

    def __init__(self, services: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._status = dict.fromkeys(services, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._watches: dict[str, set[Send]] = {service: set() for service in self._status}
        self._shutting_down = False

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service[:80]!r} here")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext, send: Send) -> None:
        """Answers the status now and at each change, until the caller goes (gRPC's non-blocking form:
        no thread waits for the stream)."""
        service = request.service
        with self._lock:
            status = self._status.get(service)
            room = sum(map(len, self._watches.values())) < MAX_WATCHES
            if status is not None and room:
                self._watches[service].add(send)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no service {service[:80]!r} here")
        if not room:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_WATCHES} health watches are open")
        if not context.add_callback(lambda: self._forget(service, send)):
            self._forget(service, send)  # gone already
            return
        _answer(send, status)

    Watch.experimental_non_blocking = True  # gRPC passes `send` and keeps the stream open

    def set(self, service: str, status: int) -> None:
        with self._lock:
            if self._shutting_down:
                return
            self._status[service] = status
            watching = list(self._watches[service])
        for send in watching:
            _answer(send, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good."""
        for service in list(self._status):
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        with self._lock:
            self._shutting_down = True

    def _forget(self, service: str, send: Send) -> None:
        with self._lock:
            self._watches[service].discard(send)


def _answer(send: Send, status: int) -> None:
    try:
        send(health_pb2.HealthCheckResponse(status=status))
    except Exception:  # a stream that ended meanwhile: its close callback forgets it
        pass
