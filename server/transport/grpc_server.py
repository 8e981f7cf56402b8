"""The aclnn.v1.Aclnn gRPC service: thin methods over the Engine; errors, metrics and logs in one place."""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from aclnn_client._proto import aclnn_pb2 as pb
from aclnn_client._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_client.errors import AclnnError, Status, invalid_error
from aclnn_client.transfer import to_chunks

from ..admission import CallAbandoned
from ..config import ServerOptions
from ..descriptors import MAX_COUNT
from ..engine import CallContext, Engine
from ..executors import CapacityError
from ..metrics import Metrics
from ..params import check
from ..storage import Storage
from .auth import TokenAuthInterceptor, caller_identity, read_tokens
from .wire import decode_params, output_tensor

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


def _stream_id(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise invalid_error("stream", f"x-aclnn-stream must be an integer, got {text!r:.40}") from None


def _message_size(message: Any, streamed: int) -> int:
    """A message's size; streamed calls (iterators) report the bytes they moved instead."""
    return message.ByteSize() if hasattr(message, "ByteSize") else streamed


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs one servicer method: its CallContext, error mapping, metrics and access log."""
    name = method.__name__

    @functools.wraps(method)
    def handler(self: AclnnServicer, request: Any, context: grpc.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata())
        request_id = metadata.get("x-request-id") or secrets.token_hex(8)
        context.set_trailing_metadata((("x-request-id", request_id),))
        remaining = context.time_remaining()
        call = CallContext(
            owner=caller_identity(context),
            session=metadata.get("x-aclnn-session"),
            deadline=None if remaining is None else time.monotonic() + remaining,
            cancelled=lambda: not context.is_active(),
        )
        started, status, reply = time.perf_counter(), "ACLNN_SUCCESS", None
        self.metrics.in_flight.inc()
        try:
            call.stream = _stream_id(metadata.get("x-aclnn-stream"))
            self.storage.touch(call.session, call.owner)
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
            sizes = (_message_size(request, call.bytes_in), _message_size(reply, call.bytes_out))
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
    def __init__(self, engine: Engine, metrics: Metrics, storage: Storage) -> None:
        self.engine = engine
        self.metrics = metrics
        self.storage = storage

    @_rpc
    def GetWorkspaceSize(self, request: pb.OpCall, call: CallContext) -> pb.WorkspacePlan:
        values = decode_params(request.params, lambda ref: self._stored(ref, call))
        size, executor = self.engine.get_workspace_size(request.op, values, call)
        return pb.WorkspacePlan(workspace_size=size, executor=executor)

    @_rpc
    def Execute(self, request: pb.ExecuteRequest, call: CallContext) -> pb.ExecuteResponse:
        inputs: dict[str, Any] = dict(request.inputs)
        inputs.update({name: self._stored(ref, call) for name, ref in request.input_refs.items()})
        call.placed = frozenset(request.placements)
        outputs = self.engine.execute(request.executor, inputs, call)
        return pb.ExecuteResponse(outputs=self._place(outputs, request.placements, call))

    @_rpc
    def Run(self, request: pb.OpCall, call: CallContext) -> pb.RunResponse:
        values = decode_params(request.params, lambda ref: self._stored(ref, call))
        call.placed = frozenset(request.placements)
        size, outputs = self.engine.run(request.op, values, call)
        return pb.RunResponse(workspace_size=size, outputs=self._place(outputs, request.placements, call))

    def _stored(self, ref: pb.StorageRef, call: CallContext) -> memoryview:
        """The bytes a StorageRef names: an uploaded tensor, or a slice of a shared-memory region."""
        kind = ref.WhichOneof("kind")
        if kind == "handle":
            return self.storage.handle(call.session, call.owner, ref.handle)
        if kind == "region":
            r = ref.region
            return self.storage.region_slice(call.session, call.owner, r.region, r.offset, r.size)
        raise invalid_error("ref", "names neither a tensor handle nor a region")

    def _place(
        self, outputs: dict[str, np.ndarray], placements: Mapping[str, pb.OutputPlacement], call: CallContext
    ) -> dict[str, pb.OutputTensor]:
        """Results inline, kept on the server, or written into regions: all checked before any is written."""
        targets: dict[str, memoryview] = {}
        for name, placement in placements.items():
            if name not in outputs:
                continue  # a masked-off output: nothing to place
            if placement.WhichOneof("kind") == "region":
                r = placement.region
                check(
                    r.size == outputs[name].nbytes,
                    name,
                    f"region slice of {r.size} bytes for a {outputs[name].nbytes}-byte result",
                )
                targets[name] = self.storage.region_slice(call.session, call.owner, r.region, r.offset, r.size)
        encoded = {}
        for name, array in outputs.items():
            flat = array.reshape(-1).view(np.uint8)
            if name in targets:
                np.frombuffer(targets[name], np.uint8)[:] = flat
                encoded[name] = output_tensor(array, inline=False)
            elif name in placements and placements[name].keep_on_server:
                handle = self.storage.add_handle(call.session, call.owner, memoryview(flat), reserved=False)
                encoded[name] = output_tensor(array, inline=False, handle=handle)
            else:
                encoded[name] = output_tensor(array)
        return encoded

    @_rpc
    def UploadTensor(self, request_iterator: Iterator[pb.TensorChunk], call: CallContext) -> pb.TensorHandle:
        """Chunks in order and without gaps, adding up to the announced size; anything else is refused."""
        first = next(request_iterator, None)
        if first is None:
            raise invalid_error("chunk", "an upload needs at least one chunk")
        total = first.total_size
        check(total <= MAX_COUNT, "chunk", f"total_size {total} is too large")
        buffer = self.storage.reserve(call.session, call.owner, total)
        try:
            received = 0
            for chunk in itertools.chain([first], request_iterator):
                data = chunk.data
                check(
                    chunk.offset == received,
                    "chunk",
                    f"chunk at offset {chunk.offset} arrived where {received} was expected",
                )
                check(received + len(data) <= total, "chunk", f"chunks carry more than the {total} bytes announced")
                buffer[received : received + len(data)] = data
                received += len(data)
            check(received == total, "chunk", f"upload truncated: {received} of {total} bytes arrived")
            handle = self.storage.add_handle(call.session, call.owner, memoryview(buffer), reserved=True)
        except BaseException:
            self.storage.release(total)
            raise
        call.bytes_in = total
        return pb.TensorHandle(handle=handle, size=total)

    @_rpc
    def DownloadTensor(self, request: pb.TensorHandle, call: CallContext) -> Iterator[pb.TensorChunk]:
        buffer = self.storage.handle(call.session, call.owner, request.handle)
        call.bytes_out = buffer.nbytes
        return to_chunks(buffer)

    @_rpc
    def FreeTensor(self, request: pb.TensorHandle, call: CallContext) -> pb.Empty:
        self.storage.free_handle(call.session, call.owner, request.handle)
        return pb.Empty()

    @_rpc
    def RegisterRegion(self, request: pb.RegisterRegionRequest, call: CallContext) -> pb.Empty:
        self.storage.register_region(call.session, call.owner, request.region, request.size)
        return pb.Empty()

    @_rpc
    def UnregisterRegion(self, request: pb.RegisterRegionRequest, call: CallContext) -> pb.Empty:
        self.storage.unregister_region(call.session, call.owner, request.region)
        return pb.Empty()

    @_rpc
    def KeepAlive(self, request: pb.Empty, call: CallContext) -> pb.Empty:
        return pb.Empty()  # the call itself renewed the session's lease

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
        self.storage = Storage(options.session_ttl_s, engine.memory_budget_bytes)
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
        pb_grpc.add_AclnnServicer_to_server(AclnnServicer(engine, self.metrics, self.storage), self.grpc)
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
        self._stopping = threading.Event()

    def start(self) -> None:
        self.grpc.start()
        if self.options.metrics_port:
            self.metrics_port = self.metrics.serve(self.options.host, self.options.metrics_port)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = threading.Thread(target=self._reap, name="aclnn-reaper", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        """Frees lapsed sessions' handles and regions even when no call arrives to notice."""
        while not self._stopping.wait(self.options.session_ttl_s / 2):
            self.storage.reap()

    def stop(self, grace: float | None) -> threading.Event:
        """Reports NOT_SERVING, refuses new calls, lets in-flight ones finish within `grace` seconds."""
        self.health.enter_graceful_shutdown()
        self._stopping.set()
        stopped = self.grpc.stop(grace)

        def release() -> None:
            stopped.wait()
            self.metrics.close()
            self.storage.close()
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
        device=options.device,
        torch_device=options.torch_device,
    )
    server = AclnnServer(options, engine)
    return server, server.port, engine
