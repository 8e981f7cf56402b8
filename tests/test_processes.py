"""Real server processes: draining on SIGTERM with calls in flight, and a replica pool losing a member."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import bind
from aclnn_common.framing import MAGIC, REPLY
from aclnn_common.wire import encode_call

OP = "aclnnLayerNormBackward"
OUTPUTS = frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"})
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())  # the syscall's number


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--port", "0", "--backend", "numpy", "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    line = proc.stdout.readline()
    match = re.fullmatch(r"listening on (\S+):(\d+)\n", line)
    assert match, f"unexpected first line {line!r}"
    return proc, f"{match[1]}:{match[2]}"


def _killed_after_first_download(client: Client, servers: dict[str, subprocess.Popen]) -> list[str]:
    """Kills the server a call's first kept result came from once that download is done (as a server
    stopped between its downloads); returns where that was."""
    download, killed = client._transfers.download, []

    def first_then_kill(replica: int, handle: str, view: np.ndarray) -> None:
        download(replica, handle, view)
        if not killed:
            killed.append(client._pool.address(replica))
            servers[killed[0]].kill()
            servers[killed[0]].wait()

    client._transfers.download = first_then_kill
    return killed


def test_a_server_gone_between_downloads_leaves_every_output_unwritten():
    """The call's results were kept on the server (all above max_inline_bytes); it stops after the first
    download: the call fails and no output is written (the first download went straight into its output,
    then the second failed: red-team finding). Results are downloaded into arrays of their own first."""
    proc, address = start_server()
    p = layer_norm_call(np.random.default_rng(0), (64, 256))
    before = {name: p[name].copy() for name in ("gradInputOut", "gradWeightOut", "gradBiasOut")}
    try:
        with Client(address, data_channel=False, max_inline_bytes=512) as c:
            killed = _killed_after_first_download(c, {address: proc})
            with pytest.raises(AclnnError) as lost:
                c.run(OP, **p)
        assert killed and lost.value.grpc_code == grpc.StatusCode.UNAVAILABLE, lost.value
        for name, value in before.items():
            np.testing.assert_array_equal(p[name], value, err_msg=f"{name} was written by a call that failed")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("data_channel", [False, True], ids=["grpc", "data channel"])
def test_a_replica_gone_before_its_results_are_downloaded_hands_the_call_on(data_channel):
    """A pool of two: the replica that ran the call stops before its kept results were downloaded. The
    download's failure was the call's (the pool moved nothing to the replica still up); now the call runs
    again there, and its results are right."""
    servers = {address: proc for proc, address in (start_server(), start_server())}
    p = layer_norm_call(np.random.default_rng(1), (64, 256))
    try:
        inline = dict(max_inline_bytes=512, unix_socket=False) if data_channel else dict(max_inline_bytes=512)
        with Client(list(servers), data_channel=data_channel, **inline) as c:
            killed = _killed_after_first_download(c, servers)
            c.run(OP, **p)
        assert len(killed) == 1
        for got, want in zip((p["gradInputOut"], p["gradWeightOut"], p["gradBiasOut"]), layer_norm_reference(p)):
            assert_close(got, want, np.float32)
    finally:
        for proc in servers.values():
            proc.kill()
            proc.wait()


def metric(metrics_port: int, name: str) -> float:
    """A gauge's value (or an unlabelled counter's) on a server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])


def in_flight(metrics_port: int) -> float:
    return metric(metrics_port, "aclnn_in_flight_calls")


def broadcast_call(seed: int, rows: int = 8192, n: int = 4096) -> dict:
    """A long computation in a small message: every row the same (stride-0 views), only [n] outputs back."""
    rng = np.random.default_rng(seed)
    row = lambda: rng.uniform(-1, 1, n).astype(np.float32)  # noqa: E731
    return dict(
        gradOut=np.broadcast_to(row(), (rows, n)),
        input=np.broadcast_to(row(), (rows, n)),
        normalizedShape=[n],
        mean=np.zeros((rows, 1), np.float32),
        rstd=np.ones((rows, 1), np.float32),
        outputMask=[False, True, True],
        gradWeightOut=np.full(n, -7.25, np.float32),
        gradBiasOut=np.full(n, -7.25, np.float32),
    )


@pytest.mark.parametrize(
    "options",
    [{}, dict(data_channel=False, max_inline_bytes=1024), dict(max_inline_bytes=1024),
     dict(max_inline_bytes=1024, unix_socket=False)],
    ids=["results in the reply", "kept over gRPC", "kept over the Unix socket", "kept over TCP"],
)  # fmt: skip
def test_sigterm_drains_calls_in_flight(options):
    """Every call in flight at SIGTERM completes, and a new one is refused UNAVAILABLE (its client moves
    on). A call's later steps (its uploads, its Run on its reservation) and its kept results' downloads
    (above max_inline_bytes) are still served: the server refused them as new calls, and the data
    channel closed under them, failing calls it had begun or computed (red-team findings)."""
    metrics_port = free_port()
    proc, address = start_server("--max-concurrency", "1", "--metrics-port", str(metrics_port))
    calls = [broadcast_call(i) for i in range(8)]
    kept = bool(options)
    try:
        with Client(address, **options) as c, concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            c.list_operators()
            futures = [pool.submit(c.run, OP, **p) for p in calls]
            while in_flight(metrics_port) < len(calls):
                assert not any(f.done() for f in futures), "calls finished before all were in flight"
                time.sleep(0.002)
            proc.send_signal(signal.SIGTERM)
            for f in futures:
                f.result(timeout=60)  # every in-flight call completes
            if kept:
                late = broadcast_call(99, rows=64)
                with pytest.raises(AclnnError) as refused:
                    c.run(OP, **late)
                assert refused.value.grpc_code == grpc.StatusCode.UNAVAILABLE, refused.value
        for p in calls:  # x = mean and rstd = 1: gradWeight = rows * g * x, gradBias = rows * g
            g, x = p["gradOut"][0].astype(np.float64), p["input"][0].astype(np.float64)
            assert_close(p["gradWeightOut"], len(p["mean"]) * g * x)
            assert_close(p["gradBiasOut"], len(p["mean"]) * g)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_an_abandoned_upload_does_not_hold_up_a_drain():
    """A drain waits for the results calls still owe, not for every handle: one tensor uploaded by a
    client that then went away made each SIGTERM wait the whole grace period (red-team finding)."""
    proc, address = start_server("--grace-period-s", "20")
    try:
        with grpc.insecure_channel(address) as channel:
            chunk = pb.TensorChunk(total_size=64, data=bytes(64))
            pb_grpc.AclnnStub(channel).UploadTensor(iter([chunk]), metadata=(("x-aclnn-session", "gone"),))
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 5
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_taken_by_any_thread_stops_the_server(signum):
    """The kernel hands a process's signal to any of its threads that does not block it: one of gRPC's,
    Numba's or the data channel's, not only the main thread, whose wait for the signal then went on
    for good (CI saw a server ignore SIGTERM). Sent here to a thread that is not the main one (tgkill)."""
    if SYS_TGKILL is None:
        pytest.skip(f"tgkill's number on {platform.machine()} is not known here")
    libc = ctypes.CDLL(None, use_errno=True)
    proc, _ = start_server()
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert threads
        libc.syscall(SYS_TGKILL, proc.pid, threads[len(threads) // 2], signum)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()


def test_sighup_reloads_the_token_file_and_ends_nothing(tmp_path):
    """SIGHUP's default would end the server at once, in-flight calls and all (red-team finding): it now
    reads --auth-token-file again, so tokens rotate without a restart; a file that does not read keeps
    the tokens in force. A server without a token file just goes on."""
    tokens = tmp_path / "tokens"
    tokens.write_text("old-token\n")
    proc, address = start_server("--auth-token-file", str(tokens), "--log-level", "INFO")
    bare, _ = start_server()
    p = layer_norm_call(np.random.default_rng(0), (4, 8))

    def runs(token: str) -> bool:
        with Client(address, token=token, timeout=10) as c:
            try:
                c.run(OP, **p)
            except AclnnError as error:
                assert error.grpc_code == grpc.StatusCode.UNAUTHENTICATED
                return False
        return True

    try:
        assert runs("old-token") and not runs("new-token")
        tokens.write_text("new-token\n")
        proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            if runs("new-token"):
                break
            time.sleep(0.05)
        assert not runs("old-token") and runs("new-token")
        tokens.write_text("")  # no token: refused, the tokens in force stay
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert runs("new-token")
        bare.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None and bare.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        log = proc.stderr.read()
        assert "SIGHUP: 1 tokens reloaded" in log and "not reloaded, the tokens in force stay" in log
    finally:
        for server in (proc, bare):
            server.kill()
            server.wait()


def test_a_withdrawn_token_ends_its_data_channel_tickets_and_connections(tmp_path):
    """A token taken out of the file at SIGHUP was refused over gRPC, while its data-channel connections
    served every call for as long as they were kept busy, and its tickets admitted new connections
    for their minute (red-team finding). Now both end with it; another token's connection goes on."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nmallory-token\n")
    proc, address = start_server("--auth-token-file", str(tokens))
    rng = np.random.default_rng(0)
    try:
        alice, mallory = Client(address, token="alice-token"), Client(address, token="mallory-token")
        for c in (alice, mallory):
            c.run(OP, **layer_norm_call(rng, (4, 8)))
        metadata = (("authorization", "Bearer mallory-token"),)
        with grpc.insecure_channel(address) as channel:
            ticket = pb_grpc.AclnnStub(channel).OpenDataChannel(pb.Empty(), metadata=metadata, timeout=10)
        tokens.write_text("alice-token\n")
        proc.send_signal(signal.SIGHUP)
        with grpc.insecure_channel(address) as channel:
            for _ in range(200):  # until the server has read the file again
                try:
                    pb_grpc.AclnnStub(channel).KeepAlive(pb.Empty(), metadata=metadata, timeout=10)
                    time.sleep(0.05)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                    break
        late = layer_norm_call(rng, (4, 8))
        before = late["gradInputOut"].copy()
        with pytest.raises(AclnnError) as refused:
            mallory.run(OP, **late)
        assert refused.value.grpc_code == grpc.StatusCode.UNAUTHENTICATED, refused.value
        np.testing.assert_array_equal(late["gradInputOut"], before)
        with socket.socket(socket.AF_UNIX) as sock:  # the ticket from before admits nobody now
            sock.settimeout(10)
            sock.connect(ticket.unix_path)
            sock.sendall(MAGIC + ticket.ticket)
            admitted, length = REPLY.unpack(sock.recv(REPLY.size, socket.MSG_WAITALL))
            assert not admitted and b"ticket" in sock.recv(length, socket.MSG_WAITALL)
        p = layer_norm_call(rng, (4, 8))
        alice.run(OP, **p)
        assert_close(p["gradInputOut"], layer_norm_reference(p)[0], np.float32)
        alice.close()
        mallory.close()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_replica_pool_survives_losing_a_member():
    """Three server processes, one killed mid-load: after retries no call fails for the user."""
    servers = [start_server() for _ in range(3)]
    addresses = [address for _, address in servers]
    failures, done = [], []
    try:
        with Client(addresses) as c:
            c.list_operators()
            # Executors on the replica that will die are planned again elsewhere when executed.
            p_two_phase = layer_norm_call(np.random.default_rng(99), (4, 16))
            executors = [c.get_workspace_size(OP, **p_two_phase)[1] for _ in range(3)]
            doomed = int(executors[0].id.split("/")[0])

            killed_at, stop_at = time.monotonic() + 0.3, time.monotonic() + 1.0

            def worker(seed: int) -> None:
                rng = np.random.default_rng(seed)
                while time.monotonic() < stop_at:
                    p = layer_norm_call(rng, (8, 64))
                    try:
                        c.run(OP, **p)
                        assert_close(p["gradInputOut"], layer_norm_reference(p)[0])
                        done.append(time.monotonic())
                    except Exception as exc:  # collected: the test reports every failure
                        failures.append(exc)

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(worker, seed) for seed in range(4)]
                time.sleep(killed_at - time.monotonic())
                servers[doomed][0].kill()
                for f in futures:
                    f.result()
            for executor in executors:
                c.execute(executor)
                assert_close(p_two_phase["gradInputOut"], layer_norm_reference(p_two_phase)[0])
        assert not failures, failures[:3]
        assert sum(t > killed_at for t in done) > 20, "the load did not go on after the kill"
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("data_channel", [False, True], ids=["grpc", "data channel"])
def test_what_a_drain_still_serves_and_what_it_refuses(serve, data_channel):
    """After SIGTERM (stop with a grace period), in process: an executor planned before runs (Execute is
    the second phase of its call); work queued on a stream before is waited for, synchronized and read
    back; a buffer and an executor can be freed. A new call is refused UNAVAILABLE, and so is a
    GetWorkspaceSize naming a live reservation (only a Run or an upload takes one), and a Run naming a
    reservation made for an Execute. Each was refused, or the queued work lost when the server left at
    once, or new work admitted (red-team findings)."""
    from test_device_memory import on_device

    served = serve()
    rng = np.random.default_rng(0)
    c = Client(served.address, data_channel=data_channel)
    planned = layer_norm_call(rng, (4, 8))
    _, executor = c.get_workspace_size(OP, **planned)
    c.set_executor_repeatable(executor)
    x = rng.standard_normal((64, 32), dtype=np.float32)
    xb, gb, yb, rb = (c.malloc(n) for n in (x.nbytes, 128, x.nbytes, 256))
    c.memcpy(xb, x)
    c.memcpy(gb, np.ones(32, np.float32))
    c.run("aclnnRmsNorm", x=on_device(xb, (64, 32)), gamma=on_device(gb, (32,)), epsilon=1e-6,
          yOut=on_device(yb, (64, 32)), rstdOut=on_device(rb, (64, 1)), stream=1)  # fmt: skip
    channel = grpc.insecure_channel(served.address)
    stub, session = pb_grpc.AclnnStub(channel), (("x-aclnn-session", "tenant"),)
    held = encode_call(OP, bind(OP, layer_norm_call(rng, (4, 8)), OUTPUTS).values)
    reservation = stub.ReserveCall(pb.CallReservation(run=held), metadata=session, timeout=30).reservation
    raw_plan = encode_call(OP, bind(OP, layer_norm_call(rng, (4, 8)), OUTPUTS).values)
    raw_executor = stub.GetWorkspaceSize(raw_plan, metadata=session, timeout=30).executor
    stopped = served.server.stop(30)
    try:
        c.execute(executor)
        assert_close(planned["gradInputOut"], layer_norm_reference(planned)[0], np.float32)
        c.synchronize(1)
        y = np.empty_like(x)
        c.memcpy(y, yb)
        reference = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6)
        assert_close(y, reference, np.float32)
        with pytest.raises(AclnnError) as refused:
            c.run(OP, **layer_norm_call(rng, (4, 8)))
        assert refused.value.grpc_code == grpc.StatusCode.UNAVAILABLE, refused.value
        c.destroy_executor(executor)
        for buf in (xb, gb, yb, rb):
            c.free(buf)
        new_plan = encode_call(OP, bind(OP, layer_norm_call(rng, (4, 8)), OUTPUTS).values)
        new_plan.reservation = reservation  # a live reservation is no ticket for new work
        with pytest.raises(grpc.RpcError) as refused_plan:
            stub.GetWorkspaceSize(new_plan, metadata=session, timeout=30)
        assert refused_plan.value.code() == grpc.StatusCode.UNAVAILABLE
        for_execute = pb.CallReservation(execute=pb.ExecuteRequest(executor=raw_executor))
        new_plan.reservation = stub.ReserveCall(for_execute, metadata=session, timeout=30).reservation
        with pytest.raises(grpc.RpcError) as refused_run:  # a reservation for an Execute runs no new Run
            stub.Run(new_plan, metadata=session, timeout=30)
        assert refused_run.value.code() == grpc.StatusCode.UNAVAILABLE
        stub.ReleaseReservation(pb.Reservation(reservation=new_plan.reservation), metadata=session, timeout=30)
        held.reservation = reservation  # the call it was made for runs
        stub.Run(held, metadata=session, timeout=30)
    finally:
        channel.close()
        c.close()
    assert stopped.wait(10)  # nothing owed any more: the drain settles well before its grace


def test_a_result_nobody_fetches_holds_a_drain_up_for_seconds_not_the_grace(serve):
    """A kept result whose client never downloads it (gone before its reply came, or after): once nothing
    else is owed the drain waits for fetches only while they keep coming (two seconds without one), not
    the whole grace period (red-team finding)."""
    served = serve()
    rng = np.random.default_rng(0)
    request = encode_call(OP, bind(OP, layer_norm_call(rng, (64, 64)), OUTPUTS).values)
    request.placements["gradInputOut"].keep_on_server = True
    with grpc.insecure_channel(served.address) as channel:
        reply = pb_grpc.AclnnStub(channel).Run(request, metadata=(("x-aclnn-session", "gone"),), timeout=30)
    assert reply.outputs["gradInputOut"].handle and served.server.storage.unfetched == 1
    started = time.monotonic()
    assert served.server.stop(60).wait(30)
    assert 1.5 < time.monotonic() - started < 10
