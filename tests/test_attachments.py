"""Tensor bytes raw beside a data-channel call's message (framing: ATTACHED), on a real server."""

from __future__ import annotations

import concurrent.futures
import os
import time

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from test_data_channel import OP, OUTPUTS, answers_keepalive, check, connect, error_of, reply, request, ticket
from test_mailbox import pass_mailbox
from test_processes import broadcast_call
from test_shared_memory import memfd, unix_connect
from test_transport import wait_for

from aclnn_client import AclnnError, Client
from aclnn_client.data_channel import Attachments
from aclnn_client.staging import RESULT_REGION_BYTES
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.binding import bind
from aclnn_common.framing import ATTACHED, CALL, IN_MAILBOX, MESSAGE_LENGTH, aligned
from aclnn_common.wire import encode_call

MIB = 1 << 20


def attached_call(method: str, message: bytes, attached: bytes) -> bytes:
    """A CALL | ATTACHED payload: the method, the message's length and the message, padding, the raw part."""
    head = bytes([len(method)]) + method.encode() + MESSAGE_LENGTH.pack(len(message)) + message
    return head + bytes(aligned(len(head)) - len(head)) + attached


def attached_inputs(p: dict) -> tuple[pb.OpCall, bytes]:
    """The call with every input's bytes attached (as the client sends it), and its raw part."""
    bound = bind(OP, p, frozenset(OUTPUTS))
    call, attachments = encode_call(OP, bound.values, storage=False), Attachments()
    for name, tensor in bound.inputs().items():
        call.params[name].tensor.ref.attached.CopyFrom(attachments.add(memoryview(tensor.data.view(np.uint8))))
    raw = b"".join(bytes(data) + bytes(aligned(len(data)) - len(data)) for _, data in attachments.parts)
    return call, raw


def exchange(sock, method: str, message: bytes, raw: bytes) -> tuple[bool, bytes]:
    """Sends a CALL | ATTACHED request over a raw connection; the reply (ok, payload)."""
    payload = attached_call(method, message, raw)
    sock.sendall(request(CALL | ATTACHED, len(payload)) + payload)
    return reply(sock)


def attached_reply(payload: bytes) -> tuple[bytes, bytes]:
    end = MESSAGE_LENGTH.size + MESSAGE_LENGTH.unpack_from(payload)[0]
    return payload[MESSAGE_LENGTH.size : end], payload[aligned(end) :]


@pytest.mark.parametrize(
    "unix,rows,inline_mib",
    [
        (True, 4, 4),  # a small call in the connection's mailbox
        (True, 512, 4),  # 2 MiB tensors: a 4 MiB request in the mailbox
        (True, 2304, 10),  # 9 MiB tensors: an 18 MiB request, too large for a mailbox: over the socket
        (False, 4, 4),
        (False, 512, 4),
    ],
    ids=["unix-small", "unix-mailbox", "unix-socket", "tcp-small", "tcp-large"],
)
def test_inline_tensors_travel_raw_beside_the_message(serve, rng, unix, rows, inline_mib):
    served = serve()
    p = layer_norm_call(rng, (rows, 1024))
    with Client(served.address, unix_socket=unix, max_inline_bytes=inline_mib * MIB) as c:
        assert c._data_channel(0).unix == unix
        c.run(OP, **p)
        check(p)
        for name in ("gradInputOut", "gradWeightOut", "gradBiasOut"):
            p[name][...] = np.nan
        _, executor = c.get_workspace_size(OP, **p)
        c.execute(executor)
    check(p)
    # The bytes moved beside the messages are counted with them; over the Unix socket a result of
    # RESULT_REGION_BYTES or more lands in a region of the client's instead (the reply: descriptors only).
    assert served.server.metrics.bytes_in.labels("Run")._value.get() > 2 * p["input"].nbytes
    sent = served.server.metrics.bytes_out.labels("Run")._value.get()
    if unix and p["gradInputOut"].nbytes >= RESULT_REGION_BYTES:
        assert sent < 64 << 10
    else:
        assert sent > p["input"].nbytes


def test_attached_ranges_are_checked(serve, rng):
    served = serve()
    p = layer_norm_call(rng, (4, 16))
    call, raw = attached_inputs(p)
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        call.placements["gradInputOut"].attached = True
        call.placements["gradWeightOut"].attached = True
        ok, answer = exchange(sock, "Run", call.SerializeToString(), raw)
        assert ok, error_of(answer)
        message, results = attached_reply(answer)
        outputs = pb.RunResponse.FromString(message).outputs
        for name in ("gradInputOut", "gradWeightOut"):
            where = outputs[name].attached
            p[name][...] = np.frombuffer(results[where.offset : where.offset + where.size], np.float32).reshape(-1, 16)
        p["gradBiasOut"][...] = np.frombuffer(outputs["gradBiasOut"].data, np.float32)  # not placed: inline
        check(p)

        # A range beyond the attached part is 161002 naming the reference; the connection stays usable.
        call.params["input"].tensor.ref.attached.offset = len(raw)
        ok, answer = exchange(sock, "Run", call.SerializeToString(), raw)
        error = error_of(answer)
        assert not ok and (error.code, error.param) == (161002, "ref")
        # A message running past the payload does not parse.
        bad = b"\x03Run" + MESSAGE_LENGTH.pack(1 << 40)
        sock.sendall(request(CALL | ATTACHED, len(bad)) + bad)
        ok, answer = reply(sock)
        assert not ok and error_of(answer).grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert answers_keepalive(sock)


def test_attached_bytes_need_the_data_channel(serve, rng):
    """gRPC has no raw part: a reference to one, or a result placed in one, is 161002."""
    served = serve()
    p = layer_norm_call(rng, (4, 16))
    call = encode_call(OP, _values(p))
    call.params["input"].tensor.ClearField("data")
    call.params["input"].tensor.ref.attached.size = p["input"].nbytes
    with Client(served.address, data_channel=False) as c:
        with pytest.raises(AclnnError) as refused:
            c._call_grpc(0, "Run", call)
        assert (refused.value.code, refused.value.param) == (161002, "ref")
        call = encode_call(OP, _values(p))
        call.placements["gradInputOut"].attached = True
        with pytest.raises(AclnnError) as refused:
            c._call_grpc(0, "Run", call)
        assert (refused.value.code, refused.value.param) == (161002, "gradInputOut")


def test_an_executor_keeps_a_copy_of_attached_bytes(serve, rng):
    """Bytes attached to GetWorkspaceSize outlive the request (its buffer is the connection's, reused)."""
    served = serve()
    p = layer_norm_call(rng, (4, 16))
    call, raw = attached_inputs(p)
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        ok, answer = exchange(sock, "GetWorkspaceSize", call.SerializeToString(), raw)
        assert ok
        plan = pb.WorkspacePlan.FromString(attached_reply(answer)[0])
        # Another request overwrites the connection's buffer, which held the first one's attached bytes.
        assert exchange(sock, "GetWorkspaceSize", call.SerializeToString(), bytes(len(raw)))[0]
        execute = pb.ExecuteRequest(executor=plan.executor).SerializeToString()
        sock.sendall(request(CALL, len(execute) + 8) + b"\x07Execute" + execute)
        ok, answer = reply(sock)
        assert ok
        outputs = pb.ExecuteResponse.FromString(answer).outputs
    for name in ("gradInputOut", "gradWeightOut", "gradBiasOut"):
        p[name][...] = np.frombuffer(outputs[name].data, np.float32).reshape(p[name].shape)
    check(p)


def test_attachments_fold_back_into_the_message_for_grpc(rng):
    """A call built for the data channel goes over gRPC when the channel has no connection for it."""
    p = layer_norm_call(rng, (4, 16))
    call = encode_call(OP, _values(p), storage=False)
    attachments = Attachments()
    where = attachments.add(memoryview(p["input"].reshape(-1).view(np.uint8)))
    call.params["input"].tensor.ref.attached.CopyFrom(where)
    call.placements["gradInputOut"].attached = True
    call.placements["gradWeightOut"].keep_on_server = True
    attachments.fold_into(call)
    assert call.params["input"].tensor.data == p["input"].tobytes()
    assert not call.params["input"].tensor.HasField("ref")
    assert list(call.placements) == ["gradWeightOut"]
    execute = pb.ExecuteRequest(executor="x")
    execute.input_refs["input"].attached.CopyFrom(where)
    execute.input_refs["mean"].handle = "h"
    attachments.fold_into(execute)
    assert execute.inputs["input"] == p["input"].tobytes() and list(execute.input_refs) == ["mean"]


def _values(p: dict) -> dict:
    return bind(OP, p, frozenset(OUTPUTS)).values


def test_a_large_request_over_tcp_arriving_in_pieces_is_served(serve):
    """A large payload wakes the server once most of its rest is there (SO_RCVLOWAT), however it is split."""
    served = serve()
    payload = b"\x09KeepAlive" + b"\xff" * (3 * MIB)  # not a message: answered INVALID_ARGUMENT once whole
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        data = request(CALL, len(payload)) + payload
        for start, end in ((0, 100_000), (100_000, 2 * MIB), (2 * MIB, len(data))):
            sock.sendall(data[start:end])
            time.sleep(0.05)
        ok, answer = reply(sock)
        assert not ok and error_of(answer).grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert answers_keepalive(sock)


def test_attached_bytes_are_held_while_a_view_lives_not_by_an_idle_connection(serve, rng):
    """A large request's payload (its attached inputs are views of it) is held in the ledger by a hold
    that follows the payload's memory: the call's views keep it, and the connection lets go of it once
    the reply is sent, not only when its next request comes."""
    served = serve()
    ledger = served.engine.ledger
    p = layer_norm_call(rng, (512, 1024))  # 2 MiB tensors: a 4 MiB request
    call, raw = attached_inputs(p)
    for name in OUTPUTS:
        call.placements[name].attached = True
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        ok, answer = exchange(sock, "Run", call.SerializeToString(), raw)
        assert ok
        wait_for(lambda: not ledger.held_by_kind().get("request"))  # the connection stays open, idle
        message, results = attached_reply(answer)
        outputs = pb.RunResponse.FromString(message).outputs
    for name in OUTPUTS:
        where = outputs[name].attached
        p[name][...] = np.frombuffer(results[where.offset : where.offset + where.size], np.float32).reshape(
            p[name].shape
        )
    check(p)
    assert ledger.held_by_kind() == {}


def test_attached_tensors_are_read_where_the_client_wrote_them_its_message_is_copied(serve, rng):
    """A call whose payload is in a mapped mailbox: its message (descriptors, ranges) is copied when
    the request arrives, so that rewriting it later changes nothing; its attached tensors are not
    copied, so that rewriting them before the call runs changes what it computes: the client's own
    results, from the bytes it wrote (the oracle on the rewritten inputs)."""
    served = serve(max_concurrency=1)
    p = layer_norm_call(rng, (64, 1024))
    call, raw = attached_inputs(p)
    for name in OUTPUTS:
        call.placements[name].attached = True
    payload = attached_call("Run", call.SerializeToString(), raw)
    message_end = len(payload) - len(raw)
    fd = memfd(MIB)
    with Client(served.address) as other, unix_connect(ticket(served.address, "s")) as sock:
        assert pass_mailbox(sock, fd, MIB) == (True, b"")
        other.list_operators()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(other.run, OP, **broadcast_call(0, rows=65536))
            wait_for(lambda: served.engine.admission.running == 1)
            os.pwrite(fd, payload, 0)
            sock.sendall(request(CALL | ATTACHED | IN_MAILBOX, len(payload)))
            wait_for(lambda: served.engine.admission.waiting == 1)  # received, queued behind the long call
            os.pwrite(fd, b"\xff" * message_end, 0)  # the message: read already
            p["gradOut"] *= -2  # the attached gradOut, rewritten in the mailbox before the call runs
            offset = call.params["gradOut"].tensor.ref.attached.offset
            os.pwrite(fd, p["gradOut"].tobytes(), message_end + offset)
            running.result(timeout=60)
        ok, answer = reply(sock)
        assert ok, error_of(answer).message
    os.close(fd)
    message, results = attached_reply(answer)
    outputs = pb.RunResponse.FromString(message).outputs
    for name in OUTPUTS:
        where = outputs[name].attached
        p[name][...] = np.frombuffer(results[where.offset : where.offset + where.size], np.float32).reshape(
            p[name].shape
        )
    check(p)


def test_a_repeated_attached_call_reads_this_requests_bytes_and_is_checked_like_the_first(serve, rng):
    """A Run whose message is one that ran in full on the connection is served from that first run
    (transport/repeats.py): on this request's attached bytes (new inputs, new results); a range
    beyond this request's attached part, or the message without its attached part, goes the full way
    and is refused as the first would have been."""
    served = serve()
    full_runs = []
    original = served.engine.run
    served.engine.run = lambda op, *a, **k: full_runs.append(op) or original(op, *a, **k)
    p = layer_norm_call(rng, (4, 16))
    call, raw = attached_inputs(p)
    for name in OUTPUTS:
        call.placements[name].attached = True
    message = call.SerializeToString()

    def results_of(answer: bytes) -> dict[str, np.ndarray]:
        head, part = attached_reply(answer)
        outputs = pb.RunResponse.FromString(head).outputs
        return {
            name: np.frombuffer(part[out.attached.offset : out.attached.offset + out.attached.size], np.float32)
            for name, out in outputs.items()
        }

    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        for _ in range(3):  # the same message, new bytes each time
            fresh = layer_norm_call(rng, (4, 16))
            for name in ("gradOut", "input", "mean", "rstd", "weightOptional"):
                p[name][...] = fresh[name]
            _, raw = attached_inputs(p)
            ok, answer = exchange(sock, "Run", message, raw)
            assert ok, error_of(answer).message
            for name, result in results_of(answer).items():
                p[name][...] = result.reshape(p[name].shape)
            check(p)
        assert full_runs == [OP]
        ok, answer = exchange(sock, "Run", message, raw[:64])  # input's range lies beyond these bytes
        assert not ok and (error_of(answer).code, error_of(answer).param) == (161002, "ref")
        sock.sendall(request(CALL, 4 + len(message)) + b"\x03Run" + message)  # no attached part at all
        ok, answer = reply(sock)
        assert not ok and (error_of(answer).code, error_of(answer).param) == (161002, "ref")
        assert full_runs == [OP]  # both went the full way, refused while decoding, before running
        assert exchange(sock, "Run", message, raw)[0]  # the layout still repeats
    assert full_runs == [OP]
    # Another connection of the same client learns it anew: the repeats are the connection's.
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        assert exchange(sock, "Run", message, raw)[0]
    assert full_runs == [OP, OP]
