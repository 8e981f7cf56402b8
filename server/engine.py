"""The transport-agnostic core: validate, plan, execute. gRPC and LocalClient both call this."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aclnn_common.errors import AclnnError, Status, invalid_error
from aclnn_common.tensor import BoolArray, IntArray, Tensor, Value

from .admission import Admission
from .backends import Backend, create_backend
from .executors import ExecutorStore
from .ledger import SMALL_HOLD_BYTES, SMALL_WORKSPACE_BYTES, Hold, MemoryLedger
from .ops import OPERATORS
from .params import CallParams, Kind
from .registry import Operator, Plan

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
    deadline: float | None = None  # time.monotonic() after which the work is not started
    cancelled: Callable[[], bool] = field(default=lambda: False)
    op: str = ""
    # Set by a transport that sends results after the engine returns: the outputs' memory stays held
    # (in these holds) until the reply is gone. None: the engine releases everything itself.
    holds: list[Hold] | None = None
    bytes_in: int = 0  # bytes a streaming call moved (unary calls measure their messages)
    bytes_out: int = 0
    queue_s: float = 0.0
    validation_s: float = 0.0
    compute_s: float = 0.0


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
        device: int = 0,
        torch_device: str = "cpu",
        load_in_background: bool = False,
    ) -> None:
        # A backend named here is created now, or with `load_in_background` on a thread of its own
        # (the cpu backend may compile its kernels for a minute): `ready` is set once it can compute.
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._backend: Backend | None = None
        if not isinstance(backend, str):
            self._backend = backend
            self.ready.set()
        elif load_in_background:
            threading.Thread(
                target=self._load, args=(backend, device, torch_device), name="aclnn-backend-load", daemon=True
            ).start()
        else:
            self._load(backend, device, torch_device)
            if self.load_error is not None:
                raise self.load_error
        self.executors = ExecutorStore(executor_ttl_s, max_executors, max_tenant_executors or max_executors)
        self.memory_budget_bytes = memory_budget_bytes or default_memory_budget()
        self.ledger = MemoryLedger(self.memory_budget_bytes, max_tenant_bytes)
        # A transport that returns results in one message caps their size (None: no cap).
        self.max_result_bytes = max_result_bytes
        self.admission = Admission(max_concurrency, max_queue, self.ledger)
        self._plans = PlanCache()

    def _load(self, name: str, device: int, torch_device: str) -> None:
        try:
            self._backend = create_backend(name, device=device, torch_device=torch_device)
        except BaseException as exc:  # reported by whoever waits for `ready` (the CLI exits with it)
            self.load_error = exc
        finally:
            self.ready.set()

    @property
    def backend(self) -> Backend:
        """The backend; calls that arrive while it is still loading wait for it."""
        if self._backend is None:
            self.ready.wait()
            if self._backend is None:
                raise AclnnError(Status.RUNTIME_ERROR, f"the backend failed to start: {self.load_error}")
        return self._backend

    @property
    def operators(self) -> Mapping[str, Operator]:
        return OPERATORS

    def get_workspace_size(
        self, op: str, values: Mapping[str, Value], call: CallContext | None = None
    ) -> tuple[int, str]:
        call = call or CallContext()
        operator, plan, workspace_size = self._plan(op, values, call)
        data = {name: values[name].data for name in plan.inputs if values[name].data is not None}
        # Bytes shipped with the plan live as long as the executor: they are its owner's to hold.
        nbytes = sum(memoryview(d).nbytes for d in data.values() if not isinstance(d, memoryview | np.ndarray))
        hold = self.ledger.reserve(call.owner, nbytes, "executor", next(iter(data), "op"))
        try:
            return workspace_size, self.executors.add(
                operator, plan, workspace_size, data, call.owner, call.session, hold
            )
        except BaseException:
            hold.release()
            raise

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
        with self._admitted(entry.plan, entry.workspace_size, call):
            entry, args = self.executors.begin_execute(
                executor_id, lambda e: self._bind_inputs(e.operator, e.plan, e.data, inputs), call.owner
            )
            return self._compute(entry.operator, entry.plan, args, call, destinations)

    def run(
        self,
        op: str,
        values: Mapping[str, Value],
        call: CallContext | None = None,
        destinations: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        call = call or CallContext()
        operator, plan, workspace_size = self._plan(op, values, call)
        args = self._bind_inputs(operator, plan, {name: values[name].data for name in plan.inputs}, {})
        with self._admitted(plan, workspace_size, call):
            return workspace_size, self._compute(operator, plan, args, call, destinations)

    def set_executor_repeatable(self, executor_id: str, call: CallContext | None = None) -> None:
        self.executors.set_repeatable(executor_id, (call or CallContext()).owner)

    def destroy_executor(self, executor_id: str, call: CallContext | None = None) -> None:
        self.executors.destroy(executor_id, (call or CallContext()).owner)

    @contextlib.contextmanager
    def _admitted(self, plan: Plan, workspace_size: int, call: CallContext) -> Iterator[None]:
        """An execution slot with memory for the call's outputs and workspace (see Admission).

        Inputs are held already (in their message, upload or executor). The outputs stay held
        after compute, in `call.holds`, when the transport sends them later.
        """
        inline = [t for name, t in plan.outputs.items() if name not in call.placed]
        inline_bytes = sum(t.numel * t.dtype.itemsize for t in inline)
        if self.max_result_bytes is not None and inline_bytes > self.max_result_bytes:
            raise invalid_error(
                inline[0].name,
                f"results of {inline_bytes} bytes exceed the max message size of {self.max_result_bytes}: "
                "keep them on the server (placements) or raise --max-message-bytes",
            )
        output_bytes = sum(t.numel * t.dtype.itemsize for t in plan.outputs.values())
        # Small ones are not held (see SMALL_HOLD_BYTES); a kept result always is.
        if output_bytes <= SMALL_HOLD_BYTES and not call.placed:
            output_bytes = 0
        if workspace_size <= SMALL_WORKSPACE_BYTES:
            workspace_size = 0
        stream = None if call.stream is None else (call.owner, call.session, call.stream)
        with self.admission.slot(workspace_size + output_bytes, call.owner, stream, call.deadline, call.cancelled) as (
            waited,
            hold,
        ):
            call.queue_s += waited
            try:
                yield
            except BaseException:
                hold.release()
                raise
        if call.holds is None:
            hold.release()
        else:
            hold.shrink(output_bytes)  # the workspace is free again; the outputs until the reply is sent
            call.holds.append(hold)

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
        workspace_size = self.backend.workspace_size(operator, plan)
        self._check_budget(plan, workspace_size)
        call.validation_s += time.perf_counter() - started
        return operator, plan, workspace_size

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

    def _check_budget(self, plan: Plan, workspace_size: int) -> None:
        """161002 for a call that could never fit one caller's memory: no allocation sized by a client's whim."""
        tensors = [*plan.inputs.values(), *plan.outputs.values()]
        sizes = [t.numel * t.dtype.itemsize for t in tensors]
        if max(sizes, default=0) > self.ledger.tenant_bytes:  # the message names the first at fault
            for t, size in zip(tensors, sizes):
                self.ledger.check_possible(size, t.name)
        total = workspace_size + sum(sizes[len(plan.inputs) :])
        self.ledger.check_possible(total, next(iter(plan.outputs), "op"))

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
            data = sent.get(name, planned.get(name))
            if data is None:
                raise invalid_error(name, "input bytes were never sent (ship them with the plan or with execute)")
            args[name] = desc.view(data)
        for spec in operator.signature.params:
            if spec.kind is not Kind.TENSOR:
                args[spec.name] = plan.values.get(spec.name)
        # Facts validation derived that are no parameter (BatchNorm's channel axis, read from a format tag).
        for name, value in plan.values.items():
            args.setdefault(name, value)
        return args

    def _compute(
        self,
        operator: Operator,
        plan: Plan,
        args: dict[str, Any],
        call: CallContext,
        destinations: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Computes into fresh arrays, so that a call that fails has written nothing; or, in process,
        into `destinations` when they are exactly every output's shape and dtype. Every failure a
        caller can cause comes before this point; only a backend's own fault could stop it midway.
        """
        given = destinations or {}
        in_place = all(
            name in given and given[name].shape == desc.shape and given[name].dtype == desc.dtype
            for name, desc in plan.outputs.items()
        )
        outputs = {
            name: given[name] if in_place else np.empty(desc.shape, desc.dtype) for name, desc in plan.outputs.items()
        }
        for name in plan.outputs.keys() & plan.inputs.keys():  # in/out: updated in place, from the input's values
            outputs[name][...] = args[name]
            args[name] = outputs[name]
        for spec in operator.signature.params:
            if spec.kind is Kind.TENSOR:
                args.setdefault(spec.name, outputs.get(spec.name))
        started = time.perf_counter()
        try:
            if getattr(self.backend, "accepts_stream", False):  # the NPU maps client streams to ACL streams
                self.backend.compute(operator, plan, args, stream=call.stream)
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


class PlanCache:
    """Validated plans of recent calls, keyed by descriptors and scalars: validation is a pure function of them.

    Repeated calls of one shape (the common case: a training step) skip the error
    table; only successful plans are kept, so every bad call is still checked in full.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._plans: collections.OrderedDict[Hashable, tuple[Operator, Plan]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> tuple[Operator, Plan] | None:
        """A copy of the cached plan: a backend may key state on the plan object (the NPU's executors),
        which must live as long as the call's executor, not as long as the cache."""
        with self._lock:
            validated = self._plans.get(key)
            if validated is None:
                return None
            self._plans.move_to_end(key)
        return validated[0], dataclasses.replace(validated[1])

    def put(self, key: Hashable, validated: tuple[Operator, Plan]) -> None:
        with self._lock:
            self._plans[key] = validated[0], dataclasses.replace(validated[1])
            if len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
