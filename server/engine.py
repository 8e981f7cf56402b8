"""The transport-agnostic core: validate, plan, execute. gRPC and LocalClient both call this."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from aclnn_common.device import byte_value
from aclnn_common.errors import AclnnError, Status, invalid_error
from aclnn_common.tensor import BoolArray, IntArray, Tensor, Value

from .admission import Admission
from .backends import Backend, NumpyBackend, create_backend, fastest_cpu_backend, npu_if_present
from .buffers import Buffer, BufferStore, DeviceMemory, HostMemory, ResidentStorage
from .descriptors import TensorDesc
from .executors import ExecutorStore
from .ledger import RUNNING, SMALL_HOLD_BYTES, SMALL_WORKSPACE_BYTES, Hold, MemoryLedger
from .ops import OPERATORS
from .params import CallParams, Kind
from .registry import Operator, Plan
from .reservations import Reservations
from .streams import StreamKey, StreamQueues

log = logging.getLogger("aclnn_server")


def memory_limit() -> int:
    """The memory this process may use: its cgroup's limit (v2 or v1) when it has one, else physical RAM."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        limit = 16 << 30
    for path in _cgroup_limit_files():
        try:
            text = pathlib.Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 spells it as a huge number, which min() ignores
            limit = min(limit, int(text))
    return limit


def _cgroup_limit_files() -> list[str]:
    """memory.max of this process's cgroup (v2), and memory.limit_in_bytes (v1)."""
    files = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    try:
        for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            parts = [p for p in path.split("/") if p]
            for depth in range(1, len(parts) + 1):  # a limit on any ancestor applies too
                below = "/".join(parts[:depth])
                if controllers == "":
                    files.append(f"/sys/fs/cgroup/{below}/memory.max")
                elif "memory" in controllers.split(","):
                    files.append(f"/sys/fs/cgroup/memory/{below}/memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    return files


def default_memory_budget() -> int:
    """Half of the memory limit (cgroup or RAM): the other half is the process's own headroom
    (interpreter, libraries, gRPC's buffers for messages not yet handed to the service)."""
    return memory_limit() // 2


@dataclass
class CallContext:
    """Who is calling and until when; the engine records where the time went."""

    owner: str | None = None  # executors made under one owner are invisible to others
    session: str | None = None  # the client session holding its handles and regions
    stream: int | None = None  # calls on one stream (per owner) never run concurrently
    placed: frozenset[str] = frozenset()  # outputs the transport delivers outside its reply
    kept: frozenset[str] = frozenset()  # of those, the ones kept on the server (held as stored tensors)
    deadline: float | None = None  # time.monotonic() after which the work is not started
    cancelled: Callable[[], bool] = field(default=lambda: False)
    op: str = ""
    # Set by a transport that sends results after the engine returns: the outputs' memory stays held
    # (in these holds) until the reply is gone. None: the engine releases everything itself.
    holds: list[Hold] | None = None
    # A data-channel request's bytes, held until its payload's last view is gone (the call's attached
    # inputs are views of it): not given back with `holds`, but counted by admission as the call's.
    request: Hold | None = None
    results: Hold | None = None  # the kept outputs' bytes, reserved as stored tensors with the call's
    reserved: dict[str, Hold] | None = None  # a reservation's holds the call runs on (ReserveCall)
    executor: str = ""  # the executor a reservation is for
    bytes_in: int = 0  # bytes a streaming call moved (unary calls measure their messages)
    bytes_out: int = 0
    # A data-channel call's raw part (framing: ATTACHED): its inputs' bytes; None where a transport has none.
    attachment: memoryview | None = None
    # Whether it lies where the client wrote it, in memory the ledger does not hold (a mailbox sealed
    # against holes); then the bytes of the inputs read from it, held with the call's memory while it runs.
    attached_in_place: bool = False
    in_place_bytes: int = 0
    attached_results: list[tuple[int, memoryview]] = field(default_factory=list)  # (offset, bytes) to send back
    queue_s: float = 0.0
    validation_s: float = 0.0
    compute_s: float = 0.0
    stored: Any = None  # the caller's storage.Session, once looked up (its regions)
    message: memoryview | None = None  # a data-channel Run's request as received (transport/repeats.py)
    repeats: dict[bytes, Any] | None = None  # its connection's runs served again from their first (repeats.py)


@dataclass(frozen=True)
class PreparedRun:
    """A validated call layout and what follows from it alone (Engine.prepare)."""

    operator: Operator
    plan: Plan
    workspace_size: int
    parts: Mapping[str, int]  # what a call holds while it runs (see Engine._call_parts)
    args: Mapping[str, Any]  # the operator's arguments but its tensors: arrays and scalars as validated
    backend: Any  # the backend it was prepared on
    compute: Callable[[dict[str, Any]], None]  # the backend's compute of the plan, prepared


class Engine:
    """Runs aclnn calls on one backend, keeping their executors and admitting their executions."""

    def __init__(
        self,
        backend: Backend | str = "numpy",
        *,
        executor_ttl_s: float = 300.0,
        max_executors: int = 4096,
        memory_budget_bytes: int | None = None,
        max_tenant_bytes: int | None = None,
        max_tenant_executors: int | None = None,
        max_result_bytes: int | None = None,
        max_concurrency: int = 2,
        max_queue: int = 64,
        max_tenant_queue: int | None = None,
        device: int = 0,
        torch_device: str = "cpu",
        load_in_background: bool = False,
    ) -> None:
        # `ready` is set once calls can be computed. A backend named here is created now, or with
        # `load_in_background` on a thread of its own; calls that come before it is ready are refused
        # at once (BackendStarting), never left waiting. `auto` is the NPU when one is here (started
        # like a named backend: seconds), else the NumPy reference at once while the cpu backend,
        # whose kernels may compile for minutes on a cold cache, loads beside it (`_start_auto`).
        # `loaded` is set once the backend asked for is in place (or failed to load: `load_error`).
        self.ready = threading.Event()
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self._backend: Backend | None = None
        self._backend_name = backend if isinstance(backend, str) else backend.name
        self._loading_since = time.monotonic()
        self._switched_at: float | None = None  # when `auto` left the reference
        self._closed = False
        self._owns_backend = isinstance(backend, str)  # a backend passed in belongs to the caller
        self._lock = threading.Lock()
        if not isinstance(backend, str):
            self._backend = backend
            self.ready.set()
            self.loaded.set()
        elif backend == "auto" and load_in_background:
            _thread(self._start_auto, device, torch_device, True)
        elif backend == "auto":
            self._start_auto(device, torch_device, False)
        elif load_in_background:
            _thread(self._load, backend, device, torch_device)
        else:
            self._load(backend, device, torch_device)
            if self.load_error is not None:
                raise self.load_error
        self.executors = ExecutorStore(executor_ttl_s, max_executors, max_tenant_executors or max_executors)
        self.memory_budget_bytes = memory_budget_bytes or default_memory_budget()
        self.ledger = MemoryLedger(self.memory_budget_bytes, max_tenant_bytes)
        # A transport that returns results in one message caps their size (None: no cap).
        self.max_result_bytes = max_result_bytes
        self.admission = Admission(max_concurrency, max_queue, self.ledger, max_tenant_queue)
        self.reservations = Reservations()
        self._plans = PlanCache()
        self._prepared = Recent()  # prepared runs (PreparedRun) by plan key and placements
        self._workspaces = Recent()  # (backend, its workspace size, within the budget) by plan key
        self.buffers = BufferStore(self.ledger, self._device_memory)
        self.streams = StreamQueues()

    def end_session(self, owner: str | None, session: str) -> None:
        """An identity's client session ended (closed, or its lease lapsed; Storage calls this, whichever
        call or thread noticed): its executors, reservations, queued calls and buffers go."""
        self.executors.end_session(owner, session)
        self.reservations.end_session(owner, session)
        self.streams.end_session(owner, session)
        self.buffers.end_session(owner, session)
        end_session = getattr(self.backend, "end_session", None)  # a backend that keeps per-session device state
        if end_session is not None:
            end_session(owner, session)

    def _start_auto(self, device: int, torch_device: str, in_background: bool) -> None:
        """`auto`: the NPU when CANN and a device are here; else the reference at once, and the cpu
        backend loaded beside it (on this thread when `in_background`, else on one of its own) and
        switched to when ready. The NPU is not put behind the reference: device memory and streams
        are its from the first call."""
        try:
            npu = npu_if_present(device)
        except Exception as exc:  # a CANN that fails otherwise: the CPU backends, saying why
            log.error("backend auto: no NPU (%s); the CPU backends", exc)
            npu = None
        if npu is not None:
            self._load_done(npu)
            return
        with self._lock:
            self._backend = self._backend or NumpyBackend()
        self.ready.set()
        name = fastest_cpu_backend()
        if name == "numpy":
            self.loaded.set()
        elif in_background:
            self._load(name, device, torch_device, beside_reference=True)
        else:
            _thread(self._load, name, device, torch_device, True)

    def _load(self, name: str, device: int, torch_device: str, beside_reference: bool = False) -> None:
        try:
            backend = create_backend(name, device=device, torch_device=torch_device)
        except BaseException as exc:
            if beside_reference:
                log.error("backend auto: staying on the numpy reference, as %s failed: %s", name, exc, exc_info=exc)
            else:
                self.load_error = exc  # reported by whoever waits for `ready` (the CLI exits with it)
            self.ready.set()
            self.loaded.set()
        else:
            self._load_done(backend)

    def _load_done(self, backend: Backend) -> None:
        """Puts a loaded backend in place (in place of the reference, for `auto`), unless the engine closed."""
        with self._lock:
            closed, previous = self._closed, self._backend
            if not closed:
                self._backend = backend
                if previous is not None and previous.name != backend.name:
                    self._switched_at = time.monotonic()
        if closed:
            _close(backend)
        elif previous is not None and previous.name != backend.name:
            log.info(
                "backend %s in place of the %s reference (auto; ready after %.1f s)",
                backend.name,
                previous.name,
                time.monotonic() - self._loading_since,
            )
        self.ready.set()
        self.loaded.set()

    @property
    def backend(self) -> Backend:
        """The backend computing calls now; before one is ready, BackendStarting (or the load's failure)."""
        backend = self._backend
        if backend is None:
            if self.load_error is not None:
                raise AclnnError(Status.RUNTIME_ERROR, f"the backend failed to start: {self.load_error}")
            raise BackendStarting(self._backend_name, time.monotonic() - self._loading_since)
        return backend

    def close(self, *, backend_too: bool = False) -> None:
        """Releases the backend (a device's context) when this engine created it, or `backend_too` (a
        server releases the one it was given); one still loading is released once loaded."""
        with self._lock:
            self._closed = True
            backend = self._backend
        self.streams.close()
        if self._owns_backend or backend_too:
            _close(backend)

    @property
    def operators(self) -> Mapping[str, Operator]:
        return OPERATORS

    def _device_memory(self) -> DeviceMemory:
        """The backend's memory for device buffers (host memory unless it offers its own)."""
        device_memory = getattr(self.backend, "device_memory", None)
        return device_memory() if device_memory is not None else HostMemory()

    def get_workspace_size(
        self, op: str, values: Mapping[str, Value], call: CallContext | None = None
    ) -> tuple[int, str]:
        call = call or CallContext()
        operator, plan, workspace_size = self._plan(op, values, call)
        data: dict[str, Any] = {name: values[name].data for name in plan.inputs if values[name].data is not None}
        data.update(self._resident(plan, values))  # device storage of inputs and outputs, as CANN's executor keeps
        # Bytes shipped with the plan (views of uploads, regions and device memory are held there) are its
        # owner's to hold while they live: with the executor, and after its last execute for as long as
        # that call still reads them (each part's hold follows its array).
        shipped = {n: d for n, d in data.items() if not isinstance(d, memoryview | np.ndarray | ResidentStorage)}
        hold = self.ledger.reserve(
            call.owner, sum(memoryview(d).nbytes for d in shipped.values()), "executor", next(iter(data), "op")
        )
        for name, bytes_ in shipped.items():
            data[name] = np.frombuffer(bytes_, np.uint8)
            hold.split(data[name].nbytes, "executor").follow(data[name])
        return workspace_size, self.executors.add(operator, plan, workspace_size, data, call.owner, call.session)

    def execute(
        self,
        executor_id: str,
        inputs: Mapping[str, Any],
        call: CallContext | None = None,
        destinations: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Runs an executor; `inputs` holds storage bytes that override those sent with the plan.

        A call refused for its bytes, or by admission, does not spend a single-use executor.
        `destinations`: arrays to compute the outputs straight into (see `_compute`).
        """
        call = call or CallContext()
        entry = self.executors.get(executor_id, call.owner)
        call.op = entry.operator.name
        workspace_size = entry.workspace_size
        if self._switched_at is not None and entry.created <= self._switched_at:
            workspace_size = self.backend.workspace_size(entry.operator, entry.plan)  # planned on the reference
        resident = _resident_of(entry.plan, entry.data, inputs)
        if not resident and not self._ordered(call):
            with self._admitted(entry.plan, workspace_size, call, destinations=destinations):
                entry, args = self.executors.begin_execute(
                    executor_id, lambda e: self._bind_inputs(e.operator, e.plan, e.data, inputs), call.owner
                )
                return self._compute(entry.operator, entry.plan, args, call, destinations)

        def bind(e: Any) -> dict[str, Any]:
            for name, storage in resident.items():
                if storage.buffer.freed:
                    raise invalid_error(name, "its device buffer was freed")
            return self._bind_inputs(e.operator, e.plan, e.data, inputs)

        entry, args = self.executors.begin_execute(executor_id, bind, call.owner)
        return self._dispatch(entry.operator, entry.plan, workspace_size, args, resident, call, destinations)

    def run(
        self,
        op: str,
        values: Mapping[str, Value],
        call: CallContext | None = None,
        destinations: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        call = call or CallContext()
        prepared = self._prepared_run(op, values, call)
        if prepared is None:
            operator, plan, workspace_size = self._plan(op, values, call)
        else:  # its plan, checked against the budget with this backend's workspace when it was prepared
            operator, plan, workspace_size = prepared.operator, prepared.plan, prepared.workspace_size
        resident = self._resident(plan, values)
        if prepared is not None and not self._ordered(call) and not resident:
            storage = {name: values[name].data for name in plan.inputs}
            return workspace_size, self._run_prepared(prepared, storage, destinations, call, checked=True)
        args = self._bind_inputs(operator, plan, {name: values[name].data for name in plan.inputs}, {})
        if not resident and not self._ordered(call):
            with self._admitted(plan, workspace_size, call, destinations=destinations):
                return workspace_size, self._compute(operator, plan, args, call, destinations)
        return workspace_size, self._dispatch(operator, plan, workspace_size, args, resident, call, destinations)

    def prepare(self, key: Hashable, call: CallContext | None = None) -> PreparedRun | None:
        """What `run` derives from a call's layout alone, for a call validated before under `key`
        (plan_key of its values) with `call`'s placements: its plan, workspace, the memory it holds
        and its kernel. None when the plan is no longer cached or the layout would fail a check
        (then run the call in full, where each check raises in its turn), for empty tensors, and on
        a backend without `prepare` (the torch and NPU backends: their compute takes the client's
        stream, and the NPU's executors live as long as their plan objects; every call runs in full)."""
        validated = self._plans.get(key)
        backend = self.backend
        prepare = getattr(backend, "prepare", None)
        if validated is None or prepare is None or any(d.numel == 0 for d in validated[1].inputs.values()):
            return None
        operator, plan = validated
        try:
            workspace_size = self._workspace(key, backend, operator, plan)
            parts = self._call_parts(plan, workspace_size, call or CallContext())
        except AclnnError:
            return None
        args = self._values(operator, plan)
        for spec in operator.signature.params:  # the tensors it lacks, as _compute would add them
            if spec.kind is Kind.TENSOR and spec.name not in plan.inputs and spec.name not in plan.outputs:
                args.setdefault(spec.name, None)
        return PreparedRun(operator, plan, workspace_size, parts, args, backend, prepare(operator, plan))

    def _prepared_run(self, op: str, values: Mapping[str, Value], call: CallContext) -> PreparedRun | None:
        """The call's prepared run (cached by its plan key and placements); on a miss the call is
        validated in full first, so that every error comes as `_plan` raises it. None: a call
        the cache cannot key, or a backend that prepares nothing."""
        if getattr(self.backend, "prepare", None) is None:
            return None
        started = time.perf_counter()
        call.op = op
        key = plan_key(op, values)
        if key is None:
            return None
        cache_key = (key, call.placed, call.kept)
        prepared = self._prepared.get(cache_key)
        if prepared is not None and prepared.backend is self.backend:
            call.validation_s += time.perf_counter() - started
            return prepared
        self._plan(op, values, call)  # which counts its own time
        prepared = self.prepare(key, call)
        if prepared is not None:
            self._prepared.put(cache_key, prepared)
        return prepared

    def run_prepared(
        self,
        prepared: PreparedRun,
        storage: Mapping[str, Any],
        destinations: Mapping[str, np.ndarray],
        call: CallContext,
        checked: bool = False,
    ) -> dict[str, np.ndarray] | None:
        """`run` of a prepared call on its inputs' `storage` into `destinations`: C-contiguous arrays of
        the layout it was prepared for, each its tensor's whole view (in process: see LocalClient), or
        (`checked`) bytes checked to hold each tensor's storage. None when the backend changed since,
        or the call must wait its turn on its stream (then run it in full)."""
        if prepared.backend is not self.backend or self._ordered(call):
            return None
        return self._run_prepared(prepared, storage, destinations, call, checked)

    def prepared_for(self, op: str, values: Mapping[str, Value], call: CallContext) -> PreparedRun | None:
        """The prepared run that `run` ran a call like this one on (same layout and placements), if cached."""
        key = plan_key(op, values)
        prepared = None if key is None else self._prepared.get((key, call.placed, call.kept))
        return prepared if prepared is not None and prepared.backend is self.backend else None

    def _run_prepared(
        self,
        prepared: PreparedRun,
        storage: Mapping[str, Any],
        destinations: Mapping[str, np.ndarray] | None,
        call: CallContext,
        checked: bool,
    ) -> dict[str, np.ndarray]:
        """Binds and computes a prepared call: what is a function of its layout (the error table's
        verdict, the budget checks, the workspace size, the kernel choice) is not done again.
        `checked`: each input's storage is checked to fit (bytes a client sent); else it is known to."""
        call.op = prepared.operator.name
        args = dict(prepared.args)
        for name, desc in prepared.plan.inputs.items():
            if checked:
                args[name] = _input_view(name, desc, storage[name])
            else:  # desc.view's view, without its checks: the array itself (run_prepared), read-only
                view = storage[name].view()
                view.flags.writeable = False
                args[name] = view
        # Holds nothing (no memory the ledger tracks, nothing read in place): the fast lane.
        if not any(prepared.parts.values()) and call.reserved is None and not call.in_place_bytes:
            stream = _stream_key(call)
            if self.admission.try_start(call.owner, stream, call.deadline):
                if call.holds is not None:  # what _admitted leaves for the transport: nothing held
                    call.results = Hold(self.ledger, call.owner, 0, "result")
                try:
                    return self._compute(prepared.operator, prepared.plan, args, call, destinations, prepared.compute)
                finally:
                    self.admission.finish(call.owner, stream)
        with self._admitted(
            prepared.plan, prepared.workspace_size, call, parts=prepared.parts, destinations=destinations
        ):
            return self._compute(prepared.operator, prepared.plan, args, call, destinations, prepared.compute)

    def set_executor_repeatable(self, executor_id: str, call: CallContext | None = None) -> None:
        self.executors.set_repeatable(executor_id, (call or CallContext()).owner)

    def destroy_executor(self, executor_id: str, call: CallContext | None = None) -> None:
        self.executors.destroy(executor_id, (call or CallContext()).owner)

    # Device memory ----------------------------------------------------------------------------

    def malloc(self, nbytes: int, call: CallContext) -> Buffer:
        return self.buffers.malloc(call.owner, call.session, nbytes)

    def free(self, buffer_id: str, call: CallContext) -> None:
        self.buffers.free(call.owner, call.session, buffer_id)

    def write_buffer(
        self, target: ResidentStorage, size: int, fill: Callable[[np.ndarray], None], call: CallContext
    ) -> None:
        """Host -> device: `fill` writes `size` bytes into the array it is given (the buffer's own
        memory when the host can address it, else a staging array copied over after)."""
        self.buffers.check_range(target, size, "size")
        with self._transfer([target], call):
            memory, block = self.buffers.memory, target.buffer.block
            host = memory.host_array(block)
            if host is not None:
                fill(host[target.offset : target.offset + size])
            else:
                staged = np.empty(size, np.uint8)
                fill(staged)
                memory.write(block, target.offset, staged)

    def read_buffer(
        self, source: ResidentStorage, size: int, call: CallContext, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Device -> host: `size` bytes into `out` (uint8), or a view of the buffer's host memory
        (else a copy) when `out` is None."""
        self.buffers.check_range(source, size, "size")
        with self._transfer([source], call):
            memory, block = self.buffers.memory, source.buffer.block
            host = memory.host_array(block)
            if out is None and host is not None:
                return host[source.offset : source.offset + size]
            if out is None:  # a host copy, held until the transport has sent it
                hold = self.ledger.reserve(call.owner, size, "call", "size")
                if call.holds is None:
                    hold.release()
                else:
                    call.holds.append(hold)
                out = np.empty(size, np.uint8)
            memory.read(block, source.offset, out)
            return out

    def copy_buffer(self, dst: ResidentStorage, src: ResidentStorage, size: int, call: CallContext) -> None:
        self.buffers.check_range(dst, size, "dst")
        self.buffers.check_range(src, size, "src")
        with self._transfer([dst, src], call):
            self.buffers.memory.copy(dst.buffer.block, dst.offset, src.buffer.block, src.offset, size)

    def fill_buffer(self, dst: ResidentStorage, size: int, value: int, call: CallContext) -> None:
        byte_value(value)
        self.buffers.check_range(dst, size, "size")
        with self._transfer([dst], call):
            self.buffers.memory.fill(dst.buffer.block, dst.offset, size, value)

    def synchronize(self, call: CallContext) -> None:
        """Waits for the calls queued on `call.stream` (every stream of the session when None); raises
        the first failure among them, once."""
        self.streams.synchronize(call.owner, call.session, call.stream, call.deadline)
        synchronize = getattr(self.backend, "synchronize", None)  # a backend that launches without waiting
        if synchronize is not None:
            synchronize((call.owner, call.session, call.stream))

    @contextlib.contextmanager
    def _transfer(self, storages: list[ResidentStorage], call: CallContext) -> Iterator[None]:
        """A transfer keeps its buffers alive and, as on a device's default stream, first waits for the
        calls queued on them."""
        buffers = self.buffers.use([("buffer", s) for s in storages])
        try:
            self.buffers.wait_unqueued(buffers, call.deadline)
            yield
        finally:
            self.buffers.done(buffers)

    def _resident(self, plan: Plan, values: Mapping[str, Value]) -> dict[str, ResidentStorage]:
        """The tensors whose storage is a device buffer, each checked to lie inside it."""
        resident = {}
        for name, desc in (*plan.inputs.items(), *plan.outputs.items()):
            value = values.get(name)
            data = value.data if isinstance(value, Tensor) else None
            if isinstance(data, ResidentStorage):
                data.check_fits(desc)
                resident[name] = data
        return resident

    def _ordered(self, call: CallContext) -> bool:
        """Whether the call must wait its turn behind calls queued on its stream."""
        return call.stream is not None and self.streams.active((call.owner, call.session, call.stream))

    def _dispatch(
        self,
        operator: Operator,
        plan: Plan,
        workspace_size: int,
        args: dict[str, Any],
        resident: dict[str, ResidentStorage],
        call: CallContext,
        destinations: Mapping[str, np.ndarray] | None,
    ) -> dict[str, np.ndarray]:
        """Runs a call on device memory, or one behind its stream's queue.

        With a stream, a call whose tensors all live in device buffers is queued (its failure stays
        on the stream) and returns no outputs; any other waits its turn and returns its host outputs.
        Without a stream, it waits for the calls queued on its buffers, as on a default stream.
        """
        tensors = plan.inputs.keys() | plan.outputs.keys()
        queued = call.stream is not None and bool(plan.outputs) and resident.keys() == tensors
        buffers = self.buffers.use(resident.items(), queued=queued)
        caller = call  # its deadline and liveness bound the wait for room in the stream's queue
        if queued:  # once queued, the caller goes on: its deadline and liveness no longer apply to the call
            call = CallContext(call.owner, call.session, call.stream, op=call.op)
        work = functools.partial(self._run_resident, operator, plan, workspace_size, args, resident, call, destinations)
        if call.stream is None:
            try:
                self.buffers.wait_unqueued(buffers, call.deadline)
                return work()
            finally:
                self.buffers.done(buffers)
        key = (call.owner, call.session, call.stream)
        done = functools.partial(self.buffers.done, buffers, queued)
        launch = queued and self._launches(operator) and self.admission.would_start(key)
        outputs = self.streams.call(
            key, work, done, wait=not queued, deadline=caller.deadline, cancelled=caller.cancelled, launch=launch
        )
        return outputs or {}

    def _launches(self, operator: Operator) -> bool:
        """Whether the backend computes a call on its device memory by launching it on the client
        stream's device stream, returning before it ran (the NPU; torch on CUDA). Such a call is
        launched by its caller when an execution slot is free (else its caller would wait for one
        before its reply, and the stream's worker launches it)."""
        backend = self.backend
        return (
            getattr(backend, "launches_resident", False)
            and getattr(backend, "compute_resident", None) is not None
            and getattr(backend, "supports", lambda op: True)(operator.name)
        )

    def _run_resident(
        self,
        operator: Operator,
        plan: Plan,
        workspace_size: int,
        args: dict[str, Any],
        resident: dict[str, ResidentStorage],
        call: CallContext,
        destinations: Mapping[str, np.ndarray] | None,
    ) -> dict[str, np.ndarray]:
        """Computes on device buffers: in place over host memory, natively on a backend that computes on
        its own device memory, else through host copies. Returns the outputs that are not resident."""
        native = getattr(self.backend, "compute_resident", None)
        every = resident.keys() == plan.inputs.keys() | plan.outputs.keys()
        if native is not None and every and getattr(self.backend, "supports", lambda op: True)(operator.name):
            with self._admitted(plan, workspace_size, call, frozenset(plan.outputs)):
                started = time.perf_counter()
                try:
                    storage = {n: (s.buffer.block, s.offset) for n, s in resident.items()}
                    native(operator, plan, storage, _stream_key(call))
                finally:
                    call.compute_s += time.perf_counter() - started
            return {}
        memory = self.buffers.memory
        views = {
            name: _ResidentView(memory, storage, desc)
            for name, storage in resident.items()
            for desc in [plan.outputs.get(name) or plan.inputs[name]]
        }
        for name in plan.inputs.keys() & resident.keys():
            args[name] = views[name].array(writeable=name in plan.outputs)
        given = dict(destinations or {})
        in_place = set()
        inputs = [args[n] for n in plan.inputs if n not in plan.outputs and args.get(n) is not None]
        for name in plan.outputs.keys() & resident.keys():
            target = views[name].array(writeable=True)
            others = [views[n].array(writeable=True) for n in plan.outputs.keys() & resident.keys() if n != name]
            if (
                views[name].direct
                and target.flags.c_contiguous
                and not any(np.may_share_memory(target, other) for other in inputs + others)
            ):
                given[name] = target
                in_place.add(name)
        with self._admitted(plan, workspace_size, call, frozenset(in_place)):
            outputs = self._compute(operator, plan, args, call, given)
        for name in plan.outputs.keys() & resident.keys():
            if name not in in_place:
                views[name].store(outputs[name])
        return {name: array for name, array in outputs.items() if name not in resident}

    @contextlib.contextmanager
    def _admitted(
        self,
        plan: Plan,
        workspace_size: int,
        call: CallContext,
        resident: frozenset[str] = frozenset(),
        parts: Mapping[str, int] | None = None,
        destinations: Mapping[str, np.ndarray] | None = None,
    ) -> Iterator[None]:
        """An execution slot with memory for the call's outputs and workspace (see Admission), taken
        now or from the call's reservation (`call.reserved`).

        Inputs are held already (in their message, upload, executor or device buffer), and so are
        the `resident` outputs, computed in their device buffers, and the outputs computed into
        `destinations` (a caller's arrays in process, a client's shared-memory region). The outputs
        stay held after compute, in `call.holds`, when the transport sends them later.
        """
        parts = parts or self._call_parts(plan, workspace_size, call, resident)
        if destinations:
            there = sum(
                d.numel * d.dtype.itemsize
                for n, d in plan.outputs.items()
                if _destination(destinations, n, d) is not None
            )
            parts = {**parts, RUNNING: max(self._workspace_held(workspace_size), parts[RUNNING] - there)}
        # What it reads in place: at most its inputs' storage, whatever it attached.
        in_place = call.in_place_bytes and min(call.in_place_bytes, sum(t.storage_nbytes for t in plan.inputs.values()))
        if in_place:
            parts = {**parts, RUNNING: parts[RUNNING] + in_place}
        reserved, call.reserved = call.reserved, None
        if reserved is not None and all(reserved[kind].nbytes >= n for kind, n in parts.items()):
            for kind, n in parts.items():
                reserved[kind].shrink(n)  # what a reservation holds beyond what the call needs
            needed, given = dict.fromkeys(parts, 0), reserved
        else:
            for hold in (reserved or {}).values():
                hold.release()  # reserved for another call than this: it waits its turn like any other
            needed, given = parts, None
        held = sum(hold.nbytes for hold in call.holds or ()) + (call.request.nbytes if call.request else 0)
        stream = None if call.stream is None else (call.owner, call.session, call.stream)
        with self.admission.slot(needed, call.owner, stream, call.deadline, call.cancelled, held) as (waited, holds):
            holds = given or holds
            call.queue_s += waited
            try:
                yield
            except BaseException:
                for hold in holds.values():
                    hold.release()
                raise
        hold, call.results = holds[RUNNING], holds["result"]
        if call.holds is None:
            hold.release()
            call.results.release()  # in process nothing is kept
        else:
            # The workspace is free again, and inputs read in place are read.
            hold.shrink(parts[RUNNING] - self._workspace_held(workspace_size) - in_place)
            call.holds += [hold, call.results]  # the outputs until the reply is sent; results split off as kept

    def _call_parts(
        self, plan: Plan, workspace_size: int, call: CallContext, resident: frozenset[str] = frozenset()
    ) -> dict[str, int]:
        """What a call holds while it runs, by kind: its workspace, its outputs' arrays and the encoded
        copy of those sent inline (until the reply is sent), and its kept outputs as stored tensors.
        `resident` outputs are computed in their device buffers (held as such already)."""
        outputs = {name: t for name, t in plan.outputs.items() if name not in resident}
        inline = [t for name, t in outputs.items() if name not in call.placed]
        inline_bytes = sum(t.numel * t.dtype.itemsize for t in inline)
        if self.max_result_bytes is not None and inline_bytes > self.max_result_bytes:
            raise invalid_error(
                inline[0].name,
                f"results of {inline_bytes} bytes exceed the max message size of {self.max_result_bytes}: "
                "keep them on the server (placements) or raise --max-message-bytes",
            )
        kept_bytes = sum(t.numel * t.dtype.itemsize for name, t in outputs.items() if name in call.kept)
        output_bytes = sum(t.numel * t.dtype.itemsize for t in outputs.values()) - kept_bytes + inline_bytes
        self._check_budget(plan, workspace_size, {RUNNING: workspace_size + output_bytes, "result": kept_bytes})
        if output_bytes <= SMALL_HOLD_BYTES:  # small ones are not held (see SMALL_HOLD_BYTES)
            output_bytes = 0
        return {RUNNING: self._workspace_held(workspace_size) + output_bytes, "result": kept_bytes}

    @staticmethod
    def _workspace_held(workspace_size: int) -> int:
        return 0 if workspace_size <= SMALL_WORKSPACE_BYTES else workspace_size

    def reserve(
        self,
        call: CallContext,
        uploads: Sequence[str],
        op: str = "",
        values: Mapping[str, Value] | None = None,
        in_place: Sequence[str] = (),
    ) -> tuple[dict[str, Hold], list[int]]:
        """The memory of a Run of `op` (or, with no `op`, an Execute of `call.executor`) as one unit, in
        turn with every waiting call: the inputs named in `uploads`, what the call holds while it runs,
        and the inputs `in_place` it may read where the client wrote them (held with it, see
        CallContext.in_place_bytes). 161002 at once, naming its largest tensor, when it could never fit.
        Returns the holds and the uploads' sizes."""
        if op:
            plan, workspace_size = self._plan(op, values or {}, call)[1:]
        else:
            entry = self.executors.get(call.executor, call.owner)
            call.op, plan, workspace_size = entry.operator.name, entry.plan, entry.workspace_size
        unknown = sorted((set(uploads) | set(in_place)) - set(plan.inputs))
        if unknown:
            raise invalid_error(unknown[0], f"is not an input tensor of this {call.op} call")
        sizes = [plan.inputs[name].storage_nbytes for name in uploads]
        parts = {"upload": sum(sizes), **self._call_parts(plan, workspace_size, call)}
        parts[RUNNING] += sum(plan.inputs[name].storage_nbytes for name in set(in_place) - set(uploads))
        largest = max(uploads, key=lambda name: plan.inputs[name].storage_nbytes, default="op")
        self.ledger.check_possible(parts, largest)
        return self.admission.hold(parts, call.owner, call.deadline, call.cancelled), sizes

    def _plan(self, op: str, values: Mapping[str, Value], call: CallContext) -> tuple[Operator, Plan, int]:
        """The error table's verdict (cached per descriptors), then the backend's workspace for it."""
        started = time.perf_counter()
        call.op = op
        key = plan_key(op, values)
        validated = self._plans.get(key) if key is not None else None
        if validated is None:
            validated = self._validate(op, values)
            if key is not None:
                self._plans.put(key, validated)
        operator, plan = validated
        workspace_size = self._workspace(key, self.backend, operator, plan)
        call.validation_s += time.perf_counter() - started
        return operator, plan, workspace_size

    def _workspace(self, key: Hashable | None, backend: Backend, operator: Operator, plan: Plan) -> int:
        """`backend`'s workspace for a plan, checked against the budget: once per plan key and backend
        (both are functions of the layout), except on a backend that asks its device each time (the
        NPU: CANN's GetWorkspaceSize, whose failure each call reports as CANN would)."""
        if getattr(backend, "plans_on_device", False):
            key = None
        known = self._workspaces.get(key) if key is not None else None
        if known is not None and known[0] is backend:
            return known[1]
        workspace_size = backend.workspace_size(operator, plan)
        self._check_budget(plan, workspace_size)
        if key is not None:
            self._workspaces.put(key, (backend, workspace_size))
        return workspace_size

    def validate(self, op: str, values: Mapping[str, Value]) -> None:
        """Raises what `run` would for these descriptors before it reads any storage (their data unused):
        the operator, its parameter names, the error table."""
        self._validate(op, values)

    @staticmethod
    def _validate(op: str, values: Mapping[str, Value]) -> tuple[Operator, Plan]:
        operator = OPERATORS.get(op)
        if operator is None:
            raise invalid_error("op", f"unknown operator {op!r}; this server has {', '.join(sorted(OPERATORS))}")
        unknown = sorted(set(values) - operator.signature.names)
        if unknown:
            raise invalid_error(unknown[0], f"{op} has no parameter named {unknown[0]!r}")
        tensors = operator.signature.checked_tensors(values)
        return operator, operator.validate(CallParams(operator.signature, values, tensors))

    def _check_budget(self, plan: Plan, workspace_size: int, parts: Mapping[str, int] | None = None) -> None:
        """161002 for a call that could never fit one caller's memory, naming its largest tensor: its
        inputs with `parts` (what it holds while it runs: by default its outputs and workspace) as
        they are held together. No allocation is sized by a client's whim, and no call waits or
        is retried for memory it can never have."""
        tensors = [*plan.inputs.values(), *plan.outputs.values()]
        views = [t.numel * t.dtype.itemsize for t in tensors]
        if max(views, default=0) > self.ledger.tenant_bytes:  # one tensor alone: the message names the first
            for t, size in zip(tensors, views):
                self.ledger.check_possible({RUNNING: size}, t.name)
        # Together: an input holds its storage (a broadcast view's is small); an output, a fresh array.
        sizes = [t.storage_nbytes for t in plan.inputs.values()] + [
            t.numel * t.dtype.itemsize for t in plan.outputs.values()
        ]
        if parts is None:
            parts = {RUNNING: workspace_size + sum(sizes[len(plan.inputs) :])}
        whole = {**parts, RUNNING: parts.get(RUNNING, 0) + sum(sizes[: len(plan.inputs)])}
        largest = max(range(len(tensors)), key=sizes.__getitem__, default=None)
        self.ledger.check_possible(whole, "op" if largest is None else tensors[largest].name)

    @staticmethod
    def _bind_inputs(
        operator: Operator, plan: Plan, planned: Mapping[str, Any], sent: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The operator's arguments except outputs: input views over their bytes, then values."""
        unknown = sorted(set(sent) - set(plan.inputs))
        if unknown:
            raise invalid_error(unknown[0], f"is not an input tensor of this {operator.name} call")
        args: dict[str, Any] = {}
        for name, desc in plan.inputs.items():
            args[name] = _input_view(name, desc, sent.get(name, planned.get(name)))
        return {**Engine._values(operator, plan), **args}

    @staticmethod
    def _values(operator: Operator, plan: Plan) -> dict[str, Any]:
        """The operator's arguments but its tensors: arrays and scalars as validated, and facts validation
        derived that are no parameter (BatchNorm's channel axis, read from a format tag)."""
        params = operator.signature.params
        values = {spec.name: plan.values.get(spec.name) for spec in params if spec.kind is not Kind.TENSOR}
        for name, value in plan.values.items():
            values.setdefault(name, value)
        return values

    def _compute(
        self,
        operator: Operator,
        plan: Plan,
        args: dict[str, Any],
        call: CallContext,
        destinations: Mapping[str, np.ndarray] | None = None,
        prepared: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, np.ndarray]:
        """Computes into fresh arrays, so that a call that fails has written nothing; or into
        `destinations` (in process, or device buffers) where one has exactly its output's shape and
        dtype. Every failure a caller can cause comes before this point; only a backend's own fault
        could stop it midway. `prepared`: the backend's compute of this plan, prepared (its kernel chosen).
        """
        outputs = {}
        for name, desc in plan.outputs.items():
            given = _destination(destinations, name, desc)
            outputs[name] = np.empty(desc.shape, desc.dtype) if given is None else given
        for name in plan.outputs.keys() & plan.inputs.keys():  # in/out: updated in place, from the input's values
            outputs[name][...] = args[name]
            args[name] = outputs[name]
        if prepared is None:
            for spec in operator.signature.params:
                if spec.kind is Kind.TENSOR:
                    args.setdefault(spec.name, outputs.get(spec.name))
        else:  # a prepared call's arguments hold its other tensors already (Engine.prepare)
            args.update(outputs)
        started = time.perf_counter()
        try:
            if prepared is not None:
                prepared(args)
            elif getattr(self.backend, "accepts_stream", False):  # the NPU maps client streams to ACL streams
                self.backend.compute(operator, plan, args, stream=_stream_key(call))
            else:
                self.backend.compute(operator, plan, args)
        except AclnnError:
            raise
        except Exception as exc:  # a backend bug must not take the server down or write anything
            log.exception("%s failed on backend %s", operator.name, self.backend.name)
            raise AclnnError(Status.INNER, f"{operator.name} failed inside the service: {exc}") from exc
        finally:
            call.compute_s += time.perf_counter() - started
        return outputs


def _destination(destinations: Mapping[str, np.ndarray] | None, name: str, desc: TensorDesc) -> np.ndarray | None:
    """The array given to compute an output straight into, if it has exactly the output's shape and dtype."""
    given = destinations.get(name) if destinations else None
    return given if given is not None and given.shape == desc.shape and given.dtype == desc.dtype else None


def _input_view(name: str, desc: TensorDesc, data: Any) -> Any:
    """An input's view over the bytes sent for it, checked to hold its storage; device storage as it is
    (bound when the call runs)."""
    if data is None:
        raise invalid_error(name, "input bytes were never sent (ship them with the plan or with execute)")
    return data if isinstance(data, ResidentStorage) else desc.view(data)


def _stream_key(call: CallContext) -> StreamKey | None:
    """The client stream a backend runs a call on: (identity, session, stream id), or None without one."""
    return None if call.stream is None else (call.owner, call.session, call.stream)


class BackendStarting(AclnnError):
    """The backend asked for is not ready yet (a cold cpu backend compiles its kernels for minutes).

    UNAVAILABLE on the wire, which clients retry: the call is refused at once, never left waiting
    for the start-up, and its message says how long the server has been at it.
    """

    # What each backend is doing while it starts, for the message.
    ACTIVITY: ClassVar[dict[str, str]] = {
        "cpu": "compiling kernels",
        "npu": "initializing the device",
        "auto": "looking for an NPU",
    }

    def __init__(self, backend: str, elapsed_s: float) -> None:
        activity = self.ACTIVITY.get(backend, "loading")
        super().__init__(
            Status.RUNTIME_ERROR,
            f"the server is starting: its {backend} backend is not ready yet ({activity}, {elapsed_s:.0f} s so far); "
            "retry later, or start it with --backend auto to be served by the reference meanwhile",
        )


def _thread(target: Callable[..., None], *args: Any) -> None:
    threading.Thread(target=target, args=args, name="aclnn-backend-load", daemon=True).start()


def _close(backend: Backend | None) -> None:
    close = getattr(backend, "close", None)
    if close is not None:
        close()


def _value_key(value: Value) -> Hashable:
    """What validation reads of a value: a tensor's descriptor (not its bytes), typed scalars."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Tensor):
        return (value.data_type, value.format, value.view_dims, value.strides, value.offset, value.storage_dims)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, bool | int | IntArray | BoolArray):
        return (type(value).__name__, value)
    raise TypeError(type(value))


def plan_key(op: str, values: Mapping[str, Value]) -> Hashable | None:
    """The cache key of a call's plan; None when a value is of no kind validation knows (never cached)."""
    try:
        return op, frozenset((name, _value_key(v)) for name, v in values.items())
    except TypeError:  # _value_key's, or an unhashable part of a value (a list inside an IntArray)
        return None


class Recent:
    """The `capacity` most recently used values, by key (a lock around each use)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._values: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._values[key] = value
            if len(self._values) > self.capacity:
                self._values.popitem(last=False)


class PlanCache(Recent):
    """Validated plans of recent calls, keyed by descriptors and scalars: validation is a pure function of them.

    Repeated calls of one shape (the common case: a training step) skip the error
    table; only successful plans are kept, so every bad call is still checked in full.
    """

    def get(self, key: Hashable) -> tuple[Operator, Plan] | None:
        """A copy of the cached plan: a backend may key state on the plan object (the NPU's executors),
        which must live as long as the call's executor, not as long as the cache."""
        validated = super().get(key)
        return None if validated is None else (validated[0], dataclasses.replace(validated[1]))

    def put(self, key: Hashable, validated: tuple[Operator, Plan]) -> None:
        super().put(key, (validated[0], dataclasses.replace(validated[1])))


def _resident_of(plan: Plan, planned: Mapping[str, Any], sent: Mapping[str, Any]) -> dict[str, ResidentStorage]:
    """An executor's tensors in device buffers: those planned there (checked then) but inputs sent anew,
    and inputs sent now in device buffers, checked here to hold their storage (161002 naming them)."""
    resident = {
        name: data
        for name, data in planned.items()
        if isinstance(data, ResidentStorage) and not (name in sent and name not in plan.outputs)
    }
    for name, data in sent.items():
        if isinstance(data, ResidentStorage) and name in plan.inputs:
            data.check_fits(plan.inputs[name])
            resident[name] = data
    return resident


class _ResidentView:
    """A tensor's elements in a device buffer, as a NumPy array: over the buffer's host memory, or
    over a host copy of its storage (written back by `store`) when the memory is on a device."""

    def __init__(self, memory: DeviceMemory, storage: ResidentStorage, desc: TensorDesc) -> None:
        self.memory, self.storage, self.desc = memory, storage, desc
        host = memory.host_array(storage.buffer.block)
        self.direct = host is not None
        nbytes = desc.storage_nbytes
        if host is not None:
            self.bytes = host[storage.offset : storage.offset + nbytes]
        else:
            self.bytes = np.empty(nbytes, np.uint8)
            memory.read(storage.buffer.block, storage.offset, self.bytes)
        self._arrays: dict[bool, np.ndarray] = {}

    def array(self, writeable: bool) -> np.ndarray:
        if writeable not in self._arrays:
            self._arrays[writeable] = self.desc.view(self.bytes, writeable=writeable)
        return self._arrays[writeable]

    def store(self, result: np.ndarray) -> None:
        """Writes a result into the view's elements (and a host copy back to the device)."""
        self.array(writeable=True)[...] = result
        if not self.direct:
            self.memory.write(self.storage.buffer.block, self.storage.offset, self.bytes)
