"""The two-phase call API, shared by the gRPC Client and the in-process LocalClient."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import numpy as np

from .binding import BoundCall, bind
from .errors import invalid_error
from .tensor import Tensor, Value


class Executor:
    """What get_workspace_size returns: the server's executor and the call's outputs."""

    def __init__(self, executor_id: str, call: BoundCall, workspace_size: int) -> None:
        self.id = executor_id  # the transport's reference to the server-side executor
        self.call = call
        self.workspace_size = workspace_size
        self.repeatable = False

    @property
    def op(self) -> str:
        return self.call.op

    def __repr__(self) -> str:
        return f"Executor({self.op}, id={self.id[:8]}, workspace_size={self.workspace_size})"


class BaseClient(abc.ABC):
    """get_workspace_size / execute / run / set_executor_repeatable / destroy_executor.

    Subclasses supply the transport: six primitive calls on parameter values.
    """

    def get_workspace_size(self, op: str, **params: Any) -> tuple[int, Executor]:
        """Validates and plans a call on the server; returns (workspace_size, executor)."""
        call = bind(op, params, self._output_names(op))
        workspace_size, executor_id = self._get_workspace_size(op, call.descriptors())
        return workspace_size, Executor(executor_id, call, workspace_size)

    def execute(self, executor: Executor) -> None:
        """Runs a planned call, reading the inputs' current contents, and fills its outputs in place."""
        if not isinstance(executor, Executor):
            raise invalid_error("executor", f"expected an Executor from get_workspace_size, got {executor!r:.60}")
        executor.call.write_outputs(self._execute(executor, executor.call.inputs()))

    def run(self, op: str, **params: Any) -> None:
        """Both phases in one round trip; fills the outputs in place."""
        call = bind(op, params, self._output_names(op))
        call.write_outputs(self._run(op, call.values))

    def set_executor_repeatable(self, executor: Executor) -> None:
        """Keeps the executor usable until destroy_executor (call before its first execute)."""
        self._set_executor_repeatable(self._executor_id(executor))
        executor.repeatable = True

    def destroy_executor(self, executor: Executor) -> None:
        self._destroy_executor(self._executor_id(executor))

    def close(self) -> None:  # noqa: B027 - optional hook: in-process clients hold nothing
        """Releases the transport."""

    def __enter__(self) -> BaseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def _executor_id(executor: Executor) -> str:
        if not isinstance(executor, Executor):
            raise invalid_error("executor", f"expected an Executor from get_workspace_size, got {executor!r:.60}")
        return executor.id

    @abc.abstractmethod
    def _output_names(self, op: str) -> frozenset[str]:
        """The output parameter names of an operator (empty for an unknown one)."""

    @abc.abstractmethod
    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]: ...

    @abc.abstractmethod
    def _execute(self, executor: Executor, inputs: Mapping[str, Tensor]) -> Mapping[str, np.ndarray]: ...

    @abc.abstractmethod
    def _run(self, op: str, values: Mapping[str, Value]) -> Mapping[str, np.ndarray]: ...

    @abc.abstractmethod
    def _set_executor_repeatable(self, executor_id: str) -> None: ...

    @abc.abstractmethod
    def _destroy_executor(self, executor_id: str) -> None: ...
