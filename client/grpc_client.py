"""The gRPC client: NumPy in, NumPy out."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from ._proto import aclnn_pb2 as pb
from ._proto import aclnn_pb2_grpc as pb_grpc
from .api import BaseClient
from .tensor import Tensor, Value, storage_bytes
from .wire import decode_error, decode_outputs, encode_call

# The server enforces its own message limit; the client accepts whatever it is sent.
_UNLIMITED = -1


def channel_target(target: str | Sequence[str]) -> str:
    """A gRPC target for one "host:port", a gRPC URI, or a list of "ip:port" replicas."""
    if isinstance(target, str):
        return target
    # gRPC's ipv4: scheme takes several literal addresses; round_robin then spreads calls over them.
    return "ipv4:" + ",".join(target)


class Client(BaseClient):
    """Calls aclnn operators on an aclnn-serve server.

    `target` is "host:port", a list of "ip:port" (balanced round-robin), or any gRPC
    target such as "dns:///name:port". `token` is sent as a bearer token; the
    certificate arguments are PEM bytes for TLS (all three for mutual TLS).
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        channel_options = [
            ("grpc.max_send_message_length", _UNLIMITED),
            ("grpc.max_receive_message_length", _UNLIMITED),
            ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
            *options,
        ]
        address = channel_target(target)
        if root_certificates or private_key or certificate_chain:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self._channel = grpc.secure_channel(address, credentials, channel_options)
        else:
            self._channel = grpc.insecure_channel(address, channel_options)
        self._stub = pb_grpc.AclnnStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._operators: dict[str, frozenset[str]] | None = None
        self._operators_lock = threading.Lock()

    def close(self) -> None:
        self._channel.close()

    def list_operators(self) -> dict[str, list[dict[str, Any]]]:
        """The server's operators and their parameters (name, kind, output, optional)."""
        reply = self._call(self._stub.ListOperators, pb.Empty())
        return {
            op.name: [{"name": p.name, "kind": p.kind, "output": p.output, "optional": p.optional} for p in op.params]
            for op in reply.operators
        }

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, metadata=self._metadata)
        except grpc.RpcError as error:
            raise decode_error(error) from None

    def _output_names(self, op: str) -> frozenset[str]:
        with self._operators_lock:
            if self._operators is None:
                self._operators = {
                    name: frozenset(p["name"] for p in params if p["output"])
                    for name, params in self.list_operators().items()
                }
        return self._operators.get(op, frozenset())

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        plan = self._call(self._stub.GetWorkspaceSize, encode_call(op, values))
        return plan.workspace_size, plan.executor

    def _execute(self, executor_id: str, inputs: Mapping[str, Tensor]) -> Mapping[str, np.ndarray]:
        request = pb.ExecuteRequest(executor=executor_id, inputs={name: storage_bytes(t) for name, t in inputs.items()})
        return decode_outputs(self._call(self._stub.Execute, request).outputs)

    def _run(self, op: str, values: Mapping[str, Value]) -> Mapping[str, np.ndarray]:
        return decode_outputs(self._call(self._stub.Run, encode_call(op, values)).outputs)

    def _set_executor_repeatable(self, executor_id: str) -> None:
        self._call(self._stub.SetExecutorRepeatable, pb.ExecutorRef(executor=executor_id))

    def _destroy_executor(self, executor_id: str) -> None:
        self._call(self._stub.DestroyExecutor, pb.ExecutorRef(executor=executor_id))
