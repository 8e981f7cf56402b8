"""One memory ledger, a fair share per tenant: attacks by tenants who keep, leak, flood or die.

Each test runs a real server (in process on a loopback port, or as its own process where
its memory or a client's death must be observed) and attacks it with raw gRPC calls or the
public client, as a tenant could.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close
from test_data_channel import connect, reply, request, ticket
from test_processes import broadcast_call, free_port, metric, start_server
from test_shared_memory import check, memfd, register, unix_connect
from test_transport import wait_for

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import bind
from aclnn_common.wire import encode_call

OP = "aclnnLayerNormBackward"
OUTPUTS = frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"})
MiB = 1 << 20


def owner(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def metadata(token: str | None = None, session: str = "s", stream: int | None = None) -> tuple:
    meta = (("x-aclnn-session", session),)
    if token:
        meta += (("authorization", f"Bearer {token}"),)
    if stream is not None:
        meta += (("x-aclnn-stream", str(stream)),)
    return meta


def op_call(p: dict, keep: tuple[str, ...] = (), with_data: bool = True) -> pb.OpCall:
    """The call as a raw client sends it: every input's bytes inline; `keep` outputs stay on the server."""
    call = bind(OP, p, OUTPUTS)
    request = encode_call(OP, call.values if with_data else call.descriptors())
    for name in keep:
        request.placements[name].keep_on_server = True
    return request


def exhausted(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_results_kept_and_never_downloaded_stop_at_the_tenants_share(serve, token_file, rng):
    """A tenant that keeps results on the server and never downloads them fills its own share, not the server."""
    served = serve(auth_token_file=token_file, memory_budget_bytes=64 * MiB, max_tenant_bytes=16 * MiB)
    p = layer_norm_call(rng, (256, 1024))  # gradInput: 1 MiB kept per call
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        handles, refused = [], None
        for _ in range(40):
            try:
                reply = stub.Run(op_call(p, keep=("gradInputOut",)), metadata=metadata("alice"))
            except grpc.RpcError as error:
                refused = error
                break
            handles.append(reply.outputs["gradInputOut"].handle)
        assert refused is not None and exhausted(refused), "kept results grew without limit"
        assert 4 <= len(handles) <= 16
        assert served.engine.ledger.held_by(owner("alice")) <= 16 * MiB
        # Another tenant is unaffected, and the first one recovers by freeing what it kept.
        stub.Run(op_call(p, keep=("gradInputOut",)), metadata=metadata("bob", session="b"))
        for handle in handles:
            stub.FreeTensor(pb.TensorHandle(handle=handle), metadata=metadata("alice"))
        stub.Run(op_call(p), metadata=metadata("alice"))
    wait_for(lambda: served.engine.ledger.held_by(owner("alice")) == 0)  # once the last reply is sent


def test_a_small_kept_result_is_held_though_small_calls_hold_nothing(serve, rng):
    """Small calls skip the ledger (SMALL_HOLD_BYTES), but a result kept on the server is always counted."""
    served = serve()
    p = layer_norm_call(rng, (4, 1024))  # gradInput: 16 KiB
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        stub.Run(op_call(p), metadata=metadata())
        assert served.engine.ledger.held_by_kind() == {}
        reply = stub.Run(op_call(p, keep=("gradInputOut",)), metadata=metadata())
        assert served.engine.ledger.held_by_kind() == {"result": 4 * 1024 * 4}
        stub.FreeTensor(pb.TensorHandle(handle=reply.outputs["gradInputOut"].handle), metadata=metadata())
    assert served.engine.ledger.held_by_kind() == {}


def test_executor_data_and_count_are_bounded_per_tenant(serve, token_file, rng):
    """Bytes shipped with GetWorkspaceSize stay held by their executor, against its owner's share."""
    served = serve(
        auth_token_file=token_file, memory_budget_bytes=64 * MiB, max_tenant_bytes=16 * MiB, max_tenant_executors=50
    )
    big = layer_norm_call(rng, (512, 1024))  # 2 MiB per input, 4 MiB per plan
    small = layer_norm_call(rng, (2, 8))
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        planned = []
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(10):
                planned.append(stub.GetWorkspaceSize(op_call(big), metadata=metadata("alice")).executor)
        assert exhausted(info.value) and 2 <= len(planned) <= 4
        assert served.engine.ledger.held_by(owner("alice")) <= 16 * MiB
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(60):
                stub.GetWorkspaceSize(op_call(small, with_data=False), metadata=metadata("alice"))
        assert exhausted(info.value) and "live for this caller" in info.value.details()
        # bob can still plan, and alice's executors give back their bytes when destroyed.
        stub.GetWorkspaceSize(op_call(big), metadata=metadata("bob", session="b"))
        for executor in planned:
            stub.DestroyExecutor(pb.ExecutorRef(executor=executor), metadata=metadata("alice"))
        wait_for(lambda: served.engine.ledger.held_by(owner("alice")) == 0)


@pytest.mark.parametrize("making", ["executor", "buffer", "reservation"])
def test_what_a_call_makes_while_its_session_ends_ends_with_it(serve, rng, monkeypatch, making):
    """A session that ends (EndSession, or its lease lapsing) while a call makes something to keep in it:
    the end ended only what existed by then, so the call ends what it made and is refused, instead of
    leaving it behind for good, held against its owner (red-team: 13 executors and 55 buffers of GiBs
    outlived their racing sessions). The race is forced here: the session ends as the thing is made."""
    served = serve()
    engine, storage = served.engine, served.server.storage
    target = {"executor": engine.executors, "buffer": engine.buffers, "reservation": engine.reservations}[making]
    method = {"executor": "add", "buffer": "malloc", "reservation": "add"}[making]
    made = getattr(target, method)

    def made_as_the_session_ends(*args, **kwargs):
        result = made(*args, **kwargs)
        for owner_id, session in [key for key in storage._sessions if key[1] == "s"]:  # whoever the peer is
            storage.end(session, owner_id)
        return result

    monkeypatch.setattr(target, method, made_as_the_session_ends)
    p = layer_norm_call(rng, (64, 64))
    calls = {
        "executor": lambda stub: stub.GetWorkspaceSize(op_call(p), metadata=metadata()),
        "buffer": lambda stub: stub.MallocBuffer(pb.MallocRequest(size=MiB), metadata=metadata()),
        "reservation": lambda stub: stub.ReserveCall(
            pb.CallReservation(run=op_call(p, with_data=False)), metadata=metadata()
        ),
    }
    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            calls[making](pb_grpc.AclnnStub(channel))
    assert "the session ended while this call ran" in info.value.details()
    assert len(engine.executors) == len(engine.buffers) == 0
    assert sum(engine.ledger.held_by_kind().values()) == 0


def test_an_empty_session_id_is_no_session(serve, rng):
    """`x-aclnn-session: ""` is no session, as on every other path: an executed repeatable executor made
    with it expires unused like any sessionless one, instead of waiting for a session nobody can end."""
    served = serve(executor_ttl_s=0.3)
    p = layer_norm_call(rng, (2, 8))
    empty = (("x-aclnn-session", ""),)
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        executor = stub.GetWorkspaceSize(op_call(p), metadata=empty).executor
        stub.SetExecutorRepeatable(pb.ExecutorRef(executor=executor), metadata=empty)
        stub.Execute(pb.ExecuteRequest(executor=executor), metadata=empty)
        wait_for(lambda: len(served.engine.executors) == 0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Execute(pb.ExecuteRequest(executor=executor), metadata=empty)
        assert "belongs to no session" in info.value.details()
    assert sum(served.engine.ledger.held_by_kind().values()) == 0


def test_a_single_use_executors_bytes_stay_held_while_its_execute_computes(serve, rng, monkeypatch):
    """An executor's plan-shipped bytes are held until no call reads them: its single execute spends the
    executor, not the bytes the compute runs on (red-team: 192 MiB computed on, held by nobody)."""
    served = serve()
    ledger, compute = served.engine.ledger, served.engine._compute
    held_during_compute = []

    def observed(*args, **kwargs):
        held_during_compute.append(ledger.held_by_kind().get("executor", 0))
        return compute(*args, **kwargs)

    monkeypatch.setattr(served.engine, "_compute", observed)
    p = layer_norm_call(rng, (512, 1024))  # 2 MiB per input tensor
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        executor = stub.GetWorkspaceSize(op_call(p), metadata=metadata()).executor
        held = ledger.held_by_kind()["executor"]
        assert held >= 4 * MiB
        stub.Execute(pb.ExecuteRequest(executor=executor), metadata=metadata())
    assert held_during_compute == [held]
    wait_for(lambda: ledger.held_by_kind().get("executor", 0) == 0)


def test_a_call_larger_than_a_tenants_share_is_161002_naming_the_tensor(serve, rng):
    served = serve(memory_budget_bytes=32 * MiB, max_tenant_bytes=4 * MiB)
    p = layer_norm_call(rng, (1024, 2048))  # 8 MiB gradInput
    with Client(served.address) as c, pytest.raises(AclnnError) as info:
        c.run(OP, **p)
    assert info.value.code == 161002 and info.value.param in ("gradOut", "input", "gradInputOut")
    wait_for(lambda: served.engine.ledger.held == 0)


def test_stream_waits_count_against_the_queue_and_respect_deadlines(serve):
    """Calls waiting for their stream's turn are queued calls: bounded, and dropped at their deadline."""
    served = serve(max_concurrency=2, max_queue=1)
    long_call, waiting, extra = (op_call(broadcast_call(i, rows=300_000)) for i in range(3))
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        running = stub.Run.future(long_call, metadata=metadata(stream=7))
        while served.engine.admission.running == 0:
            time.sleep(0.005)
        queued = stub.Run.future(waiting, metadata=metadata(stream=7), timeout=0.5)
        while served.engine.admission.waiting == 0:
            time.sleep(0.005)
        with pytest.raises(grpc.RpcError) as info:  # the queue is full: refused at once, not parked
            stub.Run(extra, metadata=metadata(stream=7), timeout=30)
        assert exhausted(info.value)
        with pytest.raises(grpc.RpcError) as info:
            queued.result()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not running.done(), "the long call should still be running"
        running.result()
    wait_for(lambda: served.engine.admission.waiting == 0 and served.engine.ledger.held == 0)


_DYING_CLIENT = """
import sys, time
import grpc
import numpy as np
sys.path.insert(0, {tests!r})
from layer_norm_cases import layer_norm_call
from aclnn_client import Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from test_tenants import metadata, op_call

rng = np.random.default_rng(0)
with Client({address!r}) as c, grpc.insecure_channel({address!r}) as channel:
    for _ in range(3):  # repeatable executors, executed: they never expire by age
        p = layer_norm_call(rng, (64, 256))
        _, e = c.get_workspace_size("aclnnLayerNormBackward", **p)
        c.set_executor_repeatable(e)
        c.execute(e)
    stub, meta = pb_grpc.AclnnStub(channel), metadata(session="dying")  # a raw caller's upload and kept result
    stub.UploadTensor(iter([pb.TensorChunk(total_size=1 << 20, offset=0, data=bytes(1 << 20))]), metadata=meta)
    stub.Run(op_call(layer_norm_call(rng, (256, 1024)), keep=("gradInputOut",)), metadata=meta)
    print("ready", flush=True)
    time.sleep(60)
"""


def test_a_dead_clients_executors_uploads_and_kept_results_are_reclaimed():
    metrics_port = free_port()
    proc, address = start_server("--session-ttl-s", "1", "--metrics-port", str(metrics_port))
    client = subprocess.Popen(
        [sys.executable, "-c", _DYING_CLIENT.format(tests=os.path.dirname(__file__), address=address)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout.readline() == "ready\n"
        assert metric(metrics_port, "aclnn_live_executors") == 3
        assert metric(metrics_port, "aclnn_memory_held_bytes") >= 2 * MiB
        client.send_signal(signal.SIGKILL)  # no goodbye: only the lapsed lease tells the server
        client.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (
            metric(metrics_port, "aclnn_live_executors") or metric(metrics_port, "aclnn_memory_held_bytes")
        ):
            time.sleep(0.2)
        assert metric(metrics_port, "aclnn_live_executors") == 0
        assert metric(metrics_port, "aclnn_memory_held_bytes") == 0
    finally:
        client.kill()
        proc.kill()
        proc.wait()


def rss_kib(pid: int, field: str) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M)[1])


@pytest.mark.slow
def test_server_memory_stays_within_the_budget_under_parallel_large_calls(rng):
    """Eight clients run large calls at once (uploads in, results into their own regions): the server's
    peak memory stays within its budget plus a fixed overhead; calls that do not fit wait or are refused.
    Its own memory: RssAnon (sampled), not VmHWM, which counts the pages of the clients' regions the
    server writes results into (shared pages, the clients' own, charged to them)."""
    budget = 384 * MiB
    proc, address = start_server("--memory-budget-bytes", str(budget), "--max-concurrency", "2")
    most, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            most[0] = max(most[0], rss_kib(proc.pid, "RssAnon") * 1024)
            time.sleep(0.002)

    try:
        with Client(address) as warm:  # baseline: everything loaded, one call served
            p = layer_norm_call(rng, (256, 1024))
            warm.run(OP, **p)
        baseline = rss_kib(proc.pid, "RssAnon") * 1024
        p = layer_norm_call(rng, (2048, 4096))  # 32 MiB per full-size tensor
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        done, outcomes = _throughput(address, p, 8, 6.0, reference=layer_norm_reference(p)[0])
        stop.set()
        watcher.join()
        peak = most[0]
    finally:
        stop.set()
        proc.kill()
        proc.wait()
    print(f"peak {(peak - baseline) >> 20} MiB over the baseline; outcomes {outcomes}")
    assert set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"} and done >= 8, outcomes
    overhead = 64 * MiB  # allocator slack and per-thread buffers beside the ledger (the old code exceeded it by 100+)
    assert peak - baseline <= budget + overhead, f"peak {peak >> 20} MiB, baseline {baseline >> 20} MiB"


def _writable_memory_cgroup() -> tuple[str, str] | None:
    """A fresh memory cgroup (v2 or v1) this test may create, as (directory, limit file); None if none."""
    for root, limit in (("/sys/fs/cgroup/unified", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
        if os.path.exists(os.path.join(root, limit if root.endswith("memory") else "cgroup.controllers")):
            path = os.path.join(root, f"aclnn-test-{os.getpid()}")
            try:
                os.mkdir(path)
            except OSError:
                continue
            if os.path.exists(os.path.join(path, limit)):
                return path, limit
            os.rmdir(path)
    return None


def test_default_budget_respects_the_cgroup_limit():
    """In a container limited to 2 GiB the default budget is half of that, not half of the host's RAM."""
    cgroup = _writable_memory_cgroup()
    if cgroup is None:
        pytest.skip("no writable memory cgroup here")
    path, limit = cgroup
    metrics_port = free_port()
    try:
        with open(os.path.join(path, limit), "w") as f:
            f.write(str(2 << 30))
        pid_file = os.path.join(path, "cgroup.procs")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aclnn_server",
                "--port",
                "0",
                "--backend",
                "numpy",
                "--metrics-port",
                str(metrics_port),
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: open(pid_file, "w").write(str(os.getpid())),
        )
        try:
            assert proc.stdout.readline().startswith("listening on")
            assert metric(metrics_port, "aclnn_memory_budget_bytes") == 1 << 30
        finally:
            proc.kill()
            proc.wait()
    finally:
        os.rmdir(path)


# --------------------------------------------------------------------------- issue 25: holds follow buffers


def upload(stub, data: bytes, meta: tuple) -> str:
    return stub.UploadTensor(iter([pb.TensorChunk(total_size=len(data), data=data)]), metadata=meta).handle


def test_an_executor_keeps_a_freed_upload_held_until_it_ends(serve, token_file, rng):
    """Finding 6: uploads planned into executors and then freed stay counted while an executor views them:
    the tenant runs into its stored share instead of growing the server's memory without bound."""
    served = serve(auth_token_file=token_file, memory_budget_bytes=64 * MiB, max_tenant_bytes=32 * MiB)
    p = layer_norm_call(rng, (1024, 1024))  # gradOut: 4 MiB
    meta = metadata("alice")
    planned = []
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(20):
                handle = upload(stub, p["gradOut"].tobytes(), meta)
                request = op_call(p, with_data=False)
                request.params["gradOut"].tensor.ref.handle = handle
                planned.append(stub.GetWorkspaceSize(request, metadata=meta).executor)
                stub.FreeTensor(pb.TensorHandle(handle=handle), metadata=meta)  # the executor still views it
        assert exhausted(refused.value) and len(planned) <= 6  # stored tensors: 3/4 of the 32 MiB share
        assert served.engine.ledger.held_by(owner("alice")) <= 24 * MiB
        for executor in planned:
            stub.DestroyExecutor(pb.ExecutorRef(executor=executor), metadata=meta)
    wait_for(lambda: served.engine.ledger.held_by(owner("alice")) == 0)


def test_a_lapsed_session_ends_its_executors_while_other_traffic_goes_on(serve, rng):
    """Finding 7: a session that lapses while other calls keep arriving still ends its executors."""
    served = serve(session_ttl_s=0.5)
    p = layer_norm_call(rng, (256, 1024))  # 1 MiB per input: held by each executor
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        for _ in range(4):
            stub.GetWorkspaceSize(op_call(p), metadata=metadata(session="dying"))
        assert len(served.engine.executors) == 4 and served.engine.ledger.held >= 4 * MiB
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(served.engine.executors) or served.engine.ledger.held):
            stub.KeepAlive(pb.Empty(), metadata=metadata(session="alive"))  # each call notices lapsed sessions
            time.sleep(0.02)
    assert len(served.engine.executors) == 0 and served.engine.ledger.held == 0


def test_sessions_and_tickets_are_capped_per_identity(serve, token_file):
    """Finding 11: made-up session ids cost the server a bounded amount per identity: ids are short, an
    identity has at most --max-tenant-sessions of them, and at most 16 live data-channel tickets."""
    served = serve(auth_token_file=token_file, max_tenant_sessions=8)
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.KeepAlive(pb.Empty(), metadata=metadata("alice", session="x" * 6000))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-aclnn-session" in refused.value.details()
        for i in range(8):  # a session is made by a call that keeps something in it
            upload(stub, b"x", metadata("alice", session=f"s{i}"))
        stub.KeepAlive(pb.Empty(), metadata=metadata("alice", session="one-more"))  # keeps nothing: makes none
        with pytest.raises(grpc.RpcError) as refused:
            upload(stub, b"x", metadata("alice", session="one-more"))
        assert exhausted(refused.value) and "--max-tenant-sessions" in refused.value.details()
        upload(stub, b"x", metadata("bob", session="one-more"))  # another identity's own
        stub.EndSession(pb.Empty(), metadata=metadata("alice", session="s0"))  # a client closed: its session goes
        upload(stub, b"x", metadata("alice", session="one-more"))
        tickets = [stub.OpenDataChannel(pb.Empty(), metadata=metadata("alice", session="s0")) for _ in range(40)]
    with connect(tickets[0]) as first, connect(tickets[-1]) as last:
        assert reply(first)[0] is False  # forgotten: an identity keeps its 16 latest
        assert reply(last) == (True, b"")


def test_kept_results_count_as_stored_tensors(serve, token_file, rng):
    """Finding 14: results kept on the server stop at the stored-tensor share (3/4 of the tenant's),
    like uploads, instead of filling the whole share."""
    served = serve(auth_token_file=token_file, memory_budget_bytes=64 * MiB, max_tenant_bytes=32 * MiB)
    p = layer_norm_call(rng, (1024, 1024))  # gradInput: 4 MiB kept per call
    kept = 0
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(10):
                stub.Run(op_call(p, keep=("gradInputOut",)), metadata=metadata("alice"))
                kept += 1
    assert exhausted(refused.value) and kept <= 6
    assert served.engine.ledger.held_by_kind().get("result", 0) <= 24 * MiB


def test_replies_in_transit_stay_held_until_sent(serve, rng):
    """Finding 8: replies nobody reads are held until they are sent (the outputs and their encoding):
    an identity's unread replies fill its own share, and the server's memory stays within its budget."""
    served = serve(memory_budget_bytes=256 * MiB, data_handshake_timeout_s=3.0)
    p = layer_norm_call(rng, (1024, 1024))  # 4 MiB inputs, a 4 MiB gradInput returned inline
    payload = b"\x03Run" + op_call(p).SerializeToString()
    offer = ticket(served.address)
    socks = []
    try:
        for _ in range(4):
            sock = connect(offer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            assert reply(sock)[0]
            sock.sendall(request(1, len(payload)) + payload)  # the reply is never read
            socks.append(sock)
        # Each reply holds its outputs and their encoded copy (about 8 MiB) until sent.
        wait_for(lambda: served.engine.ledger.held_by_kind().get("call", 0) >= 4 * 8 * MiB, timeout=10)
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: served.engine.ledger.held == 0, timeout=30)


def test_faulted_memfd_pages_do_not_outlive_the_region_or_mailbox(serve, rng):
    """Finding 13: pages the server faults into a tenant's memfd (results written into a sparse region,
    a mailbox head read through its mapping) are given back when the region or mailbox goes, though the
    tenant keeps its descriptor."""
    served = serve()
    p = layer_norm_call(rng, (1024, 1024))  # gradInput: 4 MiB, written into the region
    fd = memfd(8 * MiB)  # sparse: nothing allocated yet
    offer = ticket(served.address, "s")
    with unix_connect(offer) as sock:
        ok, region_id = register(sock, [fd], 8 * MiB)
        assert ok
        request_message = op_call(p)
        request_message.placements["gradInputOut"].region.CopyFrom(
            pb.RegionSlice(region=region_id.decode(), offset=0, size=4 * MiB)
        )
        with grpc.insecure_channel(served.address) as channel:
            pb_grpc.AclnnStub(channel).Run(request_message, metadata=(("x-aclnn-session", "s"),))
        assert os.fstat(fd).st_blocks * 512 >= 4 * MiB  # faulted in by the server
        sock.sendall(request(5, len(region_id)) + region_id)  # UNREGISTER_REGION
        assert reply(sock) == (True, b"")
    wait_for(lambda: os.fstat(fd).st_blocks == 0)
    os.close(fd)
    mailbox = memfd(1 * MiB)
    with unix_connect(offer) as sock:
        assert register(sock, [mailbox], 1 * MiB, 6)[0]  # MAILBOX
        sock.sendall(request(1 | 0x80, 64 << 10))  # a call in the (all holes) mailbox head
        assert reply(sock)[0] is False
        assert os.fstat(mailbox).st_blocks * 512 >= 64 << 10
    wait_for(lambda: os.fstat(mailbox).st_blocks == 0)
    os.close(mailbox)


def test_admission_takes_identities_in_turn(serve, token_file):
    """Finding 9: with one slot and one tenant's 24 callers queued, another tenant's calls each wait for
    at most a couple of the first tenant's, not for its whole queue."""
    served = serve(auth_token_file=token_file, max_concurrency=1, max_queue=64)
    busy = op_call(broadcast_call(0, rows=8192))  # a few ms of compute each
    small = op_call(broadcast_call(1, rows=8))
    done: list[float] = []
    stop = time.monotonic() + 60

    def alice() -> None:
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.AclnnStub(channel)
            while time.monotonic() < stop and len(done) < 100_000:
                stub.Run(busy, metadata=metadata("alice"), timeout=60)
                done.append(time.monotonic())

    passed = []
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        callers = [pool.submit(alice) for _ in range(24)]
        wait_for(lambda: served.engine.admission.waiting >= 20, timeout=30)
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.AclnnStub(channel)
            for _ in range(10):
                started = time.monotonic()
                stub.Run(small, metadata=metadata("bob", session="b"), timeout=60)
                finished = time.monotonic()
                passed.append(sum(started < t < finished for t in done))
        stop = 0
        for caller in callers:
            caller.result()
    assert sorted(passed)[len(passed) // 2] <= 2, passed  # the median bob call waited for at most 2 of alice's


# --------------------------------------------------------------------------- issue 25: whole-call admission


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "grpc"])
def test_a_call_that_can_never_fit_is_161002_before_any_upload(serve, rng, data_channel):
    """Finding 15: a call whose tensors fit one by one but not together in its identity's share is
    161002 at once, naming its largest tensor, before any of its bytes are uploaded (it used to be
    "busy, retry" from its second upload on, again and again)."""
    served = serve(memory_budget_bytes=64 * MiB)  # a share of 32 MiB
    p = layer_norm_call(rng, (2048, 2048))  # gradOut, input, gradInput: 16 MiB each
    started = time.monotonic()
    with Client(served.address, data_channel=data_channel) as c, pytest.raises(AclnnError) as raised:
        c.run(OP, **p)
    assert (raised.value.code, raised.value.param) == (161002, "gradOut"), raised.value
    assert time.monotonic() - started < 5.0
    uploads = served.server.metrics.requests.labels("UploadTensor", "", "ACLNN_SUCCESS")._value.get()
    assert uploads == 0
    wait_for(lambda: served.engine.ledger.held == 0)


def test_a_reserved_call_with_inputs_read_in_place_runs_on_its_reservation(serve, rng, monkeypatch):
    """A call that uploads its large tensors and attaches its small ones in a mailbox above 16 MiB (not
    held: what a call reads there is held with it) reserves those too (CallReservation.in_place): it
    runs on its reservation and waits for nothing but a slot, as calls with uploads do."""
    served = serve()
    asked = []
    slot = served.engine.admission.slot

    def recording(parts, *args, **kwargs):
        asked.append(dict(parts))
        return slot(parts, *args, **kwargs)

    monkeypatch.setattr(served.engine.admission, "slot", recording)
    with Client(served.address, max_inline_bytes=16 * MiB) as c:  # tensors above it uploaded
        p = layer_norm_call(rng, (2048, 1024))  # 8 MiB tensors inline: the connection's mailbox is 32 MiB
        c.run(OP, **p)
        check(p)
        asked.clear()
        p = layer_norm_call(rng, (4200, 1024))  # 16.4 MiB uploaded; mean and rstd (33 KB) in that mailbox
        c.run(OP, **p)
        check(p)
    assert asked == [{"call": 0, "result": 0}]  # all of its memory from its reservation
    wait_for(lambda: served.engine.ledger.held == 0)


def _throughput(
    address: str, p: dict, clients: int, seconds: float, reference: np.ndarray | None = None, **options: Any
) -> tuple[int, collections.Counter]:
    """Calls completed by `clients` clients (made with `options`) of one identity in `seconds`, and every
    outcome (a refused client waits 50 ms before its next call); each gradInput checked against
    `reference` when given."""
    outcomes: collections.Counter = collections.Counter()
    stop_at = time.monotonic() + seconds

    def worker() -> None:
        with Client(address, timeout=60, **options) as c:
            out = np.empty_like(p["gradInputOut"])
            while time.monotonic() < stop_at:
                try:
                    c.run(OP, **{**p, "gradInputOut": out})
                except AclnnError as error:
                    outcomes[error.grpc_code.name] += 1
                    time.sleep(0.05)
                    continue
                if reference is not None:
                    assert_close(out, reference)
                outcomes["ok"] += 1

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker) for _ in range(clients)]:
            future.result()
    return outcomes["ok"], outcomes


@pytest.mark.slow  # about 8 s each: one client alone, then eight together, on a server whose share holds two calls
@pytest.mark.parametrize("inline_bytes", [4 * MiB, None], ids=["uploads", "in-mailbox"])
def test_clients_of_one_identity_do_not_livelock_each_other(serve, rng, inline_bytes):
    """Finding 16: eight clients of one identity, each call uploading two inputs and keeping its output,
    on a share that holds two such calls: every call's memory is reserved as one unit before its first
    upload, so none holds what another needs; calls complete, none is refused. The same with the
    tensors inline (the default over the Unix socket): in their connections' mailboxes, sealed against
    holes and not held, what a call reads in place is held with its outputs as one unit while it runs."""
    served = serve(memory_budget_bytes=128 * MiB)  # a share of 64 MiB: 48 of them for stored tensors
    p = layer_norm_call(rng, (1024, 2048))  # 8 MiB per tensor: 16 MiB uploaded, 8 MiB kept per call
    alone, _ = _throughput(served.address, p, 1, 2.0, max_inline_bytes=inline_bytes)
    together, outcomes = _throughput(served.address, p, 8, 4.0, max_inline_bytes=inline_bytes)
    print(f"one client: {alone / 2.0:.1f} calls/s; eight of one identity: {together / 4.0:.1f} calls/s; {outcomes}")
    assert set(outcomes) == {"ok"} and together >= 8, outcomes
    uploads = served.server.metrics.requests.labels("UploadTensor", "", "ACLNN_SUCCESS")._value.get()
    assert (uploads > 0) == (inline_bytes is not None)
