"""The gRPC client: NumPy in, NumPy out, over one server or a pool of replicas."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from ._proto import aclnn_pb2 as pb
from ._proto import aclnn_pb2_grpc as pb_grpc
from .api import BaseClient, Executor
from .errors import AclnnError
from .tensor import Tensor, Value, storage_bytes
from .wire import decode_error, decode_outputs, encode_call

# The server enforces its own message limit; the client accepts whatever it is sent.
_UNLIMITED = -1
# Worth another try elsewhere (a replica gone, or busy); everything else is the call's own answer.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# How long a replica that answered UNAVAILABLE is passed over before it is tried again.
_DOWN_S = 2.0
_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                # Plans and one-shot runs are safe to repeat; Execute spends an executor, so it is not retried here.
                "name": [
                    {"service": "aclnn.v1.Aclnn", "method": m} for m in ("Run", "GetWorkspaceSize", "ListOperators")
                ],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
                },
            }
        ],
    }
)


def replica_addresses(target: str | Sequence[str]) -> list[str]:
    """One address per replica: a list as given, a dns:/// name resolved to its addresses, else the target."""
    if not isinstance(target, str):
        return list(target)
    if target.startswith("dns:///"):
        host, _, port = target[len("dns:///") :].rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            return [target]  # let gRPC resolve (and report) it
        addresses = {f"[{a[4][0]}]:{port}" if a[0] == socket.AF_INET6 else f"{a[4][0]}:{port}" for a in infos}
        return sorted(addresses)
    return [target]


class Client(BaseClient):
    """Calls aclnn operators on an aclnn-serve server, or on a pool of replicas.

    `target` is "host:port", a list of them, or "dns:///name:port" (each address a replica,
    as behind a headless Kubernetes Service). Plans and runs are spread round-robin; `run`
    (and planning) moves to another replica when one is gone or busy. An executor lives on
    the replica that planned it; if that replica is gone, `execute` plans the call again
    elsewhere. `token` is sent as a bearer token; the certificate arguments are PEM bytes
    for TLS (all three for mutual TLS). `timeout` is each RPC's deadline in seconds.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        addresses = replica_addresses(target)
        channel_options = [
            ("grpc.max_send_message_length", _UNLIMITED),
            ("grpc.max_receive_message_length", _UNLIMITED),
            ("grpc.service_config", _SERVICE_CONFIG),
            # One server: gRPC retries in place. Several: this client moves the call to another replica.
            ("grpc.enable_retries", int(len(addresses) == 1)),
            *options,
        ]
        secure = root_certificates or private_key or certificate_chain
        credentials = (
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain) if secure else None
        )
        self._channels = [
            grpc.secure_channel(a, credentials, channel_options)
            if credentials
            else grpc.insecure_channel(a, channel_options)
            for a in addresses
        ]
        self._down_until = [0.0] * len(addresses)
        self._stubs = [pb_grpc.AclnnStub(c) for c in self._channels]
        self._turn = itertools.count()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout
        self._operators: dict[str, frozenset[str]] | None = None
        self._operators_lock = threading.Lock()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def list_operators(self) -> dict[str, list[dict[str, Any]]]:
        """The server's operators and their parameters (name, kind, output, optional)."""
        reply, _ = self._call_any("ListOperators", pb.Empty())
        return {
            op.name: [{"name": p.name, "kind": p.kind, "output": p.output, "optional": p.optional} for p in op.params]
            for op in reply.operators
        }

    def _call_on(self, replica: int, method: str, request: Any) -> Any:
        try:
            return getattr(self._stubs[replica], method)(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as error:
            raise decode_error(error) from None

    def _next_replica(self) -> int:
        """The next replica in turn that is not known to be down (any, if all are)."""
        now, count = time.monotonic(), len(self._stubs)
        first = next(self._turn) % count
        for step in range(count):
            replica = (first + step) % count
            if self._down_until[replica] <= now:
                return replica
        return first

    def _call_any(self, method: str, request: Any) -> tuple[Any, int]:
        """Calls the next replica in turn; a gone or busy one hands the call to the next."""
        attempts = max(3, 2 * len(self._stubs))
        for attempt in range(attempts):
            replica = self._next_replica()
            try:
                return self._call_on(replica, method, request), replica
            except AclnnError as error:
                if error.grpc_code not in _RETRYABLE or attempt == attempts - 1:
                    raise
                if error.grpc_code == grpc.StatusCode.UNAVAILABLE:
                    self._down_until[replica] = time.monotonic() + _DOWN_S
                if len(self._stubs) == 1 or attempt >= len(self._stubs) - 1:
                    time.sleep(min(0.05 * (attempt + 1), 0.5))  # every replica tried: back off
        raise AssertionError("unreachable")

    def _output_names(self, op: str) -> frozenset[str]:
        with self._operators_lock:
            if self._operators is None:
                self._operators = {
                    name: frozenset(p["name"] for p in params if p["output"])
                    for name, params in self.list_operators().items()
                }
        return self._operators.get(op, frozenset())

    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]:
        plan, replica = self._call_any("GetWorkspaceSize", encode_call(op, values))
        return plan.workspace_size, f"{replica}/{plan.executor}"

    def _execute(self, executor: Executor, inputs: Mapping[str, Tensor]) -> Mapping[str, np.ndarray]:
        request = pb.ExecuteRequest(inputs={name: storage_bytes(t) for name, t in inputs.items()})
        try:
            return self._on_executor(executor.id, "Execute", request)
        except AclnnError as error:
            if error.grpc_code != grpc.StatusCode.UNAVAILABLE:
                raise
        self._replan(executor)  # its replica is gone: the executor went with it
        return self._on_executor(executor.id, "Execute", request)

    def _replan(self, executor: Executor) -> None:
        executor.workspace_size, executor.id = self._get_workspace_size(executor.op, executor.call.descriptors())
        if executor.repeatable:
            self._set_executor_repeatable(executor.id)

    def _on_executor(self, executor_id: str, method: str, request: Any) -> Any:
        replica, _, server_id = executor_id.partition("/")
        request.executor = server_id
        reply = self._call_on(int(replica), method, request)
        return decode_outputs(reply.outputs) if method == "Execute" else reply

    def _run(self, op: str, values: Mapping[str, Value]) -> Mapping[str, np.ndarray]:
        reply, _ = self._call_any("Run", encode_call(op, values))
        return decode_outputs(reply.outputs)

    def _set_executor_repeatable(self, executor_id: str) -> None:
        self._on_executor(executor_id, "SetExecutorRepeatable", pb.ExecutorRef())

    def _destroy_executor(self, executor_id: str) -> None:
        self._on_executor(executor_id, "DestroyExecutor", pb.ExecutorRef())
