"""Shared memory as a hostile tenant would try it: sealed memfds passed over the Unix socket, never names."""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import Untouched, assert_close
from test_data_channel import answers_keepalive, error_of, reply, request, ticket
from test_processes import broadcast_call
from test_transport import wait_for

import aclnn_client.grpc_client
from aclnn_client import AclnnError, Client
from aclnn_client.regions import F_SEAL_FUTURE_WRITE
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.framing import CALL, MAGIC, REGION, REGISTER_REGION, REQUEST, UNREGISTER_REGION

OP = "aclnnLayerNormBackward"
OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def check(p: dict) -> None:
    for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
        assert_close(p[name], ref.reshape(p[name].shape), name)


def memfd(size: int, seals: int = SEALS) -> int:
    fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def unix_connect(offer: pb.DataChannelTicket) -> socket.socket:
    """A raw connection to the server's Unix socket, admitted by the ticket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(offer.unix_path)
    sock.sendall(MAGIC + offer.ticket)
    assert reply(sock) == (True, b"")
    return sock


def register(sock: socket.socket, fds: list[int], size: int, kind: int = REGISTER_REGION) -> tuple[bool, bytes]:
    """A registration as the protocol has it: the request, then (when asked) one byte with `fds`."""
    sock.sendall(REQUEST.pack(kind, 0, 0, 0, REGION.size) + REGION.pack(size))
    ready = reply(sock)
    if not ready[0]:
        return ready
    socket.send_fds(sock, [b"\0"], fds)
    return reply(sock)


def refused(answer: tuple[bool, bytes], words: str) -> None:
    ok, payload = answer
    assert not ok
    error = error_of(payload)
    assert (error.code, error.param) == (161002, "region") and words in error.message, error.message


def region_call(p: dict, region: str, offsets: dict[str, int]) -> pb.OpCall:
    """The LayerNorm call of `p` with the named inputs read from `region` at `offsets`, the rest inline."""
    from aclnn_common.binding import bind
    from aclnn_common.chunks import byte_view
    from aclnn_common.wire import encode_call

    bound = bind(OP, p, frozenset(OUTPUTS))
    call = encode_call(OP, bound.descriptors())
    for name, tensor in bound.inputs().items():
        data = byte_view(tensor.data)
        if name in offsets:
            call.params[name].tensor.ref.region.CopyFrom(
                pb.RegionSlice(region=region, offset=offsets[name], size=data.nbytes)
            )
        else:
            call.params[name].tensor.data = data.tobytes()
    return call


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--backend", "numpy", "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    match = re.fullmatch(r"listening on (\S+)\n", line)
    assert match, f"unexpected first line {line!r}"
    return proc, match[1]


def test_regions_cannot_be_truncated_and_bad_ones_are_refused(server_process, rng, tmp_path):
    proc, address = server_process
    offer = ticket(address, "mallory")
    assert offer.unix_path
    with unix_connect(offer) as sock:
        # A region the client sealed cannot shrink (the SIGBUS of old) nor grow, whoever tries.
        fd = memfd(1 << 16)
        ok, region_id = register(sock, [fd], 1 << 16)
        assert ok and region_id
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
        os.close(fd)
        unsealed = memfd(1 << 16, seals=0)
        refused(register(sock, [unsealed], 1 << 16), "sealed against shrinking and growing")
        os.ftruncate(unsealed, 0)  # what the server was spared
        os.close(unsealed)
        small = memfd(4096)
        refused(register(sock, [small], 1 << 16), "declared")
        os.close(small)
        refused(register(sock, [], 4096), "exactly one memfd")
        two = [memfd(4096), memfd(4096)]
        refused(register(sock, two, 4096), "exactly one memfd")
        for fd in two:
            os.close(fd)
        # Nothing is ever opened by name, and nothing but a memfd is mapped.
        shm = f"/dev/shm/aclnn-test-{os.getpid()}"
        with open(shm, "wb") as f:
            f.truncate(4096)
        try:
            for path in (shm, str(tmp_path / "plain")):
                with open(path, "ab+") as f:
                    f.truncate(4096)
                    refused(register(sock, [f.fileno()], 4096), "not a memfd")
        finally:
            os.unlink(shm)
        assert answers_keepalive(sock)  # still in step after every refusal
    with grpc.insecure_channel(address) as channel:  # the registration by name is gone from the API
        by_name = channel.unary_unary("/aclnn.v1.Aclnn/RegisterRegion")
        with pytest.raises(grpc.RpcError) as raised:
            by_name(b"\n\x0faclnn-someone\x10\x80\x20", metadata=(("x-aclnn-session", "mallory"),))
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    p = layer_norm_call(rng, (64, 256))
    with Client(address, shared_memory=True) as c:  # the server survived it all
        c.run(OP, **p)
    check(p)
    assert proc.poll() is None


def test_refused_descriptors_are_not_kept(serve):
    served = serve()
    offer = ticket(served.address, "s")
    pid = os.getpid()
    with unix_connect(offer) as sock:
        register(sock, [memfd(4096)], 4096)  # one accepted: its mapping keeps one duplicate
        before = len(os.listdir(f"/proc/{pid}/fd"))
        for count in range(2, 52):  # good memfds, too many at once (more than the server has room for)
            fds = [memfd(4096) for _ in range(count)]
            refused(register(sock, fds, 4096), "exactly one memfd")
            for fd in fds:
                os.close(fd)
        wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= before)


def test_a_region_is_its_session_and_identity_only(serve, rng, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice\nmallory\n")
    served = serve(auth_token_file=tokens)
    p = layer_norm_call(rng, (1, 256))  # gradBias == gradOut here: a read-back channel if regions leaked
    secret = np.frombuffer(p["gradOut"].tobytes(), np.uint8)
    fd = memfd(4096)
    with mmap.mmap(fd, 4096) as view:
        view[: secret.nbytes] = secret.tobytes()
    with unix_connect(ticket(served.address, "alice", token="alice")) as sock:
        ok, region_id = register(sock, [fd], 4096)
    os.close(fd)
    assert ok
    region_id = region_id.decode()
    call = region_call(p, region_id, {"gradOut": 0})
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        own = stub.Run(call, metadata=(("x-aclnn-session", "alice"), ("authorization", "Bearer alice")))
        assert np.frombuffer(own.outputs["gradBiasOut"].data, np.float32).tobytes() == secret.tobytes()
        for session in ("mallory", "alice"):  # her own session, or alice's session id
            metadata = (("x-aclnn-session", session), ("authorization", "Bearer mallory"))
            with pytest.raises(grpc.RpcError) as raised:
                stub.Run(call, metadata=metadata)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not registered" in raised.value.details() or "another client" in raised.value.details()
            assert secret.tobytes().hex()[:16] not in raised.value.details()
    # Over the data channel (mallory's own connection) it is refused alike, and nothing is written.
    untouched = Untouched(*(p[n] for n in OUTPUTS))
    with Client(served.address, token="mallory") as mallory:
        with pytest.raises(AclnnError) as raised:
            mallory._call_on(0, "Run", call)
        assert (raised.value.code, raised.value.param) == (161002, "region")
    untouched.check()


def test_registration_needs_the_unix_socket(serve):
    served = serve()
    offer = ticket(served.address)
    with socket.create_connection(("127.0.0.1", offer.port), timeout=10) as sock:
        sock.sendall(MAGIC + offer.ticket)
        assert reply(sock)[0]
        sock.sendall(request(REGISTER_REGION, REGION.size) + REGION.pack(4096))  # TCP carries no descriptor
        refused(reply(sock), "exactly one memfd")
        sock.sendall(request(UNREGISTER_REGION, 4) + b"nope")
        refused(reply(sock), "not registered")


def test_a_late_call_never_writes_into_a_reused_region(serve, rng):
    """A call the client gave up on may still be written late: its regions are retired, never reused."""
    served = serve(max_concurrency=1)
    p = layer_norm_call(rng, (64, 1024))
    with Client(served.address) as other, Client(served.address, shared_memory=True, timeout=0.4) as c:
        c.run(OP, **p)  # warm: its regions are pooled and registered
        check(p)
        pooled = list(c._regions.all)
        assert pooled
        long_call = broadcast_call(0, rows=262144)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other.list_operators()
            running = pool.submit(other.run, OP, **long_call)
            wait_for(lambda: served.engine.admission.running == 1)  # it holds the only slot
            late = layer_norm_call(rng, (64, 1024))
            with pytest.raises(AclnnError) as raised:
                c.run(OP, **late)  # queued behind the long call until the client's deadline
            assert raised.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert not set(pooled) & set(c._regions.all)  # retired, not back in the pool
            assert all(not hasattr(r, "array") for r in pooled)  # and closed
            running.result(timeout=60)
        fresh = layer_norm_call(rng, (64, 1024))
        c.run(OP, **fresh)
        check(fresh)
        # The server holds only the fresh regions: the retired ones were unregistered.
        assert served.server.storage.counts()[1] == len(c._regions.all)


# Clients with regions: every tensor in one with shared memory; a result of RESULT_REGION_BYTES (1 MiB)
# without (the default client's large results land in a region the server seals and holds nothing for).
WITH_REGIONS = pytest.mark.parametrize(("options", "rows"), [({"shared_memory": True}, 64), ({}, 256)])


@WITH_REGIONS
def test_registrations_survive_a_server_restart(tmp_path, rng, options, rows):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ("--port", str(port), "--unix-socket", str(tmp_path / "aclnn.sock"))
    proc, address = start_server(*args)
    try:
        with Client(address, **options) as c:
            p = layer_norm_call(rng, (rows, 1024))
            c.run(OP, **p)
            check(p)
            proc.send_signal(signal.SIGKILL)  # its socket file stays behind
            proc.wait()
            proc, _ = start_server(*args)
            grpc.channel_ready_future(c._pool.channel(0)).result(timeout=30)  # its gRPC channel is back
            p = layer_norm_call(rng, (rows, 1024))
            c.run(OP, **p)  # the same client: a new ticket, its regions registered again (results': fresh ones)
            check(p)
            channel = c._data_channel(0)
            assert channel.unix and channel.registered()
    finally:
        proc.kill()
        proc.wait()


@WITH_REGIONS
def test_registrations_come_back_after_the_lease_lapsed(serve, rng, options, rows):
    served = serve()
    with Client(served.address, **options) as c:
        p = layer_norm_call(rng, (rows, 1024))
        c.run(OP, **p)
        assert served.server.storage.counts()[1] > 0
        # The server loses the session's regions, as to a lease that lapsed while the client slept
        served.server.storage.end(c._base_metadata[0][1], f"uid:{os.getuid()}")
        assert served.server.storage.counts()[1] == 0
        p = layer_norm_call(rng, (rows, 1024))
        c.run(OP, **p)
        check(p)
        assert served.server.storage.counts()[1] > 0


def test_a_layout_called_again_reuses_its_staging(serve, rng):
    """Client(shared_memory=True) keeps a call's staging by layout: the next call of the same shapes
    copies its inputs into the same regions and sends the request built before; results stay exact
    through new data, another layout in between, and calls of one layout from several threads."""
    served = serve()
    with Client(served.address, shared_memory=True) as c:
        p = layer_norm_call(rng, (64, 1024))
        c.run(OP, **p)
        check(p)
        (staged,) = c._staged.values()
        registered = served.server.storage.counts()[1]
        assert registered == len(staged.regions) == len(c._regions.all)  # one a tensor
        for rows in (64, 32, 64, 32, 64):
            p = layer_norm_call(rng, (rows, 1024))
            c.run(OP, **p)
            check(p)
        assert staged in c._staged.values() and len(c._staged) == 2
        assert served.server.storage.counts()[1] == 2 * registered  # the two layouts' regions, no more

        def calls(seed: int) -> None:
            own = np.random.default_rng(seed)
            for _ in range(10):
                q = layer_norm_call(own, (64, 1024))
                c.run(OP, **q)
                check(q)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(calls, range(4)))  # each call its own regions: a kept staging is taken out
        assert len(c._staged) <= 3


def test_kept_stagings_are_bounded(serve, rng, monkeypatch):
    """At most _STAGED_LAYOUTS layouts, _STAGED_BYTES of regions, are kept; older ones go back to the pool."""
    monkeypatch.setattr(aclnn_client.grpc_client, "_STAGED_BYTES", 4 << 20)
    served = serve()
    with Client(served.address, shared_memory=True) as c:
        for rows in range(1, 41):
            p = layer_norm_call(rng, (rows, 256))
            c.run(OP, **p)
            check(p)
            assert len(c._staged) <= aclnn_client.grpc_client._STAGED_LAYOUTS
        p = layer_norm_call(rng, (1024, 1024))  # 4 MiB each input: more than it keeps
        c.run(OP, **p)
        check(p)
        assert c._staged_bytes == sum(s.nbytes for s in c._staged.values()) <= 4 << 20
        kept = {r for s in c._staged.values() for r in s.regions}
        assert kept <= set(c._regions.all) and not kept & set(c._regions._free)


def test_keepalive_survives_concurrent_registrations(serve, rng, monkeypatch):
    served = serve()
    monkeypatch.setattr(aclnn_client.grpc_client, "_KEEPALIVE_S", 0.001)
    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    with Client(served.address, shared_memory=True) as c:
        calls = [layer_norm_call(rng, (8 + i, 64 + 8 * i)) for i in range(64)]  # every size a new region
        futures = [c.run_async(OP, **p) for p in calls]
        for future in futures:
            future.result(timeout=60)
        assert c._keepalive.is_alive()
        keepalives = served.server.metrics.requests.labels("KeepAlive", "", "ACLNN_SUCCESS")._value.get
        seen = keepalives()
        wait_for(lambda: keepalives() > seen)  # and still renewing
    for p in calls:
        check(p)
    assert not failures


def placed_call(p: dict, region: str, inputs: dict[str, int], results: dict[str, tuple[int, int]]) -> bytes:
    """The data channel's CALL payload of `p`'s Run: the named inputs read from `region` at their offsets,
    the named results placed there at (offset, size)."""
    call = region_call(p, region, inputs)
    for name, (offset, size) in results.items():
        call.placements[name].region.CopyFrom(pb.RegionSlice(region=region, offset=offset, size=size))
    return b"\x03Run" + call.SerializeToString()


def run_in_region(sock: socket.socket, payload: bytes) -> tuple[bool, bytes]:
    sock.sendall(request(CALL, len(payload)) + payload)
    return reply(sock)


@pytest.fixture(params=["numpy", "cpu"])  # not conftest's BACKENDS: other users' processes import this module
def region_of(serve, request):
    """A registered region of `size` bytes on a server of each backend (its id, the raw connection and
    a writeable map of it): the cpu backend's kernels write their results as they go."""
    opened = []
    served = serve(backend=request.param)

    def make(size: int) -> tuple[str, socket.socket, mmap.mmap]:
        sock = unix_connect(ticket(served.address))
        fd = memfd(size)
        view = mmap.mmap(fd, size)
        ok, region_id = register(sock, [fd], size)
        os.close(fd)
        assert ok, region_id
        opened.append((sock, view))
        return region_id.decode(), sock, view

    make.served = served
    yield make
    for sock, view in opened:
        sock.close()
        view.close()


def test_results_placed_in_a_region_are_computed_where_they_lie(region_of, rng):
    """Results placed in region slices are the oracle's, whether the server computes them there (no copy
    after) or, where a slice overlaps an input or another result, apart and copied in."""
    p = layer_norm_call(rng, (64, 1024))
    nbytes = {name: p[name].nbytes for name in (*OUTPUTS, "gradOut")}
    region, sock, view = region_of(1 << 20)
    view[: nbytes["gradOut"]] = p["gradOut"].tobytes()
    grad_input, grad_weight, grad_bias = 300_000, 600_000, 600_000 + nbytes["gradWeightOut"] + 64
    apart = {"gradInputOut": (grad_input, nbytes["gradInputOut"]), "gradWeightOut": (grad_weight, 4096)}
    apart["gradBiasOut"] = (grad_bias, 4096)
    layouts = [
        apart,  # computed in place
        {**apart, "gradBiasOut": (grad_weight, 4096)},  # two results in one slice
        {**apart, "gradInputOut": (64, nbytes["gradInputOut"])},  # gradInput over gradOut, the input it reads
        {**apart, "gradWeightOut": (grad_weight + 2, 4096)},  # not aligned for float32
    ]
    for results in layouts:
        ok, answer = run_in_region(sock, placed_call(p, region, {"gradOut": 0}, results))
        assert ok, error_of(answer).message
        refs = dict(zip(OUTPUTS, layer_norm_reference(p)))
        for name in OUTPUTS if results is apart else ("gradInputOut",):
            offset, size = results[name]
            got = np.frombuffer(view[offset : offset + size], np.float32).reshape(p[name].shape)
            assert_close(got, refs[name].reshape(p[name].shape), name)
        view[: nbytes["gradOut"]] = p["gradOut"].tobytes()  # the third layout wrote gradInput over it


def test_a_run_sent_again_is_served_from_its_first_and_checked_again(region_of, rng, monkeypatch):
    """A Run sent again byte for byte, every input and result in a region, is served from the first (one
    full run): on the region's new contents each time. Another session's identical bytes are refused,
    and once the region is unregistered so are its own, writing nothing (161002 naming the region)."""
    region, sock, view = region_of(1 << 20)
    engine = region_of.served.engine
    full_runs = []
    monkeypatch.setattr(engine, "run", lambda *a, _f=engine.run, **k: full_runs.append(a[0]) or _f(*a, **k))
    p = layer_norm_call(rng, (16, 256))
    inputs = [name for name, value in p.items() if name not in OUTPUTS and isinstance(value, np.ndarray)]
    offsets, end = {}, 0
    for name in [*inputs, *OUTPUTS]:
        offsets[name], end = end, end + -(-p[name].nbytes // 64) * 64
    payload = placed_call(p, region, {n: offsets[n] for n in inputs}, {n: (offsets[n], p[n].nbytes) for n in OUTPUTS})

    def result(name: str) -> np.ndarray:
        return np.frombuffer(view[offsets[name] : offsets[name] + p[name].nbytes], np.float32).reshape(p[name].shape)

    for _ in range(3):
        q = layer_norm_call(rng, (16, 256))  # new contents, the same layout
        for name in inputs:
            view[offsets[name] : offsets[name] + q[name].nbytes] = q[name].tobytes()
        ok, answer = run_in_region(sock, payload)
        assert ok, error_of(answer).message
        for name, ref in zip(OUTPUTS, layer_norm_reference(q)):
            assert_close(result(name), ref.reshape(q[name].shape), name)
    assert full_runs == [OP]
    before = bytes(view[offsets["gradInputOut"] : end])
    with unix_connect(ticket(region_of.served.address, session="s2")) as other:
        ok, answer = run_in_region(other, payload)
        assert not ok and (error_of(answer).code, error_of(answer).param) == (161002, "region")
    assert bytes(view[offsets["gradInputOut"] : end]) == before
    sock.sendall(request(UNREGISTER_REGION, len(region)) + region.encode())  # its pages are given back
    assert reply(sock)[0]
    ok, answer = run_in_region(sock, payload)
    assert not ok and (error_of(answer).code, error_of(answer).param) == (161002, "region")
    assert "not registered" in error_of(answer).message
    assert full_runs == [OP]  # both refused while decoding, before running


def test_a_session_keeps_at_most_sixteen_repeated_runs(region_of, rng):
    """Each distinct layout that ran in full is kept for its repeats, the oldest forgotten beyond 16
    (kept by the connection: the only one, here, that sent a call)."""
    region, sock, view = region_of(1 << 20)
    p = layer_norm_call(rng, (4, 64))
    view[: p["gradOut"].nbytes] = p["gradOut"].tobytes()
    results = {name: (8192 + 4096 * i, p[name].nbytes) for i, name in enumerate(OUTPUTS)}
    connections = region_of.served.server.data_channel._conns.values()
    for offset in range(0, 20 * 64, 64):  # gradOut's bytes at another offset: another request
        view[offset : offset + p["gradOut"].nbytes] = p["gradOut"].tobytes()
        ok, answer = run_in_region(sock, placed_call(p, region, {"gradOut": offset}, results))
        assert ok, error_of(answer).message
    assert sum(len(conn.repeats) for conn in connections) == 0  # its other inputs came inline: never kept
    inputs = [name for name, value in p.items() if name not in OUTPUTS and isinstance(value, np.ndarray)]
    for shift in range(20):
        offsets = {name: 16384 + shift * 64 + 4096 * i for i, name in enumerate(inputs)}
        for name, offset in offsets.items():
            view[offset : offset + p[name].nbytes] = p[name].tobytes()
        ok, answer = run_in_region(sock, placed_call(p, region, offsets, results))
        assert ok, error_of(answer).message
        for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
            offset, size = results[name]
            assert_close(np.frombuffer(view[offset : offset + size], np.float32).reshape(p[name].shape), ref, name)
    assert sorted(len(conn.repeats) for conn in connections if conn.repeats) == [16]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_clients_shared_memory_results_are_computed_in_their_regions(serve, rng, backend, monkeypatch):
    """Client(shared_memory=True): run and execute hand the engine their results' region slices to compute
    into (what the engine was given is recorded), and the results are the oracle's."""
    served = serve(backend=backend)
    given: list[set[str]] = []
    for method in ("run", "execute"):
        original = getattr(served.engine, method)
        monkeypatch.setattr(
            served.engine, method, lambda *a, _f=original, **k: given.append(set(a[3] or {})) or _f(*a, **k)
        )
    p = layer_norm_call(rng, (256, 1024))
    with Client(served.address, shared_memory=True) as c:
        c.run(OP, **p)
        check(p)
        q = {**p, **{name: np.zeros_like(p[name]) for name in OUTPUTS}}
        _, executor = c.get_workspace_size(OP, **q)
        c.execute(executor)
        check(q)
    assert given == [set(OUTPUTS), set(OUTPUTS)]


def test_the_default_clients_large_results_land_in_regions_it_pays_for(serve, rng):
    """Without shared_memory=True, results of 1-64 MiB land in a pooled region of the client's over the
    Unix socket: computed there, the reply carrying descriptors only, nothing held for it on the server
    (its pages are all the client's, allocated before the server sealed it against holes); smaller
    results come back attached; over TCP every result comes back through the socket."""
    served = serve()
    sent = served.server.metrics.bytes_out.labels("Run")
    with Client(served.address) as c:
        # 1 MiB - 4 KiB, 1 MiB, 3 MiB (a region of 4 MiB: a power of two), 8 MiB twice, 2 MiB (in the 4 MiB one)
        for rows, in_region in ((255, False), (256, True), (768, True), (2048, True), (2048, True), (512, True)):
            p = layer_norm_call(rng, (rows, 1024))
            before = sent._value.get()
            c.run(OP, **p)
            check(p)
            assert (sent._value.get() - before < 64 << 10) == in_region, rows
            assert served.engine.ledger.held_by_kind().get("region", 0) == 0
        assert served.server.storage.counts()[1] == 3  # pooled
        regions = [r for r in c._regions.all if r.results]
        assert sorted(r.size for r in regions) == [1 << 20, 4 << 20, 8 << 20]
        seals = fcntl.fcntl(regions[0].fd, fcntl.F_GET_SEALS)
        assert seals & F_SEAL_FUTURE_WRITE and seals & fcntl.F_SEAL_SEAL  # sealed by the server
        with pytest.raises(PermissionError):  # so nobody can give its pages back, the client included
            fallocate_punch(regions[0].fd, 4096)
    assert served.server.storage.counts() == (0, 0)  # close() unregistered them
    with Client(served.address, unix_socket=False) as c:
        p = layer_norm_call(rng, (256, 1024))
        before = sent._value.get()
        c.run(OP, **p)
        check(p)
        assert sent._value.get() - before >= 1 << 20
        assert served.server.storage.counts()[1] == 0


def fallocate_punch(fd: int, size: int) -> None:
    """Punches [0, size) out of a file (fallocate PUNCH_HOLE | KEEP_SIZE); OSError as the kernel says."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if libc.fallocate(fd, 0x02 | 0x01, 0, size) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))  # EPERM: PermissionError


@pytest.mark.parametrize(
    "offer", ["a page never allocated", "sealed against growing only", "sealed against writes already"]
)
def test_a_region_left_for_the_server_to_seal_must_be_whole(serve, offer):
    """A memfd left for the server to seal (against shrinking and growing only) is refused unless every
    page of it is allocated (else the server's writes would fault pages in, charged to it, that the
    client keeps) and the server can map it read-write; the connection stays in step."""
    served = serve()
    size = 1 << 20
    fd = os.memfd_create("test-results", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if offer != "a page never allocated":
        os.posix_fallocate(fd, 0, size)
    else:
        os.posix_fallocate(fd, 0, size - 4096)
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if offer == "sealed against growing only":
        seals = fcntl.F_SEAL_GROW
    elif offer == "sealed against writes already":
        seals |= F_SEAL_FUTURE_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    with unix_connect(ticket(served.address)) as sock:
        refused(register(sock, [fd], size), {"a page never allocated": "holes"}.get(offer, ""))
        assert answers_keepalive(sock)
    os.close(fd)
    assert served.server.storage.counts() == (0, 0) and served.engine.ledger.held == 0


def test_a_large_result_refused_a_region_comes_back_through_the_socket(serve, rng):
    """When the server takes no region for a large result now (here: another client of the identity holds
    every region it may have), the result comes back through the socket, as before results had regions."""
    from aclnn_server.regions import MAX_REGIONS_PER_IDENTITY

    served = serve()
    sent = served.server.metrics.bytes_out.labels("Run")
    with unix_connect(ticket(served.address, "other")) as other:
        for _ in range(MAX_REGIONS_PER_IDENTITY):
            fd = memfd(4096)
            assert register(other, [fd], 4096)[0]
            os.close(fd)
        with Client(served.address) as c:
            p = layer_norm_call(rng, (256, 1024))
            c.run(OP, **p)
            check(p)
            assert sent._value.get() >= 1 << 20
        assert served.server.storage.counts()[1] == MAX_REGIONS_PER_IDENTITY


def test_a_result_computed_in_its_region_holds_no_memory_of_its_own(serve, rng):
    """A region is held for as long as it is registered; a call that computes a result into one holds
    nothing more for that result. Else a share that fits the call would refuse it: 8 MiB tensors with
    shared memory on the numpy backend hold ~24 MiB of regions (two inputs, the result) and a call of
    ~16 MiB (its workspace), ~24 MiB with its result counted again, in a 45 MiB share."""
    served = serve(max_tenant_bytes=45 << 20)
    with Client(served.address, shared_memory=True, timeout=10) as c:
        for _ in range(2):
            p = layer_norm_call(rng, (2048, 1024))
            c.run(OP, **p)
            check(p)


@pytest.mark.parametrize(
    "fault",
    ["a result's slice of the wrong size", "a result's slice past the region", "an input the error table refuses"],
)
def test_a_call_refused_writes_nothing_into_its_results_regions(region_of, rng, fault):
    """All or nothing: a call refused for one result's placement, or by its error table, leaves the
    regions of every result as they were (the valid placements are not computed into first)."""
    p = layer_norm_call(rng, (64, 1024))
    size = 1 << 20
    region, sock, view = region_of(size)
    before = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    view[:] = before
    results = {"gradInputOut": (0, p["gradInputOut"].nbytes), "gradWeightOut": (400_000, 4096)}
    results["gradBiasOut"] = (500_000, 4096)
    if fault == "a result's slice of the wrong size":
        results["gradBiasOut"] = (500_000, 4100)
    elif fault == "a result's slice past the region":
        results["gradBiasOut"] = (size - 100, 4096)
    else:
        p["normalizedShape"] = [512]
    ok, answer = run_in_region(sock, placed_call(p, region, {}, results))
    assert not ok
    error = error_of(answer)
    assert error.code == 161002
    expected = {"an input the error table refuses": "input", "a result's slice past the region": "region"}
    assert error.param == expected.get(fault, "gradBiasOut"), error.message
    assert view[:] == before
    assert answers_keepalive(sock)


@pytest.mark.parametrize("port", ["unix", "tcp"])
def test_a_ticket_is_for_its_own_local_user(serve, port):
    """A ticket issued to one local user (uid:N) does not admit another user's process, on the Unix socket
    (its peer credentials) or on the TCP port (the owner of the loopback connection's client end: the TCP
    port admitted it, red-team finding)."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    served = serve()
    offer = ticket(served.address)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # another local user: it may reach the socket (0666 in a 0711 directory) but not use the ticket
        code = 1
        try:
            "localhost".encode("idna")  # the codec a TCP connect takes, loaded while root can read it
            os.setgid(65534)
            os.setuid(65534)
            if port == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(10)
                sock.connect(offer.unix_path)
            else:
                sock = socket.create_connection(("127.0.0.1", offer.port), timeout=10)
            sock.sendall(MAGIC + offer.ticket)
            ok, payload = reply(sock)
            os.write(write, b"refused" if not ok and "another local user" in error_of(payload).message else b"admitted")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    assert os.waitpid(child, 0)[1] == 0
    assert os.read(read, 100) == b"refused"
    os.close(read)
