"""LocalClient: the client API in process, on the server's own engine (no gRPC)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aclnn_common.api import BaseClient, Executor
from aclnn_common.binding import BoundCall
from aclnn_common.tensor import Value

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
        self._owns_backend = isinstance(backend, str)  # a backend passed in belongs to the caller

    def close(self) -> None:
        super().close()
        self.engine.executors.end_session(self._session)
        close = getattr(self.engine.backend, "close", None)
        if self._owns_backend and close is not None:
            close()

    def _output_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.output) if operator else frozenset()

    def _inout_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.inout) if operator else frozenset()

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        return self.engine.get_workspace_size(op, values, self._call())

    # In process, results are computed straight into the caller's arrays when they allow it
    # (BoundCall.destinations): no second full-size array, no copy.
    def _execute(self, executor: Executor, stream: int | None) -> None:
        call = executor.call
        data = {name: t.data for name, t in call.inputs().items()}
        call.write_outputs(self.engine.execute(executor.id, data, self._call(stream), call.destinations()))

    def _run(self, call: BoundCall, stream: int | None) -> None:
        call.write_outputs(self.engine.run(call.op, call.values, self._call(stream), call.destinations())[1])

    def _set_executor_repeatable(self, executor_id: str) -> None:
        self.engine.set_executor_repeatable(executor_id, self._call())

    def _destroy_executor(self, executor_id: str) -> None:
        self.engine.destroy_executor(executor_id, self._call())

    def _call(self, stream: int | None = None) -> CallContext:
        return CallContext(session=self._session, stream=stream)
