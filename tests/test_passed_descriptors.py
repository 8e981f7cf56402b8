"""Descriptors passed over the Unix socket, as a hostile local user passes them (issue 25, findings 1 and 3,
and the suspected hugetlb memfd): refused outside a registration, and never read, checked or closed where
blocking would stall anyone else."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import textwrap
import time

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from test_data_channel import answers_keepalive, ticket
from test_shared_memory import SEALS, check, refused, register, unix_connect
from test_transport import wait_for
from users import NOBODY, needs_root, start_as_user

from aclnn_client import Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc

OP = "aclnnLayerNormBackward"

# A TCP socket whose last close waits `linger` seconds: SO_LINGER set and its send queue full, towards
# a peer that never reads. The attacker keeps the peer, and gives its own copy of the socket away.
# And a connection the server has asked to pass a region's memfd.
LINGERING = """
import struct
import threading

from aclnn_common.framing import MAGIC, REGION, REGISTER_REGION, REQUEST
from test_data_channel import reply


def asked_to_pass(offer):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(offer.unix_path)
    sock.sendall(MAGIC + offer.ticket)
    assert reply(sock)[0]
    sock.sendall(REQUEST.pack(REGISTER_REGION, 0, 0, 0, REGION.size) + REGION.pack(4096))
    assert reply(sock) == (True, b"")
    return sock


def lingering(linger):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stuck = socket.create_connection(listener.getsockname())
    reader, _ = listener.accept()
    stuck.setblocking(False)
    try:
        while True:
            stuck.send(bytes(1 << 16))
    except BlockingIOError:
        pass
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger))
    return stuck, (listener, reader)
"""


def descriptors_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_no_descriptor_reaches_the_server_outside_a_registration(server_process):
    """Findings 1 and 3, without a ticket: handshake bytes with descriptors, one byte with two descriptors
    over and over, before and after the server accepted — the kernel refuses every one (EPERM)."""
    needs_root()
    proc, address = server_process
    offer = ticket(address)
    before = descriptors_of(proc.pid)
    attacker = start_as_user(
        NOBODY,
        f"""
        from aclnn_common.framing import MAGIC
        r, w = os.pipe()
        refusals = 0
        socks = []
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect({offer.unix_path!r})
            socks.append(sock)
            for data in [MAGIC] + [b"x"] * 50:
                try:
                    socket.send_fds(sock, [data], [r, w])
                except PermissionError:
                    refusals += 1
        print(refusals, flush=True)
        time.sleep(30)
        """,
    )
    try:
        assert int(attacker.stdout.readline()) == 20 * 51
        assert descriptors_of(proc.pid) <= before + 20  # the connections themselves, until the deadline
        p = layer_norm_call(np.random.default_rng(0), (64, 1024))
        with Client(address, shared_memory=True) as c:
            c.run(OP, **p)
        check(p)
    finally:
        attacker.kill()
        attacker.wait()


def test_a_lingering_descriptor_in_a_registration_stalls_no_one(server_process):
    """Finding 1 with a ticket: a registration passes a TCP socket whose last close lingers. It is refused
    at once; its close waits on the attacker's own broker thread, while tickets, other users' calls and
    registrations, and a graceful stop go on as usual."""
    needs_root()
    proc, address = server_process
    attacker = start_as_user(
        NOBODY,
        LINGERING
        + textwrap.dedent(f"""
        from test_data_channel import ticket
        sock = asked_to_pass(ticket({address!r}, "mallory"))
        stuck, keep = lingering(60)
        started = time.monotonic()
        socket.send_fds(sock, [b"\\0"], [stuck.fileno()])
        # Its own copy goes at once (on a thread: should the server's copy go first, this close is the
        # last and lingers here, the attacker's own loss): usually the server holds the last reference.
        threading.Thread(target=os.close, args=(stuck.detach(),)).start()
        ok, answer = reply(sock)
        print(ok, round(time.monotonic() - started, 3), flush=True)
        time.sleep(60)
        """),
    )
    try:
        ok, seconds = attacker.stdout.readline().split()
        assert ok == "False" and float(seconds) < 2.0  # refused at once
        started = time.monotonic()
        with grpc.insecure_channel(address) as channel:
            pb_grpc.AclnnStub(channel).OpenDataChannel(pb.Empty(), metadata=(("x-aclnn-session", "s"),), timeout=5)
        p = layer_norm_call(np.random.default_rng(1), (64, 1024))
        with Client(address, shared_memory=True, timeout=10) as c:  # registrations of its own, on the Unix socket
            c.run(OP, **p)
            c.run(OP, **p)
        check(p)
        assert time.monotonic() - started < 5.0
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)  # graceful stop: not held up by the lingering close
    finally:
        attacker.kill()
        attacker.wait()


def test_a_lingering_descriptor_queued_behind_a_registration_stalls_no_one(server_process):
    """A registration's memfd followed at once by a second message carrying a lingering TCP socket, sent
    while passing is allowed (races the attacker retries until it wins): the connection is closed for
    its extra bytes, and the socket's queue, with the descriptor in it, goes on the attacker's broker
    thread. Closed by a worker under the data channel's lock, it stalled every tenant for the linger."""
    needs_root()
    _proc, address = server_process
    attacker = start_as_user(
        NOBODY,
        LINGERING
        + textwrap.dedent(f"""
        import fcntl
        from test_data_channel import ticket
        offer = ticket({address!r}, "mallory")
        for attempt in range(100):
            memfd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
            os.ftruncate(memfd, 4096)
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, {SEALS})
            stuck, keep = lingering(10)
            sock = asked_to_pass(offer)  # passing is on from here until the server has received one message
            socket.send_fds(sock, [b"\\0"], [memfd])
            try:
                socket.send_fds(sock, [b"\\0"], [stuck.fileno()])
            except PermissionError:  # the server had turned passing off already: try again
                stuck.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no wait here
                for s in (sock, stuck, *keep):
                    s.close()
                os.close(memfd)
                continue
            started = time.monotonic()
            os.close(stuck.detach())
            if time.monotonic() - started > 1:  # the server had closed its copy first: this close lingered
                continue
            print(attempt, flush=True)  # the server holds the socket's last reference
            break
        time.sleep(60)
        """),
    )
    try:
        attempts = attacker.stdout.readline()
        assert attempts, "the second descriptor never got in while passing was allowed"
        time.sleep(0.5)  # the server has closed the connection by now
        started = time.monotonic()
        p = layer_norm_call(np.random.default_rng(2), (64, 1024))
        with Client(address, timeout=20) as c:  # another user's calls, on the data channel
            c.run(OP, **p)
        check(p)
        assert time.monotonic() - started < 5.0
    finally:
        attacker.kill()
        attacker.wait()


def test_a_hugetlb_memfd_is_refused(serve):
    """Suspected: a hugetlb memfd, checked and mapped, then a hole punched in it, would SIGBUS the server."""
    try:
        fd = os.memfd_create("hugetlb-region", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        pytest.skip(f"no hugetlb memfd here: {exc}")
    served = serve()
    with unix_connect(ticket(served.address, "s")) as sock:
        refused(register(sock, [fd], 2 << 20), "hugetlb")
    os.close(fd)


def test_without_passrights_uninvited_descriptors_are_closed_off_the_loop(serve, monkeypatch):
    """On a kernel without SO_PASSRIGHTS every Unix-socket read has room for all a message carries: what
    arrives outside a registration is closed (with its connection) on the broker's thread, none kept."""
    monkeypatch.setattr("aclnn_server.transport.data_channel.loop.refuse_passing", lambda listener: False)
    served = serve()
    offer = ticket(served.address, "s")
    pid = os.getpid()
    with unix_connect(offer) as warm:
        fd = _memfd()
        assert register(warm, [fd], 4096)[0]  # a registration works as before
        os.close(fd)
        before = descriptors_of(pid)
        for _ in range(10):
            with unix_connect(offer) as sock:
                r, w = os.pipe()
                socket.send_fds(sock, [b"\x01"], [r, w] * 100)
                os.close(r)
                os.close(w)
                assert sock.recv(1) == b""  # closed by the server
        wait_for(lambda: descriptors_of(pid) <= before)
        assert answers_keepalive(warm)


def _memfd(size: int = 4096) -> int:
    fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd
