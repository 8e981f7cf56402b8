"""The gRPC side under saturation and abuse, against real server processes.

Health answers while every slot is taken and more calls are refused; one tenant holding calls open
gets its share of the slots, not all; ever-new operator names
neither grow /metrics nor forge log lines; a device failure (fake CANN) is tried once per
replica, not replayed; placements with no kind do not skip the inline-result size check.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from fake_cann.build import build
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from layer_norm_cases import layer_norm_call
from test_processes import broadcast_call, free_port, in_flight

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import bind
from aclnn_common.wire import encode_call

OP = "aclnnLayerNormBackward"
OUTPUTS = frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"})
GiB = 1 << 30
SESSION = (("x-aclnn-session", "tenant-a"),)


class Server:
    """A server process whose stderr is read as it comes (a full pipe would stall its logging)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aclnn_server",
                "--port",
                "0",
                "--backend",
                "numpy",
                "--log-level",
                "WARNING",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        line = self.proc.stdout.readline()
        match = re.fullmatch(r"listening on (\S+)\n", line)
        if not match:
            self.proc.kill()
            self._reader.join(10)
            raise AssertionError(f"unexpected first line {line!r}: {''.join(self.stderr)}")
        self.address = match[1]

    def stop(self) -> str:
        """Stops it gracefully; returns its stderr."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        finally:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        return "".join(self.stderr)


def metrics_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def series(port: int) -> int:
    return sum(1 for line in metrics_text(port).splitlines() if line and not line.startswith("#"))


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def retry_delay(error: grpc.RpcError) -> float | None:
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToTimedelta().total_seconds()
    return None


# --------------------------------------------------------------------------- health under saturation


def test_health_answers_while_every_slot_is_taken_and_calls_are_refused():
    """Executions running and queued, the other call slots held by stalled uploads, more calls refused:
    health still answers SERVING at once (it used to share grpc's call limit and got RESOURCE_EXHAUSTED)."""
    metrics_port = free_port()
    server = Server(  # one identity (this user) takes every call slot here
        *("--max-concurrency", "1", "--max-queue", "1", "--metrics-port", str(metrics_port)),
        *("--memory-budget-bytes", str(16 * GiB), "--max-tenant-calls", "6"),
    )
    release = threading.Event()

    def stalled_upload():  # one chunk announcing more, then nothing until released
        yield pb.TensorChunk(offset=0, total_size=2048, data=bytes(1024))
        release.wait(60)

    refusals, probes = [], []
    try:
        with (
            Client(server.address, data_channel=False) as client,
            grpc.insecure_channel(server.address) as channel,
        ):
            stub, health = pb_grpc.AclnnStub(channel), health_pb2_grpc.HealthStub(channel)
            client.list_operators()
            # Over a second of compute each (stride-0 rows): one runs, one waits in the queue.
            runs = [
                threading.Thread(target=client.run, args=(OP,), kwargs=broadcast_call(i, rows=1 << 18)) for i in (1, 2)
            ]
            for run in runs:
                run.start()
            wait_until(lambda: in_flight(metrics_port) >= 2)
            # The remaining call slots (max concurrency + queue + 4 = 6) held by uploads that stall.
            uploads = [stub.UploadTensor.future(stalled_upload(), timeout=60, metadata=SESSION) for _ in range(4)]
            wait_until(lambda: in_flight(metrics_port) >= 6)

            def refused_calls():
                while not release.is_set():
                    started = time.monotonic()
                    try:
                        stub.Run(pb.OpCall(op=OP), timeout=10)
                    except grpc.RpcError as error:
                        # A call still in flight when the slots are released may be admitted (and fail
                        # as the empty call it is): only calls answered while saturated count.
                        if not release.is_set():
                            refusals.append((error.code(), retry_delay(error), time.monotonic() - started))

            flood = threading.Thread(target=refused_calls)
            flood.start()
            for _ in range(20):
                started = time.monotonic()
                reply = health.Check(health_pb2.HealthCheckRequest(service="aclnn.v1.Aclnn"), timeout=5)
                probes.append((reply.status, time.monotonic() - started))
                time.sleep(0.02)
            release.set()
            flood.join()
            for upload in uploads:
                with pytest.raises(grpc.RpcError):
                    upload.result()  # truncated: refused, as any truncated upload
            for run in runs:
                run.join(60)
            # Everything given back: the server takes calls again.
            client.run(OP, **layer_norm_call(np.random.default_rng(0), (4, 8)))
    finally:
        release.set()
        server.stop()
    assert all(status == health_pb2.HealthCheckResponse.SERVING for status, _ in probes), probes
    assert max(seconds for _, seconds in probes) < 1.0, probes
    assert len(refusals) >= 10
    assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _, _ in refusals), refusals[:5]
    assert all(delay is not None and delay > 0 for _, delay, _ in refusals), "refusals carry a retry hint"
    assert max(seconds for _, _, seconds in refusals) < 1.0, "refused at once, not after waiting"


def test_a_tenant_holding_calls_open_gets_its_share_of_the_call_slots_not_all(tmp_path):
    """A tenant that keeps gRPC calls open (uploads whose bytes stall, as a trickling request would) holds
    at most half of the call slots by default: its next call is refused at once, another tenant's still runs."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice\nbob\n")
    metrics_port = free_port()
    server = Server(  # call slots: 1 + 7 + 4 = 12, so 6 per identity
        *("--max-concurrency", "1", "--max-queue", "7", "--metrics-port", str(metrics_port)),
        *("--auth-token-file", str(tokens)),
    )
    alice = (*SESSION, ("authorization", "Bearer alice"))
    release = threading.Event()

    def stalled_upload():
        yield pb.TensorChunk(offset=0, total_size=2048, data=bytes(1024))
        release.wait(60)

    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AclnnStub(channel)
            uploads = [stub.UploadTensor.future(stalled_upload(), timeout=60, metadata=alice) for _ in range(6)]
            wait_until(lambda: in_flight(metrics_port) >= 6)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListOperators(pb.Empty(), timeout=10, metadata=alice)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "6 calls in progress, its share" in refused.value.details()
            assert retry_delay(refused.value) is not None
            assert time.monotonic() - started < 1.0, "refused at once"
            p = layer_norm_call(np.random.default_rng(0), (4, 8))
            with Client(server.address, token="bob", data_channel=False) as bob:
                bob.run(OP, **p)  # the other tenant is served meanwhile
            release.set()
            for upload in uploads:
                with pytest.raises(grpc.RpcError):
                    upload.result()  # truncated: refused
            wait_until(lambda: in_flight(metrics_port) == 0)
            listed = stub.ListOperators(pb.Empty(), metadata=alice).operators  # its share is free again
            assert OP in [o.name for o in listed]
    finally:
        release.set()
        server.stop()


# --------------------------------------------------------------------------- op labels and log lines


def test_ever_new_operator_names_neither_grow_metrics_nor_forge_log_lines():
    metrics_port = free_port()
    server = Server("--metrics-port", str(metrics_port), "--log-level", "INFO")
    forged = "x\nrequest_id=forged method=Run op=aclnnLayerNormBackward status=ACLNN_SUCCESS ms=0.1"
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AclnnStub(channel)

            def run(op: str, request_id: str = "plain-id") -> grpc.StatusCode:
                with pytest.raises(grpc.RpcError) as info:
                    stub.Run(pb.OpCall(op=op), metadata=(("x-request-id", request_id),), timeout=10)
                return info.value.code()

            assert run("aclnnNotHere") == grpc.StatusCode.INVALID_ARGUMENT
            before = series(metrics_port)
            for i in range(500):
                assert run(f"aclnnMadeUp{i}_{os.urandom(4).hex()}") == grpc.StatusCode.INVALID_ARGUMENT
            after = metrics_text(metrics_port)
            assert series(metrics_port) == before, "unregistered names became metric series"
            assert "aclnnMadeUp" not in after and 'op="unregistered"' in after
            run(forged, request_id="id status=ACLNN_SUCCESS" + "z" * 3000)
    finally:
        log = server.stop()
    lines = log.splitlines()
    assert not [line for line in lines if line.startswith("request_id=")], "a client's newline forged a log line"
    (line,) = [line for line in lines if "forged" in line]
    assert r'op="x\nrequest_id=forged method=Run' in line  # escaped, in one field
    assert 'request_id="id status=ACLNN_SUCCESS' in line  # a client's request id cannot add fields
    assert len(line) < 1000  # nor make a line as long as it likes


# --------------------------------------------------------------------------- a device failure is not replayed


@pytest.fixture(scope="module")
def fake_cann(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("fake_cann"))


def failed_runs(metrics_port: int) -> float:
    pattern = (
        r'^aclnn_requests_total\{method="Run",op="aclnnLayerNormBackward",status="ACLNN_ERR_RUNTIME_ERROR"\} (\S+)$'
    )
    match = re.search(pattern, metrics_text(metrics_port), re.M)
    return float(match[1]) if match else 0.0


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("data_channel", [False, True], ids=["grpc", "data-channel"])
def test_device_failure_is_tried_once_per_replica(fake_cann, replicas, data_channel):
    """Every stream synchronization fails (ACL 507035): 361001 at once, one attempt per replica
    (it used to map to UNAVAILABLE and be replayed by gRPC retries and the replica loop)."""
    env = {"ACLNN_CANN_LIB_DIR": str(fake_cann), "FAKE_CANN_FAIL": "aclrtSynchronizeStream:507035:1000"}
    ports = [free_port() for _ in range(replicas)]
    servers = [Server("--backend", "npu", "--metrics-port", str(port), env=env) for port in ports]
    try:
        with Client([server.address for server in servers], data_channel=data_channel) as client:
            client.list_operators()
            started = time.monotonic()
            with pytest.raises(AclnnError) as info:
                client.run(OP, **layer_norm_call(np.random.default_rng(0), (4, 8)))
            elapsed = time.monotonic() - started
        assert info.value.code == 361001 and "507035" in info.value.message
        assert [failed_runs(port) for port in ports] == [1.0] * replicas
        assert info.value.grpc_code == grpc.StatusCode.ABORTED
        assert elapsed < 2.0
    finally:
        for server in servers:
            server.stop()


# --------------------------------------------------------------------------- placements with no kind


def test_placements_with_no_kind_do_not_skip_the_inline_result_check():
    """A 2 MiB result with a 1 MiB message limit: listing it under placements with no kind set
    does not make it count as delivered elsewhere (161002 before computing, not a reply too large)."""
    server = Server("--max-message-bytes", str(1 << 20))
    rows, n = 512, 1024
    rng = np.random.default_rng(3)
    p = dict(
        gradOut=np.broadcast_to(rng.standard_normal(n, np.float32), (rows, n)),
        input=np.broadcast_to(rng.standard_normal(n, np.float32), (rows, n)),
        normalizedShape=[n],
        mean=np.zeros((rows, 1), np.float32),
        rstd=np.ones((rows, 1), np.float32),
        outputMask=[True, False, False],
        gradInputOut=np.empty((rows, n), np.float32),
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AclnnStub(channel)
            for placement in (pb.OutputPlacement(), pb.OutputPlacement(keep_on_server=False)):
                request = encode_call(OP, bind(OP, p, OUTPUTS).values)
                request.placements["gradInputOut"].CopyFrom(placement)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Run(request, timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
                assert "exceed the max message size" in info.value.details()
            # Kept on the server, the same call is fine.
            request.placements["gradInputOut"].keep_on_server = True
            assert stub.Run(request, timeout=30, metadata=SESSION).outputs["gradInputOut"].handle
    finally:
        server.stop()
