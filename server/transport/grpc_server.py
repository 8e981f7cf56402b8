"""The aclnn.v1.Aclnn gRPC service: thin methods over the Engine; errors, metrics and logs in one place."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from aclnn_client._proto import aclnn_pb2 as pb
from aclnn_client._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_client.errors import AclnnError, Status

from ..admission import CallAbandoned
from ..config import ServerOptions
from ..engine import CallContext, Engine
from ..executors import CapacityError
from ..metrics import Metrics
from .auth import TokenAuthInterceptor, caller_identity, read_tokens
from .wire import decode_params, encode_outputs

log = logging.getLogger("aclnn_server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aclnn"].full_name
_GRPC_CODES = {
    Status.PARAM_NULLPTR: code_pb2.INVALID_ARGUMENT,
    Status.PARAM_INVALID: code_pb2.INVALID_ARGUMENT,
    Status.RUNTIME_ERROR: code_pb2.UNAVAILABLE,
}
_RETRY_AFTER = duration_pb2.Duration(nanos=100_000_000)


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def with_request_id(status: grpc.Status, request_id: str) -> grpc.Status:
    """The status with the request id beside its details (aborting replaces earlier trailers)."""
    return _Status(status.code, status.details, (*status.trailing_metadata, ("x-request-id", request_id)))


def to_grpc_status(error: AclnnError) -> grpc.Status:
    """google.rpc.Status with an ErrorInfo(domain "aclnn", reason, metadata status/param)."""
    info = error_details_pb2.ErrorInfo(
        domain="aclnn", reason=error.reason, metadata={"status": str(error.code), "param": error.param}
    )
    details = [info]
    if isinstance(error, CapacityError):
        code = code_pb2.RESOURCE_EXHAUSTED
        details.append(error_details_pb2.RetryInfo(retry_delay=_RETRY_AFTER))
    else:
        code = _GRPC_CODES.get(error.code, code_pb2.INTERNAL)
    packed = []
    for detail in details:
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    return rpc_status.to_status(status_pb2.Status(code=code, message=error.message, details=packed))


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs one servicer method: its CallContext, error mapping, metrics and access log."""
    name = method.__name__

    @functools.wraps(method)
    def handler(self: AclnnServicer, request: Any, context: grpc.ServicerContext) -> Any:
        request_id = dict(context.invocation_metadata()).get("x-request-id") or secrets.token_hex(8)
        context.set_trailing_metadata((("x-request-id", request_id),))
        remaining = context.time_remaining()
        call = CallContext(
            owner=caller_identity(context),
            deadline=None if remaining is None else time.monotonic() + remaining,
            cancelled=lambda: not context.is_active(),
        )
        started, status, reply = time.perf_counter(), "ACLNN_SUCCESS", None
        self.metrics.in_flight.inc()
        try:
            reply = method(self, request, call)
            return reply
        except AclnnError as error:
            status = error.reason
            context.abort_with_status(with_request_id(to_grpc_status(error), request_id))
        except CallAbandoned as abandoned:
            status = abandoned.reason.upper()
            code = grpc.StatusCode.DEADLINE_EXCEEDED if abandoned.reason == "deadline" else grpc.StatusCode.CANCELLED
            context.abort(code, str(abandoned))
        except Exception as exc:
            log.exception("request_id=%s method=%s failed", request_id, name)
            status = Status.INNER.reason
            internal = to_grpc_status(AclnnError(Status.INNER, f"internal error: {exc}"))
            context.abort_with_status(with_request_id(internal, request_id))
        finally:
            self.metrics.in_flight.dec()
            total = time.perf_counter() - started
            phases = {"queue": call.queue_s, "validation": call.validation_s, "compute": call.compute_s}
            phases["transfer"] = max(0.0, total - sum(phases.values()))
            sizes = (request.ByteSize(), reply.ByteSize() if reply is not None else 0)
            self.metrics.observe(name, call.op, status, phases, sizes)
            log.info(
                "request_id=%s method=%s op=%s status=%s ms=%.3f queue_ms=%.3f validation_ms=%.3f compute_ms=%.3f "
                "bytes_in=%d bytes_out=%d",
                request_id,
                name,
                call.op or "-",
                status,
                total * 1e3,
                call.queue_s * 1e3,
                call.validation_s * 1e3,
                call.compute_s * 1e3,
                *sizes,
            )

    return handler


class AclnnServicer(pb_grpc.AclnnServicer):
    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics

    @_rpc
    def GetWorkspaceSize(self, request: pb.OpCall, call: CallContext) -> pb.WorkspacePlan:
        size, executor = self.engine.get_workspace_size(request.op, decode_params(request.params), call)
        return pb.WorkspacePlan(workspace_size=size, executor=executor)

    @_rpc
    def Execute(self, request: pb.ExecuteRequest, call: CallContext) -> pb.ExecuteResponse:
        outputs = self.engine.execute(request.executor, dict(request.inputs), call)
        return pb.ExecuteResponse(outputs=encode_outputs(outputs))

    @_rpc
    def Run(self, request: pb.OpCall, call: CallContext) -> pb.RunResponse:
        size, outputs = self.engine.run(request.op, decode_params(request.params), call)
        return pb.RunResponse(workspace_size=size, outputs=encode_outputs(outputs))

    @_rpc
    def SetExecutorRepeatable(self, request: pb.ExecutorRef, call: CallContext) -> pb.Empty:
        self.engine.set_executor_repeatable(request.executor, call)
        return pb.Empty()

    @_rpc
    def DestroyExecutor(self, request: pb.ExecutorRef, call: CallContext) -> pb.Empty:
        self.engine.destroy_executor(request.executor, call)
        return pb.Empty()

    @_rpc
    def ListOperators(self, request: pb.Empty, call: CallContext) -> pb.OperatorList:
        return pb.OperatorList(
            operators=[
                pb.OperatorInfo(
                    name=name,
                    params=[
                        pb.ParamInfo(name=p.name, kind=p.kind.value, output=p.output, optional=p.optional)
                        for p in op.signature.params
                    ],
                )
                for name, op in sorted(self.engine.operators.items())
            ]
        )


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _read(path: Any) -> bytes | None:
    return None if path is None else open(path, "rb").read()


class AclnnServer:
    """The gRPC server with its health, reflection and metrics services; start() and stop() like grpc.Server."""

    def __init__(self, options: ServerOptions, engine: Engine) -> None:
        self.options, self.engine = options, engine
        self.metrics = Metrics(lambda: len(engine.executors))
        self.health = health.HealthServicer(experimental_non_blocking=True)
        interceptors = [TokenAuthInterceptor(read_tokens(options.auth_token_file))] if options.auth_token_file else []
        # Threads for every admitted or queued execution, plus a few for cheap calls (plans, health).
        workers = options.max_concurrency + options.max_queue + 4
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aclnn-rpc"),
            interceptors=interceptors,
            maximum_concurrent_rpcs=workers,
            options=[
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", options.max_message_bytes),
                # One server per port: a second one must fail to bind, not silently share it.
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_AclnnServicer_to_server(AclnnServicer(engine, self.metrics), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.grpc,
        )
        address = bind_address(options.host, options.port)
        if options.tls_cert is not None:
            credentials = grpc.ssl_server_credentials(
                [(_read(options.tls_key), _read(options.tls_cert))],
                root_certificates=_read(options.tls_client_ca),
                require_client_auth=options.tls_client_ca is not None,
            )
            self.port = self.grpc.add_secure_port(address, credentials)
        else:
            self.port = self.grpc.add_insecure_port(address)
        self.metrics_port: int | None = None

    def start(self) -> None:
        self.grpc.start()
        if self.options.metrics_port:
            self.metrics_port = self.metrics.serve(self.options.host, self.options.metrics_port)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None) -> threading.Event:
        """Reports NOT_SERVING, refuses new calls, lets in-flight ones finish within `grace` seconds."""
        self.health.enter_graceful_shutdown()
        stopped = self.grpc.stop(grace)

        def release() -> None:
            stopped.wait()
            self.metrics.close()
            close = getattr(self.engine.backend, "close", None)
            if close is not None:
                close()

        threading.Thread(target=release, name="aclnn-release", daemon=True).start()
        return stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc.wait_for_termination(timeout)


def create_server(options: ServerOptions, engine: Engine | None = None) -> tuple[AclnnServer, int, Engine]:
    """Builds (not starts) the server; returns it with its bound port and engine."""
    engine = engine or Engine(
        options.backend,
        executor_ttl_s=options.executor_ttl_s,
        max_executors=options.max_executors,
        memory_budget_bytes=options.memory_budget_bytes,
        max_result_bytes=options.max_message_bytes,
        max_concurrency=options.max_concurrency,
        max_queue=options.max_queue,
    )
    server = AclnnServer(options, engine)
    return server, server.port, engine
