"""Progress deadlines, as a tenant that announces bytes and goes quiet would meet them (issue 25, finding 10):
uploads and replies must keep a minimum pace on the data channel and on gRPC streams alike, and one
identity's stalled transfers hold at most its share of the data channel's workers."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from layer_norm_cases import layer_norm_call
from test_data_channel import answers_keepalive, connect, reply, request, ticket
from test_data_channel_abuse import closed_by_server
from test_shared_memory import start_server
from test_tenants import metadata, op_call
from test_transport import wait_for

from aclnn_client import Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.chunks import to_chunks
from aclnn_common.framing import DOWNLOAD, MAGIC, UPLOAD

MIB = 1 << 20


def test_silent_uploads_hold_their_identitys_share_of_the_workers_until_their_pace_lapses(serve, token_file):
    """Uploads announced and never sent hold at most half of the data channel's workers, and only until
    they fall behind the minimum pace (the grace period, here 1 s): another tenant is served meanwhile."""
    served = serve(
        auth_token_file=token_file,
        max_concurrency=1,
        max_queue=2,  # 7 data-channel workers: 3 for one identity
        data_handshake_timeout_s=1.0,
        memory_budget_bytes=4 << 30,
    )
    offer = ticket(served.address, "a", token="alice")
    silent = []
    try:
        for _ in range(8):
            sock = connect(offer)
            assert reply(sock)[0]
            sock.sendall(request(UPLOAD, 64 * MIB))  # 64 MiB announced, none sent
            silent.append(sock)
        with Client(served.address, token="bob", unix_socket=False) as bob:
            bob.list_operators()  # over gRPC
            channel = bob._data_channel(0)
            assert channel is not None
            channel.call("KeepAlive", pb.Empty(), None, 10)  # on a worker of its own
            assert not any(closed_by_server(sock, 0.0) for sock in silent[:3])  # the stalled ones still stand
        for sock in silent:
            assert closed_by_server(sock, 10.0)  # each at its pace's deadline, parked ones after
    finally:
        for sock in silent:
            sock.close()
    wait_for(lambda: served.engine.ledger.held == 0)


def test_two_identities_keeping_the_pace_leave_a_worker_for_a_third(serve, tmp_path):
    """Two identities whose transfers hold their workers (stalled uploads here; uploads that keep the
    minimum pace hold them as long as they like) cannot take every worker: one that holds some takes
    another only while more than the few kept for identities holding none are free, so a third
    identity is served at once, while the stalled uploads still stand."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice\nbob\ncarol\n")
    served = serve(
        auth_token_file=tokens,
        max_concurrency=1,
        max_queue=3,  # 8 data-channel workers: 4 for one identity, 1 kept for identities holding none
        data_handshake_timeout_s=4.0,  # the stalled uploads' grace
        memory_budget_bytes=4 << 30,
    )
    channel = served.server.data_channel
    stalled = []
    try:
        for token in ("alice", "bob"):
            offer = ticket(served.address, token, token=token)
            for _ in range(6):
                stalled.append(connect(offer))
                assert reply(stalled[-1])[0]  # admitted while workers are free
        carol = ticket(served.address, "carol", token="carol")
        for sock in stalled:
            sock.sendall(request(UPLOAD, 64 * MIB))  # 64 MiB announced, none sent
        wait_for(lambda: channel._busy_total >= 7, timeout=1.0)  # alice 4, bob 3: 1 worker free
        started = time.monotonic()
        with connect(carol) as sock:  # its handshake needs a worker too
            assert reply(sock)[0]
            assert answers_keepalive(sock)
        assert time.monotonic() - started < 2.0  # not once the stalled uploads are cut, after 4 s
        assert not any(closed_by_server(sock, 0.0) for sock in stalled)  # they all still stand
    finally:
        for sock in stalled:
            sock.close()
    wait_for(lambda: served.engine.ledger.held == 0)


def test_a_reply_nobody_reads_is_cut_off_at_its_pace(serve, rng):
    """A download (and any reply) whose reader stopped holds its worker and memory only until it falls
    behind the minimum pace, on the data channel."""
    served = serve(data_handshake_timeout_s=1.0)
    p = layer_norm_call(rng, (1024, 4096))  # gradInput: 16 MiB, kept on the server
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        handle = (
            stub.Run(op_call(p, keep=("gradInputOut",)), metadata=metadata(session="s1")).outputs["gradInputOut"].handle
        )
    offer = ticket(served.address, "s1")
    payload = pb.TensorHandle(handle=handle).SerializeToString()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", offer.port))
        sock.sendall(MAGIC + offer.ticket)
        assert reply(sock)[0]
        started = time.monotonic()
        sock.sendall(request(DOWNLOAD, len(payload)) + payload)  # never read
        wait_for(lambda: served.server.data_channel.open_connections == 0, timeout=15)  # closed by the server
        elapsed = time.monotonic() - started
    assert elapsed < 10.0  # not the old 5 s + 16 s allowance for its size
    with connect(offer) as sock:  # the server is in step for others
        assert reply(sock)[0]
        assert answers_keepalive(sock)


def test_a_quiet_grpc_upload_is_cancelled_once_behind_the_pace(serve):
    """gRPC streams had no deadline: an UploadTensor that announces bytes and goes quiet is cancelled
    once behind the minimum pace (not at the client's deadline, or never), and gives its bytes back."""
    served = serve(data_handshake_timeout_s=1.0)
    release = threading.Event()

    def quiet_upload():
        yield pb.TensorChunk(total_size=64 * MIB, offset=0, data=bytes(1024))
        release.wait(60)

    try:
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.AclnnStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as stopped:
                stub.UploadTensor(quiet_upload(), metadata=metadata(session="s1"), timeout=60)
            assert stopped.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 10.0
            wait_for(lambda: served.engine.ledger.held == 0)
    finally:
        release.set()


def test_an_unread_grpc_download_is_cancelled_once_behind_the_pace():
    """A DownloadTensor nobody reads is cancelled once behind the minimum pace. Against a server process:
    with client and server in one process, gRPC's shared transport at times took the whole download in."""
    proc, address = start_server("--port", "0", "--data-handshake-timeout-s", "1")
    try:
        # Without BDP probing the client's receive window stays small: the download cannot land whole.
        with grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            stub = pb_grpc.AclnnStub(channel)
            handle = stub.UploadTensor(to_chunks(memoryview(np.zeros(32 * MIB, np.uint8))), metadata=metadata())
            started = time.monotonic()
            chunks = stub.DownloadTensor(handle, metadata=metadata(), timeout=60)
            time.sleep(3.0)  # not read: the grace period (1 s) and more pass
            with pytest.raises(grpc.RpcError) as stopped:
                list(chunks)
            assert stopped.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 10.0
    finally:
        proc.kill()
        proc.wait()
