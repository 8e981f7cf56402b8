"""How many gRPC calls the server takes at once, decided before a thread is spent on one.

grpc's own `maximum_concurrent_rpcs` counts health checks with everything else, so a busy
server answers its probes RESOURCE_EXHAUSTED and an orchestrator restarts a replica that is
merely loaded. Here health checks run on a pool of their own (grpc's per-method thread pool,
the mechanism its health service uses for Watch) and are never counted; every other call
takes one of `limit` slots on grpc's polling thread, before any request byte is read, and a
call beyond the limit is answered RESOURCE_EXHAUSTED with a retry hint at once, without
reading its request. One identity may hold at most `per_identity` of the slots (counted once
its call has a thread, still before its request is read), so a tenant that trickles request
bytes on many calls cannot take every slot from the others. Only authenticated calls get here:
token authentication is the outer interceptor, so a wrong or missing token never takes a slot.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_status import rpc_status

from aclnn_common.errors import Status

from ..errors import CapacityError
from .service import error_status

HEALTH = "/grpc.health.v1.Health/"


_MAKERS = {  # (request streaming, response streaming): the handler's constructor
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _handler(
    behavior: Callable[..., Any], like: grpc.RpcMethodHandler, request_streaming: bool
) -> grpc.RpcMethodHandler:
    """A handler with `like`'s serializers and response kind, running `behavior`."""
    make = _MAKERS[request_streaming, like.response_streaming]
    return make(behavior, like.request_deserializer, like.response_serializer)


def _behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary


def on_pool(handler: grpc.RpcMethodHandler, pool: futures.ThreadPoolExecutor) -> grpc.RpcMethodHandler:
    """The same handler, run on `pool` instead of the server's (non-blocking streams stay non-blocking)."""
    inner = _behavior(handler)

    def behavior(*args: Any) -> Any:
        return inner(*args)

    behavior.experimental_thread_pool = pool  # type: ignore[attr-defined]
    behavior.experimental_non_blocking = getattr(inner, "experimental_non_blocking", False)  # type: ignore[attr-defined]
    return _handler(behavior, handler, handler.request_streaming)


class CallLimit(grpc.ServerInterceptor):
    """At most `limit` calls other than health checks at once; health checks run on `health_pool`.

    The slot is taken on grpc's polling thread and given back when the call ends however it
    ends (`add_callback`). So that the behavior holding it always runs, even for a call
    cancelled before its request arrived, a unary request is read by the wrapper from
    grpc's request iterator rather than by grpc before the behavior.
    """

    def __init__(
        self,
        limit: int,
        health_pool: futures.ThreadPoolExecutor,
        identify: Callable[[grpc.ServicerContext], str | None],
        on_refused: Callable[[], None] = lambda: None,
        per_identity: int | None = None,
    ) -> None:
        self.limit, self.health_pool, self.on_refused = limit, health_pool, on_refused
        self.identify = identify
        self.per_identity = per_identity or limit
        self.active = 0
        self._by_identity: dict[str | None, int] = {}
        self._lock = threading.Lock()
        self._busy = _busy_status(f"server busy: {limit} calls in progress; retry shortly")
        self._busy_tenant = _busy_status(
            f"this caller has {self.per_identity} calls in progress, its share of the server; retry shortly"
        )

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED without a thread
        if details.method.startswith(HEALTH):
            return on_pool(handler, self.health_pool)
        with self._lock:
            admitted = self.active < self.limit
            self.active += admitted
        if not admitted:
            self.on_refused()
            return _handler(self._refuse, handler, request_streaming=True)
        return self._holding(handler, details.method)

    def _release(self, owner: str | None, counted: bool) -> None:
        with self._lock:
            self.active -= 1
            if counted:
                left = self._by_identity[owner] - 1
                if left:
                    self._by_identity[owner] = left
                else:
                    del self._by_identity[owner]

    def _count(self, owner: str | None) -> bool:
        """Counts a call against its identity's share; False when the share is full."""
        with self._lock:
            mine = self._by_identity.get(owner, 0)
            if mine >= self.per_identity:
                return False
            self._by_identity[owner] = mine + 1
            return True

    def _refuse(self, requests: Any, context: grpc.ServicerContext) -> None:
        context.abort_with_status(self._busy)  # the request is never read

    def _holding(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = _behavior(handler)
        unary = not handler.request_streaming

        def behavior(requests: Any, context: grpc.ServicerContext) -> Any:
            owner = self.identify(context)
            counted = self._count(owner)
            release = functools.partial(self._release, owner, counted)
            if not context.add_callback(release):
                release()  # the call has already ended
            if not counted:
                self.on_refused()
                context.abort_with_status(self._busy_tenant)  # its request is never read
            if not unary:
                return inner(requests, context)
            request = next(requests, None)
            if request is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} requires exactly one request message")
            return inner(request, context)

        return _handler(behavior, handler, request_streaming=True)


def _busy_status(message: str) -> Any:
    return rpc_status.to_status(error_status(CapacityError(Status.INNER_CREATE_EXECUTOR, message, "op")))
