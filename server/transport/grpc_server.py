"""The aclnn.v1.Aclnn gRPC service: thin methods over AclnnService, plus the server around them."""

from __future__ import annotations

import functools
import ipaddress
import itertools
import logging
import os
import pathlib
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import INT64_MAX, INT64_MIN
from aclnn_common.chunks import to_chunks
from aclnn_common.errors import invalid_error
from aclnn_common.liveness import grpc_server_options

from ..config import ServerOptions, options_at_fault
from ..engine import CallContext, Engine, default_memory_budget
from ..ledger import SMALL_HOLD_BYTES
from ..metrics import Metrics
from ..params import check
from ..storage import Storage
from .auth import Identities, TokenAuthInterceptor, read_tokens, token_identity
from .data_channel import DataChannelServer
from .data_channel import Limits as DataChannelLimits
from .health import HealthService
from .limits import CallLimit
from .progress import Progress, Transfer
from .service import AclnnService, failure_status, new_request_id, release

log = logging.getLogger("aclnn_server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aclnn"].full_name


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def with_request_id(status: grpc.Status, request_id: str) -> grpc.Status:
    """The status with the request id beside its details (aborting replaces earlier trailers)."""
    return _Status(status.code, status.details, (*status.trailing_metadata, ("x-request-id", request_id)))


_STREAM_ID = re.compile(r"-?[0-9]{1,19}")
# How long a draining server waits for kept results to be fetched once nothing else is owed, while none is.
_FETCH_WAIT_S = 2.0


def stream_id(text: str | None) -> int | None:
    """x-aclnn-stream's id: a signed 64-bit integer in decimal, as the data channel's header holds one
    (the same stream on either transport), nothing longer or looser (no sign '+', spaces or '_')."""
    if text is None:
        return None
    if _STREAM_ID.fullmatch(text) is None or not INT64_MIN <= int(text) <= INT64_MAX:
        raise invalid_error("stream", f"x-aclnn-stream must be a signed 64-bit integer, got {text!r:.40}")
    return int(text)


class _ChunkUpload:
    """An UploadTensor stream: chunks in order and without gaps, adding up to the announced size."""

    def __init__(self, chunks: Iterator[pb.TensorChunk], reservation: str) -> None:
        self.chunks, self.reservation = chunks, reservation
        self.first: pb.TensorChunk | None = None

    @property
    def total_size(self) -> int:
        """The size the first chunk announces (read here, so that a refusal is the service's)."""
        if self.first is None:
            self.first = next(self.chunks, None)
            if self.first is None:
                raise invalid_error("chunk", "an upload needs at least one chunk")
        return self.first.total_size

    def read_into(self, buffer: memoryview) -> None:
        total, received = self.total_size, 0
        for chunk in itertools.chain([self.first], self.chunks):
            data = chunk.data
            expected = f"chunk at offset {chunk.offset} arrived where {received} was expected"
            check(chunk.offset == received, "chunk", expected)
            check(received + len(data) <= total, "chunk", f"chunks carry more than the {total} bytes announced")
            buffer[received : received + len(data)] = data
            received += len(data)
        check(received == total, "chunk", f"upload truncated: {received} of {total} bytes arrived")


def _paced(messages: Iterator[Any], transfer: Transfer, param: str) -> Iterator[Any]:
    """A request stream's messages, their bytes counted for the progress watchdog; a stream it (or the
    client) cancelled is 161002 naming `param`."""
    while True:
        try:
            message = next(messages, None)
        except grpc.RpcError:
            why = "its bytes came too slowly" if transfer.overdue else "it was cancelled"
            raise invalid_error(param, f"truncated: {why}") from None
        if message is None:
            return
        transfer.moved(len(message.data))
        yield message


def _watched_chunks(buffer: memoryview, progress: Progress, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:
    """A download's chunks, the client reading them at least as fast as the progress watchdog asks."""
    transfer = progress.watch(context)
    try:
        for chunk in to_chunks(buffer):
            yield chunk
            transfer.moved(len(chunk.data))
    finally:
        progress.done(transfer)


class _ChunkWrite:
    """A WriteBuffer stream: the first message names the buffer, offset and size; all carry the bytes in order."""

    def __init__(self, messages: Iterator[pb.BufferWrite]) -> None:
        self.messages = messages
        self.first: pb.BufferWrite | None = None

    def _first(self) -> pb.BufferWrite:
        if self.first is None:
            self.first = next(self.messages, None)
            if self.first is None:
                raise invalid_error("data", "a write needs at least one message")
        return self.first

    @property
    def buffer(self) -> str:
        return self._first().buffer

    @property
    def offset(self) -> int:
        return self._first().offset

    @property
    def size(self) -> int:
        return self._first().size

    def read_into(self, target: memoryview) -> None:
        received = 0
        for message in itertools.chain([self._first()], self.messages):
            data = message.data
            check(received + len(data) <= target.nbytes, "data", f"more than the {target.nbytes} bytes announced")
            target[received : received + len(data)] = data
            received += len(data)
        check(received == target.nbytes, "data", f"write truncated: {received} of {target.nbytes} bytes arrived")


class AclnnServicer(pb_grpc.AclnnServicer):
    """Each RPC: its CallContext from the gRPC context, then AclnnService; failures abort with their status."""

    def __init__(self, service: AclnnService, identities: Identities, progress: Progress) -> None:
        self.service, self.identities, self.progress = service, identities, progress

    def _serve(self, name: str, request: Any, context: grpc.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata())
        request_id = metadata.get("x-request-id") or new_request_id()
        context.set_trailing_metadata((("x-request-id", request_id),))
        remaining = context.time_remaining()
        call = CallContext(
            owner=self.identities.of(context),
            session=metadata.get("x-aclnn-session") or None,  # an empty id is no session, everywhere
            deadline=None if remaining is None else time.monotonic() + remaining,
            cancelled=lambda: not context.is_active(),
        )
        try:
            call.stream = stream_id(metadata.get("x-aclnn-stream"))
            reply = self.service.invoke(name, request, call, request_id)
            # What the call holds (its outputs) is held until the reply is sent: until the RPC ends; a
            # large reply must be read at the watchdog's pace.
            size = reply.ByteSize() if call.holds and hasattr(reply, "ByteSize") else 0
            transfer = self.progress.watch(context, size) if size > SMALL_HOLD_BYTES else None
            if not context.add_callback(functools.partial(self._sent, call, transfer)):
                self._sent(call, transfer)
            return reply
        except Exception as exc:
            status = rpc_status.to_status(failure_status(exc)[0])
            context.abort_with_status(with_request_id(status, request_id))

    def _sent(self, call: CallContext, transfer: Transfer | None) -> None:
        release(call)
        if transfer is not None:
            self.progress.done(transfer)

    def GetWorkspaceSize(self, request: pb.OpCall, context: grpc.ServicerContext) -> pb.WorkspacePlan:
        return self._serve("GetWorkspaceSize", request, context)

    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteResponse:
        return self._serve("Execute", request, context)

    def Run(self, request: pb.OpCall, context: grpc.ServicerContext) -> pb.RunResponse:
        return self._serve("Run", request, context)

    def SetExecutorRepeatable(self, request: pb.ExecutorRef, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("SetExecutorRepeatable", request, context)

    def DestroyExecutor(self, request: pb.ExecutorRef, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("DestroyExecutor", request, context)

    def ListOperators(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.OperatorList:
        return self._serve("ListOperators", request, context)

    def UploadTensor(
        self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext
    ) -> pb.TensorHandle:
        reservation = dict(context.invocation_metadata()).get("x-aclnn-reservation", "")
        transfer = self.progress.watch(context)
        try:
            chunks = _paced(request_iterator, transfer, "chunk")
            return self._serve("UploadTensor", _ChunkUpload(chunks, reservation), context)
        finally:
            self.progress.done(transfer)

    def DownloadTensor(self, request: pb.TensorHandle, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:
        return _watched_chunks(self._serve("DownloadTensor", request, context), self.progress, context)

    def FreeTensor(self, request: pb.TensorHandle, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("FreeTensor", request, context)

    def KeepAlive(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Lease:
        return self._serve("KeepAlive", request, context)

    def OpenDataChannel(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DataChannelTicket:
        return self._serve("OpenDataChannel", request, context)

    def MallocBuffer(self, request: pb.MallocRequest, context: grpc.ServicerContext) -> pb.BufferInfo:
        return self._serve("MallocBuffer", request, context)

    def FreeBuffer(self, request: pb.BufferRef, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("FreeBuffer", request, context)

    def WriteBuffer(self, request_iterator: Iterator[pb.BufferWrite], context: grpc.ServicerContext) -> pb.Empty:
        transfer = self.progress.watch(context)
        try:
            return self._serve("WriteBuffer", _ChunkWrite(_paced(request_iterator, transfer, "data")), context)
        finally:
            self.progress.done(transfer)

    def ReadBuffer(self, request: pb.BufferRange, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:
        return _watched_chunks(self._serve("ReadBuffer", request, context), self.progress, context)

    def CopyBuffer(self, request: pb.BufferCopy, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("CopyBuffer", request, context)

    def FillBuffer(self, request: pb.BufferFill, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("FillBuffer", request, context)

    def Synchronize(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("Synchronize", request, context)

    def ReserveCall(self, request: pb.CallReservation, context: grpc.ServicerContext) -> pb.Reservation:
        return self._serve("ReserveCall", request, context)

    def ReleaseReservation(self, request: pb.Reservation, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("ReleaseReservation", request, context)

    def EndSession(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        return self._serve("EndSession", request, context)


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_failure(host: str, port: int) -> str:
    """Why the system refuses to bind host:port (asked again with a plain socket), for the start-up error."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return "gRPC could not bind it"


def _listening_elsewhere(host: str, port: int) -> list[str]:
    """The addresses a name stands for (localhost: 127.0.0.1 and ::1, as gRPC's resolver has it) whose
    listening socket on `port` is another process's, as this host's kernel tables say (Linux; elsewhere
    none is found). An address literal or a wildcard is bound whole or not at all: nothing to check."""
    try:
        ipaddress.ip_address(host)
        return []
    except ValueError:
        pass
    if host == "localhost":
        wanted = {"127.0.0.1", "::1"}
    else:
        try:
            wanted = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:
            return []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    ours = set()
    for fd in fds:
        try:
            ours.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed since (the listing's own descriptor among them)
    listeners: dict[str, set[str]] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, local_port = fields[1].partition(":")
            if fields[3] != "0A" or int(local_port, 16) != port or len(address) != width:  # 0A: LISTEN
                continue
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, width, 8))
            listeners.setdefault(ipaddress.ip_address(raw).compressed, set()).add(f"socket:[{fields[9]}]")
    return sorted(a for a in wanted if listeners.get(a) and not listeners[a] & ours)


def _read(path: Any) -> bytes | None:
    return None if path is None else open(path, "rb").read()


def _ssl_context(options: ServerOptions) -> ssl.SSLContext:
    """The data channel's TLS, from the gRPC port's files (mutual when a client CA is given)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(options.tls_cert, options.tls_key)
    if options.tls_client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(options.tls_client_ca)
    return context


class AclnnServer:
    """The gRPC server with its health, reflection and metrics services; start() and stop() like grpc.Server."""

    def __init__(self, options: ServerOptions, engine: Engine) -> None:
        self.options, self.engine = options, engine
        self.metrics = Metrics(lambda: len(engine.executors))
        self.storage = Storage(
            options.session_ttl_s,
            engine.ledger,
            engine.end_session,
            max_per_identity=options.max_tenant_sessions,
        )
        self.metrics.track_memory(lambda: engine.ledger.held, engine.ledger.held_by_kind, engine.ledger.budget_bytes)
        self.metrics.track_buffers(lambda: len(engine.buffers))
        self.metrics.track_admission(lambda: engine.admission.running, lambda: engine.admission.waiting)
        self.health = HealthService(("", SERVICE_NAME))  # NOT_SERVING until the backend is ready
        # Calls other than health checks: one per admitted or queued execution, plus a few cheap ones
        # (plans, uploads); beyond them RESOURCE_EXHAUSTED at once. Health checks have threads of their own.
        workers = options.max_concurrency + options.max_queue + 4
        self._health_pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="aclnn-health")
        self.identities = Identities(tokens=options.auth_token_file is not None, host=options.host)
        self.progress = Progress(options.data_handshake_timeout_s)
        per_identity = options.max_tenant_calls or max(1, workers // 2)
        self.call_limit = CallLimit(
            workers, self._health_pool, self.identities.of, self.metrics.refused.inc, per_identity
        )
        interceptors: list[grpc.ServerInterceptor] = [self.call_limit]
        # Threads are made on first use: a server without tokens never makes any.
        self._refusal_pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="aclnn-refuse")
        if options.auth_token_file:  # outermost: a refused call takes no slot and its request is never read
            with options_at_fault(auth_token_file=options.auth_token_file):
                self._tokens = TokenAuthInterceptor(read_tokens(options.auth_token_file), self._refusal_pool)
            interceptors.insert(0, self._tokens)
        self.grpc = grpc.server(
            # Two spare threads: refusals, and calls that ended while their thread is still finishing.
            futures.ThreadPoolExecutor(max_workers=workers + 2, thread_name_prefix="aclnn-rpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", options.max_message_bytes),
                # One server per port: a second one must fail to bind, not silently share it.
                ("grpc.so_reuseport", 0),
                # Clients re-resolve a DNS name when a connection ends: ending each after a while lets
                # pods added by an autoscaler get calls. Calls in flight get the grace period to finish.
                ("grpc.max_connection_age_ms", int(options.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(options.grace_period_s * 1000)),
                # A client gone without a word has its calls cancelled (aclnn_common.liveness).
                *grpc_server_options(),
            ],
        )
        self.service = AclnnService(engine, self.metrics, self.storage)
        pb_grpc.add_AclnnServicer_to_server(AclnnServicer(self.service, self.identities, self.progress), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.grpc,
        )
        address = bind_address(options.host, options.port)
        with options_at_fault(host=options.host, port=options.port):
            try:
                if options.tls_cert is not None:
                    credentials = grpc.ssl_server_credentials(
                        [(_read(options.tls_key), _read(options.tls_cert))],
                        root_certificates=_read(options.tls_client_ca),
                        require_client_auth=options.tls_client_ca is not None,
                    )
                    self.port = self.grpc.add_secure_port(address, credentials)
                else:
                    self.port = self.grpc.add_insecure_port(address)
            except RuntimeError:  # gRPC's says only "failed to bind": the system's reason
                raise OSError(f"cannot listen there ({_bind_failure(options.host, options.port)})") from None
            taken = _listening_elsewhere(options.host, self.port)
            if taken:  # gRPC binds what it can of a name's addresses and only logs the rest
                self.grpc.stop(None)
                raise OSError(
                    f"port {self.port} of {', '.join(taken)} is another process's: a second server would share it"
                )
        self.identities.port = self.port
        unix_socket = None if options.unix_socket in ("", "off") else options.unix_socket
        self.data_channel = (
            DataChannelServer(
                self.service,
                options.host,
                options.data_port if options.data_port >= 0 else None,
                options.max_message_bytes,
                DataChannelLimits(
                    max_connections=2 * workers,
                    max_per_identity=options.data_max_connections_per_tenant,
                    max_handshakes=options.data_max_handshakes,
                    handshake_timeout_s=options.data_handshake_timeout_s,
                    idle_timeout_s=options.data_idle_timeout_s,
                    workers=workers,
                ),
                tls=_ssl_context(options) if options.tls_cert is not None else None,
                unix_socket=unix_socket,
            )
            if options.data_port >= 0 or unix_socket is not None
            else None
        )
        if self.data_channel is not None:
            self.metrics.data_connections.set_function(lambda: self.data_channel.open_connections)
        self.metrics_port: int | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self.grpc.start()
        if self.data_channel is not None:
            self.data_channel.start()
        if self.options.metrics_port:
            with options_at_fault(host=self.options.host, metrics_port=self.options.metrics_port):
                self.metrics_port = self.metrics.serve(self.options.host, self.options.metrics_port)
        if self.engine.ready.is_set():
            self._serve_when_ready()
        else:
            threading.Thread(target=self._serve_when_ready, name="aclnn-ready", daemon=True).start()
        self._reaper = threading.Thread(target=self._reap, name="aclnn-reaper", daemon=True)
        self._reaper.start()

    def _serve_when_ready(self) -> None:
        """Health turns SERVING once the backend can compute (a cold cpu backend compiles first)."""
        self.engine.ready.wait()
        if self.engine.load_error is None and not self._stopping.is_set():
            for service in ("", SERVICE_NAME):
                self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _reap(self) -> None:
        """Frees lapsed sessions' handles and regions even when no call arrives to notice."""
        while not self._stopping.wait(min(self.options.session_ttl_s / 2, 5.0)):
            self.storage.reap()
            self.engine.reservations.reap()

    def stop(self, grace: float | None) -> threading.Event:
        """Reports NOT_SERVING, refuses new calls, lets in-flight ones finish within `grace` seconds.

        New calls are refused UNAVAILABLE (ServerLeaving), on both transports; a call begun before (its
        reservation live) goes on, and a call's kept results may still be downloaded (a call is not over
        for its client before): both transports serve until nothing is in flight, no reservation is
        live and no kept result is unfetched, or the grace period ends. The event is set once both
        transports have stopped and the backend is released.
        """
        self.health.enter_graceful_shutdown()
        self._stopping.set()
        self.service.draining = True
        deadline = time.monotonic() + (grace or 0)
        stopped = threading.Event()

        def release() -> None:
            if grace is not None:
                self._settle(deadline)
            left = None if grace is None else max(0.0, deadline - time.monotonic())
            if self.data_channel is not None:
                self.data_channel.stop(left)
            self.grpc.stop(left).wait()
            self._health_pool.shutdown(wait=False)
            self._refusal_pool.shutdown(wait=False)
            self.progress.stop()
            self.metrics.close()
            self.storage.close()
            self.engine.close(backend_too=True)
            stopped.set()

        threading.Thread(target=release, name="aclnn-release", daemon=True).start()
        return stopped

    def _settle(self, deadline: float) -> None:
        """Returns once nothing is owed, or at `deadline`: no call being served on either transport (those
        refused as the server leaves do not count), none begun (a live reservation), no work queued on a
        stream, and no kept result unfetched, or none fetched for _FETCH_WAIT_S (a client that got its
        reply fetches at once: one that never will, as one gone before its reply came, holds nothing up
        for long; a failure on a stream nobody synchronizes holds nothing up at all)."""
        unfetched, fetched_at = None, time.monotonic()
        while time.monotonic() < deadline:
            if self.service.in_flight or len(self.engine.reservations) or self.engine.streams.working():
                fetched_at = time.monotonic()
            else:
                left = self.storage.unfetched
                if not left or time.monotonic() - fetched_at > _FETCH_WAIT_S:
                    return
                if left != unfetched:
                    unfetched, fetched_at = left, time.monotonic()
            time.sleep(0.02)

    def reload(self) -> None:
        """SIGHUP: reads --auth-token-file again (tokens rotate without a restart); a file that does not
        read keeps the tokens in force. Calls in flight finish; a withdrawn token's data-channel tickets
        admit nobody from now on, and its connections close once their current request is done."""
        path = self.options.auth_token_file
        if path is None:
            log.info("SIGHUP: nothing to reload (no --auth-token-file)")
            return
        try:
            tokens = read_tokens(path)
        except (OSError, ValueError) as exc:
            log.error("SIGHUP: --auth-token-file %s not reloaded, the tokens in force stay: %s", path, exc)
            return
        self._tokens.replace(tokens)
        if self.data_channel is not None:  # a withdrawn token's tickets and connections end with it
            kept = {token_identity(token) for token in tokens}
            self.data_channel.revoke(lambda owner: (owner or "").startswith("token:") and owner not in kept)
        log.info("SIGHUP: %d tokens reloaded from %s", len(tokens), path)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc.wait_for_termination(timeout)


def create_server(options: ServerOptions, engine: Engine | None = None) -> tuple[AclnnServer, int, Engine]:
    """Builds (not starts) the server; returns it with its bound port and engine."""
    budget = options.memory_budget_bytes or default_memory_budget()
    engine = engine or Engine(
        options.backend,
        executor_ttl_s=options.executor_ttl_s,
        max_executors=options.max_executors,
        memory_budget_bytes=budget,
        # A server is shared: by default no identity may hold more than half of it.
        max_tenant_bytes=options.max_tenant_bytes or budget // 2,
        max_tenant_executors=options.max_tenant_executors,
        max_result_bytes=options.max_message_bytes,
        max_concurrency=options.max_concurrency,
        max_queue=options.max_queue,
        max_tenant_queue=options.max_tenant_queue,
        device=options.device,
        torch_device=options.torch_device,
        load_in_background=True,
    )
    server = AclnnServer(options, engine)
    return server, server.port, engine
