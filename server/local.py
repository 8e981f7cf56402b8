"""LocalClient: the client API in process, on the server's own engine (no gRPC)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from aclnn_client.api import BaseClient, Executor
from aclnn_client.tensor import Tensor, Value

from .engine import Engine


class LocalClient(BaseClient):
    """The same methods as aclnn_client.Client, running the operators in this process.

    `backend` takes the server's names (numpy, auto, ...); other keyword arguments
    configure the Engine (executor_ttl_s, max_executors, memory_budget_bytes).
    """

    def __init__(self, backend: str = "numpy", **engine_options: Any) -> None:
        self.engine = Engine(backend, **engine_options)

    def _output_names(self, op: str) -> frozenset[str]:
        operator = self.engine.operators.get(op)
        return frozenset(p.name for p in operator.signature.params if p.output) if operator else frozenset()

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        return self.engine.get_workspace_size(op, values)

    def _execute(self, executor: Executor, inputs: Mapping[str, Tensor]) -> Mapping[str, np.ndarray]:
        return self.engine.execute(executor.id, {name: t.data for name, t in inputs.items()})

    def _run(self, op: str, values: Mapping[str, Value]) -> Mapping[str, np.ndarray]:
        return self.engine.run(op, values)[1]

    def _set_executor_repeatable(self, executor_id: str) -> None:
        self.engine.set_executor_repeatable(executor_id)

    def _destroy_executor(self, executor_id: str) -> None:
        self.engine.destroy_executor(executor_id)
