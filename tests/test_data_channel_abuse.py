"""The data channel under floods, slow peers and greedy tenants: a real server, raw sockets, the public client."""

from __future__ import annotations

import concurrent.futures
import os
import re
import resource
import select
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import pytest
from layer_norm_cases import layer_norm_call
from test_data_channel import answers_keepalive, check, connect, error_of, reply, request, ticket
from test_processes import broadcast_call
from test_transport import wait_for

from aclnn_client import Client
from aclnn_common.binding import bind
from aclnn_common.chunks import byte_view
from aclnn_common.framing import CALL, MAGIC, REQUEST
from aclnn_common.wire import encode_call

OP = "aclnnLayerNormBackward"
MIB = 1 << 20


@pytest.fixture
def many_descriptors():
    """Room for a few thousand sockets in this process (the flood's and the in-process server's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 8192)
    if wanted < 4096:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for a flood")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("good\nbad\n")
    return path


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed the connection within `timeout` (EOF or reset), reading what it sent."""
    deadline = time.monotonic() + timeout
    readable = select.poll()
    readable.register(sock, select.POLLIN)
    while time.monotonic() < deadline:
        if readable.poll(50):
            try:
                if not sock.recv(4096):
                    return True
            except (ConnectionResetError, BrokenPipeError):
                return True
    return False


def timed_calls(client: Client, p: dict, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        client.run(OP, **p)
        times.append(time.perf_counter() - started)
    return times


def test_flood_of_idle_and_slow_connections_does_not_stall_a_good_client(serve, rng, tokens, many_descriptors):
    served = serve(auth_token_file=tokens, data_handshake_timeout_s=1.0)
    port = served.server.data_channel.port
    p = layer_norm_call(rng, (8, 64))
    with Client(served.address, token="good", unix_socket=False) as good:
        baseline = statistics.median(timed_calls(good, p, 30))
        threads_before = threading.active_count()

        # Slow loris after admission (a tenant's valid ticket): a request header, one byte a second.
        offer = ticket(served.address, "bad-session", token="bad")
        admitted = [connect(offer) for _ in range(8)]
        for sock in admitted:
            assert reply(sock)[0]
        # Slow loris before admission: the handshake, one byte a second.
        loris = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(1000)]
        header = REQUEST.pack(CALL, 0, 0, 0, 1000)
        hello = MAGIC + offer.ticket
        stop = threading.Event()

        def trickle() -> None:
            for second in range(len(header)):
                if stop.wait(1.0):
                    return
                for sock in loris:
                    try:
                        sock.send(hello[second : second + 1])
                    except OSError:
                        pass
                for sock in admitted:
                    try:
                        sock.send(header[second : second + 1])
                    except OSError:
                        pass

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            time.sleep(0.5)
            during = timed_calls(good, p, 30)
            # No thread per connection: the flood adds none (the trickling sender is this test's own).
            assert threading.active_count() <= threads_before + 1
            assert statistics.median(during) < 5 * baseline + 0.05, (baseline, statistics.median(during))
            assert max(during) < 2.0
            # A new client (new connections) gets through too, if need be over gRPC.
            with Client(served.address, token="good", unix_socket=False) as late:
                late.run(OP, **p)
            check(p)
            # Idle and slow peers are closed at their deadlines (1 s for the handshake and the request
            # base allowance), not after a minute of silence each.
            for sock in idle[:50] + loris + admitted:
                assert closed_by_server(sock, 5.0)
        finally:
            stop.set()
            sender.join()
            for sock in idle + loris + admitted:
                sock.close()
        assert served.server.data_channel.open_connections <= 2  # the good clients' own
        good.run(OP, **p)
    check(p)


def test_one_identity_cannot_take_every_connection(serve, rng, tokens):
    served = serve(auth_token_file=tokens, data_max_connections_per_tenant=4)
    greedy = ticket(served.address, "greedy", token="bad")
    held = [connect(greedy) for _ in range(4)]
    try:
        for sock in held:
            assert reply(sock) == (True, b"")
        with connect(greedy) as fifth:
            ok, payload = reply(fifth)
            assert not ok and error_of(payload).grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "data-max-connections-per-tenant" in error_of(payload).message
            assert closed_by_server(fifth, 5.0)
        p = layer_norm_call(rng, (8, 64))
        with Client(served.address, token="good", unix_socket=False) as other:  # another identity: admitted
            other.run(OP, **p)
            assert served.server.data_channel.open_connections == 5
            assert other._data_channel(0) is not None
        check(p)
        with Client(served.address, token="bad", unix_socket=False) as capped:  # the greedy one: over gRPC
            capped.run(OP, **p)
        check(p)
        runs = served.server.metrics.requests.labels("Run", OP, "ACLNN_SUCCESS")._value.get()
        assert runs == 2
    finally:
        for sock in held:
            sock.close()


def test_idle_connections_are_reaped_and_clients_reconnect(serve, rng):
    served = serve(data_idle_timeout_s=0.5)
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        assert closed_by_server(sock, 5.0)
    p = layer_norm_call(rng, (8, 64))
    with Client(served.address, unix_socket=False) as c:
        c.run(OP, **p)
        channel = c._data_channel(0)
        wait_for(lambda: served.server.data_channel.open_connections == 0)  # its pooled connection was reaped
        c.run(OP, **p)  # on a new connection, not an error
        assert c._data_channel(0) is channel and served.server.data_channel.open_connections == 1
    check(p)
    runs = served.server.metrics.requests.labels("Run", OP, "ACLNN_SUCCESS")._value.get()
    assert runs == 2  # both over the data channel (gRPC calls are counted alike, but none failed over)


def test_a_closed_connection_cancels_its_queued_call(serve, rng):
    served = serve(max_concurrency=1)
    long_call = broadcast_call(0, rows=262144)  # over a second of compute on one slot
    with Client(served.address) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        c.list_operators()
        running = pool.submit(c.run, OP, **long_call)
        wait_for(lambda: served.engine.admission.running == 1)  # admitted: it holds the only slot
        p = layer_norm_call(rng, (8, 64))
        bound = bind(OP, p, c._output_names(OP))  # the call as the client encodes it, sent by hand
        call = encode_call(OP, bound.descriptors())
        for name, tensor in bound.inputs().items():
            call.params[name].tensor.data = byte_view(tensor.data).tobytes()
        payload = b"\x03Run" + call.SerializeToString()
        with connect(ticket(served.address)) as sock:
            assert reply(sock)[0]
            sock.sendall(request(CALL, len(payload)) + payload)
            wait_for(lambda: served.engine.admission.waiting == 1)  # queued behind the long call
        # Closed while queued: the call is dropped at once, it never runs.
        cancelled = served.server.metrics.requests.labels("Run", OP, "CANCELLED")._value.get
        wait_for(lambda: cancelled() == 1, timeout=1.0)
        assert not running.done()
        running.result(timeout=60)
    assert served.server.metrics.requests.labels("Run", OP, "ACLNN_SUCCESS")._value.get() == 1


def test_data_port_is_taken_back_at_once_after_a_restart(serve, rng):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    p = layer_norm_call(rng, (8, 64))
    first = serve(data_port=port, unix_socket="off")
    with Client(first.address) as c:
        c.run(OP, **p)
    first.server.stop(None).wait()  # the server closes first: its end of the connection lingers in TIME_WAIT
    second = serve(data_port=port, unix_socket="off")  # SO_REUSEADDR: binds all the same
    assert second.server.data_channel.port == port
    with Client(second.address) as c:
        c.run(OP, **p)
        assert second.server.data_channel.open_connections == 1
    check(p)


def test_accept_loop_survives_running_out_of_descriptors(tmp_path, rng):
    """A server process with few descriptors: a flood exhausts them; once it passes, clients are served."""
    log = tmp_path / "server.log"
    limit = 64

    # The limit is set by a process of its own that then becomes the server (exec), not by a preexec_fn:
    # Python code in a fork of this many-threaded test process is not safe (CI once saw the server die
    # before its first line).
    few_descriptors = (
        "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]),) * 2); "
        "os.execv(sys.executable, [sys.executable, '-m', 'aclnn_server', *sys.argv[2:]])"
    )
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", few_descriptors, str(limit), "--port", "0", "--backend", "numpy", "--log-level",
             "WARNING", "--data-max-handshakes", "1000", "--data-handshake-timeout-s", "60", "--unix-socket", "off"],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        line = proc.stdout.readline()
        listening = re.fullmatch(r"listening on (\S+)\n", line)
        assert listening, f"first line {line!r}, exit {proc.poll()}, log: {log.read_text()[-2000:]}"
        address = listening[1]
        port = ticket(address).port
        used = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert used < limit - 8, f"the server uses {used} descriptors at rest"
        flood = []
        try:
            for _ in range(2 * limit):  # more than the server can accept: the rest wait in the backlog
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            wait_for(lambda: "cannot accept connections" in log.read_text(), timeout=10)
        finally:
            for sock in flood:
                sock.close()
        p = layer_norm_call(rng, (8, 64))
        # The backlog drains as the closed connections are accepted and dropped; then a client is admitted.
        wait_for(lambda: _data_channel_opens(address), timeout=30)
        with Client(address) as c:
            c.run(OP, **p)
            assert c._data_channel(0) is not None
        check(p)
        # One warning per episode and one when it ends, not one per refused accept (a retry every 0.1 s).
        # The flood's backlog, draining, can start a second episode: each accepted connection holds a
        # descriptor until the server reads its end.
        said = re.findall(r"cannot accept connections|accepts connections again", log.read_text())
        assert said and said == ["cannot accept connections", "accepts connections again"] * (len(said) // 2), said
    finally:
        proc.kill()
        proc.wait()


def _data_channel_opens(address: str) -> bool:
    with Client(address) as c:
        return c._data_channel(0) is not None


def test_request_bytes_are_reserved_before_they_arrive(serve):
    served = serve(memory_budget_bytes=4 * MIB)  # a tenant's share: half, 2 MiB
    ledger = served.engine.ledger
    offer = ticket(served.address)
    with connect(offer) as slow, connect(offer) as second:
        assert reply(slow)[0] and reply(second)[0]
        slow.sendall(request(CALL, 3 * MIB // 2))  # announced, never sent: held all the same
        wait_for(lambda: ledger.held_by_kind().get("request") == 3 * MIB // 2)
        second.sendall(request(CALL, MIB) + b"\0" * MIB)  # does not fit beside it now
        ok, payload = reply(second)
        assert not ok and error_of(payload).grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        second.sendall(request(CALL, 4 * MIB) + b"\0" * (4 * MIB))  # could never fit
        ok, payload = reply(second)
        assert not ok and (error_of(payload).code, error_of(payload).param) == (161002, "request")
        assert answers_keepalive(second)  # the refused bytes were drained: in step
    wait_for(lambda: not ledger.held_by_kind().get("request"))
