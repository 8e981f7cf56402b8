"""Only verified identities, and authentication before any slot or byte: attacks on who a caller is
(issue 25, findings 2, 4, 5 and 12), with real servers, raw gRPC and other local users."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from test_grpc_abuse import OUTPUTS, Server
from users import NOBODY, as_user, needs_root, relay

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.binding import bind
from aclnn_common.wire import encode_call
from aclnn_server.transport.auth import local_socket_uid, parse_peer, peer_identity

OP = "aclnnLayerNormBackward"


def test_wrong_tokens_take_no_call_slot_and_no_request_is_read(serve, token_file):
    """Finding 2: streams with made-up tokens (each its own would-be identity) that never send a chunk
    are refused at once, before the call limit counts them; a valid tenant is served meanwhile."""
    served = serve(auth_token_file=token_file, max_concurrency=1, max_queue=1)  # 6 call slots
    release = threading.Event()

    def no_chunk():
        release.wait(30)
        yield pb.TensorChunk(total_size=1, data=b"x")

    try:
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.AclnnStub(channel)
            started = time.monotonic()
            uploads = [
                stub.UploadTensor.future(no_chunk(), timeout=30, metadata=(("authorization", f"Bearer made-up-{i}"),))
                for i in range(40)
            ]
            for upload in uploads:
                with pytest.raises(grpc.RpcError) as refused:
                    upload.result(timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - started < 5, "refused at once, without waiting for a chunk"
            assert served.server.call_limit.active == 0
            bogus_unary = [
                stub.Run.future(pb.OpCall(op=OP), metadata=(("authorization", f"Bearer x{i}"),)) for i in range(20)
            ]
            for call in bogus_unary:
                with pytest.raises(grpc.RpcError) as refused:
                    call.result(timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(served.address, token="alice") as alice:
            alice.run(OP, **layer_norm_call(np.random.default_rng(0), (4, 8)))
    finally:
        release.set()
    assert served.server.metrics.refused._value.get() == 0  # none of them took (or was refused) a slot


def test_made_up_tokens_without_a_token_file_are_one_identity(serve):
    """Finding 5: with no token file a bearer token proves nothing: every made-up token of one local user
    is that user, so its caps hold together."""
    served = serve(max_tenant_executors=2)
    p = layer_norm_call(np.random.default_rng(1), (4, 8))
    clients = [Client(served.address, token=token) for token in ("x1", "x2", "x3")]
    try:
        for c in clients[:2]:
            c.get_workspace_size(OP, **p)
        with pytest.raises(AclnnError) as refused:
            clients[2].get_workspace_size(OP, **p)
    finally:
        for c in clients:
            c.close()
    assert refused.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "live for this caller" in refused.value.message


def test_a_local_user_is_not_taken_for_another_by_its_port(server_process):
    """Finding 4: another user binds 127.0.0.2:P, where P is a victim's client port, and calls through it.
    It is itself (the exact connection's owner), not the victim: the victim's upload stays invisible."""
    needs_root()
    _, address = server_process
    victim_relay, victim_address, port = relay(0, address)
    attacker_relay, attacker_address, _ = relay(NOBODY, address, source="127.0.0.2", source_port=port)
    session = (("x-aclnn-session", "shared-name"),)
    try:
        with grpc.insecure_channel(victim_address) as channel:
            handle = pb_grpc.AclnnStub(channel).UploadTensor(
                iter([pb.TensorChunk(total_size=4, data=b"\x01\x02\x03\x04")]), metadata=session
            )
            with grpc.insecure_channel(attacker_address) as stolen:
                with pytest.raises(grpc.RpcError) as refused:
                    list(pb_grpc.AclnnStub(stolen).DownloadTensor(handle, metadata=session))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "unknown" in refused.value.details() or "another client" in refused.value.details()
            chunks = list(pb_grpc.AclnnStub(channel).DownloadTensor(handle, metadata=session))
            assert b"".join(c.data for c in chunks) == b"\x01\x02\x03\x04"
    finally:
        for p in (victim_relay, attacker_relay):
            p.kill()
            p.wait()


def test_only_an_established_connection_names_a_local_user():
    """Finding 4: a listening or closing socket on the client's address is nobody (TIME_WAIT reports uid 0)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        server = listener.getsockname()
        client = socket.create_connection(server)
        accepted, _ = listener.accept()
        port = client.getsockname()[1]
        loopback = ipaddress.ip_address("127.0.0.1")
        assert local_socket_uid(loopback, port, loopback, server[1]) == os.getuid()
        assert local_socket_uid(loopback, port, loopback, server[1] + 1) is None  # another server port
        assert local_socket_uid(loopback, server[1], loopback, 0) is None  # the listener itself
        client.close()  # the client closes first: its end lingers in TIME_WAIT
        accepted.close()
        time.sleep(0.05)
        assert local_socket_uid(loopback, port, loopback, server[1]) is None


def test_ipv6_loopback_users_are_told_apart():
    """Finding 12: over ::1, each local user is itself: another user's executor is unknown to root."""
    needs_root()
    server = Server("--host", "::1")
    address = "[::1]:" + server.address.rpartition(":")[2]
    try:
        executor = as_user(
            NOBODY,
            f"""
            p = layer_norm_cases.layer_norm_call(np.random.default_rng(0), (4, 8))
            with Client({address!r}) as c:
                print(c.get_workspace_size("{OP}", **p)[1])
            """,
        ).strip()
        with Client(address) as root, pytest.raises(AclnnError) as refused:
            root.execute(executor)
        assert (refused.value.code, refused.value.param) == (161002, "executor")
    finally:
        server.stop()


@pytest.mark.parametrize(
    "peer,parsed",
    [
        ("ipv6:%5B::1%5D:5000", ("::1", 5000)),
        ("ipv6:[::1]:5000", ("::1", 5000)),
        ("ipv6:%5B::ffff:127.0.0.1%5D:7", ("127.0.0.1", 7)),
        ("ipv4:10.1.2.3:80", ("10.1.2.3", 80)),
        ("unix:/tmp/x", None),
    ],
)
def test_grpc_peer_strings_are_decoded(peer, parsed):
    result = parse_peer(peer)
    assert (None if result is None else (str(result[0]), result[1])) == parsed


@pytest.mark.parametrize(
    "host,reached", [("localhost", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("0.0.0.0", "127.0.0.9")]
)
def test_one_local_user_is_one_tenant_from_any_loopback_address(host, reached):
    """A server bound to a name or every address is told the peer's address by gRPC, not its own: a
    local user calling from 127.0.0.2, .3 and .4 was `peer:127.0.0.N` three times, three shares of each
    limit (three times --max-tenant-executors here). Now it is its uid: the kernel is asked for the
    connection at 127.0.0.1 and, failing that, for one from its address and port to the server's port
    on any loopback address (a dump it filters by the ports); and another user (root) is itself."""
    needs_root()
    insecure = ("--insecure",) if host == "0.0.0.0" else ()
    server = Server("--host", host, "--max-tenant-executors", "2", *insecure)
    port = server.address.rpartition(":")[2]
    relays = [relay(NOBODY, f"{reached}:{port}", source=f"127.0.0.{n}") for n in (2, 3, 4)]
    rng = np.random.default_rng(0)
    try:
        made, refusals = 0, []
        for _, address, _ in relays:
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.AclnnStub(channel)
                for _ in range(2):
                    request = encode_call(OP, bind(OP, layer_norm_call(rng, (4, 8)), OUTPUTS).values, storage=False)
                    try:
                        stub.GetWorkspaceSize(request, timeout=30)
                        made += 1
                    except grpc.RpcError as exc:
                        refusals.append(exc.details())
        assert made == 2, refusals
        assert all("executor" in refusal for refusal in refusals), refusals
        with grpc.insecure_channel(f"{reached}:{port}") as channel:  # root is root, wherever it calls
            request = encode_call(OP, bind(OP, layer_norm_call(rng, (4, 8)), OUTPUTS).values, storage=False)
            pb_grpc.AclnnStub(channel).GetWorkspaceSize(request, timeout=30)
    finally:
        for proc, _, _ in relays:
            proc.kill()
            proc.wait()
        server.stop()


def test_unidentified_loopback_peers_share_one_identity():
    loopback = ipaddress.ip_address("127.0.0.1")
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))
    port = unused.getsockname()[1]  # no connection there: nobody the kernel could name
    try:
        for peer in (f"ipv4:127.0.0.{n}:{port}" for n in (1, 2, 200)):
            assert peer_identity(peer, "0.0.0.0", port + 1) == "peer:loopback"
        assert peer_identity(f"ipv6:[::1]:{port}", "::", port + 1) == "peer:loopback"
        assert peer_identity(f"ipv4:10.1.2.3:{port}", "0.0.0.0", port + 1) == "peer:10.1.2.3"
        assert local_socket_uid(loopback, port, loopback, port + 1) is None
    finally:
        unused.close()
