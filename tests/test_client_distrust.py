"""The clients trust no server: a reply that lies (a length no server of ours sends, bytes that do not
parse, a peer that trickles) is an AclnnError within the call's deadline, never a hang, an unbounded
buffer or a Python exception from decoding it; and a call that fails writes none of its results.

The peer here is a raw socket speaking the data channel's framing (common/framing.py) as a buggy or
impostor server would, with the real DataChannel client against it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from google.rpc import status_pb2

from aclnn_client import AclnnError
from aclnn_client.data_channel import DataChannel, NoConnection, recv_exact
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.framing import MAGIC, REPLY, REQUEST

HANG_S = 30  # only a hang reaches it
Peer = Callable[[socket.socket], None]


def admit(conn: socket.socket) -> None:
    recv_exact(conn, len(MAGIC) + 16)  # the magic and a 16-byte ticket
    conn.sendall(REPLY.pack(1, 0))


def read_request(conn: socket.socket) -> None:
    *_, length = REQUEST.unpack(recv_exact(conn, REQUEST.size))
    recv_exact(conn, length)


@pytest.fixture
def lying_peer() -> Iterator[Callable[[Peer], DataChannel]]:
    """A data-channel peer on a loopback port that answers as `peer` does; the client's channel to it."""
    listeners: list[socket.socket] = []

    def start(peer: Peer, connect_timeout: float = 5.0) -> DataChannel:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve() -> None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    peer(conn)
                except OSError:
                    pass  # the client gave up and closed

        threading.Thread(target=serve, daemon=True).start()
        ticket = b"t" * 16
        return DataChannel(listener.getsockname(), ticket, lambda: ticket, connect_timeout=connect_timeout)

    yield start
    for listener in listeners:
        listener.close()


def trickle(conn: socket.socket, announced: int, header_too: bool = False) -> None:
    """A reply announcing `announced` bytes, sent two bytes a second (what a socket timeout alone
    misses): its header at once, or (`header_too`) that too."""
    reply = REPLY.pack(1, announced) + bytes(announced)
    start = 0 if header_too else REPLY.size
    conn.sendall(reply[:start])
    for at in range(start, len(reply)):
        time.sleep(0.5)
        conn.sendall(reply[at : at + 1])


def timed(call: Callable[[], object]) -> tuple[AclnnError, float]:
    started = time.monotonic()
    with pytest.raises(AclnnError) as err:
        call()
    return err.value, time.monotonic() - started


@pytest.mark.parametrize("header_too", [False, True], ids=["payload", "header"])
def test_a_trickled_reply_ends_at_the_calls_deadline(lying_peer, header_too):
    channel = lying_peer(lambda conn: (admit(conn), read_request(conn), trickle(conn, 200, header_too)))
    error, took = timed(lambda: channel.call("MallocBuffer", pb.MallocRequest(size=16), None, timeout=1.0))
    assert "DEADLINE_EXCEEDED" in error.message and took < 3, (error, took)


def test_a_trickled_admission_ends_at_the_connect_timeout(lying_peer):
    """Admission answered a byte at a time: no connection (the client goes on over gRPC) within the
    connect timeout, not one receive timeout per byte (a client's every thread waited on it)."""
    channel = lying_peer(lambda conn: (recv_exact(conn, len(MAGIC) + 16), trickle(conn, 200)), connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(NoConnection):
        channel.call("MallocBuffer", pb.MallocRequest(size=16), None, timeout=None)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("ok", [True, False], ids=["reply", "error-reply"])
def test_a_reply_longer_than_any_server_sends_is_refused_before_it_is_read(lying_peer, ok):
    """A header claiming 3 GiB (then sending them) was buffered whole: the client's memory for any server's word."""

    def peer(conn: socket.socket) -> None:
        admit(conn)
        read_request(conn)
        conn.sendall(REPLY.pack(ok, 3 << 30) + b"\0" * (1 << 20))
        time.sleep(HANG_S)

    error, took = timed(lambda: lying_peer(peer).call("MallocBuffer", pb.MallocRequest(size=16), None, timeout=HANG_S))
    assert "over what the server sends" in error.message and took < 5, (error, took)


@pytest.mark.parametrize(
    "reply",
    [
        REPLY.pack(0, 5) + b"\xff\xff\xff\xff\xff",  # an error reply that is no google.rpc.Status
        REPLY.pack(1, 3) + b"\x0a\xff\x01",  # an ok reply whose message does not parse
    ],
    ids=["status", "message"],
)
def test_a_reply_that_does_not_parse_is_an_aclnn_error(lying_peer, reply):
    def peer(conn: socket.socket) -> None:
        admit(conn)
        read_request(conn)
        conn.sendall(reply)
        time.sleep(1)

    error, _ = timed(lambda: lying_peer(peer).call("MallocBuffer", pb.MallocRequest(size=16), None, timeout=HANG_S))
    assert error.code == 361001 and "malformed reply" in error.message


def test_an_error_status_that_is_no_failure_code_stays_an_error(lying_peer):
    """ErrorInfo status "0" (or "abc") from a lying server: a runtime error, not success or a ValueError."""
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2

    for given in ("0", "abc"):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(domain="aclnn", reason="X", metadata={"status": given}))
        status = status_pb2.Status(code=3, message="refused", details=[detail]).SerializeToString()

        def peer(conn: socket.socket, status: bytes = status) -> None:
            admit(conn)
            read_request(conn)
            conn.sendall(REPLY.pack(0, len(status)) + status)
            time.sleep(1)

        error, _ = timed(lambda: lying_peer(peer).call("MallocBuffer", pb.MallocRequest(size=16), None, timeout=HANG_S))
        assert error.code == 361001, (given, error)


def test_grpc_error_details_that_do_not_parse_are_an_aclnn_error():
    """A gRPC refusal whose grpc-status-details-bin is not a google.rpc.Status (or names another code
    than the call's): the call's AclnnError, not the DecodeError or ValueError of decoding it."""
    from concurrent import futures

    import grpc

    from aclnn_client import Client

    details = {"garbage": b"\xff\xff\xff", "another-code": status_pb2.Status(code=5, message="x").SerializeToString()}
    for name, trailer in details.items():

        def refuse(request: bytes, context: grpc.ServicerContext, trailer: bytes = trailer) -> bytes:
            context.set_trailing_metadata((("grpc-status-details-bin", trailer),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")

        server = grpc.server(futures.ThreadPoolExecutor(2))
        handler = grpc.method_handlers_generic_handler(
            "aclnn.v1.Aclnn", {"MallocBuffer": grpc.unary_unary_rpc_method_handler(refuse)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with Client(f"127.0.0.1:{port}", data_channel=False) as c, pytest.raises(AclnnError) as err:
                c.malloc(16)
        finally:
            server.stop(None)
        assert "refused" in err.value.message, (name, err.value)


def test_a_result_whose_bytes_do_not_match_its_dims_is_malformed():
    from aclnn_common.wire import decode_output

    for data in (b"\0" * 8, b"\0" * 20):
        with pytest.raises(AclnnError) as err:
            decode_output(pb.OutputTensor(data_type=0, dims=[4], data=data))  # FLOAT [4]: 16 bytes
        assert err.value.code == 361001 and "malformed reply" in err.value.message
