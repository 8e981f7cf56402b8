"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

_PHASES = ("queue", "validation", "compute", "transfer")
_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class Metrics:
    def __init__(self, live_executors: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aclnn_requests",
            "RPCs by method, operator and aclnn status",
            ["method", "op", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "aclnn_request_phase_seconds",
            "Time per RPC phase: queue, validation, compute, transfer",
            ["method", "op", "phase"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.bytes_in = Counter("aclnn_received_bytes", "Request message bytes", ["method"], registry=self.registry)
        self.bytes_out = Counter("aclnn_sent_bytes", "Response message bytes", ["method"], registry=self.registry)
        self.in_flight = Gauge("aclnn_in_flight_calls", "RPCs being handled", registry=self.registry)
        self.refused = Counter(
            "aclnn_refused_calls", "RPCs refused at once: the server was handling all it takes", registry=self.registry
        )
        live = Gauge("aclnn_live_executors", "Executors alive on this server", registry=self.registry)
        live.set_function(live_executors)
        self.data_connections = Gauge(
            "aclnn_data_channel_connections", "Open data-channel connections", registry=self.registry
        )
        self._http = None
        # The labelled children of each (method, op, status): `labels()` is too slow for every call.
        self._children: dict[tuple[str, str, str], tuple] = {}

    def observe(self, method: str, op: str, status: str, phases: dict[str, float], sizes: tuple[int, int]) -> None:
        """Records one call. Every label value is a series kept for good: callers pass only values
        from bounded sets (method names, registered operators or one fixed label, status names)."""
        children = self._children.get((method, op, status))
        if children is None:
            children = self._children[method, op, status] = (
                self.requests.labels(method, op, status),
                {phase: self.seconds.labels(method, op, phase) for phase in _PHASES},
                self.bytes_in.labels(method),
                self.bytes_out.labels(method),
            )
        requests, seconds, bytes_in, bytes_out = children
        requests.inc()
        for phase, histogram in seconds.items():
            if phases.get(phase):
                histogram.observe(phases[phase])
        bytes_in.inc(sizes[0])
        bytes_out.inc(sizes[1])

    def track_memory(self, held: Callable[[], int], held_by_kind: Callable[[], dict[str, int]], budget: int) -> None:
        """The memory ledger's bytes held for callers (in total and by kind) and its budget."""
        Gauge("aclnn_memory_budget_bytes", "Bytes the server may hold for callers", registry=self.registry).set(budget)
        Gauge("aclnn_memory_held_bytes", "Bytes held for callers now", registry=self.registry).set_function(held)
        by_kind = Gauge(
            "aclnn_memory_held_by_kind_bytes",
            "Bytes held for callers now, by kind (message, request, call, upload, result, executor, region, buffer, "
            "mailbox)",
            ["kind"],
            registry=self.registry,
        )
        for kind in ("message", "request", "call", "upload", "result", "executor", "region", "buffer", "mailbox"):
            by_kind.labels(kind).set_function(lambda kind=kind: held_by_kind().get(kind, 0))

    def track_admission(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Executions running (each holds a slot of --max-concurrency) and queued for one."""
        Gauge("aclnn_running_calls", "Calls executing now", registry=self.registry).set_function(running)
        Gauge("aclnn_queued_calls", "Calls waiting for an execution slot", registry=self.registry).set_function(waiting)

    def track_buffers(self, live_buffers: Callable[[], int]) -> None:
        """Device buffers alive (their bytes are the ledger's kind `buffer`)."""
        live = Gauge("aclnn_device_buffers", "Device buffers alive on this server", registry=self.registry)
        live.set_function(live_buffers)

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics over HTTP; returns the bound port."""
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
        self._http = make_server(address[0], port, make_wsgi_app(self.registry), server_class, _QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="aclnn-metrics", daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


# The metrics port has no credentials (scrapers carry none): a thread per scrape, but at most this many
# at once (more are closed at once), each dropped once it stalls this long, so that idle connections
# by the hundred pin no threads.
MAX_SCRAPES = 8
SCRAPE_TIMEOUT_S = 5.0


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64  # connections beyond the scrapes served are taken and closed, not left to retry

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._scrapes = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(*args, **kwargs)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._scrapes.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._scrapes.release()

    def handle_error(self, request: socket.socket, client_address: object) -> None:
        pass  # a scraper that stalled or went away: nothing for the server's log


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, format: str, *args: object) -> None:  # a line per scrape on stderr: no
        pass
