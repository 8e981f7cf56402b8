"""The data channel's attached bytes and mapped mailboxes, as a hostile tenant would use them: raw
sockets against a real server, lying about ranges, resealing its memfd, rewriting what the server
computes on, stalling, flooding; what each does to the server and to everyone else."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from test_attachments import attached_call, attached_inputs, attached_reply, exchange
from test_data_channel import OUTPUTS, check, error_of, reply, request, ticket
from test_mailbox import pass_mailbox
from test_shared_memory import memfd, refused, register, unix_connect
from test_transport import wait_for

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.framing import ATTACHED, CALL, IN_MAILBOX, MESSAGE_LENGTH

MIB = 1 << 20
UNSEALABLE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # sealed as a region must be, but open to more seals
F_SEAL_FUTURE_WRITE = 0x0010


def results_of(answer: bytes, p: dict) -> None:
    """Fills `p`'s outputs from an attached reply."""
    message, results = attached_reply(answer)
    outputs = pb.RunResponse.FromString(message).outputs
    for name in OUTPUTS:
        where = outputs[name].attached
        data = results[where.offset : where.offset + where.size]
        p[name][...] = np.frombuffer(data, np.float32).reshape(p[name].shape)


def all_attached(p: dict) -> tuple[pb.OpCall, bytes]:
    call, raw = attached_inputs(p)
    for name in OUTPUTS:
        call.placements[name].attached = True
    return call, raw


# Memfds the client can seal later ----------------------------------------------------------------


def test_a_memfd_open_to_new_seals_is_refused_as_mailbox_or_region(serve):
    """A client that adds F_SEAL_FUTURE_WRITE after registering stops the server from punching out the
    pages it faulted in (reading holes of a mailbox, writing results into a sparse region): they
    would stay charged to the server, in a memfd the client keeps, after their hold ended. So
    descriptors must come sealed against further seals (F_SEAL_SEAL), as the client seals them."""
    served = serve()
    with unix_connect(ticket(served.address, "s")) as sock:
        for kind in ("mailbox", "region"):
            fd = memfd(MIB, seals=UNSEALABLE)
            answer = pass_mailbox(sock, fd, MIB) if kind == "mailbox" else register(sock, [fd], MIB)
            refused(answer, "F_SEAL_SEAL")
            os.close(fd)
        keepalive = b"\x09KeepAlive"
        sock.sendall(request(CALL, len(keepalive)) + keepalive)
        assert reply(sock) == (True, b"")
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
        keepalive = b"\x09KeepAlive"
        sock.sendall(request(CALL, len(keepalive)) + keepalive)
        assert reply(sock) == (True, b"")
    os.close(fd)


@pytest.mark.parametrize("in_mailbox", [False, True], ids=["socket", "mailbox"])
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
        os.pwrite(fd, payload, 0)
        sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
        return reply(sock)

    fd = memfd(MIB)
    with unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, MIB) == (True, b"")
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
