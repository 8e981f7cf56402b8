"""Replicas: which backends a target names, one gRPC channel to each, and one balanced channel to all.

A target is "host:port", a list of them, or a DNS name ("name:port", "dns:///name:port",
"dns://DNS-SERVER/name:port"). A name is never pinned to the addresses it had at start:

- The *balanced* channel is one gRPC channel for the whole name, with gRPC's own resolver and its
  `round_robin` policy: stateless calls (no state on any server before or after) go there, and gRPC
  re-resolves the name whenever a connection breaks.
- State lives on one backend (an executor, a kept result, an upload, a session's regions, a data
  channel's ticket), so calls that make or use it go to a *backend channel*: one per address,
  created on demand, that verifies the server's certificate against the name the user gave
  (`grpc.ssl_target_name_override`), not against the address. The client resolves the name itself
  (the same DNS server when the target names one) to know the backends, again every
  `resolve_interval` seconds and at once after a backend answered UNAVAILABLE, so backends added
  by an autoscaler take calls and removed ones stop getting new ones.

Backends are numbered in the order they were first seen; a number is never reused, so a reference
to state ("3/<executor id>") stays valid, or fails cleanly when its backend is gone.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.errors import AclnnError, Status

log = logging.getLogger("aclnn_client")

# How long a backend that answered UNAVAILABLE is passed over before it is tried again.
DOWN_S = 2.0
# How often the client resolves a name again to learn backends added or removed.
RESOLVE_S = 5.0
# A DNS server named in the target ("dns://host:port/...") gets this long to answer.
_DNS_TIMEOUT_S = 2.0
# gRPC reconnects a broken connection after a backoff that grows to 120 s by default: a server that
# restarted would stay unreachable to this client long after it is back. Capped at 1 s here, and a
# call with nowhere else to go waits up to RECONNECT_WAIT_S for its backend's connection.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
RECONNECT_WAIT_S = 2.0


@dataclass(frozen=True)
class Target:
    """What a target names: fixed addresses, or a name to resolve (`host` is what certificates must show)."""

    addresses: tuple[str, ...] = ()  # fixed backends ("host:port" or any gRPC target)
    name: str | None = None  # a DNS name to resolve, with its port
    port: int = 0
    dns_server: tuple[str, int] | None = None  # the authority of a dns:// target
    grpc_target: str | None = None  # the balanced channel's target (names only)
    host: str | None = None  # the host name the user gave (None: several, or not a host)

    @property
    def loopback(self) -> bool:
        """Whether every endpoint is on this host (decided without resolving anything)."""
        if self.name is not None:
            return is_loopback(self.name)
        return all(a.startswith("unix:") or is_loopback(data_channel_host(a) or "") for a in self.addresses)


def parse_target(target: str | Sequence[str]) -> Target:
    """A list of addresses, one address, or a name that is resolved (and resolved again later)."""
    if not isinstance(target, str):
        addresses = tuple(target)
        hosts = {data_channel_host(a) for a in addresses}
        return Target(addresses, host=hosts.pop() if len(hosts) == 1 else None)
    dns_server = None
    rest = target
    if target.startswith("dns:"):
        authority, _, rest = target[len("dns:") :].removeprefix("//").partition("/")
        if authority:
            server_host, colon, server_port = authority.rpartition(":")
            dns_server = (server_host.strip("[]"), int(server_port)) if colon else (authority, 53)
    host = data_channel_host(rest)
    if host is None:
        return Target((target,))  # unix:, ipv4:, ... : gRPC's own, one backend
    if _is_address(host) or host == "localhost":
        return Target((rest,), host=host)
    port = int(rest.rpartition(":")[2])
    prefix = f"dns://{target[len('dns://') :].partition('/')[0]}/" if dns_server else "dns:///"
    return Target(name=host, port=port, dns_server=dns_server, grpc_target=f"{prefix}{host}:{port}", host=host)


def resolve(target: Target) -> list[str]:
    """The backends' addresses now ("ip:port"); an empty list when the name has none."""
    if target.name is None:
        return list(target.addresses)
    if target.dns_server is not None:
        ips = _query(target.dns_server, target.name)
    else:
        try:
            infos = socket.getaddrinfo(target.name, target.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("cannot resolve %s: %s", target.name, exc)
            return []
        ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{target.port}" if ":" in ip else f"{ip}:{target.port}" for ip in ips]


def _query(server: tuple[str, int], name: str) -> list[str]:
    """A records of `name` from one DNS server (the one a dns://SERVER/ target names), over UDP."""
    ident = secrets.randbits(16)
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    query = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(_DNS_TIMEOUT_S)
        try:
            sock.sendto(query, server)
            while True:
                reply = sock.recv(4096)
                if reply[:2] == query[:2]:
                    break
        except OSError as exc:
            log.warning("DNS server %s:%d did not answer for %s: %s", *server, name, exc)
            return []
    count, offset = struct.unpack(">H", reply[6:8])[0], 12 + len(question) + 4
    ips = []
    for _ in range(count):
        offset = _skip_name(reply, offset)
        rtype, _, _, length = struct.unpack(">HHIH", reply[offset : offset + 10])
        offset += 10
        if rtype == 1 and length == 4:
            ips.append(str(ipaddress.IPv4Address(reply[offset : offset + 4])))
        offset += length
    return sorted(set(ips))


def _skip_name(message: bytes, offset: int) -> int:
    while message[offset]:
        if message[offset] >= 0xC0:  # a compression pointer ends the name
            return offset + 2
        offset += 1 + message[offset]
    return offset + 1


@dataclass
class _Backend:
    address: str
    live: bool = True  # in the latest resolution
    down_until: float = 0.0
    channel: grpc.Channel | None = None
    stub: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pool:
    """The backends of one target, each with its own channel, and the balanced channel when it names a name."""

    def __init__(self, target: Target, credentials: grpc.ChannelCredentials | None, options: list[tuple]) -> None:
        self.target = target
        self._credentials, self._options = credentials, options
        self._backends: list[_Backend] = []
        self._index: dict[str, int] = {}
        self._lock = threading.Lock()
        self._resolving = threading.Lock()
        self._resolved_at = -float("inf")
        self._turn = itertools.count()
        self.resolve_interval = RESOLVE_S
        self.balanced = None
        self._balanced_channel = None
        if target.grpc_target is not None:
            self._balanced_channel = self._channel(target.grpc_target)
            self.balanced = pb_grpc.AclnnStub(self._balanced_channel)
        if target.name is None:
            self._update(list(target.addresses))

    def _channel(self, address: str, name_override: bool = False) -> grpc.Channel:
        options = [*RECONNECT_OPTIONS, *self._options]
        if name_override and self.target.host is not None:
            # A backend is dialled by address, but it is the name the user gave that its certificate must show.
            options += [("grpc.default_authority", f"{self.target.host}:{self.target.port}")]
            if self._credentials is not None:
                options += [("grpc.ssl_target_name_override", self.target.host)]
        if self._credentials is not None:
            return grpc.secure_channel(address, self._credentials, options)
        return grpc.insecure_channel(address, options)

    def _update(self, addresses: list[str]) -> None:
        with self._lock:
            for backend in self._backends:
                backend.live = backend.address in addresses
            for address in addresses:
                if address not in self._index:
                    self._index[address] = len(self._backends)
                    self._backends.append(_Backend(address))
                    log.info("backend %s joined %s", address, self.target.name or "the pool")

    def refresh(self, force: bool = False) -> None:
        """Resolves the name again when it is due (or `force`); one thread at a time, others go on."""
        if self.target.name is None or not (force or time.monotonic() - self._resolved_at >= self.resolve_interval):
            return
        if not self._resolving.acquire(blocking=not self._backends):
            return
        try:
            if force or time.monotonic() - self._resolved_at >= self.resolve_interval:
                addresses = resolve(self.target)
                if addresses:  # a failed resolution keeps what was known, and is tried again at the next call
                    self._resolved_at = time.monotonic()
                    self._update(addresses)
        finally:
            self._resolving.release()

    def next(self) -> int:
        """The next backend in turn that is live and not known to be down (any live one, if all are)."""
        self.refresh()
        if len(self._backends) == 1:
            return 0  # one backend: the choice is made whatever its state
        now = time.monotonic()
        with self._lock:
            live = [i for i, b in enumerate(self._backends) if b.live] or list(range(len(self._backends)))
        if not live:
            raise grpc_unavailable(f"{self.target.name} has no addresses")
        first = next(self._turn) % len(live)
        for step in range(len(live)):
            replica = live[(first + step) % len(live)]
            if self._backends[replica].down_until <= now:
                return replica
        return live[first]

    def down(self, replica: int) -> None:
        """The backend answered UNAVAILABLE: passed over for a while, and the name resolved again."""
        self._backends[replica].down_until = time.monotonic() + DOWN_S
        self._resolved_at = -float("inf")

    def wait_connected(self, replica: int, timeout: float) -> bool:
        """Waits at most `timeout` s for the backend's connection (and the balanced channel's) to be up;
        whether they are. After a restart gRPC reconnects when its backoff ends (RECONNECT_OPTIONS).

        Asked with a call that waits for the connection (wait_for_ready; any answer means it is up),
        not grpc.channel_ready_future, whose polling thread outlives the wait and raises "Channel
        closed" when the client closes the channel within its next 0.2 s."""
        stubs = [self.stub(replica), *([self.balanced] if self.balanced is not None else [])]
        deadline = time.monotonic() + timeout
        for stub in stubs:
            try:
                stub.ListOperators(pb.Empty(), timeout=max(0.0, deadline - time.monotonic()), wait_for_ready=True)
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return False
        return True

    def count(self) -> int:
        """Backends to choose from now (live ones)."""
        with self._lock:
            return sum(b.live for b in self._backends) or len(self._backends)

    def address(self, replica: int) -> str:
        return self._backends[replica].address

    def channel(self, replica: int) -> grpc.Channel:
        """The backend's own channel (created on first use)."""
        backend = self._backends[replica]
        with backend.lock:
            if backend.channel is None:
                backend.channel = self._channel(backend.address, name_override=self.target.name is not None)
                backend.stub = pb_grpc.AclnnStub(backend.channel)
        return backend.channel

    def stub(self, replica: int) -> Any:
        self.channel(replica)
        return self._backends[replica].stub

    def close(self) -> None:
        with self._lock:
            channels = [b.channel for b in self._backends if b.channel is not None]
        if self._balanced_channel is not None:
            channels.append(self._balanced_channel)
        for channel in channels:
            channel.close()


def grpc_unavailable(message: str) -> AclnnError:
    return AclnnError(Status.RUNTIME_ERROR, f"UNAVAILABLE: {message}", grpc_code=grpc.StatusCode.UNAVAILABLE)


def data_channel_host(address: str) -> str | None:
    """The host of a "host:port" or "[v6]:port" address (None for other gRPC targets: unix:, ...)."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or "/" in host or host.startswith(("unix", "ipv4", "ipv6", "vsock")):
        return None
    return host[1:-1] if host.startswith("[") else host


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
