"""LocalClient: the client API in process, on the server's own engine (no gRPC)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aclnn_common.api import BaseClient, Executor
from aclnn_common.binding import BoundCall, array_layout, bind
from aclnn_common.device import DeviceBuffer
from aclnn_common.errors import AclnnError
from aclnn_common.tensor import Tensor, Value

from .buffers import ResidentStorage
from .engine import CallContext, Engine, PreparedRun, plan_key

# Layouts of repeated calls remembered per client (a training loop brings a few).
_PREPARED_CALLS = 256


class LocalClient(BaseClient):
    """The same methods as aclnn_client.Client, running the operators in this process.

    `backend` takes the server's names (numpy, auto, ...); other keyword arguments
    configure the Engine (executor_ttl_s, max_executors, memory_budget_bytes).

    A `run` whose arguments have the layout of an earlier call that computed straight into its
    outputs (same operator, parameter names, array dtypes, shapes, strides and flags, same other
    values) skips binding, the error table and what the engine derives from the plan (workspace,
    admission sizes, the backend's kernel: Engine.prepare), all functions of that layout: a small
    call's fixed cost (a training step's, LayerNorm on a batch of 64) is then a fraction of a full one.
    """

    def __init__(self, backend: str = "numpy", **engine_options: Any) -> None:
        super().__init__()
        self.engine = Engine(backend, **engine_options)
        # Executors belong to this client's session, which lasts as long as the client (in process,
        # nobody can go away and leave them behind).
        self._session = f"local-{id(self):x}"
        self._prepared: dict[Hashable, _Prepared] = {}
        self._prepared_lock = threading.Lock()

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.engine.end_session(None, self._session)
        self.engine.close()

    def run(self, op: str, /, *, stream: int | None = None, **params: Any) -> None:
        """Both phases in one call; fills the outputs in place (a repeated layout: see the class)."""
        if stream is not None:
            return super().run(op, stream=stream, **params)
        self._check_open()
        layout = array_layout(op, params)
        prepared = self._prepared.get(layout[0]) if layout is not None else None
        if prepared is not None and prepared(self, layout[1]):
            return None
        call = bind(op, params, self._output_names(op), self._inout_names(op))
        if self._run_call(call, None) and layout is not None:
            self._remember(layout[0], _Prepared.of(self.engine, call))
        return None

    def _output_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.output) if operator else frozenset()

    def _inout_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.inout) if operator else frozenset()

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        return self.engine.get_workspace_size(op, self._resolved(op, values), self._call())

    # In process, results are computed straight into the caller's arrays when they allow it
    # (BoundCall.destinations): no second full-size array, no copy.
    def _execute(self, executor: Executor, stream: int | None) -> None:
        call = executor.call
        data = {name: t.data for name, t in call.inputs().items()}
        call.write_outputs(self.engine.execute(executor.id, data, self._call(stream), call.destinations()))

    def _run(self, call: BoundCall, stream: int | None) -> None:
        self._run_call(call, stream)

    def _run_call(self, call: BoundCall, stream: int | None) -> bool:
        """Runs a bound call; whether it computed straight into every output."""
        destinations = call.destinations()
        values = self._resolved(call.op, call.values)
        results = self.engine.run(call.op, values, self._call(stream), destinations)[1]
        call.write_outputs(results)
        return bool(destinations) and all(result is destinations.get(name) for name, result in results.items())

    def _remember(self, key: Hashable, prepared: _Prepared | None) -> None:
        if prepared is None:
            return
        with self._prepared_lock:
            if len(self._prepared) >= _PREPARED_CALLS:
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[key] = prepared

    def _set_executor_repeatable(self, executor_id: str) -> None:
        self.engine.set_executor_repeatable(executor_id, self._call())

    def _destroy_executor(self, executor_id: str) -> None:
        self.engine.destroy_executor(executor_id, self._call())

    # Device memory: the engine's buffers, in this client's session --------------------------

    def _malloc(self, nbytes: int) -> DeviceBuffer:
        buffer = self.engine.malloc(nbytes, self._call())
        return DeviceBuffer(buffer.id, buffer.size, self)

    def _free_buffer(self, buf: DeviceBuffer) -> None:
        self.engine.free(buf.id, self._call())

    def _write(self, dst: DeviceBuffer, data: memoryview) -> None:
        source = np.frombuffer(data, np.uint8)
        target = self._storage(dst, "dst")
        self.engine.write_buffer(target, source.nbytes, lambda into: np.copyto(into, source), self._call())

    def _read(self, src: DeviceBuffer, target: np.ndarray) -> None:
        self.engine.read_buffer(self._storage(src, "src"), target.nbytes, self._call(), out=target)

    def _copy(self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int) -> None:
        self.engine.copy_buffer(self._storage(dst, "dst"), self._storage(src, "src"), nbytes, self._call())

    def _fill(self, dst: DeviceBuffer, value: int, nbytes: int) -> None:
        self.engine.fill_buffer(self._storage(dst, "dst"), nbytes, value, self._call())

    def _synchronize(self, stream: int | None) -> None:
        self.engine.synchronize(self._call(stream))

    def _storage(self, buf: DeviceBuffer, name: str) -> ResidentStorage:
        return self.engine.buffers.slice(None, self._session, buf.id, buf.offset, name)

    def _resolved(self, op: str, values: Mapping[str, Value]) -> dict[str, Value]:
        """The values with device pointers resolved to this session's buffers (as the server's wire decoding
        does, and in the same order: a pointer refused is reported after what the descriptors are refused for)."""
        resolved = dict(values)
        try:
            for name, value in values.items():
                if isinstance(value, Tensor) and isinstance(value.data, DeviceBuffer):
                    self._own(value.data, name)
                    resolved[name] = dataclasses.replace(value, data=self._storage(value.data, name))
        except AclnnError:
            self.engine.validate(op, {n: v.without_data() if isinstance(v, Tensor) else v for n, v in values.items()})
            raise
        return resolved

    def _call(self, stream: int | None = None) -> CallContext:
        return CallContext(session=self._session, stream=stream)


@dataclass(frozen=True)
class _Prepared:
    """A call layout that validated and computed straight into its outputs: what the engine derived
    from it (Engine.prepare), and which of its arrays are inputs and outputs."""

    run: PreparedRun
    outputs: tuple[str, ...]
    # The pairs of arrays that must not share memory for the outputs to be computed in place: each
    # output with each other output and each input that is not also an output (disjoint's pairs).
    apart: tuple[tuple[str, str], ...]

    @staticmethod
    def of(engine: Engine, call: BoundCall) -> _Prepared | None:
        key = plan_key(call.op, call.values)
        if key is None or not all(isinstance(t, np.ndarray) for t in call.output_targets.values()):
            return None
        prepared = engine.prepare(key)
        if prepared is None:
            return None
        outputs = tuple(call.output_targets)
        inputs = [name for name in call.inputs() if name not in call.inout]
        apart = [(a, b) for i, a in enumerate(outputs) for b in [*outputs[i + 1 :], *inputs]]
        return _Prepared(prepared, outputs, tuple(apart))

    def __call__(self, client: LocalClient, arrays: Mapping[str, np.ndarray]) -> bool:
        """Runs the call on these arrays (the layout's: C-contiguous, each its own storage); False when
        it must run in full instead: its outputs overlap its inputs this time, or the backend changed."""
        for a, b in self.apart:
            if np.may_share_memory(arrays[a], arrays[b]):
                return False
        destinations = {name: arrays[name] for name in self.outputs}
        return client.engine.run_prepared(self.run, arrays, destinations, client._call()) is not None
