"""The aclnn.v1.Aclnn methods, independent of the transport that carries them.

gRPC (grpc_server.py) and the data channel (data_channel.py) decode a request, build
its CallContext and call `AclnnService.invoke`; the metrics, the access log and the
mapping of every failure to a google.rpc.Status happen here, once for both.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import re
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.binding import disjoint
from aclnn_common.errors import AclnnError, Status, invalid_error
from aclnn_common.framing import aligned
from aclnn_common.tensor import Tensor
from aclnn_common.types import numpy_dtype

from ..admission import CallAbandoned
from ..buffers import ResidentStorage
from ..descriptors import MAX_COUNT
from ..engine import BackendStarting, CallContext, Engine
from ..errors import CapacityError, ServerLeaving
from ..ledger import SMALL_HOLD_BYTES
from ..metrics import Metrics
from ..params import check
from ..regions import RegionOffer, map_region
from ..storage import Session, Storage, region_slice
from . import repeats
from .wire import decode_call, output_tensor

log = logging.getLogger("aclnn_server")
# A successful call that took this long (or longer) is logged at INFO; others at DEBUG.
SLOW_CALL_S = 1.0

# Request ids: a random prefix per server run and a counter, so that making one costs no system call
# (getrandom releases the GIL: a hand-off to another busy worker on every call under load).
_REQUEST_ID_PREFIX = secrets.token_hex(4)
_request_numbers = itertools.count()


def new_request_id() -> str:
    """An id for the access log, unique within this server's run (and, by its prefix, across runs)."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_numbers):08x}"


# A client's value logged as is: short, and nothing that could end the line or pass for another field.
_PLAIN = re.compile(r"[\w.:/@+-]{1,128}", re.ASCII)

_GRPC_CODES = {
    Status.PARAM_NULLPTR: code_pb2.INVALID_ARGUMENT,
    Status.PARAM_INVALID: code_pb2.INVALID_ARGUMENT,
    # A device or runtime failure is not a replica gone (UNAVAILABLE, which clients replay): ABORTED
    # is retried by no gRPC retry policy, only "at a higher level" (the client pool tries one other replica).
    Status.RUNTIME_ERROR: code_pb2.ABORTED,
}
_RETRY_AFTER = duration_pb2.Duration(nanos=100_000_000)


def placed(placements: Mapping[str, pb.OutputPlacement], call: CallContext) -> None:
    """Sets the outputs delivered outside the reply's message (a placement counts only with a kind: a
    region, kept on the server, or attached: sent from the output's own array, no encoded copy), and
    which of them are kept."""
    if placements:
        call.kept = frozenset(name for name, p in placements.items() if p.keep_on_server)
        call.placed = call.kept | {name for name, p in placements.items() if _beside(p)}


def _beside(placement: pb.OutputPlacement) -> bool:
    """Whether an output goes outside the reply's message: into a region, or attached (`attached: false`
    is a placement in the message, as _place sends it, held and limited as one)."""
    kind = placement.WhichOneof("kind")
    return kind == "region" or (kind == "attached" and placement.attached)


def attach_result(call: CallContext, offset: int, data: np.ndarray) -> None:
    """A result's bytes (flat), for the transport to send raw after the reply at `offset` of its attached part."""
    call.attached_results.append((offset, memoryview(data)))
    call.bytes_out += data.nbytes


def loggable(text: str) -> str:
    """A client-supplied value for a log line: as is when plain, else a JSON string (escaped, at most 128 chars)."""
    if _PLAIN.fullmatch(text):
        return text
    return json.dumps(text[:128] + ("..." if len(text) > 128 else ""))


def error_status(error: AclnnError) -> status_pb2.Status:
    """google.rpc.Status with an ErrorInfo(domain "aclnn", reason, metadata status/param)."""
    info = error_details_pb2.ErrorInfo(
        domain="aclnn", reason=error.reason, metadata={"status": str(error.code), "param": error.param}
    )
    details = [info]
    if isinstance(error, CapacityError):
        code = code_pb2.RESOURCE_EXHAUSTED
        details.append(error_details_pb2.RetryInfo(retry_delay=_RETRY_AFTER))
    elif isinstance(error, BackendStarting | ServerLeaving):
        code = code_pb2.UNAVAILABLE  # not this call's fault: clients retry it (here, or on another replica)
    else:
        code = _GRPC_CODES.get(error.code, code_pb2.INTERNAL)
    packed = []
    for detail in details:
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    return status_pb2.Status(code=code, message=error.message, details=packed)


def failure_status(exc: Exception) -> tuple[status_pb2.Status, str]:
    """The status a failed call answers with, and its name for metrics and the access log."""
    if isinstance(exc, AclnnError):
        return error_status(exc), exc.reason
    if isinstance(exc, CallAbandoned):
        code = code_pb2.DEADLINE_EXCEEDED if exc.reason == "deadline" else code_pb2.CANCELLED
        return status_pb2.Status(code=code, message=str(exc)), exc.reason.upper()
    return error_status(AclnnError(Status.INNER, f"internal error: {exc}")), Status.INNER.reason


class BufferBytes(Protocol):
    """A WriteBuffer's target and bytes as a transport delivers them."""

    buffer: str
    offset: int
    size: int

    def read_into(self, target: memoryview) -> None:
        """Fills all of `target` or raises (161002 on `data`) when the bytes are truncated."""


class Upload(Protocol):
    """An upload's bytes as a transport delivers them."""

    total_size: int
    reservation: str  # the call reservation whose memory it takes (ReserveCall), or ""

    def read_into(self, buffer: memoryview) -> None:
        """Fills all of `buffer` or raises (161002 on `chunk`) when the bytes are truncated or out of order."""


def release(call: CallContext) -> None:
    """Gives back what a call held until its reply was sent (or it failed): its request and outputs."""
    for hold in call.holds or ():
        hold.release()


def _message_size(message: Any) -> int:
    """A message's size (0 for what is none: an upload's stream, a download's bytes). Bytes a call
    moves beside its messages (uploads, downloads, attached results) are counted apart, in CallContext."""
    return message.ByteSize() if hasattr(message, "ByteSize") else 0


# What a draining server still serves whoever asks: the second phase of a call planned before (Execute of
# its executor), what calls that ran owe their clients (kept results, the work queued on a stream and
# device memory's contents), what lets go of what a client holds, and what a client needs to ask for
# those (the operators' parameters, a data-channel ticket: the calls over it pass this same gate).
DRAIN_METHODS = frozenset(
    {
        "ListOperators",
        "OpenDataChannel",
        "Execute",
        "DownloadTensor",
        "Synchronize",
        "ReadBuffer",
        "FreeTensor",
        "FreeBuffer",
        "DestroyExecutor",
        "ReleaseReservation",
        "UnregisterRegion",
        "EndSession",
        "KeepAlive",
    }
)
# The requests that take a reservation's memory: a step of a call begun before the drain.
_RESERVED_STEPS = frozenset({"Run", "Execute", "UploadTensor"})


class AclnnService:
    """The service's methods over the engine and storage; each takes (request, CallContext)."""

    def __init__(self, engine: Engine, metrics: Metrics, storage: Storage) -> None:
        self.engine = engine
        self.ledger = engine.ledger
        self.metrics = metrics
        self.storage = storage
        # The data channel sets this: OpenDataChannel issues its tickets.
        self.issue_ticket: Callable[[CallContext], pb.DataChannelTicket] | None = None
        self.draining = False  # shutting down: new calls are refused (ServerLeaving), begun ones finish
        self._in_flight, self._in_flight_lock = 0, threading.Lock()

    @property
    def in_flight(self) -> int:
        """Calls being served now, on either transport (refused ones are not counted)."""
        with self._in_flight_lock:
            return self._in_flight

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    def _finishing(self, name: str, request: Any, call: CallContext) -> bool:
        """Whether a draining server still takes this request: one of DRAIN_METHODS, or a step of a call
        begun before (an upload into, or the Run of, a live reservation)."""
        if name in DRAIN_METHODS or (name == "ReserveCall" and request.HasField("execute")):
            return True  # (an Execute's memory: the second phase of a call planned before)
        reservation = getattr(request, "reservation", "") if name in _RESERVED_STEPS else ""
        method = "Run" if name == "Run" else None  # a reservation made for an Execute runs no Run
        return bool(reservation) and self.engine.reservations.holds(call.owner, call.session, reservation, method)

    def invoke(self, name: str, request: Any, call: CallContext, request_id: str) -> Any:
        """Runs method `name`, recording its metrics and access-log line; failures propagate.

        The memory the call holds (its request, its outputs) stays held until the transport has sent
        the reply and calls `release(call)`; a failed call's is given back here.
        """
        started, status, reply = time.perf_counter(), "ACLNN_SUCCESS", None
        self.metrics.in_flight.inc()
        # What the transport counted when it received the request whole (no ByteSize: it serializes the message).
        request_size = call.bytes_in or _message_size(request)
        try:
            if self.draining and not self._finishing(name, request, call):  # before it takes any memory
                raise ServerLeaving()
            if call.holds is None:  # a transport that reserved its request's bytes before receiving them sets holds
                call.holds = []
                # A whole message, received: its bytes are held until the reply (small ones: see SMALL_HOLD_BYTES).
                if hasattr(request, "ByteSize") and request_size > SMALL_HOLD_BYTES:
                    call.holds.append(self.ledger.reserve(call.owner, request_size, "message", "request"))
            with self._counted():
                call.stored = self.storage.touch(call.session, call.owner)
                reply = getattr(self, name)(request, call)
            return reply
        except Exception as exc:
            status = failure_status(exc)[1]
            if not isinstance(exc, AclnnError | CallAbandoned):
                log.exception("request_id=%s method=%s failed", loggable(request_id), name)
            # What the failed call's frames viewed (an upload's buffer, outputs) goes now with its holds,
            # not when the traceback is collected.
            traceback.clear_frames(exc.__traceback__)
            release(call)
            raise
        finally:
            self.metrics.in_flight.dec()
            total = time.perf_counter() - started
            phases = {"queue": call.queue_s, "validation": call.validation_s, "compute": call.compute_s}
            phases["transfer"] = max(0.0, total - sum(phases.values()))
            sizes = (request_size or call.bytes_in, _message_size(reply) + call.bytes_out)
            # Only this server's operators become labels: ever-new names would grow /metrics without bound.
            op_label = call.op if not call.op or call.op in self.engine.operators else "unregistered"
            self.metrics.observe(name, op_label, status, phases, sizes)
            # A line per call costs a small call a fifth of its time (formatting and the write to
            # stderr, in the GIL): INFO has the calls that failed or were slow, DEBUG every call.
            level = logging.DEBUG if status == "ACLNN_SUCCESS" and total < SLOW_CALL_S else logging.INFO
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "request_id=%s method=%s op=%s status=%s ms=%.3f queue_ms=%.3f validation_ms=%.3f "
                    "compute_ms=%.3f bytes_in=%d bytes_out=%d",
                    loggable(request_id),
                    name,
                    loggable(call.op) if call.op else "-",
                    status,
                    total * 1e3,
                    call.queue_s * 1e3,
                    call.validation_s * 1e3,
                    call.compute_s * 1e3,
                    *sizes,
                )

    # Calls --------------------------------------------------------------------------------

    def GetWorkspaceSize(self, request: pb.OpCall, call: CallContext) -> pb.WorkspacePlan:
        session = self.storage.touch(call.session, call.owner, create=True)  # the executor lives in the session
        # The executor keeps its bytes: attached ones are copied out of the request (and held with it).
        values = self._values(request, call, kept=True)
        size, executor = self.engine.get_workspace_size(request.op, values, call)
        self._still_in(session, lambda: self.engine.destroy_executor(executor, call))
        return pb.WorkspacePlan(workspace_size=size, executor=executor)

    def Execute(self, request: pb.ExecuteRequest, call: CallContext) -> pb.ExecuteResponse:
        self._take_reservation(request.reservation, call)
        inputs: dict[str, Any] = dict(request.inputs)
        inputs.update({name: self._stored(ref, call, name) for name, ref in request.input_refs.items()})
        placed(request.placements, call)
        in_regions = self._executor_regions(request, inputs, call)
        outputs = self.engine.execute(request.executor, inputs, call, in_regions)
        return pb.ExecuteResponse(outputs=self._place(outputs, request.placements, call, in_regions))

    def Run(self, request: pb.OpCall, call: CallContext) -> pb.RunResponse:
        reply = self._repeat(request, call)
        if reply is not None:
            return reply
        self._take_reservation(request.reservation, call)
        values = self._values(request, call)
        placed(request.placements, call)
        in_regions = self._run_regions(values, request.placements, call)
        size, outputs = self.engine.run(request.op, values, call, in_regions)
        reply = pb.RunResponse(workspace_size=size, outputs=self._place(outputs, request.placements, call, in_regions))
        self._keep_for_repeats(request, call, values, outputs, in_regions, reply)
        return reply

    def _keep_for_repeats(
        self,
        request: pb.OpCall,
        call: CallContext,
        values: Mapping[str, Any],
        outputs: Mapping[str, np.ndarray],
        in_regions: Mapping[str, np.ndarray],
        reply: pb.RunResponse,
    ) -> None:
        """Keeps a Run that ran in full for its repeats, when it can repeat (repeats.py)."""
        if call.message is None:  # not a data-channel Run
            return
        prepared = self.engine.prepared_for(request.op, values, call)
        run = prepared and repeats.repeated_run(prepared, request, call, outputs, in_regions, reply)
        if run and call.repeats is not None:
            repeats.keep(call.repeats, bytes(call.message), run)

    def _repeat(self, request: pb.OpCall, call: CallContext) -> pb.RunResponse | None:
        """A Run served from the first like it on its connection (repeats.py); None: run it in full."""
        if call.message is None or call.repeats is None:
            return None
        key = bytes(call.message)
        run = call.repeats.get(key)
        if run is None:
            return None
        session = self._session_of(call)
        attached = run.attached_storage(call.attachment)
        # A range outside this request's attached part, or results attached to a call that attaches nothing
        # (the same message sent without its part): the call in full says so.
        if attached is None or (run.attached_results and call.attachment is None):
            return None
        try:
            storage = {name: region_slice(session.regions, *where) for name, where in run.inputs}
            destinations = {
                name: np.frombuffer(region_slice(session.regions, *where), dtype).reshape(shape)
                for name, where, shape, dtype in run.results
            }
        except AclnnError:  # a region unregistered since: the call in full says so
            del call.repeats[key]
            return None
        call.placed, call.kept = run.placed, run.kept
        # Inputs read where the client wrote them are held with the call, as in full (_stored counts them).
        in_place = sum(view.nbytes for view in attached.values()) if call.attached_in_place else 0
        call.in_place_bytes += in_place
        outputs = self.engine.run_prepared(run.prepared, {**storage, **attached}, destinations, call, checked=True)
        if outputs is None:  # the backend changed, or the call waits its turn on its stream: in full, which counts them
            call.in_place_bytes -= in_place
            return None
        if repeats.computed_in(outputs, destinations):
            for name, offset in run.attached_results:  # sent raw after the reply, where it says
                attach_result(call, offset, outputs[name].reshape(-1).view(np.uint8))
            return run.reply
        placed_outputs = self._place(outputs, request.placements, call, destinations)
        return pb.RunResponse(workspace_size=run.prepared.workspace_size, outputs=placed_outputs)

    def ReserveCall(self, request: pb.CallReservation, call: CallContext) -> pb.Reservation:
        """Holds a Run's or an Execute's memory as one unit, before its bytes are sent (reservations.py)."""
        session = self.storage.touch(call.session, call.owner, create=True)
        if request.HasField("run"):
            placed(request.run.placements, call)
            values = decode_call(request.run, lambda ref, name: None)  # descriptors are enough to plan
            holds, sizes = self.engine.reserve(call, request.uploads, request.run.op, values, request.in_place)
        else:
            placed(request.execute.placements, call)
            call.executor = request.execute.executor
            holds, sizes = self.engine.reserve(call, request.uploads, in_place=request.in_place)
        method = "Run" if request.HasField("run") else "Execute"
        reservation = self.engine.reservations.add(call.owner, call.session, holds, sizes, method)
        self._still_in(session, lambda: self.engine.reservations.release(call.owner, call.session, reservation))
        return pb.Reservation(reservation=reservation, bytes=sum(hold.nbytes for hold in holds.values()))

    def ReleaseReservation(self, request: pb.Reservation, call: CallContext) -> pb.Empty:
        self.engine.reservations.release(call.owner, call.session, request.reservation)
        return pb.Empty()

    def _take_reservation(self, reservation: str, call: CallContext) -> None:
        """The call runs on its reservation's memory (an unknown one: it waits its turn like any other)."""
        if reservation:
            call.reserved = self.engine.reservations.take(call.owner, call.session, reservation)
            call.holds = (call.holds or []) + list((call.reserved or {}).values())  # given back with the call's

    def SetExecutorRepeatable(self, request: pb.ExecutorRef, call: CallContext) -> pb.Empty:
        self.engine.set_executor_repeatable(request.executor, call)
        return pb.Empty()

    def DestroyExecutor(self, request: pb.ExecutorRef, call: CallContext) -> pb.Empty:
        self.engine.destroy_executor(request.executor, call)
        return pb.Empty()

    def ListOperators(self, request: pb.Empty, call: CallContext) -> pb.OperatorList:
        return pb.OperatorList(
            operators=[
                pb.OperatorInfo(
                    name=name,
                    params=[
                        pb.ParamInfo(
                            name=p.name, kind=p.kind.value, output=p.output, optional=p.optional, inout=p.inout
                        )
                        for p in op.signature.params
                    ],
                )
                for name, op in sorted(self.engine.operators.items())
            ]
        )

    def _still_in(self, session: Session | None, end: Callable[[], None]) -> None:
        """Refuses a call whose session ended (EndSession, or its lease lapsed) while it made something to
        keep there, and `end`s that thing: the session's end ended only what existed by then."""
        if session is not None and self.storage.ended(session):
            with contextlib.suppress(AclnnError):  # ended already, if the session's end came after all
                end()
            raise invalid_error("session", "the session ended while this call ran: nothing was kept in it")

    def _values(self, request: pb.OpCall, call: CallContext, kept: bool = False) -> dict[str, Any]:
        """The call's parameter values with their storage. A storage refused (a freed handle, a range
        outside a region) is reported after what the call's descriptors alone are refused for: the
        operator, its parameter names and the error table come first, as in process."""
        try:
            return decode_call(request, lambda ref, name: self._stored(ref, call, name, kept))
        except AclnnError:
            self.engine.validate(request.op, decode_call(request, lambda ref, name: None))
            raise

    def _stored(
        self, ref: pb.StorageRef, call: CallContext, param: str, kept: bool = False
    ) -> memoryview | bytes | ResidentStorage:
        """The bytes a StorageRef names: an uploaded tensor, a slice of a shared-memory region, device
        memory (a buffer unknown or freed is 161002 naming `param`, the tensor's parameter, as in process),
        or a slice of the request's attached part (a copy when `kept` beyond the request)."""
        kind = ref.WhichOneof("kind")
        if kind == "attached":  # first: every small call's tensors are
            part, r = call.attachment, ref.attached
            check(part is not None, "ref", "attached bytes come only with a data-channel call that attaches them")
            start, end = r.offset, r.offset + r.size
            if end > part.nbytes:  # the message is formatted only for a refusal
                raise invalid_error(
                    "ref", f"attached range {start}+{r.size} lies outside the {part.nbytes} bytes attached"
                )
            if kept:
                return bytes(part[start:end])
            if call.attached_in_place:
                call.in_place_bytes += r.size  # held with the call while it runs (Engine._admitted)
            return part[start:end]
        if kind == "handle":
            return self.storage.handle(call.session, call.owner, ref.handle)
        if kind == "region":
            return self._region_slice(ref.region, call)
        if kind == "device":
            return self._device(ref.device, call, param)
        raise invalid_error("ref", "names neither a tensor handle, a region, a device buffer nor attached bytes")

    def _region_slice(self, r: pb.RegionSlice, call: CallContext) -> memoryview:
        return region_slice(self._session_of(call).regions, r.region, r.offset, r.size)

    def _session_of(self, call: CallContext) -> Session:
        """The caller's session, looked up once a call (under the storage's lock; invoke's touch does)."""
        if call.stored is None:
            call.stored = self.storage.lookup(call.session, call.owner)
        return call.stored

    def _in_regions(
        self,
        results: Mapping[str, tuple[tuple[int, ...], np.dtype | None] | None],
        inputs: list[Any],
        placements: Mapping[str, pb.OutputPlacement],
        call: CallContext,
    ) -> dict[str, np.ndarray]:
        """A call's results placed in shared-memory regions, as arrays over their slices for the engine
        to compute straight into (no copy into the region after: one pass over each result's bytes less).

        `results`: each result's shape and dtype by name, None for a name the call also reads (in/out,
        input), a name absent for nothing computed (masked off); `inputs`: the call's input storage.
        All or none, so that a call refused has written nothing: only when every placed result goes to
        a region slice that holds exactly its bytes, aligned for its dtype, sharing memory with no other
        result and no input, or comes back attached. Otherwise none, and _place copies the results
        there (or refuses the placement, after the call's own errors, as before)."""
        if not placements:
            return {}
        arrays: dict[str, np.ndarray] = {}
        try:
            for name, placement in placements.items():
                if name not in results:
                    continue  # nothing is computed for it
                result, r, kind = results[name], placement.region, placement.WhichOneof("kind")
                if kind == "attached" and call.attachment is not None and not placement.keep_on_server:
                    continue  # sent from its own array, beside the reply: nothing to refuse after the call
                if result is None or kind != "region" or placement.keep_on_server:
                    return {}
                shape, dtype = result
                if dtype is None or r.size != math.prod(shape) * dtype.itemsize or r.offset % dtype.itemsize:
                    return {}
                where = self._region_slice(r, call)
                arrays[name] = np.frombuffer(where, dtype).reshape(shape)
        except AclnnError:  # refused by _place, after the call's own checks
            return {}
        views = [np.frombuffer(data, np.uint8) for data in inputs if isinstance(data, memoryview | bytes)]
        views += [data for data in inputs if isinstance(data, np.ndarray)]
        return arrays if disjoint(arrays, views) else {}

    def _run_regions(
        self, values: Mapping[str, Any], placements: Mapping[str, pb.OutputPlacement], call: CallContext
    ) -> dict[str, np.ndarray]:
        """_in_regions for a Run: its outputs are the tensors that carry no bytes."""
        if not placements:
            return {}
        tensors = {name: v for name, v in values.items() if isinstance(v, Tensor)}
        results = {
            n: None if t.data is not None else (t.view_dims, numpy_dtype(t.data_type)) for n, t in tensors.items()
        }
        inputs = [t.data for t in tensors.values() if t.data is not None]
        return self._in_regions(results, inputs, placements, call)

    def _executor_regions(
        self, request: pb.ExecuteRequest, inputs: Mapping[str, Any], call: CallContext
    ) -> dict[str, np.ndarray]:
        """_in_regions for an Execute: the results its executor planned, its inputs sent now and with the plan."""
        if not request.placements:
            return {}
        try:
            entry = self.engine.executors.get(request.executor, call.owner)
        except AclnnError:  # Execute refuses it
            return {}
        plan = entry.plan
        results = {n: None if n in plan.inputs else (d.shape, d.dtype) for n, d in plan.outputs.items()}
        return self._in_regions(results, [*inputs.values(), *entry.data.values()], request.placements, call)

    def _place(
        self,
        outputs: dict[str, np.ndarray],
        placements: Mapping[str, pb.OutputPlacement],
        call: CallContext,
        in_regions: Mapping[str, np.ndarray],
    ) -> dict[str, pb.OutputTensor]:
        """Results inline, kept on the server, or written into regions: all checked before any is written
        (those the engine computed into their `in_regions` arrays were checked there, and are in place)."""
        targets: dict[str, memoryview | None] = {}
        attached: set[str] = set()  # read once: each look-up in a protobuf map costs ~1 us
        for name, placement in placements.items():
            if name not in outputs:
                continue  # a masked-off output: nothing to place
            kind = placement.WhichOneof("kind")
            if kind == "attached":
                check(call.attachment is not None, name, "attached results come only with a data-channel call")
                if placement.attached:
                    attached.add(name)
            elif kind == "region" and outputs[name] is in_regions.get(name):
                targets[name] = None  # computed there
            elif kind == "region":
                r = placement.region
                check(
                    r.size == outputs[name].nbytes,
                    name,
                    f"region slice of {r.size} bytes for a {outputs[name].nbytes}-byte result",
                )
                targets[name] = self._region_slice(r, call)
        encoded = {}
        attached_end = 0
        for name, array in outputs.items():
            flat = array.reshape(-1).view(np.uint8)
            if name in attached:  # sent raw after the reply by the transport
                offset = aligned(attached_end)
                attached_end = offset + flat.nbytes
                attach_result(call, offset, flat)
                where = pb.ByteRange(offset=offset, size=flat.nbytes)
                encoded[name] = output_tensor(array, inline=False, attached=where)
            elif name in targets:
                target = targets[name]
                if target is not None:
                    np.frombuffer(target, np.uint8)[:] = flat
                encoded[name] = output_tensor(array, inline=False)
            elif name in call.kept:
                # Reserved with the call as a stored tensor; held now for as long as the array lives.
                call.results.split(flat.nbytes, "result").follow(array)
                handle = self.storage.add_handle(call.session, call.owner, memoryview(flat), result=True)
                encoded[name] = output_tensor(array, inline=False, handle=handle)
            else:
                encoded[name] = output_tensor(array)
        return encoded

    # Bytes outside messages ---------------------------------------------------------------

    def UploadTensor(self, upload: Upload, call: CallContext) -> pb.TensorHandle:
        """Stores an upload as a handle once all its bytes arrived; a failed one stores nothing."""
        total = upload.total_size
        check(0 <= total <= MAX_COUNT, "chunk", f"total_size {total} is too large")
        held = None
        if upload.reservation:  # its bytes come out of its call's reservation
            held = self.engine.reservations.upload(call.owner, call.session, upload.reservation, total)
        buffer = self.storage.reserve(call.session, call.owner, total, held)  # held while it is referenced
        upload.read_into(buffer)
        handle = self.storage.add_handle(call.session, call.owner, buffer)
        call.bytes_in = total
        return pb.TensorHandle(handle=handle, size=total)

    def DownloadTensor(self, request: pb.TensorHandle, call: CallContext) -> memoryview:
        """A handle's bytes; the transport sends them (in chunks, or raw)."""
        buffer = self.storage.handle(call.session, call.owner, request.handle, fetched=True)
        call.bytes_out = buffer.nbytes
        return buffer

    def FreeTensor(self, request: pb.TensorHandle, call: CallContext) -> pb.Empty:
        self.storage.free_handle(call.session, call.owner, request.handle)
        return pb.Empty()

    def RegisterRegion(self, request: RegionOffer, call: CallContext) -> str:
        """Maps a memfd the data channel's Unix socket received (never a name); returns the region's id."""
        return self.storage.register_region(call.session, call.owner, *map_region(request))

    def UnregisterRegion(self, region_id: str, call: CallContext) -> None:
        self.storage.unregister_region(call.session, call.owner, region_id)

    # Device memory ------------------------------------------------------------------------

    def MallocBuffer(self, request: pb.MallocRequest, call: CallContext) -> pb.BufferInfo:
        session = self.storage.touch(call.session, call.owner, create=True)  # the buffer lives in the session
        buffer = self.engine.malloc(request.size, call)
        self._still_in(session, lambda: self.engine.free(buffer.id, call))
        return pb.BufferInfo(buffer=buffer.id, size=buffer.size)

    def FreeBuffer(self, request: pb.BufferRef, call: CallContext) -> pb.Empty:
        self.engine.free(request.buffer, call)
        return pb.Empty()

    def WriteBuffer(self, write: BufferBytes, call: CallContext) -> pb.Empty:
        """Host -> device; a write whose bytes do not all arrive is 161002 naming `data` (the bytes
        that did may have landed)."""
        target = self.engine.buffers.slice(call.owner, call.session, write.buffer, write.offset, "dst")
        size = write.size
        self.engine.write_buffer(target, size, lambda array: write.read_into(memoryview(array)), call)
        call.bytes_in = size
        return pb.Empty()

    def ReadBuffer(self, request: pb.BufferRange, call: CallContext) -> memoryview:
        """Device -> host: the bytes, which the transport sends (in chunks, or raw)."""
        source = self.engine.buffers.slice(call.owner, call.session, request.buffer, request.offset, "src")
        data = self.engine.read_buffer(source, request.size, call)
        call.bytes_out = data.nbytes
        return memoryview(data)

    def CopyBuffer(self, request: pb.BufferCopy, call: CallContext) -> pb.Empty:
        dst = self._device(request.dst, call, "dst")
        self.engine.copy_buffer(dst, self._device(request.src, call, "src"), request.size, call)
        return pb.Empty()

    def FillBuffer(self, request: pb.BufferFill, call: CallContext) -> pb.Empty:
        self.engine.fill_buffer(self._device(request.dst, call, "dst"), request.size, request.value, call)
        return pb.Empty()

    def Synchronize(self, request: pb.Empty, call: CallContext) -> pb.Empty:
        self.engine.synchronize(call)
        return pb.Empty()

    def _device(self, ref: pb.DeviceSlice, call: CallContext, param: str) -> ResidentStorage:
        return self.engine.buffers.slice(call.owner, call.session, ref.buffer, ref.offset, param)

    def EndSession(self, request: pb.Empty, call: CallContext) -> pb.Empty:
        """The client closed: its session ends now, with everything in it."""
        self.storage.end(call.session, call.owner)
        return pb.Empty()

    def KeepAlive(self, request: pb.Empty, call: CallContext) -> pb.Lease:
        return pb.Lease(session_ttl_s=self.storage.session_ttl_s)  # invoke renewed the session's lease

    def OpenDataChannel(self, request: pb.Empty, call: CallContext) -> pb.DataChannelTicket:
        if self.issue_ticket is None:
            return pb.DataChannelTicket(port=0)
        return self.issue_ticket(call)
