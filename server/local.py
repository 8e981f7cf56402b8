"""LocalClient: the client API in process, on the server's own engine (no gRPC)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from aclnn_common.api import BaseClient, Executor
from aclnn_common.binding import BoundCall
from aclnn_common.device import DeviceBuffer
from aclnn_common.tensor import Tensor, Value

from .buffers import ResidentStorage
from .engine import CallContext, Engine


class LocalClient(BaseClient):
    """The same methods as aclnn_client.Client, running the operators in this process.

    `backend` takes the server's names (numpy, auto, ...); other keyword arguments
    configure the Engine (executor_ttl_s, max_executors, memory_budget_bytes).
    """

    def __init__(self, backend: str = "numpy", **engine_options: Any) -> None:
        super().__init__()
        self.engine = Engine(backend, **engine_options)
        # Executors belong to this client's session, which lasts as long as the client (in process,
        # nobody can go away and leave them behind).
        self._session = f"local-{id(self):x}"

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.engine.end_session(None, self._session)
        self.engine.close()

    def _output_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.output) if operator else frozenset()

    def _inout_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.inout) if operator else frozenset()

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        return self.engine.get_workspace_size(op, self._resolved(values), self._call())

    # In process, results are computed straight into the caller's arrays when they allow it
    # (BoundCall.destinations): no second full-size array, no copy.
    def _execute(self, executor: Executor, stream: int | None) -> None:
        call = executor.call
        data = {name: t.data for name, t in call.inputs().items()}
        call.write_outputs(self.engine.execute(executor.id, data, self._call(stream), call.destinations()))

    def _run(self, call: BoundCall, stream: int | None) -> None:
        values = self._resolved(call.values)
        call.write_outputs(self.engine.run(call.op, values, self._call(stream), call.destinations())[1])

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

    def _resolved(self, values: Mapping[str, Value]) -> dict[str, Value]:
        """The values with device pointers resolved to this session's buffers (as the server's wire decoding does)."""
        resolved = dict(values)
        for name, value in values.items():
            if isinstance(value, Tensor) and isinstance(value.data, DeviceBuffer):
                self._own(value.data, name)
                resolved[name] = dataclasses.replace(value, data=self._storage(value.data, name))
        return resolved

    def _call(self, stream: int | None = None) -> CallContext:
        return CallContext(session=self._session, stream=stream)
