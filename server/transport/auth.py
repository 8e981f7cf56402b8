"""Bearer-token authentication, and who a caller is (the owner of what it creates)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

# Health checks stay open: orchestrators probe without credentials.
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def read_tokens(path: Any) -> frozenset[str]:
    """One token per line; blank lines and # comments are ignored."""
    with open(path, encoding="utf-8") as f:
        tokens = frozenset(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise ValueError(f"{path} holds no token")
    return tokens


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


def _unauthenticated(message: str) -> grpc.RpcMethodHandler:
    def abort(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC (except health checks) without a valid `authorization: Bearer` token."""

    def __init__(self, tokens: frozenset[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def _valid(self, token: str | None) -> bool:
        if token is None:
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any(hmac.compare_digest(digest, d) for d in self._digests)  # constant time

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_SERVICES):
            return continuation(details)
        token = bearer_token(details.invocation_metadata)
        if not self._valid(token):
            return _unauthenticated("missing bearer token" if token is None else "invalid bearer token")
        return continuation(details)


def caller_identity(context: grpc.ServicerContext) -> str | None:
    """The principal that owns what this call creates and whose memory share it spends: its token,
    else its client certificate, else the peer (the local user, for a peer on this host)."""
    token = bearer_token(context.invocation_metadata())
    if token is not None:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    names = context.auth_context().get("x509_common_name")
    return "cert:" + names[0].decode() if names else peer_identity(context.peer())


def peer_identity(peer: str) -> str | None:
    """`uid:N` for a TCP peer on this host (its socket's owner, from /proc/net), else `peer:ADDRESS`.

    Cached for a few seconds per peer string (the client's address and port): a closed client
    port stays in TIME_WAIT far longer, so no other process can be given the same string meanwhile.
    """
    now = time.monotonic()
    cached = _PEERS.get(peer)
    if cached is not None and cached[1] > now:
        return cached[0]
    if len(_PEERS) >= _PEER_CACHE_SIZE:
        _PEERS.clear()
    identity = _peer_identity(peer)
    _PEERS[peer] = identity, now + _PEER_CACHE_S
    return identity


_PEERS: dict[str, tuple[str | None, float]] = {}
_PEER_CACHE_S = 10.0
_PEER_CACHE_SIZE = 4096


def _peer_identity(peer: str) -> str | None:
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer or None
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        return "peer:" + host
    uid = _local_socket_uid(int(port)) if loopback else None
    return f"uid:{uid}" if uid is not None else "peer:" + host


def _local_socket_uid(port: int) -> int | None:
    """The uid owning the local TCP socket bound to `port` (the client's end of a loopback connection)."""
    wanted = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[1].endswith(wanted):
                        return int(fields[7])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None
