"""Who a caller is: verified identities only, and bearer tokens checked before anything else runs.

An identity is what the server can verify: a bearer token from the token file (`token:` and a
digest), a client certificate's common name (mutual TLS), or, for a peer on this host, the
local user that owns the client's socket (`uid:N`). That user is read from the kernel
(NETLINK_SOCK_DIAG) for the exact connection — the client's address and port, the server's
address and port, in state ESTABLISHED — so no other socket, listening or closing, can stand in
for it. Anything else is `peer:ADDRESS`, shared by every caller from that address (`peer:loopback`
for every caller on this host whose user cannot be told). A bearer
token without a token file proves nothing and gives no identity.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
import struct
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from typing import Any

import grpc

log = logging.getLogger("aclnn_server")

# Health checks stay open: orchestrators probe without credentials.
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def read_tokens(path: Any) -> frozenset[str]:
    """One token per line; blank lines and # comments are ignored."""
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is not part of the first token
        tokens = frozenset(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise ValueError(f"{path} holds no token")
    return tokens


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


def token_identity(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC (except health checks) without a valid `authorization: Bearer` token.

    It is the outermost interceptor: a refused call takes no call slot, and its request is never
    read (the refusal's handler takes the request as a stream it never iterates). Refusals run on a
    small pool of their own, so a flood of them queues behind nothing but itself.
    """

    def __init__(self, tokens: frozenset[str], refusal_pool: futures.ThreadPoolExecutor) -> None:
        self.replace(tokens)
        self._refusal_pool = refusal_pool

    def replace(self, tokens: frozenset[str]) -> None:
        """The tokens from now on (a token file read again): a call is checked against one set or the other."""
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
            return self._refuse("missing bearer token" if token is None else "invalid bearer token")
        return continuation(details)

    def _refuse(self, message: str) -> grpc.RpcMethodHandler:
        def abort(requests: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)  # the request stream is never read

        abort.experimental_thread_pool = self._refusal_pool  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(abort)


class Identities:
    """The identity of each gRPC call, worked out once per call.

    `tokens`: whether a token file is configured (then every call passed TokenAuthInterceptor
    and its token is its identity). `host`, `port`: where the gRPC server listens, the far end of a
    local client's socket (`port` is set once the server is bound).
    """

    def __init__(self, tokens: bool, host: str, port: int = 0) -> None:
        self.tokens, self.host, self.port = tokens, host, port
        self._known: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def of(self, context: grpc.ServicerContext) -> str | None:
        """The call's identity: its token (with a token file), else its certificate, else its peer."""
        with self._lock:
            if context in self._known:
                return self._known[context]
        identity = self._identify(context)
        with self._lock:
            self._known[context] = identity
        return identity

    def _identify(self, context: grpc.ServicerContext) -> str | None:
        if self.tokens:
            token = bearer_token(context.invocation_metadata())
            if token is not None:
                return token_identity(token)
        certificate = certificate_identity(context.auth_context())
        return certificate or peer_identity(context.peer(), self.host, self.port)


def certificate_identity(auth: Mapping[str, list[bytes]]) -> str | None:
    """A verified client certificate's identity: its common name, else its first subject alternative
    name (a SPIFFE URI, a DNS name), else its fingerprint; None without one. (gRPC reports a missing
    common name as one empty name: every certificate without one was once the same `cert:` tenant.)"""
    for key, prefix in (("x509_common_name", "cert:"), ("x509_subject_alternative_name", "cert-san:")):
        names = [name for name in auth.get(key, ()) if name]
        if names:
            return prefix + names[0].decode(errors="replace")
    pem = [cert for cert in auth.get("x509_pem_cert", ()) if cert]
    return "cert-sha256:" + hashlib.sha256(pem[0]).hexdigest()[:32] if pem else None


def parse_peer(peer: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """The address and port in a gRPC peer string (`ipv4:1.2.3.4:5`, `ipv6:%5B::1%5D:5`); None for others."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = urllib.parse.unquote(address).rpartition(":")
    try:
        return _address(host.removeprefix("[").removesuffix("]")), int(port)
    except ValueError:
        return None


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IP address, an IPv4-mapped IPv6 one as the IPv4 address it is (dual-stack sockets report those)."""
    ip = ipaddress.ip_address(text)
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None else ip


def connection_user(sock: socket.socket) -> int | None:
    """The uid owning the client end of an accepted TCP connection from this host (loopback), else None."""
    try:
        client, client_port = sock.getpeername()[:2]
        server, server_port = sock.getsockname()[:2]
        client_ip, server_ip = _address(client), _address(server)
    except (OSError, ValueError, TypeError):
        return None
    return local_socket_uid(client_ip, client_port, server_ip, server_port) if client_ip.is_loopback else None


def peer_identity(peer: str, server_host: str, server_port: int) -> str | None:
    """`uid:N` for a client on this host (the owner of its end of this very connection), else
    `peer:ADDRESS`; every loopback client whose user the kernel cannot tell is one `peer:loopback`
    (each of 127/8's 16M addresses its own tenant would give one local user as many shares)."""
    parsed = parse_peer(peer)
    if parsed is None:
        return peer or None
    ip, port = parsed
    if ip.is_loopback:
        for server in _server_ends(server_host, ip):
            uid = local_socket_uid(ip, port, server, server_port)
            if uid is not None:
                return f"uid:{uid}"
        uid = _uid_reaching(ip, port, server_port)  # reached on another of loopback's addresses
        if uid is not None:
            return f"uid:{uid}"
        return LOOPBACK_PEER
    return f"peer:{ip.compressed}"


LOOPBACK_PEER = "peer:loopback"


def _server_ends(host: str, client: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[Any]:
    """Where a loopback client's connection may end (gRPC tells the peer's address, not its own): the
    address the server is bound to; bound to a name or every address, the one the client reached
    itself on, and the usual loopback address (a client may come from 127.0.0.N to 127.0.0.1)."""
    try:
        bound = ipaddress.ip_address(host)
    except ValueError:  # a name (localhost)
        bound = None
    if bound is not None and not bound.is_unspecified:
        return [bound]
    usual = ipaddress.ip_address("127.0.0.1" if client.version == 4 else "::1")
    return [client] if client == usual else [client, usual]


# NETLINK_SOCK_DIAG: one request for one socket by its addresses and ports (linux/inet_diag.h).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_NLM_F_DUMP = 0x300
_TCP_ESTABLISHED = 1
_NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, extensions, pad, states
_PORTS = struct.Struct(">HH")  # inet_diag_sockid: source and destination ports (network order)
_TAIL = struct.Struct("=III")  # inet_diag_sockid: interface, cookie
_UID = struct.Struct("=I")
# inet_diag_msg: family, state, timer, retransmits (4), sockid (48), expires, rqueue, wqueue (12), uid.
_UID_OFFSET = _HEADER.size + 4 + 48 + 12
_warned = False
_diag = threading.local()


def local_socket_uid(
    client: ipaddress.IPv4Address | ipaddress.IPv6Address, client_port: int, server: Any, server_port: int
) -> int | None:
    """The uid owning the established TCP socket from `client`:`client_port` to `server`:`server_port`
    (the client's end of a loopback connection); None when there is none, or it cannot be asked.

    An IPv4 connection may be made by an IPv6 socket (v4-mapped addresses, as gRPC makes them): both are asked.
    """
    if client.version != getattr(server, "version", client.version):
        return None
    ends = [(client, server)]
    if client.version == 4:  # gRPC's own sockets are dual-stack: those are asked first
        ends.insert(0, tuple(ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + a.packed) for a in (client, server)))
    for client_end, server_end in ends:
        uid = _established_uid(client_end, client_port, server_end, server_port)
        if uid is not None:
            return uid
    return None


def _established_uid(client: Any, client_port: int, server: Any, server_port: int) -> int | None:
    family = socket.AF_INET if client.version == 4 else socket.AF_INET6
    sockid = (
        _PORTS.pack(client_port, server_port)
        + client.packed.ljust(16, b"\0")
        + server.packed.ljust(16, b"\0")
        + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    answer = _ask(_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_ESTABLISHED) + sockid)
    if answer is None:
        return None
    if len(answer) < _UID_OFFSET + _UID.size or _HEADER.unpack_from(answer)[1] == _NLMSG_ERROR:
        return None  # no such socket
    found_family, state = answer[_HEADER.size], answer[_HEADER.size + 1]
    found_id = answer[_HEADER.size + 4 : _HEADER.size + 4 + 36]
    # The lookup falls back to a listening socket on the address: only this very connection will do.
    if found_family != family or state != _TCP_ESTABLISHED or found_id != sockid[:36]:
        return None
    return _UID.unpack_from(answer, _UID_OFFSET)[0]


def _uid_reaching(client: Any, client_port: int, server_port: int) -> int | None:
    """The uid owning the established socket from `client`:`client_port` to `server_port` on any loopback
    address (a server bound to every address, reached on 127.0.1.1 or any other of 127/8): a dump the
    kernel filters by the two ports. None when there is none, or several of different users."""
    families = [(socket.AF_INET6, _mapped(client)), (socket.AF_INET, client)] if client.version == 4 else []
    families = families or [(socket.AF_INET6, client)]
    uids = set()
    for family, source in families:
        sockid = _PORTS.pack(client_port, server_port) + b"\0" * 32 + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_ESTABLISHED) + sockid
        for message in _dump(request):
            if len(message) < _UID_OFFSET + _UID.size or message[_HEADER.size] != family:
                continue
            ports = _PORTS.unpack_from(message, _HEADER.size + 4)
            src = message[_HEADER.size + 8 : _HEADER.size + 8 + len(source.packed)]
            dst = message[_HEADER.size + 24 : _HEADER.size + 24 + len(source.packed)]
            far = ipaddress.ip_address(dst)
            if ports == (client_port, server_port) and src == source.packed and _address(str(far)).is_loopback:
                uids.add(_UID.unpack_from(message, _UID_OFFSET)[0])
    return uids.pop() if len(uids) == 1 else None


def _mapped(address: ipaddress.IPv4Address) -> ipaddress.IPv6Address:
    return ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + address.packed)


class _DiagSocket:
    """A thread's netlink socket, closed with the thread's storage (one the collector closes warns)."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
        self.sequence = 0

    def __del__(self) -> None:
        self.socket.close()


def _dump(request: bytes) -> list[bytes]:
    """A sock_diag dump's messages (each with its header), on a netlink socket of its own; [] when the
    kernel cannot be asked."""
    messages: list[bytes] = []
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as diag:
            header = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
            diag.send(header + request)
            while True:
                answer = diag.recv(65536)
                offset = 0
                while offset + _HEADER.size <= len(answer):
                    length, kind = _HEADER.unpack_from(answer, offset)[:2]
                    if kind in (_NLMSG_DONE, _NLMSG_ERROR) or length < _HEADER.size:
                        return messages
                    messages.append(answer[offset : offset + length])
                    offset += (length + 3) & ~3
                if not answer:
                    return messages
    except OSError:
        return []


def _ask(request: bytes) -> bytes | None:
    """One sock_diag request and its one answer, on this thread's netlink socket (kept between calls);
    None when the kernel cannot be asked."""
    diag = getattr(_diag, "socket", None)
    try:
        if diag is None:
            diag = _diag.socket = _DiagSocket()
        diag.sequence += 1
        header = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, diag.sequence, 0)
        diag.socket.send(header + request)
        answer = diag.socket.recv(4096)
    except OSError as exc:
        global _warned
        if not _warned:
            _warned = True
            log.warning("cannot ask the kernel who owns a local client's socket (%s): local users are peers", exc)
        answer = b""
    if diag is not None and len(answer) >= _HEADER.size and _HEADER.unpack_from(answer)[3] == diag.sequence:
        return answer
    _diag.socket = None  # failed, or out of step: a fresh socket next time (this one closes as it goes)
    return None
