"""How either end notices a peer that stopped answering (its host gone, a network cut, a process
stopped): a call to it would otherwise wait forever, and what the server holds for it would stay held.

- gRPC: HTTP/2 pings. A client pings its server every CLIENT_PING_S while a call is open, however long
  it lasts (a Synchronize waits for as long as its stream's work takes), and fails the call
  (UNAVAILABLE) when a ping goes unanswered for PING_TIMEOUT_S. The server pings each client
  connection every SERVER_PING_S, and takes a client's pings as often as every MIN_PING_INTERVAL_S
  (more often, twice: it ends the connection with GOAWAY, gRPC's own defence against ping floods).
- The data channel over TCP: the kernel's keepalive probes, after TCP_IDLE_S of silence, every
  TCP_INTERVAL_S, TCP_PROBES of them (a host that is gone; a stopped process's kernel still answers).
"""

from __future__ import annotations

import socket

CLIENT_PING_S = 30
PING_TIMEOUT_S = 20
SERVER_PING_S = 60
MIN_PING_INTERVAL_S = 1
TCP_IDLE_S, TCP_INTERVAL_S, TCP_PROBES = 30, 10, 3


def grpc_client_options() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", CLIENT_PING_S * 1000),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_S * 1000),
        # Any ping in flight, not only keepalive's, waits this long for its answer (gRPC's default: a minute).
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_S * 1000),
        ("grpc.keepalive_permit_without_calls", 0),  # an idle connection costs the server nothing to keep
        ("grpc.http2.max_pings_without_data", 0),  # gRPC's default stops pinging a quiet call after two
    ]


def grpc_server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", SERVER_PING_S * 1000),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_S * 1000),
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_S * 1000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_S * 1000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def tcp_keepalive(sock: socket.socket) -> None:
    """Turns the kernel's keepalive probes on for a TCP socket (Linux's options; elsewhere the defaults)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", TCP_IDLE_S), ("TCP_KEEPINTVL", TCP_INTERVAL_S), ("TCP_KEEPCNT", TCP_PROBES)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
