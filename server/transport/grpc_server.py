"""The aclnn.v1.Aclnn gRPC service: thin methods over the Engine, errors mapped in one place."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from aclnn_client._proto import aclnn_pb2 as pb
from aclnn_client._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_client.errors import AclnnError, Status

from ..engine import Engine
from ..executors import CapacityError
from .wire import decode_params, encode_outputs

log = logging.getLogger("aclnn_server")

_GRPC_CODES = {
    Status.PARAM_NULLPTR: code_pb2.INVALID_ARGUMENT,
    Status.PARAM_INVALID: code_pb2.INVALID_ARGUMENT,
    Status.RUNTIME_ERROR: code_pb2.UNAVAILABLE,
}


def to_grpc_status(error: AclnnError) -> grpc.Status:
    """google.rpc.Status with an ErrorInfo(domain "aclnn", reason, metadata status/param)."""
    if isinstance(error, CapacityError):
        code = code_pb2.RESOURCE_EXHAUSTED
    else:
        code = _GRPC_CODES.get(error.code, code_pb2.INTERNAL)
    info = error_details_pb2.ErrorInfo(
        domain="aclnn", reason=error.reason, metadata={"status": str(error.code), "param": error.param}
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=code, message=error.message, details=[detail]))


def _aclnn_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turns an AclnnError (or a bug) raised by the engine into a rich gRPC status."""

    @functools.wraps(method)
    def handler(self: AclnnServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except AclnnError as error:
            context.abort_with_status(to_grpc_status(error))
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            context.abort_with_status(to_grpc_status(AclnnError(Status.INNER, f"internal error: {exc}")))

    return handler


class AclnnServicer(pb_grpc.AclnnServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @_aclnn_errors
    def GetWorkspaceSize(self, request: pb.OpCall, context: grpc.ServicerContext) -> pb.WorkspacePlan:
        size, executor = self.engine.get_workspace_size(request.op, decode_params(request.params))
        return pb.WorkspacePlan(workspace_size=size, executor=executor)

    @_aclnn_errors
    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteResponse:
        outputs = self.engine.execute(request.executor, dict(request.inputs))
        return pb.ExecuteResponse(outputs=encode_outputs(outputs))

    @_aclnn_errors
    def Run(self, request: pb.OpCall, context: grpc.ServicerContext) -> pb.RunResponse:
        size, outputs = self.engine.run(request.op, decode_params(request.params))
        return pb.RunResponse(workspace_size=size, outputs=encode_outputs(outputs))

    @_aclnn_errors
    def SetExecutorRepeatable(self, request: pb.ExecutorRef, context: grpc.ServicerContext) -> pb.Empty:
        self.engine.set_executor_repeatable(request.executor)
        return pb.Empty()

    @_aclnn_errors
    def DestroyExecutor(self, request: pb.ExecutorRef, context: grpc.ServicerContext) -> pb.Empty:
        self.engine.destroy_executor(request.executor)
        return pb.Empty()

    @_aclnn_errors
    def ListOperators(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.OperatorList:
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


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    backend: str = "auto"
    max_message_bytes: int = 1 << 30
    max_workers: int = 8
    executor_ttl_s: float = 300.0
    max_executors: int = 4096
    memory_budget_bytes: int | None = None


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def create_server(options: ServerOptions, engine: Engine | None = None) -> tuple[grpc.Server, int, Engine]:
    """Builds (not starts) the gRPC server; returns it with its bound port and engine."""
    engine = engine or Engine(
        options.backend,
        executor_ttl_s=options.executor_ttl_s,
        max_executors=options.max_executors,
        memory_budget_bytes=options.memory_budget_bytes,
        max_result_bytes=options.max_message_bytes,
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="aclnn-rpc"),
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            # One server per port: a second one must fail to bind, not silently share it.
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_AclnnServicer_to_server(AclnnServicer(engine), server)
    port = server.add_insecure_port(bind_address(options.host, options.port))
    return server, port, engine
