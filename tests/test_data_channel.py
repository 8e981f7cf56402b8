"""The data channel: calls and tensor bytes over a TCP connection beside gRPC (with its TLS), on a real server."""

from __future__ import annotations

import logging
import os
import socket
import time

import grpc
import numpy as np
import pytest
from certs import make_certificates
from google.rpc import status_pb2
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import Untouched, assert_close
from test_transport import wait_for

from aclnn_client import AclnnError, Client
from aclnn_client.data_channel import recv_exact
from aclnn_client.grpc_client import data_channel_host
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.framing import CALL, DOWNLOAD, MAGIC, REPLY, REQUEST, UPLOAD
from aclnn_common.wire import decode_status

OP = "aclnnLayerNormBackward"
OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")
MIB = 1 << 20


def check(p: dict) -> None:
    for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
        assert_close(p[name], ref.reshape(p[name].shape), name)


def ticket(address: str, session: str = "s1", token: str | None = None) -> pb.DataChannelTicket:
    metadata = (("x-aclnn-session", session),) + ((("authorization", f"Bearer {token}"),) if token else ())
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.AclnnStub(channel).OpenDataChannel(pb.Empty(), metadata=metadata)


def connect(offer: pb.DataChannelTicket, ticket_bytes: bytes | None = None) -> socket.socket:
    """A raw connection, admitted (or not) by the ticket; returns it after the server's answer."""
    sock = socket.create_connection(("127.0.0.1", offer.port), timeout=10)
    sock.sendall(MAGIC + (offer.ticket if ticket_bytes is None else ticket_bytes))
    return sock


def reply(sock: socket.socket) -> tuple[bool, bytes]:
    ok, length = REPLY.unpack(recv_exact(sock, REPLY.size))
    return bool(ok), bytes(recv_exact(sock, length))


def error_of(payload: bytes) -> AclnnError:
    return decode_status(status_pb2.Status.FromString(payload))


def request(kind: int, length: int, stream: int | None = None) -> bytes:
    return REQUEST.pack(kind, stream is not None, stream or 0, 0, length)


KEEPALIVE = b"\x09KeepAlive"  # a CALL payload: the method's name and no message


def answers_keepalive(sock: socket.socket) -> bool:
    """Whether the connection still serves in step: a KeepAlive call is answered with success (the lease)."""
    sock.sendall(request(CALL, len(KEEPALIVE)) + KEEPALIVE)
    ok, payload = reply(sock)
    return ok and pb.Lease.FromString(payload).session_ttl_s > 0


def test_client_calls_go_over_the_data_channel(serve, rng):
    served = serve()
    p = layer_norm_call(rng, (8, 64))
    with Client(served.address) as c:
        c.run(OP, **p)
        check(p)
        assert served.server.data_channel.open_connections == 1  # the call's pooled connection
        _, executor = c.get_workspace_size(OP, **p)
        c.execute(executor)
    check(p)
    runs = served.server.metrics.requests.labels("Run", OP, "ACLNN_SUCCESS")._value.get()
    assert runs == 1  # counted and logged like an RPC


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "grpc"])
def test_large_tensors_round_trip_and_are_freed(serve, rng, data_channel):
    served = serve()
    p = layer_norm_call(rng, (512, 1024))  # 2 MiB per tensor, above the 1 MiB inline limit
    wide = np.full((512, 2048), -7.25, np.float32)
    p["gradInputOut"] = wide[:, ::2]  # a strided output: received through a bounce buffer
    with Client(served.address, max_inline_bytes=MIB, data_channel=data_channel) as c:
        c.run(OP, **p)
        # Uploads freed; over the data channel's Unix socket the 2 MiB result's region stays pooled.
        assert served.server.storage.counts() == (0, int(data_channel))
        assert (served.server.data_channel.open_connections > 0) == data_channel
    check(p)
    assert (wide[:, 1::2] == -7.25).all()


def test_errors_come_back_with_status_and_param(serve, rng):
    served = serve()
    p = layer_norm_call(rng, (4, 16))
    p["rstd"] = p["rstd"].astype(np.float64)
    untouched = Untouched(*(p[n] for n in OUTPUTS))
    with Client(served.address) as c:
        with pytest.raises(AclnnError) as raised:
            c.run(OP, **p)
        assert raised.value.code == 161002 and raised.value.param == "rstd"
        assert raised.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        untouched.check()
        p["rstd"] = p["rstd"].astype(np.float32)
        c.run(OP, **p)  # the connection stayed in step after the error reply
    check(p)


def test_a_connection_needs_a_valid_ticket(serve):
    served = serve()
    offer = ticket(served.address)
    with connect(offer, b"\0" * len(offer.ticket)) as sock:
        ok, payload = reply(sock)
        assert not ok and error_of(payload).grpc_code == grpc.StatusCode.UNAUTHENTICATED
        assert sock.recv(1) == b""  # and it is closed
    with connect(offer) as sock:
        assert reply(sock) == (True, b"")


def test_tickets_are_issued_to_authenticated_callers_only(serve, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    served = serve(auth_token_file=tokens)
    with pytest.raises(grpc.RpcError) as raised:
        ticket(served.address)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ticket(served.address, token="secret").port == served.server.data_channel.port


def test_handles_stay_with_their_session(serve):
    served = serve()
    with connect(ticket(served.address, "alice")) as alice:
        assert reply(alice)[0]
        alice.sendall(request(UPLOAD, 3))
        assert reply(alice) == (True, b"")
        alice.sendall(b"abc")
        ok, payload = reply(alice)
        handle = pb.TensorHandle.FromString(payload)
        assert ok and handle.size == 3
    with connect(ticket(served.address, "mallory")) as mallory:
        assert reply(mallory)[0]
        message = handle.SerializeToString()
        mallory.sendall(request(DOWNLOAD, len(message)) + message)
        ok, payload = reply(mallory)
        assert not ok and "unknown" in error_of(payload).message


def test_truncated_upload_stores_nothing(serve):
    served = serve()
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        sock.sendall(request(UPLOAD, 1000))
        assert reply(sock) == (True, b"")
        sock.sendall(b"x" * 400)
    wait_for(lambda: not served.server.data_channel.open_connections)
    wait_for(lambda: served.server.storage.counts() == (0, 0) and served.server.engine.ledger.held == 0)


def test_upload_over_budget_is_refused_before_any_byte(serve):
    served = serve(memory_budget_bytes=1 << 20)
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        sock.sendall(request(UPLOAD, 2 << 20))
        ok, payload = reply(sock)
        assert not ok and "cannot hold" in error_of(payload).message
        sock.sendall(request(UPLOAD, 2))  # the connection is still in step
        assert reply(sock) == (True, b"")
        sock.sendall(b"ok")
        assert reply(sock)[0]
    assert served.engine.ledger.held_by_kind() == {"upload": 2}


@pytest.mark.parametrize(
    "payload,code",
    [
        (b"\x07NoSuchMethod", grpc.StatusCode.UNIMPLEMENTED),
        (b"\x0dListOperators", grpc.StatusCode.UNIMPLEMENTED),  # gRPC only
        (b"\x03Run\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),  # not a protobuf message
        (b"\x03Run" + pb.OpCall(op="aclnnNope").SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT),
        (b"\x09KeepAlive"[:-1], grpc.StatusCode.INVALID_ARGUMENT),  # a name running past the payload
        (b"\xffKeepAlive", grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["unknown-method", "grpc-only-method", "garbage-message", "unknown-op", "name-past-end", "name-far-past-end"],
)
def test_bad_calls_are_answered_and_the_connection_survives(serve, payload, code):
    served = serve()
    with connect(ticket(served.address)) as sock:
        assert reply(sock)[0]
        sock.sendall(request(CALL, len(payload)) + payload)
        ok, answer = reply(sock)
        assert not ok and error_of(answer).grpc_code == code
        assert answers_keepalive(sock)


def test_protocol_violations_close_the_connection(serve):
    served = serve(max_message_bytes=MIB)
    for header in (request(9, 0), request(CALL, 2 * MIB)):
        with connect(ticket(served.address)) as sock:
            assert reply(sock)[0]
            sock.sendall(header)
            data = sock.recv(REPLY.size)
            if data:  # an answer first (the oversize request), then the close
                recv_exact(sock, REPLY.unpack(data)[1])
                assert sock.recv(1) == b""


def test_no_data_channel_when_off(serve, rng):
    served = serve(data_port=-1, unix_socket="off")
    assert served.server.data_channel is None
    assert ticket(served.address).port == 0
    p = layer_norm_call(rng, (4, 16))
    with Client(served.address) as c:
        c.run(OP, **p)  # over gRPC
    check(p)
    tcp_off = serve(data_port=-1)  # the Unix socket alone
    offer = ticket(tcp_off.address)
    assert offer.port == 0 and offer.unix_path
    with Client(tcp_off.address) as c:
        c.run(OP, **p)
        assert tcp_off.server.data_channel.open_connections == 1
    check(p)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_data_channel_has_the_grpc_ports_tls(serve, certs, rng, mutual):
    tls = dict(tls_cert=certs.path("server.pem"), tls_key=certs.path("server.key"))
    identity = {}
    if mutual:
        tls["tls_client_ca"] = certs.path("ca.pem")
        identity = dict(private_key=certs.client.key, certificate_chain=certs.client.cert)
    served = serve(**tls)
    p = layer_norm_call(rng, (512, 1024))  # large tensors: uploads and downloads over TLS too
    # unix_socket=False: the TCP port with its TLS, not the Unix socket a client on this host would take.
    tcp_only = dict(max_inline_bytes=MIB, unix_socket=False)
    with Client(served.address, root_certificates=certs.ca.cert, **tcp_only, **identity) as c:
        c.run(OP, **p)
        assert served.server.data_channel.open_connections == 1
        assert not c._data_channel(0).unix
    check(p)
    big = layer_norm_call(rng, (2048, 1024))  # 8 MiB tensors and result: inline over TLS by default
    with Client(served.address, root_certificates=certs.ca.cert, unix_socket=False, **identity) as c:
        c.run(OP, **big)
    check(big)
    # Plaintext on the TLS port is never admitted: at most a TLS alert record, then the close.
    with socket.create_connection(("127.0.0.1", served.server.data_channel.port), timeout=10) as sock:
        sock.sendall(MAGIC + b"\0" * 16)
        try:
            answer = sock.recv(64)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" or answer[0] == 0x15  # 0x15: a TLS alert
    wait_for(lambda: not served.server.data_channel.open_connections)


def test_unreachable_data_channel_falls_back_to_grpc(serve, rng, caplog):
    served = serve()
    served.server.data_channel.stop(0)  # offered, but nothing listens any more
    p = layer_norm_call(rng, (4, 16))
    with caplog.at_level(logging.WARNING, "aclnn_client"), Client(served.address) as c:
        c.run(OP, **p)
    check(p)
    assert "using gRPC only" in caplog.text


def test_client_deadline_applies_on_the_data_channel(serve, rng):
    served = serve(max_concurrency=1, max_queue=4)
    p = layer_norm_call(rng, (4, 16))
    with served.engine.admission.slot({}), Client(served.address, timeout=0.3) as c:
        with pytest.raises(AclnnError) as raised:
            c.run(OP, **p)  # queued behind the held slot until its deadline
    assert raised.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    "address,host",
    [("127.0.0.1:5", "127.0.0.1"), ("[::1]:5", "::1"), ("node-3:5", "node-3"), ("unix:/tmp/s", None)],
)
def test_data_channel_host(address, host):
    assert data_channel_host(address) == host


def test_auto_socket_directories_of_dead_servers_are_removed(serve):
    """A server killed (SIGKILL) leaves its `auto` directory and socket under the temp dir (hundreds piled
    up); the next server with `auto` removes this user's whose socket answers nobody. One whose socket
    is listened on, a young one (a server still starting) and another user's stay."""
    import stat
    import tempfile

    def made(listening: bool, age_s: float, uid: int | None = None) -> tuple[str, socket.socket]:
        directory = tempfile.mkdtemp(prefix="aclnn-serve-")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(os.path.join(directory, "data.sock"))
        if listening:
            sock.listen()
        else:
            sock.close()  # the file stays, as a killed server leaves it
        if uid is not None:
            os.chown(directory, uid, uid)
        os.utime(directory, (time.time() - age_s, time.time() - age_s))
        return directory, sock

    dead, _ = made(listening=False, age_s=3600)
    live, listener = made(listening=True, age_s=3600)
    young, _ = made(listening=False, age_s=0)
    others = made(listening=False, age_s=3600, uid=65534)[0] if os.getuid() == 0 else None
    try:
        serve(unix_socket="auto")
        assert not os.path.exists(dead)
        assert os.path.exists(live) and os.path.exists(young)
        assert others is None or stat.S_ISDIR(os.lstat(others).st_mode)
    finally:
        listener.close()
        for directory in (live, young, others):
            if directory is not None:
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
                os.rmdir(directory)
