"""A connection's mailbox on the Unix socket: large calls' bytes in a sealed memfd, as a caller and
as a hostile tenant would use it (raw sockets, a real server process)."""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import select
import socket
import threading

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from test_data_channel import KEEPALIVE, error_of, reply, request, ticket
from test_processes import broadcast_call, free_port, metric
from test_shared_memory import (
    OP,
    OUTPUTS,
    check,
    memfd,
    refused,
    region_call,
    register,
    start_server,
    unix_connect,
)
from test_transport import wait_for

from aclnn_client import AclnnError, Client
from aclnn_client.grpc_client import MAX_MAILBOX_ATTACHED_BYTES
from aclnn_client.regions import F_SEAL_FUTURE_WRITE
from aclnn_client.staging import Staging
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.framing import CALL, HELD_MAILBOX_BYTES, IN_MAILBOX, MAILBOX, MAILBOX_MAX_BYTES, REGION, REQUEST
from aclnn_common.wire import decode_output

MIB = 1 << 20
MAPPED = 64 << 10  # the head of a mailbox the server maps (read-only) when the ledger cannot hold all of it


def mailbox_maps(pid: int, name: str = "aclnn-mailbox") -> list[int]:
    """The sizes of the process's mappings of mailbox memfds (the client's are named aclnn-mailbox)."""
    sizes = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if f"/memfd:{name}" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                sizes.append(end - start)
    return sizes


def mailbox_fds(pid: int, descriptors: bool = False) -> list[int]:
    """The sizes of the mailbox memfds the process holds open (each once, however many descriptors),
    or (`descriptors`) one descriptor of each."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:aclnn-mailbox"):
                info = os.stat(f"/proc/{pid}/fd/{fd}")
                found[info.st_ino] = int(fd) if descriptors else info.st_size
        except FileNotFoundError:
            pass  # closed meanwhile
    return sorted(found.values())


def pass_mailbox(sock: socket.socket, fd: int, size: int) -> tuple[bool, bytes]:
    return register(sock, [fd], size, MAILBOX)


def run_payload(p: dict) -> bytes:
    """The data channel's CALL payload of `Run` with every input inline."""
    return b"\x03Run" + region_call(p, "", {}).SerializeToString()


def check_reply(sock: socket.socket, p: dict) -> None:
    """Reads the reply of `p`'s Run call and checks its outputs against the oracle."""
    ok, answer = reply(sock)
    assert ok, error_of(answer).message
    outputs = pb.RunResponse.FromString(answer).outputs
    for name in OUTPUTS:
        p[name][...] = decode_output(outputs[name])
    check(p)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_large_calls_travel_in_a_mailbox_that_grows_and_goes_with_its_connection(server_process, rng):
    proc, address = server_process
    with Client(address, max_inline_bytes=32 * MIB) as c:
        p = layer_norm_call(rng, (2, 1024))  # 21 KB: one socket buffer, no mailbox
        c.run(OP, **p)
        check(p)
        assert mailbox_fds(proc.pid) == []
        # 37 KB (two socket buffers), 0.5 MB, 1.6 MB: one mailbox, each time a larger one in its place
        for rows, size in ((4, 256 << 10), (64, 1 * MIB), (200, 2 * MIB)):
            p = layer_norm_call(rng, (rows, 1024))
            c.run(OP, **p)
            check(p)
            assert mailbox_fds(proc.pid) == [size] and mailbox_maps(os.getpid()) == [size]
        assert mailbox_maps(proc.pid) == [2 * MIB]  # the server maps the whole mailbox (read-only), the last only
        p = layer_norm_call(rng, (2100, 1024))  # 17 MB: a mailbox above HELD_MAILBOX_BYTES, sealed against holes
        c.run(OP, **p)
        check(p)
        assert mailbox_fds(proc.pid) == [32 * MIB] and mailbox_maps(proc.pid) == [32 * MIB]
        (mailbox,) = mailbox_fds(os.getpid(), descriptors=True)
        assert fcntl.fcntl(mailbox, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE  # nobody can punch a hole in it
        # 2 x 20.5 MB: every page of a mailbox this large is the client's for the connection's life, so
        # it grows by 16 MiB steps (48 MiB), not to the next power of two (64 MiB)
        p = layer_norm_call(rng, (5000, 1024))
        c.run(OP, **p)
        check(p)
        assert mailbox_fds(proc.pid) == [48 * MIB] and mailbox_maps(os.getpid()) == [48 * MIB]
        # 2 x 34.4 MB: above max_inline_bytes, uploaded; the mailbox stays as it was
        p = layer_norm_call(rng, (8400, 1024))
        c.run(OP, **p)
        check(p)
        assert mailbox_fds(proc.pid) == [48 * MIB]
        # A mailbox per pooled connection: four calls set off together (a call finished before the next
        # thread took a connection would hand its connection on, and a fast machine did that to all 8).
        calls = [layer_norm_call(rng, (16, 1024)) for _ in range(8)]
        together = threading.Barrier(4)

        def run_together(q: dict) -> None:
            together.wait()
            c.run(OP, **q)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(run_together, calls))
        for q in calls:
            check(q)
        assert 1 < len(mailbox_fds(proc.pid)) <= 4
    assert mailbox_maps(os.getpid()) == []
    # closed with their connections: the server closes a mailbox's descriptors a moment before it
    # unmaps it (CPython's mmap closes its duplicate, then unmaps), so both are waited for
    wait_for(lambda: mailbox_fds(proc.pid) == [] and mailbox_maps(proc.pid) == [])


def test_tensors_beyond_what_a_mailbox_takes_are_uploaded_largest_first(server_process):
    """A call may attach at most MAX_MAILBOX_ATTACHED_BYTES over the Unix socket: beyond, its largest
    inline tensors are uploaded instead (asked of a real client of a real server, by sizes alone: a
    call that large would need ~300 MB of arrays)."""
    _proc, address = server_process
    with Client(address, max_inline_bytes=200 * MIB) as c:
        staging = Staging(c._transfers)
        most = c._transfers.max_attached_bytes(0)
        assert most == MAX_MAILBOX_ATTACHED_BYTES
        assert staging._uploads(0, {"a": 160 * MIB, "b": 100 * MIB, "c": 4 * MIB}) == ["a"]
        assert staging._uploads(0, {"a": 120 * MIB, "b": 120 * MIB, "c": 4 * MIB}) == []
        assert staging._uploads(0, {"a": 201 * MIB, "b": 100 * MIB}) == ["a"]  # above max_inline_bytes
    with Client(address, unix_socket=False) as c:  # over TCP: 16 MiB each, what the message limit holds in all
        assert c._transfers.max_attached_bytes(0) == 63 * MIB
        assert Staging(c._transfers)._uploads(0, {"a": 17 * MIB, "b": 16 * MIB}) == ["a"]
        assert Staging(c._transfers)._uploads(0, {"a": 16 * MIB, "b": 16 * MIB, "c": 16 * MIB, "d": 16 * MIB}) == ["d"]


@pytest.mark.parametrize("older", [False, True], ids=["this-server", "a-server-from-before"])
def test_a_call_attaches_no_more_than_its_server_takes_in_a_mailbox(serve, rng, monkeypatch, older):
    """This server takes mailboxes of up to MAILBOX_MAX_BYTES and says so in its ticket: two 34.4 MB
    tensors go inline in one. A server from before that field says nothing and takes at most 64 MiB:
    there the client attaches at most 63 MiB and uploads the larger tensor (sent through the socket
    instead, the call would be over that server's message limit)."""
    # Imported here: other users' processes import this module, and the server's imports need what
    # they cannot read once they are another user (tests/users.py).
    from aclnn_server.transport.data_channel import loop as loop_module
    from aclnn_server.transport.data_channel import requests as requests_module

    if older:
        monkeypatch.setattr(requests_module, "MAILBOX_MAX_BYTES", 64 * MIB)  # what it refuses beyond
        monkeypatch.setattr(loop_module, "MAILBOX_MAX_BYTES", 0)  # what its ticket says: nothing
    served = serve()
    with Client(served.address) as c:
        assert c._transfers.max_attached_bytes(0) == (63 * MIB if older else MAX_MAILBOX_ATTACHED_BYTES)
        p = layer_norm_call(rng, (8400, 1024))
        c.run(OP, **p)
        check(p)
    uploads = served.server.metrics.requests.labels("UploadTensor", "", "ACLNN_SUCCESS")._value.get()
    assert uploads == (1 if older else 0)


def test_a_mailbox_refused_as_busy_is_asked_for_again(serve, rng):
    """An identity's registrations are served one at a time, four more queued, the rest refused as busy
    (clients of one identity starting together). A client refused its mailbox that way asks again
    shortly, then sends that payload through the socket, and asks again with its next payload: it
    does not send every later payload through the socket (as it does where a server takes none)."""
    served = serve(data_handshake_timeout_s=1.0)
    offer = ticket(served.address, "s")
    stalled = [unix_connect(offer) for _ in range(6)]
    ask = REQUEST.pack(MAILBOX, 0, 0, 0, REGION.size) + REGION.pack(MIB)
    stalled[0].sendall(ask)
    assert reply(stalled[0]) == (True, b"")  # "send it": the broker waits for a memfd that never comes
    for sock in stalled[1:]:
        sock.sendall(ask)  # four queued behind it, one refused at once
    (busy,), _, _ = select.select(stalled[1:], [], [], 5)
    ok, answer = reply(busy)
    assert not ok and error_of(answer).grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client(served.address) as c:
        p = layer_norm_call(rng, (256, 1024))  # 2 MiB of payload: a mailbox asked for, refused as busy
        c.run(OP, **p)
        check(p)
        assert mailbox_maps(os.getpid()) == []  # neither the client's nor the server's mapping
        for sock in stalled:
            sock.close()
        p = layer_norm_call(rng, (256, 1024))
        c.run(OP, **p)
        check(p)
        assert mailbox_maps(os.getpid()) == [4 * MIB, 4 * MIB]  # the client's and the server's


def test_a_mapped_mailbox_is_held_in_the_ledger_while_mapped(serve, rng):
    """The whole mailbox is mapped and held as its identity's (a hole read through the mapping would
    fill a page charged to the server) for as long as the mapping lives; a call's request is not held
    beyond it; a mailbox the identity's share cannot hold is mapped at its head only (the rest: pread)."""
    served = serve(memory_budget_bytes=16 * MIB)  # a tenant's share: 8 MiB, of which stored bytes 6 MiB
    ledger = served.engine.ledger
    with Client(served.address) as c:
        for rows in (4, 200, 200):
            p = layer_norm_call(rng, (rows, 1024))
            c.run(OP, **p)
            check(p)
        # The client's whole mailbox, and the one the server (this process too) maps, both 2 MiB.
        assert sorted(mailbox_maps(os.getpid())) == [2 * MIB, 2 * MIB]
        wait_for(lambda: ledger.held_by_kind() == {"mailbox": 2 * MIB})  # the request's part: given back
    wait_for(lambda: ledger.held == 0 and mailbox_maps(os.getpid()) == [])
    p = layer_norm_call(rng, (64, 1024))
    payload = run_payload(p)
    with unix_connect(ticket(served.address, "s")) as sock:
        fd = memfd(HELD_MAILBOX_BYTES)
        assert pass_mailbox(sock, fd, HELD_MAILBOX_BYTES) == (True, b"")
        assert mailbox_maps(os.getpid(), "test-region") == [MAPPED] and ledger.held == 0
        os.pwrite(fd, payload, 0)
        sock.sendall(request(CALL | IN_MAILBOX, len(payload)))
        check_reply(sock, p)
        os.close(fd)


def test_hostile_mailboxes_are_refused_and_the_server_survives(server_process, rng, tmp_path):
    proc, address = server_process
    offer = ticket(address, "mallory")
    p = layer_norm_call(rng, (64, 1024))
    payload = run_payload(p)
    with unix_connect(offer) as sock:  # a mailbox call before there is a mailbox
        sock.sendall(request(CALL | IN_MAILBOX, len(payload)))
        assert closed_by_server(sock)
    with unix_connect(offer) as sock:
        unsealed = memfd(MIB, seals=0)
        refused(pass_mailbox(sock, unsealed, MIB), "sealed against shrinking and growing")
        os.close(unsealed)
        with open(tmp_path / "plain", "wb+") as f:
            f.truncate(MIB)
            refused(pass_mailbox(sock, f.fileno(), MIB), "not a memfd")
        small = memfd(4096)
        refused(pass_mailbox(sock, small, MIB), "declared")
        os.close(small)
        huge = memfd(2 * MAILBOX_MAX_BYTES)
        ok, answer = pass_mailbox(sock, huge, 2 * MAILBOX_MAX_BYTES)
        os.close(huge)
        assert not ok and "mailbox holds" in error_of(answer).message
        fd = memfd(MIB)
        assert pass_mailbox(sock, fd, MIB) == (True, b"")
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # the SIGBUS a truncated mailbox would cause is sealed away
        mailbox = np.memmap(f"/proc/self/fd/{fd}", np.uint8, "r+", shape=(MIB,))
        mailbox[: len(payload)] = np.frombuffer(payload, np.uint8)
        sock.sendall(request(CALL | IN_MAILBOX, len(payload)))
        check_reply(sock, p)
        sock.sendall(request(CALL | IN_MAILBOX, MIB + 1))  # a claim beyond the mailbox
        assert closed_by_server(sock)
        del mailbox
        os.close(fd)
    with unix_connect(offer) as sock:  # a mailbox never written: all holes, read through the mapping
        sparse = memfd(HELD_MAILBOX_BYTES)
        assert pass_mailbox(sock, sparse, HELD_MAILBOX_BYTES) == (True, b"")
        sock.sendall(request(CALL | IN_MAILBOX, HELD_MAILBOX_BYTES))
        ok, answer = reply(sock)
        assert not ok and "not on the data channel" in error_of(answer).message  # zeros name no method
        # What a hole read can fill: the mapping, which the ledger holds (see the test above).
        assert mailbox_maps(proc.pid, "test-region") == [HELD_MAILBOX_BYTES]
        os.close(sparse)
    wait_for(lambda: mailbox_maps(proc.pid, "test-region") == [])  # gone with its connection
    fresh = layer_norm_call(rng, (64, 1024))
    with Client(address) as c:
        c.run(OP, **fresh)
    check(fresh)
    assert proc.poll() is None


@pytest.mark.parametrize("rows", [4, 64])  # 37 KB: through the mapped head; 0.5 MB: pread
def test_the_server_reads_a_copy_of_the_request_not_the_mailbox(serve, rng, rows):
    """A client that rewrites its mailbox while its call waits cannot change what the server computes."""
    served = serve(max_concurrency=1)
    p = layer_norm_call(rng, (rows, 1024))
    payload = run_payload(p)
    fd = memfd(MIB)
    mailbox = np.memmap(f"/proc/self/fd/{fd}", np.uint8, "r+", shape=(MIB,))
    with Client(served.address) as other, unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, MIB) == (True, b"")
        other.list_operators()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(other.run, OP, **broadcast_call(0, rows=65536))
            wait_for(lambda: served.engine.admission.running == 1)
            mailbox[: len(payload)] = np.frombuffer(payload, np.uint8)
            sock.sendall(request(CALL | IN_MAILBOX, len(payload)))
            wait_for(lambda: served.engine.admission.waiting == 1)  # received, queued behind the long call
            mailbox[: len(payload)] = 0xFF  # what the server would read if it read the mailbox now
            running.result(timeout=60)
        check_reply(sock, p)
    del mailbox
    os.close(fd)


def test_a_call_given_up_on_leaves_its_mailbox_to_no_one(rng):
    """The server reads a mailbox once, when the request arrives, and never writes it: a call given
    up on (at the client's deadline or the server's) changes no later call, and leaks no mailbox."""
    metrics_port = free_port()
    proc, address = start_server("--port", "0", "--max-concurrency", "1", "--metrics-port", str(metrics_port))
    try:
        with Client(address, unix_socket=False) as other, Client(address, timeout=0.4) as c:
            p = layer_norm_call(rng, (64, 1024))
            c.run(OP, **p)
            check(p)
            assert mailbox_maps(os.getpid()) == [MIB]
            other.list_operators()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(other.run, OP, **broadcast_call(0, rows=262144))
                wait_for(lambda: metric(metrics_port, "aclnn_running_calls") == 1)  # it holds the only slot
                late = layer_norm_call(rng, (64, 1024))
                with pytest.raises(AclnnError) as raised:
                    c.run(OP, **late)  # queued behind the long call until the deadline
                assert raised.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
                # The client's deadline closed the connection and its mailbox, or the server's answered in step.
                assert mailbox_maps(os.getpid()) in ([], [MIB])
                running.result(timeout=60)
            for _ in range(3):
                fresh = layer_norm_call(rng, (64, 1024))
                c.run(OP, **fresh)
                check(fresh)
            assert mailbox_maps(os.getpid()) == [MIB] and mailbox_fds(proc.pid) == [MIB]
        wait_for(lambda: mailbox_fds(proc.pid) == [])
    finally:
        proc.kill()
        proc.wait()


def test_mailbox_requests_are_framed_like_any_other(serve):
    """Bytes after a mailbox call's header break the framing: the connection is closed, nothing served."""
    served = serve()
    with unix_connect(ticket(served.address, "s")) as sock:
        fd = memfd(MIB)
        assert pass_mailbox(sock, fd, MIB) == (True, b"")
        os.close(fd)
        sock.sendall(request(CALL | IN_MAILBOX, len(KEEPALIVE)) + KEEPALIVE)
        assert closed_by_server(sock)
    with Client(served.address) as c:
        c.list_operators()


def test_a_mailbox_this_host_cannot_make_leaves_the_payload_to_the_socket(serve, rng, monkeypatch):
    """A mailbox above HELD_MAILBOX_BYTES is sealed with F_SEAL_FUTURE_WRITE, which kernels before Linux
    5.1 refuse (EINVAL): the call's bytes then go through the socket, and the call is served."""
    import aclnn_client.regions

    monkeypatch.setattr(aclnn_client.regions, "F_SEAL_FUTURE_WRITE", 1 << 20)  # a seal no kernel knows
    served = serve()
    with Client(served.address) as c:
        p = layer_norm_call(rng, (4096, 1024))  # two 16 MiB tensors inline: a 48 MiB mailbox asked for
        c.run(OP, **p)
        check(p)
        assert mailbox_maps(os.getpid()) == []
        p = layer_norm_call(rng, (256, 1024))  # a 4 MiB mailbox, held, is made as before
        c.run(OP, **p)
        check(p)
        assert mailbox_maps(os.getpid()) == [4 * MIB, 4 * MIB]


def test_a_call_larger_than_the_socket_carries_without_a_mailbox_is_staged_again_with_uploads(serve, rng, monkeypatch):
    """Two 40 MiB tensors (80 MiB attached) and no mailbox to be had (here: a seal the kernel refuses;
    as well: no memory for one now): through the socket the call would be over the server's message
    limit, so it is staged again with its larger tensor uploaded, and later calls on that channel
    attach no more than the socket carries."""
    import aclnn_client.regions

    monkeypatch.setattr(aclnn_client.regions, "F_SEAL_FUTURE_WRITE", 1 << 20)  # a seal no kernel knows
    served = serve()
    with Client(served.address) as c:
        assert c._transfers.max_attached_bytes(0) == MAX_MAILBOX_ATTACHED_BYTES
        p = layer_norm_call(rng, (10240, 1024))
        c.run(OP, **p)
        check(p)
        assert c._transfers.max_attached_bytes(0) == 63 * MIB
        p = layer_norm_call(rng, (10240, 1024))  # the same layout again: staged anew, one tensor uploaded
        c.run(OP, **p)
        check(p)
    uploads = served.server.metrics.requests.labels("UploadTensor", "", "ACLNN_SUCCESS")._value.get()
    assert uploads == 2
    refused = served.server.metrics.requests.labels("Run", OP, "RESOURCE_EXHAUSTED")._value.get()
    assert refused == 0  # nothing of the first try was sent
