"""The service as operators run it: health, reflection, metrics, request ids, limits, deadlines, load."""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import socket
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close
from test_processes import free_port, start_server

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import bind
from aclnn_common.wire import encode_call
from aclnn_server import metrics
from aclnn_server.transport import health as health_service
from aclnn_server.transport import service

OP = "aclnnLayerNormBackward"


def test_health_serving_then_not_serving_while_draining(serve):
    address, server, _ = serve()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "aclnn.v1.Aclnn"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == 1  # SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="aclnn.v1.Aclnn"))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        server.stop(2)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_watches_cancelled_by_the_thousand_hold_up_nothing(token_file):
    """Health is open to anyone. grpc_health's Watch sent its first answer holding a lock that a cancelled
    watch's close callback (on gRPC's one serving thread) waits for: two unauthenticated clients
    watching and cancelling hung every call within seconds, and SIGTERM too (red-team finding)."""
    proc, address = start_server("--auth-token-file", str(token_file))
    stop = threading.Event()
    watches = [0, 0]

    def watch_and_cancel(k: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=3)
                next(stream)
                stream.cancel()
                watches[k] += 1

    attackers = [threading.Thread(target=watch_and_cancel, args=(k,), daemon=True) for k in range(2)]
    try:
        for t in attackers:
            t.start()
        with grpc.insecure_channel(address) as channel:
            health, aclnn = health_pb2_grpc.HealthStub(channel), pb_grpc.AclnnStub(channel)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=3).status == 1
                aclnn.ListOperators(pb.Empty(), metadata=(("authorization", "Bearer alice"),), timeout=3)
                time.sleep(0.2)
        assert min(watches) > 20
        stop.set()
        for t in attackers:
            t.join(10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        stop.set()
        proc.kill()
        proc.wait()


def test_health_knows_its_own_services_only_and_caps_watches(serve, monkeypatch):
    """Another service name is NOT_FOUND, for Check and Watch alike, and never kept (grpc_health kept
    every name watched: megabytes each, unauthenticated); at most MAX_WATCHES watches at once."""
    monkeypatch.setattr(health_service, "MAX_WATCHES", 3)
    address, _, _ = serve()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for call in (stub.Check, lambda r: next(stub.Watch(r))):
            with pytest.raises(grpc.RpcError) as err:
                call(health_pb2.HealthCheckRequest(service="x" * 100_000))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        streams = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(3)]
        assert all(next(s).status == 1 for s in streams)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(health_pb2.HealthCheckRequest(service="aclnn.v1.Aclnn")))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams.pop().cancel()
        time.sleep(0.2)  # its close callback has run
        assert next(stub.Watch(health_pb2.HealthCheckRequest(service="aclnn.v1.Aclnn"))).status == 1


def test_idle_connections_to_the_metrics_port_pin_no_threads(serve, monkeypatch):
    """The metrics port takes no credentials: 300 half-sent requests held 300 threads for good (red-team
    finding). At most MAX_SCRAPES are served at once, each dropped after SCRAPE_TIMEOUT_S of silence."""
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(metrics._QuietHandler, "timeout", 0.5)
    served = serve(metrics_port=free_port())
    port = served.server.metrics_port
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        for sock in idle:
            sock.sendall(b"GET /metr")  # and nothing more
        time.sleep(0.2)
        assert threading.active_count() <= before + metrics.MAX_SCRAPES
        time.sleep(1.0)  # the stalled ones are dropped
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "aclnn_requests_total" in text
    finally:
        for sock in idle:
            sock.close()


def test_reflection_lists_and_describes_the_service(serve):
    address, _, _ = serve()
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"aclnn.v1.Aclnn", "grpc.health.v1.Health"} <= set(db.get_services())
        assert db.FindFileContainingSymbol("aclnn.v1.Aclnn").name == "aclnn/v1/aclnn.proto"


def test_request_id_is_echoed_and_logged(serve, caplog, rng):
    address, _, _ = serve()
    p = layer_norm_call(rng, (2, 4))
    with Client(address) as c:
        c.run(OP, **p)  # warm the operator list
    with grpc.insecure_channel(address) as channel, caplog.at_level(logging.INFO, logger="aclnn_server"):
        call = pb.OpCall(op="nope")
        with pytest.raises(grpc.RpcError) as raised:
            pb_grpc.AclnnStub(channel).Run(call, metadata=(("x-request-id", "req-42"),))
    assert ("x-request-id", "req-42") in raised.value.trailing_metadata()
    logged = [r.message for r in caplog.records if "request_id=req-42" in r.message]
    assert logged and "status=ACLNN_ERR_PARAM_INVALID" in logged[0]


def test_fresh_request_ids_are_distinct_and_logged_for_both_transports(serve, caplog, rng):
    address, _, _ = serve()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        ids = [stub.ListOperators.with_call(pb.Empty())[1].trailing_metadata() for _ in range(3)]
    echoed = [dict(metadata)["x-request-id"] for metadata in ids]
    assert len(set(echoed)) == 3 and all(len(i) >= 16 for i in echoed)
    with Client(address) as c, caplog.at_level(logging.DEBUG, logger="aclnn_server"):
        for _ in range(3):
            c.run(OP, **layer_norm_call(rng, (2, 4)))  # over the data channel
    logged = [r.message.split()[0] for r in caplog.records if "method=Run" in r.message]
    assert len(logged) == 3 and len(set(logged)) == 3


def test_info_logs_the_calls_that_failed_or_were_slow_and_debug_every_call(serve, caplog, rng, monkeypatch):
    address, _, _ = serve()

    def logged_at(level: int, call: dict) -> list[logging.LogRecord]:
        caplog.clear()
        with Client(address) as c, caplog.at_level(level, logger="aclnn_server"):
            try:
                c.run(OP, **call)
            except AclnnError:
                pass
        return [r for r in caplog.records if "method=Run" in r.message]

    good, bad = layer_norm_call(rng, (2, 4)), {**layer_norm_call(rng, (2, 4)), "normalizedShape": [5]}
    assert logged_at(logging.INFO, good) == []
    (line,) = logged_at(logging.DEBUG, good)
    assert line.levelno == logging.DEBUG and "status=ACLNN_SUCCESS" in line.message
    (line,) = logged_at(logging.INFO, bad)
    assert line.levelno == logging.INFO and "status=ACLNN_ERR_PARAM_INVALID" in line.message
    monkeypatch.setattr(service, "SLOW_CALL_S", 0.0)  # every call is slow
    (line,) = logged_at(logging.INFO, good)
    assert line.levelno == logging.INFO and "status=ACLNN_SUCCESS" in line.message


def test_prometheus_metrics(serve, rng):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    address, server, _ = serve(metrics_port=metrics_port)
    with Client(address) as c:
        p = layer_norm_call(rng, (4, 8))
        c.run(OP, **p)
        c.get_workspace_size(OP, **p)  # a live executor
        with pytest.raises(AclnnError):
            c.run(OP, **dict(p, gradOut=None))
        # Read while the client is open: a closed client's session ends, and its executors with it.
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'aclnn_requests_total{method="Run",op="aclnnLayerNormBackward",status="ACLNN_SUCCESS"} 1.0' in text
    assert 'status="ACLNN_ERR_PARAM_NULLPTR"} 1.0' in text
    for phase in ("queue", "validation", "compute", "transfer"):
        assert f'phase="{phase}"' in text
    assert "aclnn_live_executors 1.0" in text
    assert "aclnn_received_bytes_total" in text and "aclnn_in_flight_calls" in text
    assert "aclnn_running_calls 0.0" in text and "aclnn_queued_calls 0.0" in text  # all done


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def raw_run(address: str, p: dict, **kwargs):
    """One Run through a bare stub: no client-side retries."""
    values = bind(OP, p, frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"})).values
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.AclnnStub(channel).Run(encode_call(OP, values), **kwargs)


def test_queue_bound_answers_resource_exhausted_with_retry_hint(serve, rng):
    """One execution slot held, one call queued: the next is refused at once, and the server recovers."""
    address, _, engine = serve(max_concurrency=1, max_queue=1)
    queued = layer_norm_call(rng, (4, 8))
    with engine.admission.slot({}):  # a long execution holds the only slot
        waiter = concurrent.futures.ThreadPoolExecutor(1).submit(raw_run, address, queued)
        wait_until(lambda: engine.admission.waiting == 1)
        with pytest.raises(grpc.RpcError) as raised:
            raw_run(address, layer_norm_call(rng, (4, 8)))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = rpc_status.from_call(raised.value).details
        retry, info = error_details_pb2.RetryInfo(), error_details_pb2.ErrorInfo()
        assert any(d.Unpack(retry) for d in details) and retry.retry_delay.ToNanoseconds() > 0
        assert any(d.Unpack(info) for d in details) and info.metadata["status"] == "561101"
    reply = waiter.result(timeout=30)  # the queued call ran once the slot was free
    assert set(reply.outputs) == {"gradInputOut", "gradWeightOut", "gradBiasOut"}
    with Client(address) as c:
        p = layer_norm_call(rng, (3, 8))
        c.run(OP, **p)
        assert_close(p["gradInputOut"], layer_norm_reference(p)[0])
    assert engine.admission.running == engine.admission.waiting == 0


def test_client_retries_a_busy_server(serve, rng):
    address, _, engine = serve(max_concurrency=1, max_queue=0)
    p = layer_norm_call(rng, (4, 8))
    slot = engine.admission.slot({})
    slot.__enter__()
    threading.Timer(0.15, slot.__exit__, (None, None, None)).start()
    with Client(address) as c:
        c.run(OP, **p)  # refused while the slot is held, then retried through
    assert_close(p["gradInputOut"], layer_norm_reference(p)[0])


def test_expired_deadline_is_not_run(serve, rng):
    address, server, engine = serve(max_concurrency=1)
    p = layer_norm_call(rng, (4, 8))
    with engine.admission.slot({}):
        with Client(address, timeout=0.2) as hurried, pytest.raises(AclnnError) as info:
            hurried.run(OP, **p)
        assert info.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: engine.admission.waiting == 0)  # it left the queue without running
    assert (p["gradInputOut"] == -7.25).all()
    runs = server.metrics.requests.labels("Run", OP, "DEADLINE")
    wait_until(lambda: runs._value.get() >= 1)


def test_load_mixed_valid_and_invalid_calls(serve):
    """Several client threads, hundreds of calls, every answer checked, nothing lost."""
    address, _, _ = serve(max_concurrency=2, max_queue=64)
    results = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(address) as c:
            for i in range(60):
                p = layer_norm_call(rng, (int(rng.integers(1, 9)), int(rng.integers(1, 65))))
                if i % 3 == 0:
                    p["rstd"] = None
                    with pytest.raises(AclnnError) as info:
                        c.run(OP, **p)
                    results.append((info.value.code, info.value.param) == (161001, "rstd"))
                elif i % 3 == 1:
                    c.run(OP, **p)
                    ref = layer_norm_reference(p)
                    assert_close(p["gradInputOut"], ref[0])
                    assert_close(p["gradBiasOut"], ref[2])
                    results.append(True)
                else:
                    _, executor = c.get_workspace_size(OP, **p)
                    c.execute(executor)
                    assert_close(p["gradWeightOut"], layer_norm_reference(p)[1])
                    results.append(True)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(worker, seed) for seed in range(6)]:
            f.result()
    assert len(results) == 360 and all(results)
