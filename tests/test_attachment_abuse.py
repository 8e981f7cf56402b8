"""The data channel's attached bytes and mapped mailboxes, as a hostile tenant would use them: raw
sockets against a real server, lying about ranges, resealing its memfd, rewriting what the server
computes on, stalling, flooding; what each does to the server and to everyone else."""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import mmap
import os
import pathlib
import shutil
import socket
import ssl
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest
from certs import make_certificates
from layer_norm_cases import layer_norm_call
from test_attachments import attached_call, attached_inputs, attached_reply, exchange
from test_data_channel import OP, OUTPUTS, answers_keepalive, check, connect, error_of, reply, request, ticket
from test_mailbox import closed_by_server, mailbox_maps, pass_mailbox
from test_processes import broadcast_call
from test_shared_memory import SEALS, memfd, refused, region_call, register, unix_connect
from test_transport import wait_for
from users import NOBODY, needs_root, start_as_user

from aclnn_client import Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import bind
from aclnn_common.chunks import byte_view
from aclnn_common.framing import ATTACHED, CALL, HELD_MAILBOX_BYTES, IN_MAILBOX, MAGIC, MESSAGE_LENGTH, REPLY, aligned
from aclnn_server.transport.data_channel import mailbox as data_channel_mailbox

MIB = 1 << 20
UNSEALABLE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # sealed as a region must be, but open to more seals
F_SEAL_FUTURE_WRITE = 0x0010


HOLELESS = 32 * MIB  # a mailbox above HELD_MAILBOX_BYTES: sealed against holes, mapped whole, never held


def others_are_served(address: str, rng: np.random.Generator, rows: tuple[int, ...]) -> None:
    """Another tenant's calls meanwhile, one for each count of rows: answered, and exact."""
    with Client(address) as c:
        for count in rows:
            p = layer_norm_call(rng, (count, 1024))
            c.run(OP, **p)
            check(p)


def writable_mailbox(size: int) -> tuple[int, np.memmap]:
    """A mailbox memfd and a writable mapping of it; above HELD_MAILBOX_BYTES sealed against holes as
    the client seals it (F_SEAL_FUTURE_WRITE once mapped: writes go through this mapping only)."""
    fd = memfd(size, seals=0)
    mapping = np.memmap(f"/proc/self/fd/{fd}", np.uint8, "r+", shape=(size,))
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | (F_SEAL_FUTURE_WRITE if size > HELD_MAILBOX_BYTES else 0))
    return fd, mapping


def results_of(answer: bytes, p: dict) -> None:
    """Fills `p`'s outputs from an attached reply."""
    message, results = attached_reply(answer)
    outputs = pb.RunResponse.FromString(message).outputs
    for name in OUTPUTS:
        where = outputs[name].attached
        data = results[where.offset : where.offset + where.size]
        p[name][...] = np.frombuffer(data, np.float32).reshape(p[name].shape)


def run_in_mailbox(sock: socket.socket, mailbox: np.memmap, payload: bytes, p: dict) -> None:
    """Sends `p`'s all-attached Run `payload` in the connection's mailbox; its outputs, checked, from the reply."""
    mailbox[: len(payload)] = np.frombuffer(payload, np.uint8)
    sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
    ok, answer = reply(sock)
    assert ok, error_of(answer).message
    results_of(answer, p)
    check(p)


def all_attached(p: dict) -> tuple[pb.OpCall, bytes]:
    call, raw = attached_inputs(p)
    for name in OUTPUTS:
        call.placements[name].attached = True
    return call, raw


# Memfds the client can seal later ----------------------------------------------------------------


def test_a_memfd_open_to_new_seals_is_refused_as_mailbox_or_region(serve):
    """A client that adds F_SEAL_FUTURE_WRITE after registering stops the server from punching out the
    pages it faulted in (reading holes of a mailbox, writing results into a sparse region): they
    would stay charged to the server, in a memfd the client keeps, after their hold ended. So a
    mailbox must come sealed against further seals (F_SEAL_SEAL), as the client seals it; a region
    may come without, for the server to seal itself, but then with every page allocated (the
    client's), so that there is nothing the server could fault in."""
    served = serve()
    with unix_connect(ticket(served.address, "s")) as sock:
        for kind in ("mailbox", "region"):
            fd = memfd(MIB, seals=UNSEALABLE)
            answer = pass_mailbox(sock, fd, MIB) if kind == "mailbox" else register(sock, [fd], MIB)
            refused(answer, "F_SEAL_SEAL" if kind == "mailbox" else "holes")
            os.close(fd)
        assert answers_keepalive(sock)
    wait_for(lambda: served.engine.ledger.held == 0)


def test_pages_the_server_faults_into_a_mailbox_are_given_back(serve):
    """A mailbox never written (all holes) read through the server's mapping: the pages that read
    filled (charged to the server) are punched out of the client's memfd once the mapping goes, and
    the client cannot seal its memfd to keep them."""
    served = serve()
    size = 8 * MIB
    fd = memfd(size)
    with unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, size) == (True, b"")
        sock.sendall(request(CALL | IN_MAILBOX, size))  # the server copies all of it: every page faulted
        ok, answer = reply(sock)
        assert not ok and "not on the data channel" in error_of(answer).message
        assert os.fstat(fd).st_blocks * 512 >= size  # filled by the server's reads, not by the client
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    wait_for(lambda: served.engine.ledger.held == 0)
    assert os.fstat(fd).st_blocks == 0
    os.close(fd)


# Mailboxes sealed against holes (above HELD_MAILBOX_BYTES) --------------------------------------


def test_a_mailbox_above_the_held_size_must_be_sealed_against_holes(serve):
    """Up to HELD_MAILBOX_BYTES a mailbox is held in the ledger and punched when it goes; a larger one
    must be sealed against writes (F_SEAL_FUTURE_WRITE: nobody can punch a hole in it), and is then
    mapped whole without being held."""
    served = serve()
    ledger = served.engine.ledger
    with unix_connect(ticket(served.address, "s")) as sock:
        punchable = memfd(HELD_MAILBOX_BYTES + 4096)
        refused(pass_mailbox(sock, punchable, HELD_MAILBOX_BYTES + 4096), "sealed against writes")
        fd, mapping = writable_mailbox(HOLELESS)
        assert pass_mailbox(sock, fd, HOLELESS) == (True, b"")
        assert mailbox_maps(os.getpid(), "test-region") == [HOLELESS] * 2 and ledger.held == 0  # ours and its
        assert answers_keepalive(sock)
        for handle in (punchable, fd):
            os.close(handle)
    del mapping
    wait_for(lambda: mailbox_maps(os.getpid(), "test-region") == [])


def test_a_request_over_holes_in_a_sealed_mailbox_is_refused_and_fills_nothing(serve, rng):
    """A client that lies about what it wrote (a request over bytes it never wrote, or wrote only in
    part) is refused in step before the server reads a byte of it: the server fills no page of the
    client's memfd, holds nothing for it, and the connection serves the call once it is written. No
    one can punch a hole after the check (EPERM), so a range found whole is never looked at again."""
    served = serve()
    ledger = served.engine.ledger
    p = layer_norm_call(rng, (2048, 1024))  # 8 MiB tensors: a 16 MiB payload
    call, raw = all_attached(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    fd, mailbox = writable_mailbox(HOLELESS)
    with unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, HOLELESS) == (True, b"")
        for written in (0, len(payload) // 2):  # nothing, then half of it
            mailbox[:written] = np.frombuffer(payload[:written], np.uint8)
            sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
            ok, answer = reply(sock)
            assert not ok and "holes" in error_of(answer).message, answer
            assert os.fstat(fd).st_blocks * 512 == -(-written // 4096) * 4096  # the client's pages, no more
            assert ledger.held == 0
        run_in_mailbox(sock, mailbox, payload, p)
        assert os.fstat(fd).st_blocks * 512 == -(-len(payload) // 4096) * 4096
        assert _libc.fallocate(fd, _PUNCH_HOLE, 0, len(payload)) == -1 and ctypes.get_errno() == errno.EPERM
        assert answers_keepalive(sock)
    del mailbox
    os.close(fd)
    wait_for(lambda: ledger.held == 0 and mailbox_maps(os.getpid(), "test-region") == [])


def test_another_users_flood_of_large_inline_calls_is_held_within_its_share(serve, rng):
    """Another local user opens connections with sealed 32 MiB mailboxes and sends 8 MiB-tensor calls in
    all of them at once, again and again, and tries to punch its mailboxes: what its calls read in place
    is held in its share while they run (never more than the share), the server fills no page of its
    memfds, nothing is held for its idle mailboxes, another tenant's calls go on, correct; everything
    is given back when it leaves."""
    needs_root()
    served = serve(memory_budget_bytes=96 * MIB)  # a tenant's share: 48 MiB, two such calls at once
    ledger = served.engine.ledger
    signals = tempfile.mkdtemp()  # where the attacker can see it (pytest's tmp_path is root's only)
    os.chmod(signals, 0o755)
    go, calls = pathlib.Path(signals, "go"), pathlib.Path(signals, "call")
    call, raw = all_attached(layer_norm_call(rng, (2048, 1024)))
    calls.write_bytes(attached_call("Run", call.SerializeToString(), raw))
    calls.chmod(0o644)
    attacker = start_as_user(
        NOBODY,
        f"""
        import ctypes, errno, fcntl, threading
        import numpy as np
        from aclnn_common.framing import ATTACHED, CALL, IN_MAILBOX
        from test_data_channel import reply, request, ticket
        from test_mailbox import pass_mailbox
        from test_shared_memory import SEALS, memfd, unix_connect
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        payload = np.fromfile({str(calls)!r}, np.uint8)
        offer = ticket({served.address!r}, "flood")
        conns = []
        for _ in range(6):
            sock = unix_connect(offer)
            fd = memfd({HOLELESS}, seals=0)
            mailbox = np.memmap(f"/proc/self/fd/{{fd}}", np.uint8, "r+", shape=({HOLELESS},))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | {F_SEAL_FUTURE_WRITE})
            mailbox[: payload.size] = payload
            assert pass_mailbox(sock, fd, {HOLELESS}) == (True, b"")
            assert libc.fallocate(fd, 3, 0, {HOLELESS}) == -1 and ctypes.get_errno() == errno.EPERM
            conns.append((sock, fd, mailbox))
        outcomes = []

        def flood(sock):
            for _ in range(3):
                sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, payload.size))
                outcomes.append(reply(sock)[0])

        threads = [threading.Thread(target=flood, args=(sock,)) for sock, _, _ in conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(sum(outcomes), sum(os.fstat(fd).st_blocks * 512 for _, fd, _ in conns), flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        for sock, _, _ in conns:
            sock.close()
        """,
    )
    most, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            most[0] = max(most[0], ledger.held_by("uid:65534"))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        answered, filled = (int(word) for word in attacker.stdout.readline().split())
        stop.set()
        assert answered == 18  # every call waited its turn within the share, and ran
        assert filled == 6 * -(-calls.stat().st_size // 4096) * 4096  # its payloads' pages, none filled by the server
        assert 16 * MIB <= most[0] <= 48 * MIB and "mailbox" not in ledger.held_by_kind()
        others_are_served(served.address, rng, (4, 64, 2048))
        go.touch()
        assert attacker.wait(timeout=30) == 0
    finally:
        stop.set()
        attacker.kill()
        attacker.wait()
        shutil.rmtree(signals)
    wait_for(lambda: ledger.held == 0 and mailbox_maps(os.getpid(), "test-region") == [])


# Lying about the message and the attached part --------------------------------------------------


def test_a_mailbox_call_too_short_for_its_own_header_is_answered_in_step(serve):
    """CALL | ATTACHED | IN_MAILBOX payloads shorter than a method name and a message length, or
    whose name length points past them: each an error reply, the connection usable after."""
    served = serve()
    fd = memfd(MIB)
    with unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, MIB) == (True, b"")
        for payload in (b"", b"\x03", b"\x03Run", b"\xffRun" + bytes(8), b"\x03Run" + MESSAGE_LENGTH.pack(1 << 63)):
            os.pwrite(fd, payload + bytes(300), 0)
            sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
            ok, _ = reply(sock)
            assert not ok, payload
        assert answers_keepalive(sock)
    os.close(fd)


@pytest.mark.parametrize("in_mailbox", [None, MIB, HOLELESS], ids=["socket", "mailbox", "holeless-mailbox"])
def test_lying_attached_ranges_are_refused_naming_the_reference(serve, rng, in_mailbox):
    """Ranges past the attached part at sizes near 2^64, ranges that wrap around, a size that does not
    match the tensor's: 161002 naming `ref` or the tensor, nothing written; ranges that overlap
    (one input read twice) are the caller's business and computed as asked."""
    served = serve()
    p = layer_norm_call(rng, (4, 64))
    call, raw = all_attached(p)

    def ask(message: pb.OpCall) -> tuple[bool, bytes]:
        if not in_mailbox:
            return exchange(sock, "Run", message.SerializeToString(), raw)
        payload = attached_call("Run", message.SerializeToString(), raw)
        mailbox[: len(payload)] = np.frombuffer(payload, np.uint8)
        sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
        return reply(sock)

    fd, mailbox = writable_mailbox(in_mailbox or MIB)
    with unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, in_mailbox or MIB) == (True, b"")
        top = (1 << 64) - 1
        where = call.params["input"].tensor.ref.attached
        good = (where.offset, where.size)
        for offset, size, param in (
            (top, 1, "ref"),
            (0, top, "ref"),
            (top - 63, 128, "ref"),  # offset + size wraps around 2^64
            (len(raw) - 64, 128, "ref"),  # runs past the end by a little
            (good[0], good[1] - 4, "input"),  # inside the part, one element short
        ):
            where.offset, where.size = offset, size
            ok, answer = ask(call)
            error = error_of(answer)
            assert not ok and (error.code, error.param) == (161002, param), (offset, size, error.message)
        # One range read as two inputs (gradOut and input the same bytes): computed as asked.
        where.offset, where.size = good
        twin = pb.OpCall()
        twin.CopyFrom(call)
        twin.params["gradOut"].tensor.ref.attached.CopyFrom(where)
        ok, answer = ask(twin)
        assert ok, error_of(answer).message
        p["gradOut"][...] = p["input"]
        results_of(answer, p)
        check(p)
    os.close(fd)
    wait_for(lambda: served.engine.ledger.held == 0)


# Large requests over TCP: the low-water mark --------------------------------------------------


class PiecewiseTls:
    """A TLS client of the data channel whose ciphertext the test sends in pieces of its choosing
    (as a network delivers it: a piece may end inside a TLS record)."""

    def __init__(self, address: str, ca: bytes, cafile: str) -> None:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(address, credentials) as channel:
            offer = pb_grpc.AclnnStub(channel).OpenDataChannel(pb.Empty(), metadata=(("x-aclnn-session", "s"),))
        self.sock = socket.create_connection(("127.0.0.1", offer.port), timeout=30)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        context = ssl.create_default_context(cafile=cafile)
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                self.incoming.write(self.sock.recv(65536))
        self.sock.sendall(self.ciphertext(MAGIC + offer.ticket))
        assert REPLY.unpack(self.read(REPLY.size)) == (1, 0)

    def ciphertext(self, data: bytes) -> bytes:
        self.tls.write(data)
        return self.outgoing.read()

    def read(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            try:
                data += self.tls.read(nbytes - len(data))
            except ssl.SSLWantReadError:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("closed by the server") from None
                self.incoming.write(chunk)
        return data


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


def test_a_large_tls_request_whose_tail_arrives_later_is_served(serve, certs, rng):
    """Over TLS the bytes OpenSSL took of a record it could not finish are out of the socket already:
    a low-water mark of the request's remaining (plaintext) bytes could exceed the ciphertext still to
    come, and the connection then waited, unwoken, until its progress deadline cut it (11 of 12 such
    pauses did, reproduced). The pause here ends each time at another point inside a record."""
    tls = dict(tls_cert=certs.path("server.pem"), tls_key=certs.path("server.key"))
    served = serve(data_handshake_timeout_s=1.5, **tls)
    p = layer_norm_call(rng, (256, 1024))  # 1 MiB tensors
    call, raw = attached_inputs(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    for k in range(6):
        client = PiecewiseTls(served.address, certs.ca.cert, str(certs.path("ca.pem")))
        data = client.ciphertext(request(CALL | ATTACHED, len(payload)) + payload)
        cut = 300_000 + k * 1400  # the last ~0.3 MB come 0.3 s later
        client.sock.sendall(data[:-cut])
        time.sleep(0.3)
        client.sock.sendall(data[-cut:])
        ok, length = REPLY.unpack(client.read(REPLY.size))
        assert ok, k
        client.read(length)
        client.sock.close()


# Floods -------------------------------------------------------------------------------------------


def test_another_users_mailbox_flood_is_held_within_its_share(serve, rng):
    """Another local user opens every connection it may, each with a 16 MiB mailbox never written,
    and sends a 16 MiB call in each (the server reads all of it: each page of a mapped mailbox
    faulted in). Only what its share can hold is mapped whole; the pages the server filled in its
    memfds are never more than the ledger holds for it; a 17th connection is refused; another
    tenant's calls go on, correct; and all of it is given back when the attacker leaves."""
    needs_root()
    size = 16 * MIB
    served = serve(memory_budget_bytes=64 * MIB)  # a tenant's share: 32 MiB, of which stored bytes 24 MiB
    ledger = served.engine.ledger
    signals = tempfile.mkdtemp()  # where the attacker can see it (pytest's tmp_path is root's only)
    os.chmod(signals, 0o755)
    go = pathlib.Path(signals, "go")
    attacker = start_as_user(
        NOBODY,
        f"""
        from aclnn_common.framing import CALL, IN_MAILBOX
        from test_data_channel import reply, request, ticket
        from test_mailbox import pass_mailbox
        from test_shared_memory import memfd, unix_connect
        offer = ticket({served.address!r}, "flood")
        socks, fds = [], []
        for _ in range(16):
            sock = unix_connect(offer)
            fd = memfd({size})
            assert pass_mailbox(sock, fd, {size}) == (True, b"")
            sock.sendall(request(CALL | IN_MAILBOX, {size}))
            assert not reply(sock)[0]  # zeros name no method
            socks.append(sock)
            fds.append(fd)
        try:
            unix_connect(offer)
            print("admitted a 17th", flush=True)
        except AssertionError:
            pass
        print(sum(os.fstat(fd).st_blocks * 512 for fd in fds), flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.fstat(fd).st_blocks for fd in fds):
            time.sleep(0.05)
        print(sum(os.fstat(fd).st_blocks * 512 for fd in fds), flush=True)
        """,
    )
    try:
        filled = int(attacker.stdout.readline())
        held = ledger.held_by("uid:65534")  # with, for a moment, its last request's copy
        assert size <= filled <= held <= 32 * MIB and ledger.held_by_kind()["mailbox"] <= 24 * MIB
        assert sorted(mailbox_maps(os.getpid(), "test-region")) == [64 << 10] * 15 + [size]
        others_are_served(served.address, rng, (4, 64, 64))
        go.touch()
        assert int(attacker.stdout.readline()) == 0  # punched out once the server let go
        assert attacker.wait(timeout=30) == 0
    finally:
        attacker.kill()
        attacker.wait()
        shutil.rmtree(signals)
    wait_for(lambda: ledger.held == 0 and mailbox_maps(os.getpid(), "test-region") == [])


# Rewriting what the server computes on -----------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def test_attached_inputs_rewritten_and_punched_while_computed_affect_only_their_caller(serve, rng):
    """A client rewrites its attached inputs in the mailbox (NaN, infinities, random bytes) and
    punches holes in them, over and over, while the server computes on them in place: its own calls
    answer (whatever they computed), the server stays up, and another tenant's concurrent calls are
    exact. The mailbox and the request copies are all given back after."""
    served = serve()
    size = 16 * MIB
    p = layer_norm_call(rng, (512, 1024))  # 2 MiB tensors, attached in the mailbox
    call, raw = all_attached(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    attached_from = len(payload) - len(raw)
    fd = memfd(size)
    os.pwrite(fd, payload, 0)
    mailbox = np.memmap(f"/proc/self/fd/{fd}", np.uint8, "r+", shape=(size,))
    stop = threading.Event()

    def vandal() -> None:
        garbage = np.frombuffer(rng.bytes(len(raw)), np.uint8)
        specials = np.array([np.nan, np.inf, -np.inf, 3e38], np.float32).view(np.uint8)
        turn = 0
        while not stop.is_set():
            turn += 1
            if turn % 3 == 0:
                _libc.fallocate(fd, _PUNCH_HOLE, attached_from, len(raw) // 4096 * 4096)
            elif turn % 3 == 1:
                mailbox[attached_from : len(payload)] = np.resize(specials, len(raw))
            else:
                mailbox[attached_from : len(payload)] = garbage

    def victim() -> None:
        with Client(served.address) as c:
            while not stop.is_set():
                q = layer_norm_call(rng, (64, 1024))
                c.run(OP, **q)
                check(q)

    with unix_connect(ticket(served.address, "vandal")) as sock, concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert pass_mailbox(sock, fd, size) == (True, b"")
        running = [pool.submit(vandal), pool.submit(victim)]
        try:
            for _ in range(10):
                sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
                ok, answer = reply(sock)
                assert ok, error_of(answer).message
                attached_reply(answer)
        finally:
            stop.set()
            for future in running:
                future.result(timeout=60)
        assert answers_keepalive(sock)
    os.close(fd)
    wait_for(lambda: served.engine.ledger.held == 0)


def test_a_repeated_call_read_in_place_holds_its_inputs_as_the_first_did(serve, rng):
    """A Run served from the first like it on its connection (transport/repeats.py) whose attached
    inputs are read where the client wrote them (a mailbox above HELD_MAILBOX_BYTES, which the server
    does not hold) holds their bytes with its memory while it runs, as a call in full does: a repeat
    is no way around the ledger. All of it is given back after."""
    served = serve()
    in_place = []
    original = served.engine.run_prepared

    def counting(prepared, storage, destinations, call, checked=False):
        in_place.append(call.in_place_bytes)
        return original(prepared, storage, destinations, call, checked)

    served.engine.run_prepared = counting
    fd, mailbox = writable_mailbox(HOLELESS)
    with unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, HOLELESS) == (True, b"")
        for _ in range(3):
            p = layer_norm_call(rng, (64, 1024))
            call, raw = all_attached(p)
            run_in_mailbox(sock, mailbox, attached_call("Run", call.SerializeToString(), raw), p)
    os.close(fd)
    tensors = [value.tensor for value in call.params.values() if value.WhichOneof("kind") == "tensor"]
    attached = sum(t.ref.attached.size for t in tensors if t.ref.WhichOneof("kind") == "attached")
    assert attached > 256 * 1024 and in_place == [attached, attached]  # the two repeats; the first ran in full
    wait_for(lambda: served.engine.ledger.held == 0)


# Stalling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_attached_results_never_read_are_held_until_the_connection_is_cut(serve, rng, unix):
    """A client sends a call whose 16 MiB of results come back attached, and never reads them: the
    results stay held while the reply waits in a full socket, the connection is cut once the reply
    falls behind the minimum pace, and then everything is given back; others are served meanwhile."""
    served = serve(data_handshake_timeout_s=0.5)
    ledger = served.engine.ledger
    p = layer_norm_call(rng, (4096, 1024))
    call, raw = all_attached(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    offer = ticket(served.address, "stall")
    if unix:
        sock = unix_connect(offer)
    else:
        sock = connect(offer)
        assert reply(sock)[0]
    with sock:
        sock.sendall(request(CALL | ATTACHED, len(payload)) + payload)
        wait_for(lambda: ledger.held_by_kind().get("call", 0) >= p["input"].nbytes)  # the results, unsent
        q = layer_norm_call(rng, (64, 1024))
        with Client(served.address) as c:
            c.run(OP, **q)
        check(q)
        wait_for(lambda: served.server.data_channel.open_connections == 0, timeout=10)
        wait_for(lambda: ledger.held == 0)


def test_a_large_tcp_request_at_a_steady_pace_above_the_minimum_is_served(serve, rng):
    """The low-water mark wakes the server only once a good part of a request's rest arrived: never
    so late that a client keeping above the minimum pace (here 1.6 MiB/s against 1 MiB/s) seems to
    have stalled for the grace period (here 0.5 s) meanwhile."""
    served = serve(data_handshake_timeout_s=0.5)
    p = layer_norm_call(rng, (384, 1024))  # 1.5 MiB tensors: a 3 MiB request
    call, raw = attached_inputs(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    data = request(CALL | ATTACHED, len(payload)) + payload
    piece = 64 << 10
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        for start in range(0, len(data), piece):
            sock.sendall(data[start : start + piece])
            time.sleep(piece / (1.6 * MIB))
        ok, answer = reply(sock)
        assert ok, error_of(answer).message


def test_a_half_sent_attached_request_is_cut_and_given_back(serve, rng):
    """Half of a 3 MiB attached request over TCP, then silence: the worker is never woken for it (its
    rest is below the low-water mark), the housekeeping cuts it at its deadline, and its reserved
    bytes are given back; another client is served meanwhile."""
    served = serve(data_handshake_timeout_s=0.5)
    ledger = served.engine.ledger
    p = layer_norm_call(rng, (384, 1024))
    call, raw = attached_inputs(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        sock.sendall(request(CALL | ATTACHED, len(payload)) + payload[: len(payload) // 2])
        wait_for(lambda: ledger.held_by_kind().get("request") == len(payload))
        q = layer_norm_call(rng, (64, 1024))
        with Client(served.address, unix_socket=False) as c:
            c.run(OP, **q)
        check(q)
        wait_for(lambda: ledger.held == 0, timeout=5)
        assert closed_by_server(sock)


@pytest.mark.parametrize("size", [MIB, HOLELESS], ids=["held", "sealed-against-holes"])
def test_a_queued_mailbox_call_whose_client_left_lets_go_of_the_mailbox(serve, rng, size):
    """A call whose attached inputs are read in place in the mailbox waits behind another tenant's
    long call, holding nothing more while it waits (in a mailbox above 16 MiB what it reads is held
    only once it runs); its client closes the connection: the call is given up, the mapping and any
    hold go."""
    served = serve(max_concurrency=1)
    ledger = served.engine.ledger
    p = layer_norm_call(rng, (64, 1024))
    call, raw = all_attached(p)
    payload = attached_call("Run", call.SerializeToString(), raw)
    fd, mailbox = writable_mailbox(size)
    mailbox[: len(payload)] = np.frombuffer(payload, np.uint8)
    with Client(served.address) as other, concurrent.futures.ThreadPoolExecutor(1) as pool:
        other.list_operators()
        with unix_connect(ticket(served.address, "s")) as sock:
            assert pass_mailbox(sock, fd, size) == (True, b"")
            running = pool.submit(other.run, OP, **broadcast_call(0, rows=65536))
            wait_for(lambda: served.engine.admission.running == 1)
            before = ledger.held
            sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
            wait_for(lambda: served.engine.admission.waiting == 1)
            assert ledger.held == before  # its message is small: not held
        running.result(timeout=60)
    del mailbox
    os.close(fd)
    wait_for(lambda: ledger.held == 0 and mailbox_maps(os.getpid(), "test-region") == [])
    assert served.engine.admission.waiting == 0


# Giving memory back -----------------------------------------------------------------------------


class OwnedLock:
    """A lock that knows which thread holds it (the data channel's, watched)."""

    def __init__(self) -> None:
        self._lock, self.owner = threading.Lock(), None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self.owner = threading.get_ident()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.owner = None
        self._lock.release()


def test_mailboxes_are_punched_outside_the_loops_lock(serve, monkeypatch):
    """Punching a mapped mailbox out of its memfd takes ~30 ms per 64 MiB (here): never with the data
    channel's lock held, which every worker takes for every request, so that a tenant closing many
    full mailboxes at once (or idling until they are swept) stalls no one else. Watched for the three
    ways a connection ends: the client closes it, the idle sweep, the server's stop."""
    punched, under_lock = [], []

    def watched(mapping, fd, hold, punch) -> None:
        punched.append(fd)
        under_lock.append(lock.owner == threading.get_ident())
        return unmapped(mapping, fd, hold, punch)

    unmapped = data_channel_mailbox._unmapped
    monkeypatch.setattr(data_channel_mailbox, "_unmapped", watched)
    served = serve(data_idle_timeout_s=0.5)
    lock = served.server.data_channel._lock = OwnedLock()
    fds = [memfd(MIB) for _ in range(3)]
    offer = ticket(served.address, "s")
    with unix_connect(offer) as sock:  # closed by the client
        assert pass_mailbox(sock, fds[0], MIB) == (True, b"")
    wait_for(lambda: len(punched) == 1)
    idle = unix_connect(offer)  # swept when idle
    assert pass_mailbox(idle, fds[1], MIB) == (True, b"")
    wait_for(lambda: len(punched) == 2)
    idle.close()
    with unix_connect(offer) as sock:  # closed by the server's stop
        assert pass_mailbox(sock, fds[2], MIB) == (True, b"")
        served.server.stop(None)
        wait_for(lambda: len(punched) == 3)
    assert under_lock == [False, False, False]
    for fd in fds:
        os.close(fd)


def _region_with_inputs(sock: socket.socket, p: dict, size: int) -> tuple[str, memoryview, dict[str, int], int]:
    """A registered region holding the call's inputs: (its id, its mapping, their offsets, the first free byte)."""
    fd = memfd(size)
    view = mmap.mmap(fd, size)
    ok, region = register(sock, [fd], size)
    assert ok, region
    os.close(fd)
    offsets, free = {}, 0
    for name, tensor in bind(OP, p, frozenset(OUTPUTS)).inputs().items():
        data = byte_view(tensor.data)
        offsets[name] = free
        view[free : free + data.nbytes] = bytes(data)
        free = aligned(free + data.nbytes)
    return region.decode(), view, offsets, free


def test_a_repeat_is_refused_as_its_call_in_full_would_be(serve, rng):
    """A Run served again from its connection's repeats: the same message sent without an attached part,
    with results placed attached, was answered with a reply naming results that never came; in full it is
    161002 (red-team finding: the repeat skipped the check)."""
    served = serve()
    with unix_connect(ticket(served.address, "s")) as sock:
        p = layer_norm_call(rng, (16, 32))
        region, _, offsets, _ = _region_with_inputs(sock, p, 1 << 20)
        call = region_call(p, region, offsets)
        for name in OUTPUTS:
            call.placements[name].attached = True
        message = call.SerializeToString()
        assert exchange(sock, "Run", message, b"")[0]  # in full, with its (empty) attached part
        payload = b"\x03Run" + message  # the same message, with no attached part at all
        sock.sendall(request(CALL, len(payload)) + payload)
        ok, answer = reply(sock)
        assert not ok and "attached results come only with" in error_of(answer).message
        assert answers_keepalive(sock)


def test_attached_false_is_an_inline_result_limited_and_held_as_one(serve, rng):
    """`attached: false` puts a result in the reply's message: it was counted as sent beside it, past the
    message limit (an 8 MiB result under a 4 MiB limit) and outside the ledger."""
    served = serve(max_message_bytes=4 * MIB)
    with unix_connect(ticket(served.address, "s")) as sock:
        p = layer_norm_call(rng, (1024, 2048))  # gradInputOut: 8 MiB
        region, _, offsets, _ = _region_with_inputs(sock, p, 32 * MIB)
        for attached in (None, False):
            call = region_call(p, region, offsets)
            if attached is not None:
                for name in OUTPUTS:
                    call.placements[name].attached = attached
            ok, answer = exchange(sock, "Run", call.SerializeToString(), b"")
            assert not ok and "exceed the max message size" in error_of(answer).message


def test_a_tensor_with_inline_bytes_and_a_ref_is_refused(serve, rng):
    """Which of two storages a call reads is no guess: in full it read the inline bytes, its repeats the ref."""
    served = serve()
    with unix_connect(ticket(served.address, "s")) as sock:
        p = layer_norm_call(rng, (4, 8))
        region, _, offsets, _ = _region_with_inputs(sock, p, 1 << 20)
        call = region_call(p, region, offsets)
        call.params["gradOut"].tensor.data = p["gradOut"].tobytes()
        ok, answer = exchange(sock, "Run", call.SerializeToString(), b"")
        error = error_of(answer)
        assert not ok and (error.code, error.param) == (161002, "gradOut") and "not both" in error.message
