"""The gRPC client: NumPy in, NumPy out, over one server or a pool of replicas."""

from __future__ import annotations

import logging
import math
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.api import BaseClient, Executor
from aclnn_common.binding import BoundCall, array_layout, bind
from aclnn_common.chunks import byte_view, copy_bytes, receive_into, to_chunks, write_chunks
from aclnn_common.device import DeviceBuffer
from aclnn_common.errors import AclnnError
from aclnn_common.framing import MAILBOX_MAX_BYTES
from aclnn_common.framing import METHODS as DATA_CHANNEL_METHODS
from aclnn_common.liveness import grpc_client_options
from aclnn_common.tensor import Tensor, Value
from aclnn_common.types import numpy_dtype
from aclnn_common.wire import decode_error, encode_call

from .data_channel import UNSAID_MAILBOX_MAX_BYTES, Attachments, DataChannel, NoConnection
from .pool import RECONNECT_WAIT_S, Pool, data_channel_host, grpc_unavailable, is_loopback, parse_target
from .regions import Region, RegionPool
from .staging import StagedLayout, Staging
from .tls import check_token, settings

__all__ = ["Client", "data_channel_host"]

log = logging.getLogger("aclnn_client")

# The server enforces its own message limit; the client accepts whatever it is sent.
_UNLIMITED = -1
_T = TypeVar("_T")
# Worth another try (a backend gone, or busy); everything else is the call's own answer.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A server's device or runtime failure (361001): not replayed; one other backend is tried, once.
_DEVICE_FAILED = grpc.StatusCode.ABORTED
# The one retry layer (gRPC's own retries are off): a retry-safe call (run, planning, listing) is
# tried at most this many times, each on the next backend not known to be down, sleeping
# 0.05, 0.1, 0.2 s (at most 0.35 s in all) before the 2nd, 3rd and 4th when it was refused as busy.
# A backend gone (UNAVAILABLE) with no other to try: retries first wait for its connection to come
# back (a server restarting on its port), RECONNECT_WAIT_S in all (or the timeout, when shorter).
ATTEMPTS = 4
_BACKOFF_S = 0.05
# The longest a client holding state on a server (regions, buffers, repeatable executors) waits between renewals
# of its session's lease (sooner for a server whose lease is shorter: see Client._renew).
_KEEPALIVE_S = 10.0
_MIN_RENEWAL_S = 0.05  # however short a server's lease, renewals are no busy loop
# The most a thread keeps to receive kept results into between its calls (see _Transfers.scratch).
_SCRATCH_BYTES = 64 << 20
# Balanced channels spread stateless calls over every backend the name resolves to.
_SERVICE_CONFIG = '{"loadBalancingConfig": [{"round_robin": {}}]}'
# The default inline limits (max_inline_bytes None). Over gRPC a message's cost grows faster than its
# size (protobuf copies, and upb's serializer beyond a few MiB): streaming took less from 512 KiB-1 MiB
# tensors on (bench/transport.py --sweep). The data channel sends inline tensors raw, without that cost;
# over its Unix socket a call's tensors travel in its connection's mailbox, where the server reads them
# without a copy: tensors up to 64 MiB stay inline there (up to MAX_MAILBOX_ATTACHED_BYTES in all),
# twice as fast as an upload through the socket at 32-64 MiB. Over TCP an upload costs two exchanges
# more than the bytes, and its result a download and a free: tensors up to 16 MiB stay inline there
# (8 MiB calls took 9-12 ms inline against 15-17 ms uploaded), in all at most what the server's
# message limit leaves (its ticket says; from a server that does not say, 4 MiB each, as before).
UNIX_INLINE_BYTES = 64 << 20
TCP_INLINE_BYTES = 16 << 20
UNSAID_TCP_INLINE_BYTES = 4 << 20
GRPC_INLINE_BYTES = 512 << 10
_MAILBOX_MESSAGE_ROOM = 1 << 20  # of a mailbox or message limit, kept for the call's message: the rest may be attached
MAX_MAILBOX_ATTACHED_BYTES = MAILBOX_MAX_BYTES - _MAILBOX_MESSAGE_ROOM
# Run requests kept per client, by layout (see _layout_key): a training loop repeats a few layouts.
_LAYOUTS = 256
# Shared-memory calls' staging kept by layout: at most this many, their regions this many bytes in all.
_STAGED_LAYOUTS = 16
_STAGED_BYTES = 16 << 20
_REPEATED_LAYOUTS = 64  # arrays' layouts remembered (_Repeat), each naming a kept staging


class Client(BaseClient):
    """Calls aclnn operators on an aclnn-serve server, or on a pool of replicas.

    `target` is "host:port", a list of them, or a DNS name ("name:port", "dns:///name:port",
    "dns://DNS-SERVER:53/name:port", as behind a headless Kubernetes Service). A name is resolved
    again while the client runs: stateless calls go round-robin through gRPC's own resolver, and
    state (an executor, a kept result, regions) stays with the backend that holds it (see
    `client/pool.py`). `run` and planning move to another backend when one is gone or busy (at
    most ATTEMPTS tries); an executor whose backend is gone is planned again elsewhere.

    TLS: `tls=True` verifies servers against the system's trust store; any of the PEM arguments
    (`root_certificates`, and `private_key` with `certificate_chain` for mutual TLS) implies TLS.
    Certificates are verified against the host name in `target`, on gRPC and the data channel.
    `token` is sent as a bearer token, and never in clear to a server off this host: that raises
    ValueError unless `allow_plaintext_token=True`. `timeout` is each RPC's deadline in seconds.

    Tensors larger than `max_inline_bytes` are streamed in chunks and referenced by handle,
    so they may exceed gRPC's message limits (2 GiB included); by default 64 MiB over the data
    channel's Unix socket (in all at most MAX_MAILBOX_ATTACHED_BYTES: the largest go as uploads
    beyond it) and 16 MiB over its TCP (in all at most the server's message limit less 1 MiB),
    where inline tensors travel raw beside the call (on the
    Unix socket in a mailbox the server reads them from: its memory, the size of the largest
    call's tensors, up to 256 MiB, stays with the connection), and GRPC_INLINE_BYTES over gRPC,
    whose messages cost more per byte than streaming beyond that. With `data_channel=True` (the
    default), calls and tensor bytes go over the server's data channel, which moves bytes
    without protobuf copies: its Unix socket when the server runs on this host (a loopback
    target; `unix_socket=False`: never), else a TCP connection beside gRPC (with the same
    TLS); gRPC when the server offers neither, or cannot take a connection now. With
    `shared_memory=True` as well, tensor bytes go through shared memory (sealed memfds,
    passed to the server over its Unix socket) when it has one on this host; without it, results
    of 1-64 MiB do (staging.RESULT_REGION_BYTES).
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        allow_plaintext_token: bool = False,
        shared_memory: bool = False,
        data_channel: bool = True,
        unix_socket: bool = True,
        timeout: float | None = None,
        max_inline_bytes: int | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        parsed = parse_target(target)
        self._tls = settings(tls, root_certificates, private_key, certificate_chain)
        check_token(token, self._tls, parsed.loopback, allow_plaintext_token)  # before anything connects
        super().__init__()
        channel_options = [
            ("grpc.max_send_message_length", _UNLIMITED),
            ("grpc.max_receive_message_length", _UNLIMITED),
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 0),  # one retry layer: this client's (ATTEMPTS)
            *grpc_client_options(),  # a server that stops answering fails the call (common/liveness.py)
            # A token in clear goes straight to the server, never through an HTTP proxy (http_proxy,
            # grpc_proxy), which would read it: to a loopback server it has no business at all.
            *([("grpc.enable_http_proxy", 0)] if token and self._tls is None else []),
            *options,
        ]
        self._pool = Pool(parsed, self._tls.credentials() if self._tls else None, channel_options)
        # Per backend: its data channel, None (gRPC only), absent until first needed.
        self._data_channels: dict[int, DataChannel | None] = {}
        self._use_data_channel = data_channel
        self._data_lock = threading.Lock()
        self._base_metadata = (("x-aclnn-session", secrets.token_hex(16)),)
        if token:
            self._base_metadata += (("authorization", f"Bearer {token}"),)
        self._timeout = timeout
        self.max_inline_bytes = max_inline_bytes
        self._unix_socket = unix_socket
        self._shared_memory = shared_memory and hasattr(os, "memfd_create")
        self._regions = RegionPool()
        # Backends holding state of this client's session (regions, executors), with a count each:
        # the keepalive thread renews their leases while any is held.
        self._held: dict[int, int] = {}
        self._held_lock = threading.Lock()
        self._repeatable: set[str] = set()  # repeatable executors not destroyed (each holds its session)
        self._region_replicas: set[int] = set()
        self._called: set[int] = set()  # backends this client's session may hold something on (EndSession at close)
        self._keepalive: threading.Thread | None = None
        self._closed = threading.Event()
        self._operators: dict[str, tuple[frozenset[str], frozenset[str]]] | None = None
        self._operators_lock = threading.Lock()
        self._transfers = _Transfers(self)
        # Run requests whose tensors all travel attached, by layout: the same layout encodes to the same
        # message (descriptors, attached ranges, placements), so it is built once (~60 us of Python).
        self._layouts: dict[tuple, tuple[pb.OpCall, bool]] = {}
        self._layouts_lock = threading.Lock()
        # With shared memory, the staging of recent layouts (staging.StagedLayout): each its own regions.
        self._staged: dict[tuple, StagedLayout] = {}
        self._staged_bytes = 0
        self._repeats: dict[Hashable, _Repeat] = {}  # by the arrays' layout (binding.array_layout)
        self._device_home: int | None = None  # the backend holding this client's device memory

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._closed.set()
        channels = [c for c in list(self._data_channels.values()) if c is not None]
        for channel in channels:
            for region in channel.registered():
                try:
                    channel.unregister(region, self._timeout)
                except (AclnnError, NoConnection):
                    pass  # the server is gone: its lease on our session lapses by itself
        self._regions.close()
        for replica in sorted(self._called):  # what this client's session holds there ends now
            try:
                self._call_on(replica, "EndSession", pb.Empty())
            except (AclnnError, NoConnection):
                pass  # gone: its lease on our session lapses by itself
        for channel in channels:
            channel.close()
        self._pool.close()

    def list_operators(self) -> dict[str, list[dict[str, Any]]]:
        """The server's operators and their parameters (name, kind, output, optional, inout)."""
        self._check_open()
        reply, _ = self._call_any("ListOperators", lambda replica: pb.Empty(), stateless=lambda: True)
        return {
            op.name: [
                {"name": p.name, "kind": p.kind, "output": p.output, "optional": p.optional, "inout": p.inout}
                for p in op.params
            ]
            for op in reply.operators
        }

    # Calls ----------------------------------------------------------------------------------

    def _metadata(self, stream: int | None = None) -> tuple[tuple[str, str], ...]:
        return self._base_metadata if stream is None else (*self._base_metadata, ("x-aclnn-stream", str(stream)))

    def _call_on(
        self,
        replica: int,
        method: str,
        request: Any,
        stream: int | None = None,
        stateless: bool = False,
        attachments: Attachments | None = None,
    ) -> Any:
        """Calls one backend: over its data channel when it has one, else gRPC (the balanced channel
        when the call is `stateless` and the target is a name: gRPC picks the backend). A request's
        `attachments` go raw beside it over the data channel; gRPC takes them back inside it."""
        if not stateless:
            self._called.add(replica)  # a call that may keep something in this client's session there
        channel = self._data_channel(replica) if method in DATA_CHANNEL_METHODS else None
        if channel is not None:
            try:
                return channel.call(method, request, stream, self._timeout, attachments)
            except NoConnection as exc:
                self._no_connection(replica, exc)  # nothing was sent: gRPC carries it
            except AclnnError as error:
                if error.grpc_code == grpc.StatusCode.UNAVAILABLE:
                    self._forget_data_channel(replica)  # the server may be back on another port: ask again
                raise
        if attachments is not None:
            attachments.fold_into(request)
        return self._call_grpc(None if stateless and self._pool.balanced else replica, method, request, stream)

    def _no_connection(self, replica: int, exc: NoConnection) -> None:
        """The data channel had no connection for a request (which then goes over gRPC)."""
        log.debug("data channel of backend %d: %s; this request goes over gRPC", replica, exc)
        if not exc.refused:
            self._forget_data_channel(replica)  # gone, or restarted elsewhere: ask for a new one next time

    def _call_grpc(self, replica: int | None, method: str, request: Any, stream: int | None = None) -> Any:
        """One RPC on a backend's own channel, or on the balanced channel (`replica` None)."""
        stub = self._pool.balanced if replica is None else self._pool.stub(replica)
        try:
            return getattr(stub, method)(request, metadata=self._metadata(stream), timeout=self._timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:  # this client cancels none: the server ended it
                raise grpc_unavailable(f"the server ended the call as it stopped ({error.details()})") from None
            raise decode_error(error) from None

    def _call_any(
        self,
        method: str,
        build: Callable[[int], Any],
        stream: int | None = None,
        stateless: Callable[[], bool] = lambda: False,
        attachments: Callable[[], Attachments | None] = lambda: None,
        then: Callable[[Any, int], Any] = lambda reply, replica: reply,
    ) -> tuple[Any, int]:
        """Builds the request for the next backend in turn and calls it; a gone or busy one hands it on.
        Returns `then(reply, backend)` (what the call needs of that backend still: its kept results), and
        the backend.

        At most ATTEMPTS tries. A device failure (ABORTED) is not a backend gone: one other backend
        is tried, once, and the one whose device failed is not tried again.
        """
        device_failed: int | None = None
        reconnect_by: float | None = None  # how long UNAVAILABLE waits for a connection, over all tries
        for attempt in range(ATTEMPTS):
            replica = self._pool.next()
            if replica == device_failed:
                replica = self._pool.next()
            try:
                request = build(replica)  # its reservation or uploads may find the backend busy too
                reply = self._call_on(replica, method, request, stream, stateless(), attachments())
                return then(reply, replica), replica
            except AclnnError as error:
                elsewhere = error.grpc_code == _DEVICE_FAILED and device_failed is None and self._pool.count() > 1
                if not (elsewhere or error.grpc_code in _RETRYABLE) or attempt == ATTEMPTS - 1:
                    raise
                if elsewhere:
                    device_failed = replica
                    continue
                if error.grpc_code == grpc.StatusCode.UNAVAILABLE:
                    self._pool.down(replica)
                    if self._pool.count() == 1:  # nowhere else to go: a restarting server's connection comes back
                        reconnect_by = reconnect_by or time.monotonic() + min(RECONNECT_WAIT_S, self._timeout or 1e9)
                        self._pool.wait_connected(replica, reconnect_by - time.monotonic())
                if error.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED or self._pool.count() == 1:
                    time.sleep(_BACKOFF_S * 2**attempt)  # busy, or nowhere else to go: back off
        raise AssertionError("unreachable")

    def _output_names(self, op: str) -> frozenset[str]:
        return self._written_names(op)[0]

    def _inout_names(self, op: str) -> frozenset[str]:
        return self._written_names(op)[1]

    def _written_names(self, op: str) -> tuple[frozenset[str], frozenset[str]]:
        """An operator's outputs and its in/out tensors, as the server lists them (asked once)."""
        if self._operators is not None:
            return self._operators.get(op, (frozenset(), frozenset()))
        with self._operators_lock:
            if self._operators is None:
                self._operators = {
                    name: (
                        frozenset(p["name"] for p in params if p["output"]),
                        frozenset(p["name"] for p in params if p["inout"]),
                    )
                    for name, params in self.list_operators().items()
                }
        return self._operators.get(op, (frozenset(), frozenset()))

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        replica = self._pinned(values)
        if replica is not None:  # on device memory: its backend plans it
            plan = self._call_on(replica, "GetWorkspaceSize", encode_call(op, values))
        else:
            plan, replica = self._call_any("GetWorkspaceSize", lambda replica: encode_call(op, values))
        return plan.workspace_size, f"{replica}/{plan.executor}"

    def _execute(self, executor: Executor, stream: int | None) -> None:
        self._regions_kept(lambda: self._execute_once(executor, stream))

    def _execute_once(self, executor: Executor, stream: int | None) -> None:
        call = executor.call
        sizes = _output_sizes(call.values, call.output_targets)
        for attempt in range(2):
            replica, _, server_id = executor.id.partition("/")
            with Staging(self._transfers) as staging:
                request = pb.ExecuteRequest(executor=server_id)
                staging.place(int(replica), sizes, request.placements)
                reservation = pb.CallReservation(execute=pb.ExecuteRequest(executor=server_id))
                reservation.execute.placements.MergeFrom(request.placements)
                staged = staging.inputs(int(replica), call.inputs(), reservation)
                for name, data in staged.items():
                    if isinstance(data, bytes):
                        request.inputs[name] = data
                    else:
                        request.input_refs[name].CopyFrom(data)
                request.reservation = staging.reservation
                try:
                    reply = self._call_on(int(replica), "Execute", request, stream, attachments=staging.attachments)
                except AclnnError as error:
                    if attempt or not (error.grpc_code == grpc.StatusCode.UNAVAILABLE or _lost(executor, error)):
                        raise
                    staging.reset(failed=True)
                    self._replan(executor)  # its replica is gone, or lost it: the executor is planned again
                    continue
                call.write_outputs(staging.results(int(replica), reply.outputs))
                return

    def run(self, op: str, /, *, stream: int | None = None, **params: Any) -> None:
        """Both phases in one round trip; fills the outputs in place. A call of a layout that ran
        before (the same arrays' shapes and dtypes, the same scalars) is sent as it was then: with
        shared memory from the regions its layout keeps (_Repeat), else, when its tensors and results
        all travelled raw beside it over the data channel, as the same message (_AttachedRepeat)."""
        repeats = stream is None and (self._shared_memory or (self._use_data_channel and self._pool.count() == 1))
        layout = array_layout(op, params) if repeats else None
        if layout is None:
            return super().run(op, stream=stream, **params)
        self._check_open()
        key, arrays = layout
        with self._layouts_lock:
            repeat = self._repeats.get(key)
        if repeat is not None and repeat(self, arrays):
            return None
        call = bind(op, params, self._output_names(op), self._inout_names(op))
        ran = self._regions_kept(lambda: self._run_once(call, None))
        if ran is not None:
            with self._layouts_lock:
                if len(self._repeats) >= _REPEATED_LAYOUTS:
                    del self._repeats[next(iter(self._repeats))]  # the oldest
                self._repeats[key] = ran
        return None

    def _run(self, call: BoundCall, stream: int | None) -> None:
        self._regions_kept(lambda: self._run_once(call, stream))

    def _run_once(self, call: BoundCall, stream: int | None) -> _Repeat | _AttachedRepeat | None:
        """Runs a bound call; returns how to repeat it when its staging was kept for its layout (shared
        memory), or it went all attached over the data channel as its layout's kept request."""
        sizes = _output_sizes(call.values, call.output_targets)
        attempts = 0
        sent: tuple[pb.OpCall, tuple[str, ...]] | None = None  # the request, and its inputs in attached order

        with Staging(self._transfers) as staging:

            def build(replica: int) -> pb.OpCall:
                nonlocal attempts, sent
                staging.reset(failed=True)  # a previous attempt's, which failed (its regions may still be written)
                staging.retried, attempts, sent = attempts > 0, attempts + 1, None
                views = {name: byte_view(tensor.data) for name, tensor in call.inputs().items()}
                layout = self._layout_key(replica, call, views)
                if layout is not None and self._shared_memory:
                    staged = self._staged_layout(replica, layout)
                    if staged is not None:
                        return staging.adopt(staged, views)
                keyed = layout is not None and not (self._shared_memory or staging.retried)
                known = self._layouts.get(layout) if keyed else None
                if known is not None:
                    if known[1]:
                        staging.attach(views)  # at the same offsets as when it was built: same sizes, same order
                    request = pb.OpCall()
                    request.CopyFrom(known[0])  # gRPC, if it must carry it, folds the bytes into the copy
                    sent = (request, tuple(views))
                    return request
                request = encode_call(call.op, call.values, storage=False)
                staging.place(replica, sizes, request.placements)
                staged = staging.inputs(replica, call.inputs(), pb.CallReservation(run=request))
                for name, data in staged.items():
                    if isinstance(data, bytes):
                        request.params[name].tensor.data = data
                    else:
                        request.params[name].tensor.ref.CopyFrom(data)
                request.reservation = staging.reservation
                if layout is not None and self._shared_memory:
                    staging.keep(layout, request, views, sizes)
                elif layout is not None and (staging.all_attached or not (views or sizes)):  # or all on device
                    self._remember_layout(layout, request, attached=staging.attachments is not None)
                    sent = (request, tuple(views))
                return request

            replica = self._pinned(call.values)
            if replica is not None:  # on device memory: its backend runs it
                request = build(replica)
                reply = self._call_on(replica, "Run", request, stream, attachments=staging.attachments)
                results = staging.results(replica, reply.outputs)
            else:  # a backend that goes away before its kept results are downloaded hands the call on too
                (reply, results), replica = self._call_any(
                    "Run",
                    build,
                    stream,
                    stateless=lambda: staging.stateless,
                    attachments=lambda: staging.attachments,
                    then=lambda reply, replica: (reply, staging.results(replica, reply.outputs)),
                )
            call.write_outputs(results)
            if staging.staged is not None:
                return _Repeat.of(replica, staging.staged.key, reply)
            if sent is not None and staging.all_attached and staging.attachments.received is not None:
                return _AttachedRepeat.of(self._data_channels.get(replica), replica, *sent, reply)
            return None

    def _layout_key(self, replica: int, call: BoundCall, views: Mapping[str, memoryview]) -> tuple | None:
        """What a Run request's encoding depends on, when it may be one kept (tensors attached over the
        data channel or in shared memory, or in device buffers, keyed by buffer and offset); None
        otherwise, or for an unhashable value. Scalars are keyed by type and bits (1, True and 1.0,
        or 0.0 and -0.0, encode differently)."""
        if not self._transfers.attaches(replica):
            return None
        transfers = self._transfers
        limits = (
            transfers.max_inline_bytes(replica),
            transfers.max_attached_bytes(replica),
            transfers.max_attached_bytes(replica, results=True),
        )
        key: list[object] = [replica, call.op, limits]
        for name, value in call.values.items():
            if isinstance(value, Tensor):
                if isinstance(value.data, DeviceBuffer):
                    size: object = ("device", value.data.id, value.data.offset)
                else:
                    size = views[name].nbytes if name in views else -1 if value.data is None else -2
                key.append((name, value.view_dims, value.data_type, value.strides, value.offset, value.format,
                            value.storage_dims, size))  # fmt: skip
            elif isinstance(value, float):
                key.append((name, float, _DOUBLE.pack(value)))
            else:
                key.append((name, type(value), value))
        layout = tuple(key)
        try:
            hash(layout)
        except TypeError:  # a hand-made Tensor with lists: encoded each time
            return None
        return layout

    def _remember_layout(self, layout: tuple, request: pb.OpCall, attached: bool) -> None:
        """Keeps a request by its layout; `attached`: its tensors' bytes travel attached beside it."""
        known = pb.OpCall()
        known.CopyFrom(request)
        with self._layouts_lock:
            if len(self._layouts) >= _LAYOUTS:
                del self._layouts[next(iter(self._layouts))]  # the oldest
            self._layouts[layout] = (known, attached)

    def _staged_layout(self, replica: int, layout: tuple) -> StagedLayout | None:
        """The staging kept for a shared-memory call's layout, taken out for this call; None when there
        is none, or its regions were registered again since (a server restarted, or a lease lapsed)."""
        with self._layouts_lock:
            staged = self._staged.pop(layout, None)
            if staged is not None:
                self._staged_bytes -= staged.nbytes
        if staged is None:
            return None
        try:
            channel = self._data_channel(replica)
            current = channel is not None and all(
                channel.region_id(region, region.fd, region.size, self._timeout) == region_id
                for region, region_id in staged.ids
            )
        except (AclnnError, NoConnection):
            current = False
        if current:
            return staged
        self._regions.release(staged.regions)
        return None

    def _keep_staged(self, staged: StagedLayout) -> None:
        """Keeps a call's staging for its layout (staging.StagedLayout); the oldest kept go back to the
        pool beyond _STAGED_LAYOUTS of them, or _STAGED_BYTES of their regions."""
        released = []
        with self._layouts_lock:
            if self._closed.is_set():
                return  # the pool closed its regions
            other = self._staged.pop(staged.key, None)  # two calls of one layout, built at once
            if other is not None:
                self._staged_bytes -= other.nbytes
                released += other.regions
            self._staged[staged.key] = staged
            self._staged_bytes += staged.nbytes
            while len(self._staged) > _STAGED_LAYOUTS or self._staged_bytes > _STAGED_BYTES:
                oldest = self._staged.pop(next(iter(self._staged)))
                self._staged_bytes -= oldest.nbytes
                released += oldest.regions
        self._regions.release(released)

    def _regions_kept(self, attempt: Callable[[], _T]) -> _T:
        """Runs a call; when a server lost this session's regions (it restarted, or the lease lapsed),
        registers them again and runs it once more."""
        try:
            return attempt()
        except AclnnError as error:
            if not _regions_lost(error):  # results' regions too
                raise
        log.info("a server lost this client's shared-memory regions: registering them again")
        for channel in list(self._data_channels.values()):
            if channel is not None:
                channel.forget_regions()
        return attempt()

    def _replan(self, executor: Executor) -> None:
        lost_id = executor.id
        executor.workspace_size, executor.id = self._get_workspace_size(executor.op, executor.call.descriptors())
        if executor.repeatable:
            self._set_executor_repeatable(executor.id)
            self._forget_repeatable(lost_id)

    def _on_executor(self, executor_id: str, method: str) -> None:
        replica, _, server_id = executor_id.partition("/")
        self._call_on(int(replica), method, pb.ExecutorRef(executor=server_id))

    def _set_executor_repeatable(self, executor_id: str) -> None:
        self._on_executor(executor_id, "SetExecutorRepeatable")
        # It lives in this client's session on its replica: the session must outlive pauses in use.
        with self._held_lock:
            self._repeatable.add(executor_id)
        self._hold_session(int(executor_id.partition("/")[0]))

    def _destroy_executor(self, executor_id: str) -> None:
        try:
            self._on_executor(executor_id, "DestroyExecutor")
        finally:
            self._forget_repeatable(executor_id)

    def _forget_repeatable(self, executor_id: str) -> None:
        with self._held_lock:
            held = executor_id in self._repeatable
            self._repeatable.discard(executor_id)
        if held:
            self._release_session(int(executor_id.partition("/")[0]))

    # Device memory ------------------------------------------------------------------------------

    def _pinned(self, values: Mapping[str, Value]) -> int | None:
        """The backend a call on device memory must run on (all of a client's buffers live on one); else None."""
        replica = None
        for name, value in values.items():
            if isinstance(value, Tensor) and isinstance(value.data, DeviceBuffer):
                self._own(value.data, name)
                replica = value.data.replica
        return replica

    def _malloc(self, nbytes: int) -> DeviceBuffer:
        if self._device_home is None:
            with self._held_lock:
                if self._device_home is None:
                    self._device_home = self._pool.next()
        replica = self._device_home
        reply = self._call_on(replica, "MallocBuffer", pb.MallocRequest(size=nbytes))
        self._hold_session(replica)  # buffers live in this client's session: it is kept alive while any is
        return DeviceBuffer(reply.buffer, reply.size, self, replica)

    def _free_buffer(self, buf: DeviceBuffer) -> None:
        self._call_on(buf.replica, "FreeBuffer", pb.BufferRef(buffer=buf.id))
        self._release_session(buf.replica)

    def _write(self, dst: DeviceBuffer, data: memoryview) -> None:
        request = pb.BufferWrite(buffer=dst.id, offset=dst.offset, size=data.nbytes)
        channel = self._data_channel(dst.replica)
        if channel is not None:
            try:
                return channel.write_buffer(request, data, self._timeout)
            except NoConnection as exc:
                self._no_connection(dst.replica, exc)
        try:
            stub = self._pool.stub(dst.replica)
            stub.WriteBuffer(write_chunks(request, data), metadata=self._metadata(), timeout=self._timeout)
        except grpc.RpcError as error:
            raise decode_error(error) from None
        return None

    def _read(self, src: DeviceBuffer, target: Any) -> None:
        request = pb.BufferRange(buffer=src.id, offset=src.offset, size=target.nbytes)
        channel = self._data_channel(src.replica)
        if channel is not None:
            try:
                return channel.read_buffer(request, target, self._timeout)
            except NoConnection as exc:
                self._no_connection(src.replica, exc)
        try:
            chunks = self._pool.stub(src.replica).ReadBuffer(request, metadata=self._metadata(), timeout=self._timeout)
            receive_into(target, chunks)
        except grpc.RpcError as error:
            raise decode_error(error) from None
        return None

    def _copy(self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int) -> None:
        request = pb.BufferCopy(size=nbytes)
        request.dst.buffer, request.dst.offset = dst.id, dst.offset
        request.src.buffer, request.src.offset = src.id, src.offset
        self._call_on(dst.replica, "CopyBuffer", request)

    def _fill(self, dst: DeviceBuffer, value: int, nbytes: int) -> None:
        request = pb.BufferFill(size=nbytes, value=value)
        request.dst.buffer, request.dst.offset = dst.id, dst.offset
        self._call_on(dst.replica, "FillBuffer", request)

    def _synchronize(self, stream: int | None) -> None:
        if self._device_home is not None:  # calls are queued only on device memory, which lives there
            self._call_on(self._device_home, "Synchronize", pb.Empty(), stream)

    # Bytes outside messages -------------------------------------------------------------------

    def _upload(self, replica: int, data: memoryview, reservation: str = "") -> str:
        channel = self._data_channel(replica)
        if channel is not None:
            try:
                return channel.upload(data, self._timeout, reservation)
            except NoConnection as exc:
                self._no_connection(replica, exc)
        metadata = self._metadata() + ((("x-aclnn-reservation", reservation),) if reservation else ())
        try:
            stub = self._pool.stub(replica)
            reply = stub.UploadTensor(to_chunks(data), metadata=metadata, timeout=self._timeout)
        except grpc.RpcError as error:
            raise decode_error(error) from None
        return reply.handle

    def _reserve(self, replica: int, request: pb.CallReservation) -> str:
        return self._call_on(replica, "ReserveCall", request).reservation

    def _release_reservation(self, replica: int, reservation: str) -> None:
        try:
            self._call_on(replica, "ReleaseReservation", pb.Reservation(reservation=reservation))
        except AclnnError:
            pass  # gone with its replica, or it ends by itself

    def _download(self, replica: int, handle: str, view: Any) -> None:
        channel = self._data_channel(replica)
        if channel is not None:
            try:
                channel.download(handle, view, self._timeout)
                return
            except NoConnection as exc:
                self._no_connection(replica, exc)
        chunks = self._pool.stub(replica).DownloadTensor(
            pb.TensorHandle(handle=handle), metadata=self._metadata(), timeout=self._timeout
        )
        try:
            receive_into(view, chunks)
        except grpc.RpcError as error:
            raise decode_error(error) from None

    def _data_channel(self, replica: int) -> DataChannel | None:
        """The backend's data channel, asked for once; None when it offers none or cannot be reached."""
        if not self._use_data_channel:
            return None
        if replica in self._data_channels:
            return self._data_channels[replica]
        with self._data_lock:
            if replica not in self._data_channels:
                self._data_channels[replica] = self._open_data_channel(replica)
        return self._data_channels[replica]

    def _open_data_channel(self, replica: int) -> DataChannel | None:
        """The server's Unix socket when it runs on this host, else its TCP data channel; None: gRPC only."""
        address = self._pool.address(replica)
        host = data_channel_host(address)
        local = address.startswith("unix:") or (host is not None and is_loopback(host))
        if host is None and not local:
            return None
        try:
            offer = self._call_grpc(replica, "OpenDataChannel", pb.Empty())
        except AclnnError as error:
            if error.grpc_code == grpc.StatusCode.UNIMPLEMENTED:
                return None  # a server from before the data channel
            raise

        def open_ticket() -> bytes:
            return self._call_grpc(replica, "OpenDataChannel", pb.Empty()).ticket

        ways: list[tuple[str, int] | str] = []
        if offer.unix_path and local and self._unix_socket:
            ways.append(offer.unix_path)
        if offer.port and host is not None:
            ways.append((host, offer.port))
        failures = []
        for way in ways:
            tls = self._tls.context() if self._tls and not isinstance(way, str) else None
            # Its ticket came from the backend at this address: its data port is at the same address.
            channel = DataChannel(
                way,
                offer.ticket,
                open_ticket,
                tls=tls,
                server_hostname=self._pool.target.host,
                mailbox_max_bytes=offer.mailbox_max_bytes or UNSAID_MAILBOX_MAX_BYTES,
                max_message_bytes=offer.max_message_bytes,
            )
            try:
                channel.warm()  # one real connection (TLS and admission included) proves the way
            except NoConnection as exc:
                if exc.refused:
                    return channel  # reachable but full now: requests go over gRPC until it admits one
                failures.append(str(exc))
                continue
            except (OSError, AclnnError) as exc:
                failures.append(f"{channel}: {exc}")
                continue
            return channel
        if failures:
            log.warning("data channel unusable (%s): using gRPC only", "; ".join(failures))
        return None

    def _forget_data_channel(self, replica: int) -> None:
        with self._data_lock:
            channel = self._data_channels.pop(replica, None)
        if channel is not None:
            channel.close()

    def _free(self, replica: int, handle: str) -> None:
        try:
            self._call_on(replica, "FreeTensor", pb.TensorHandle(handle=handle))
        except AclnnError:
            pass  # gone with its replica, or freed when the session lapses

    def _region(self, replica: int, size: int, results: bool = False) -> tuple[Region, str] | None:
        """A pooled region (a `results` one: staging.RESULT_REGION_BYTES) and its id on `replica`
        (registered on first use); None when the replica has no Unix socket on this host, or takes no
        region now (the bytes then go another way)."""
        channel = self._data_channel(replica)
        if channel is None or not channel.unix:
            return None
        region = self._regions.acquire(size, results)
        try:
            region_id = channel.region_id(region, region.fd, region.size, self._timeout)
        except (AclnnError, NoConnection) as exc:
            if results:  # a server sealed it already (before a restart, or a lapsed lease): a fresh one next time
                self._regions.retire([region])
                region.close()
            else:
                self._regions.release([region])
            log.debug("no shared memory for %d bytes on replica %d: %s", size, replica, exc)
            return None
        self._called.add(replica)
        if replica not in self._region_replicas:
            self._region_replicas.add(replica)
            self._hold_session(replica)  # pooled regions live as long as this client
        return region, region_id

    def _retire(self, regions: list[Region]) -> None:
        """Regions of a call that did not end normally: the server may still write its late results
        into them, so they are never reused. Each is unregistered (the server unmaps it once the
        call's last use of it ends) and closed; the pool makes fresh ones."""
        if not regions:
            return
        self._regions.retire(regions)
        channels = [c for c in list(self._data_channels.values()) if c is not None and c.unix]
        for region in regions:
            for channel in channels:
                try:
                    channel.unregister(region, self._timeout)
                except (AclnnError, NoConnection):
                    pass  # unreachable now: the session's lease ends it
            region.close()

    def _hold_session(self, replica: int) -> None:
        """Something of this client's session lives on `replica` (regions, a repeatable executor): its
        lease is renewed (KeepAlive) until as many `_release_session` calls."""
        with self._held_lock:
            self._held[replica] = self._held.get(replica, 0) + 1
            if self._keepalive is None:
                self._keepalive = threading.Thread(target=self._renew, name="aclnn-keepalive", daemon=True)
                self._keepalive.start()

    def _release_session(self, replica: int) -> None:
        with self._held_lock:
            self._held[replica] -= 1
            if not self._held[replica]:
                del self._held[replica]

    def _renew(self) -> None:
        """Renews the leases of sessions holding state until close(); a failure is logged, never fatal.
        Each renewal comes within a third of the shortest lease the servers state (their
        --session-ttl-s: a server's own setting, which a fixed period missed when it was short), and
        at least every _KEEPALIVE_S; the first at once, to learn them."""
        leases: dict[int, float] = {}  # what each server stated, kept while it holds nothing of ours too
        period = 0.0
        while not self._closed.wait(period):
            with self._held_lock:
                replicas = list(self._held)
            for replica in replicas:
                try:
                    lease = self._call_on(replica, "KeepAlive", pb.Empty())
                    if lease.session_ttl_s > 0:  # a server that states none: the fixed period
                        leases[replica] = lease.session_ttl_s
                except Exception as exc:  # the thread must outlive any one failure
                    log.warning("keepalive to %s failed: %s", self._pool.address(replica), exc)
            period = min([_KEEPALIVE_S] + [max(ttl / 3, _MIN_RENEWAL_S) for ttl in leases.values()])


class _Transfers:
    """The client's byte moves as staging sees them (staging.Transfers), so staging needs no client internals."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.shared_memory = client._shared_memory
        self.upload, self.download, self.free = client._upload, client._download, client._free
        self.reserve, self.release_reservation = client._reserve, client._release_reservation
        self.region, self.retire, self.release = client._region, client._retire, client._regions.release
        self.keep = client._keep_staged
        self._scratch = threading.local()

    def scratch(self, nbytes: int) -> np.ndarray:
        """Each thread's own bytes to receive kept results into, reused by its next call (a fresh array's
        pages cost a large download as much as the copy out of it); above _SCRATCH_BYTES a fresh array."""
        if nbytes > _SCRATCH_BYTES:
            return np.empty(nbytes, np.uint8)
        held = getattr(self._scratch, "bytes", None)
        if held is None or held.nbytes < nbytes:
            held = self._scratch.bytes = np.empty(nbytes, np.uint8)
        return held[:nbytes]

    def attaches(self, replica: int) -> bool:
        return self._channel(replica) is not None

    def max_inline_bytes(self, replica: int, retried: bool = False) -> int:
        if self.client.max_inline_bytes is not None:
            return self.client.max_inline_bytes
        channel = self._channel(replica)
        if channel is None:
            return GRPC_INLINE_BYTES
        if channel.unix:
            return UNIX_INLINE_BYTES
        return TCP_INLINE_BYTES if channel.max_message_bytes and not retried else UNSAID_TCP_INLINE_BYTES

    def max_attached_bytes(self, replica: int, results: bool = False) -> int | None:
        """What a call may attach in all, less room for its message: its tensors over the Unix socket
        what a mailbox the server takes holds (its ticket says: MAILBOX_MAX_BYTES, or 64 MiB from a
        server that does not say); over TCP, and its results (replies cross the socket), what the
        server's message limit holds (its ticket says; None from a server that does not)."""
        channel = self._channel(replica)
        if channel is None:
            return None
        most = channel.mailbox_max_bytes if channel.unix and not results else channel.max_message_bytes
        return most - min(_MAILBOX_MESSAGE_ROOM, most // 2) if most else None

    def reads_in_place(self, replica: int) -> bool:
        channel = self._channel(replica)
        return channel is not None and channel.unix

    def _channel(self, replica: int) -> DataChannel | None:
        try:
            return self.client._data_channel(replica)
        except AclnnError:  # the replica is unreachable: the call finds out where it can move on, or replan
            return None


@dataclass(frozen=True)
class _Repeat:
    """A shared-memory Run's layout that ran before, sent again as it was: its inputs copied into the
    regions its layout's staging keeps (staging.StagedLayout), the request built then, and its results
    copied out of theirs, each straight between the caller's arrays and the regions (no binding, no
    staging, no decoding: the server serves it from its first too, transport/repeats.py). A reply
    unlike the first, or an error the full path would retry, sends the call the full way."""

    replica: int
    layout: tuple  # its staging's key (Client._layout_key)
    reply: pb.RunResponse
    results: tuple[tuple[str, int], ...]  # each result's bytes

    @staticmethod
    def of(replica: int, layout: tuple, reply: pb.RunResponse) -> _Repeat:
        results = tuple(
            (name, math.prod(out.dims) * numpy_dtype(out.data_type).itemsize) for name, out in reply.outputs.items()
        )
        return _Repeat(replica, layout, reply, results)

    def __call__(self, client: Client, arrays: Mapping[str, np.ndarray]) -> bool:
        """Runs the call on these arrays (the layout's); False when it must go the full way instead."""
        staged = client._staged_layout(self.replica, self.layout)
        if staged is None:
            return False
        try:
            staged.copy_in({name: arrays[name].reshape(-1).view(np.uint8) for name in staged.inputs})
            reply = client._call_on(self.replica, "Run", staged.request)
        except AclnnError as error:
            client._retire(staged.regions)  # as a failed call's: the server may still write into them
            if _regions_lost(error) or _retried(error):
                return False  # the full way tries again, or elsewhere, as it would have
            raise
        except BaseException:
            client._retire(staged.regions)
            raise
        if reply != self.reply:
            client._keep_staged(staged)
            return False  # it ran, but answers unlike the first: run again the full way, which decodes it
        for name, nbytes in self.results:
            copy_bytes(arrays[name].reshape(-1).view(np.uint8), staged.outputs[name].array[:nbytes])
        client._keep_staged(staged)
        return True


@dataclass(frozen=True)
class _AttachedRepeat:
    """A Run's layout that went all attached over the data channel before (its inputs raw beside the
    request, its results raw beside the reply: small calls, the default transport), sent again as it
    was: the same message, already serialized, with the caller's arrays attached in the same order, and
    its results copied out of the reply's raw part straight into the caller's arrays (no binding, no
    staging, no decoding: the server serves it from its first too, transport/repeats.py). Only with
    one backend (stateless calls spread over several), on the data channel it first went over (a new
    one: the full way); a reply unlike the first, or an error the full path would retry, sends the
    call the full way."""

    channel: DataChannel
    replica: int
    message: bytes
    inputs: tuple[str, ...]  # in the order they are attached
    reply: pb.RunResponse
    results: tuple[tuple[str, int, int], ...]  # each result's offset and size in the reply's raw part

    @staticmethod
    def of(
        channel: DataChannel | None, replica: int, request: pb.OpCall, inputs: tuple[str, ...], reply: pb.RunResponse
    ) -> _AttachedRepeat | None:
        if channel is None or not all(out.HasField("attached") for out in reply.outputs.values()):
            return None  # a result inside the message (one whose size was not known ahead): the full way
        results = tuple((name, out.attached.offset, out.attached.size) for name, out in reply.outputs.items())
        return _AttachedRepeat(channel, replica, request.SerializeToString(deterministic=True), inputs, reply, results)

    def __call__(self, client: Client, arrays: Mapping[str, np.ndarray]) -> bool:
        """Runs the call on these arrays (the layout's); False when it must go the full way instead."""
        # Asked each time: it resolves the target again when due (backends added: calls spread, the full way).
        if client._pool.next() != self.replica or client._data_channels.get(self.replica) is not self.channel:
            return False
        attachments = Attachments()
        for name in self.inputs:
            attachments.add(arrays[name].reshape(-1).view(np.uint8))
        try:
            reply = self.channel.call("Run", self.message, None, client._timeout, attachments)
        except NoConnection:
            return False  # nothing was sent: the full way finds another
        except AclnnError as error:
            if _retried(error):
                return False  # the full way tries again, or elsewhere, as it would have
            raise
        received = attachments.received
        if reply != self.reply or received is None:
            return False  # it ran, but answers unlike the first: run again the full way, which decodes it
        if any(offset + size > received.nbytes for _, offset, size in self.results):
            return False
        for name, offset, size in self.results:
            copy_bytes(arrays[name].reshape(-1).view(np.uint8), received[offset : offset + size])
        return True


_DOUBLE = struct.Struct("<d")


def _retried(error: AclnnError) -> bool:
    """Whether the full way tries a call again after this error: later (busy, gone) or elsewhere (a device failed)."""
    return error.grpc_code in _RETRYABLE or error.grpc_code == _DEVICE_FAILED


def _regions_lost(error: AclnnError) -> bool:
    """Whether a server no longer knows a region of this client's session (it restarted, or the lease lapsed)."""
    return error.param == "region" and "is not registered" in error.message


def _lost(executor: Executor, error: AclnnError) -> bool:
    """Whether a repeatable executor that was never destroyed is unknown to its server (it restarted,
    or the client's session lapsed): then it is planned again, as its owner expects it to live on."""
    lost = "is unknown" in error.message or "ended with its client session" in error.message
    return executor.repeatable and error.param == "executor" and lost


def _output_sizes(values: Mapping[str, Value], outputs: Any) -> dict[str, int]:
    """Bytes of each output's result (its view's elements), from its descriptor."""
    sizes = {}
    for name in outputs:
        tensor = values.get(name)
        dtype = numpy_dtype(tensor.data_type) if isinstance(tensor, Tensor) else None
        if dtype is not None and all(d >= 0 for d in tensor.view_dims):
            sizes[name] = math.prod(tensor.view_dims) * dtype.itemsize
    return sizes
