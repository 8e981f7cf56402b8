"""The transport-agnostic core: validate, plan, execute. gRPC and LocalClient both call this."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aclnn_client.errors import AclnnError, Status, invalid_error
from aclnn_client.tensor import BoolArray, IntArray, Tensor, Value

from .admission import Admission
from .backends import Backend, create_backend
from .executors import ExecutorStore
from .ops import OPERATORS
from .params import CallParams, Kind
from .registry import Operator, Plan

log = logging.getLogger("aclnn_server")


def default_memory_budget() -> int:
    """Half of physical memory: the most one call's tensors may claim."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


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
        max_result_bytes: int | None = None,
        max_concurrency: int = 2,
        max_queue: int = 64,
        device: int = 0,
        torch_device: str = "cpu",
    ) -> None:
        if isinstance(backend, str):
            backend = create_backend(backend, device=device, torch_device=torch_device)
        self.backend = backend
        self.executors = ExecutorStore(executor_ttl_s, max_executors)
        self.memory_budget_bytes = memory_budget_bytes or default_memory_budget()
        # A transport that returns results in one message caps their size (None: no cap).
        self.max_result_bytes = max_result_bytes
        self.admission = Admission(max_concurrency, max_queue, self.memory_budget_bytes)
        self._streams: weakref.WeakValueDictionary[tuple, _StreamLock] = weakref.WeakValueDictionary()
        self._streams_lock = threading.Lock()
        self._plans = PlanCache()

    @property
    def operators(self) -> Mapping[str, Operator]:
        return OPERATORS

    def get_workspace_size(
        self, op: str, values: Mapping[str, Value], call: CallContext | None = None
    ) -> tuple[int, str]:
        call = call or CallContext()
        operator, plan, workspace_size = self._plan(op, values, call)
        data = {name: values[name].data for name in plan.inputs if values[name].data is not None}
        return workspace_size, self.executors.add(operator, plan, workspace_size, data, call.owner)

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
        """An execution slot for the call's inputs, outputs and workspace (see Admission)."""
        inline = [t for name, t in plan.outputs.items() if name not in call.placed]
        inline_bytes = sum(t.numel * t.dtype.itemsize for t in inline)
        if self.max_result_bytes is not None and inline_bytes > self.max_result_bytes:
            raise invalid_error(
                inline[0].name,
                f"results of {inline_bytes} bytes exceed the max message size of {self.max_result_bytes}: "
                "keep them on the server (placements) or raise --max-message-bytes",
            )
        held = workspace_size + sum(t.storage_nbytes for t in plan.inputs.values())
        held += sum(t.numel * t.dtype.itemsize for t in plan.outputs.values())
        with self._stream(call), self.admission.slot(held, call.deadline, call.cancelled) as waited:
            call.queue_s += waited
            yield

    def _stream(self, call: CallContext) -> contextlib.AbstractContextManager:
        """The lock that keeps one stream's calls from overlapping (clients submit them in order)."""
        if call.stream is None:
            return contextlib.nullcontext()
        with self._streams_lock:
            key = (call.owner, call.session, call.stream)
            lock = self._streams.get(key)
            if lock is None:
                lock = self._streams[key] = _StreamLock()
        return lock

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
        """A call may not claim more memory than the budget: no allocation sized by a client's whim."""
        budget = self.memory_budget_bytes
        for t in [*plan.inputs.values(), *plan.outputs.values()]:
            if t.numel * t.dtype.itemsize > budget:
                raise invalid_error(t.name, f"a view of {t.numel} elements exceeds the server's memory budget")
        total = workspace_size + sum(t.numel * t.dtype.itemsize for t in plan.outputs.values())
        if total > budget:
            raise invalid_error(
                next(iter(plan.outputs), "op"),
                f"outputs and workspace need {total} bytes, above the server's memory budget of {budget}",
            )

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


class _StreamLock:
    """A lock that a weak dictionary can hold: it lives while some call uses its stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()
