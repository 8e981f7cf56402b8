"""Bearer-token authentication, and who a caller is (the owner of what it creates)."""

from __future__ import annotations

import hashlib
import hmac
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
    """The principal that owns what this call creates: its token, else its client certificate."""
    token = bearer_token(context.invocation_metadata())
    if token is not None:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    names = context.auth_context().get("x509_common_name")
    return "cert:" + names[0].decode() if names else None
