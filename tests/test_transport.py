"""Tensors beyond message limits, shared memory, async calls and streams — over a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
import torch
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close, t64

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc

OP = "aclnnLayerNormBackward"
MIB = 1 << 20


def check(p: dict) -> None:
    ref = layer_norm_reference(p)
    for name, r in zip(("gradInputOut", "gradWeightOut", "gradBiasOut"), ref):
        assert_close(p[name], r.reshape(p[name].shape), name)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("phase", ["run", "two-phase"])
def test_large_tensors_stream_in_chunks_and_are_freed(serve, rng, phase):
    address, server, _ = serve()
    p = layer_norm_call(rng, (512, 1024))  # 2 MiB per tensor, above a 1 MiB inline limit
    wide = np.full((512, 2048), -7.25, np.float32)
    p["gradInputOut"] = wide[:, ::2]  # a strided output view, filled chunk by chunk
    with Client(address, max_inline_bytes=MIB, data_channel=False) as c:
        if phase == "run":
            c.run(OP, **p)
        else:
            _, executor = c.get_workspace_size(OP, **p)
            c.execute(executor)
        assert server.storage.counts() == (0, 0)  # uploads and kept results were freed
    check(p)
    assert (wide[:, 1::2] == -7.25).all()
    received = server.metrics.bytes_in.labels("UploadTensor")._value.get()
    assert received >= 2 * 512 * 1024 * 4  # gradOut and input went through UploadTensor


def test_default_inline_limits_follow_the_transport(serve, rng):
    """1 MiB tensors: inline (raw) over the data channel, streamed over gRPC (GRPC_INLINE_BYTES)."""
    address, server, _ = serve()
    p = layer_norm_call(rng, (256, 1024))
    uploaded = server.metrics.bytes_in.labels("UploadTensor")
    for data_channel, streamed in ((True, 0), (False, 2 * p["input"].nbytes)):
        before = uploaded._value.get()
        with Client(address, data_channel=data_channel) as c:
            c.run(OP, **p)
        check(p)
        assert uploaded._value.get() - before == streamed


def upload(address: str, chunks, session: str = "s1") -> pb.TensorHandle:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.AclnnStub(channel).UploadTensor(iter(chunks), metadata=(("x-aclnn-session", session),))


@pytest.mark.parametrize(
    "chunks,message",
    [
        ([pb.TensorChunk(total_size=8, offset=0, data=b"1234")], "truncated: 4 of 8"),
        (
            [pb.TensorChunk(total_size=8, offset=0, data=b"12"), pb.TensorChunk(offset=4, data=b"56")],
            "offset 4 arrived where 2 was expected",
        ),
        ([pb.TensorChunk(total_size=4, offset=0, data=b"123456")], "more than the 4 bytes"),
        ([], "at least one chunk"),
        ([pb.TensorChunk(total_size=2**62, offset=0, data=b"")], "cannot hold"),
    ],
    ids=["truncated", "out-of-order", "too-long", "empty", "over-budget"],
)
def test_bad_uploads_are_refused_and_store_nothing(serve, chunks, message):
    address, server, _ = serve()
    with pytest.raises(grpc.RpcError) as raised:
        upload(address, chunks)
    assert message in raised.value.details()
    wait_for(lambda: server.storage.counts() == (0, 0) and server.engine.ledger.held == 0)
    handle = upload(address, [pb.TensorChunk(total_size=3, data=b"abc")])  # still serving
    assert handle.size == 3


def test_handles_need_their_session(serve):
    address, _, _ = serve()
    handle = upload(address, [pb.TensorChunk(total_size=3, data=b"abc")], session="alice")
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.DownloadTensor(handle, metadata=(("x-aclnn-session", "mallory"),)))
        assert "unknown" in raised.value.details()
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.DownloadTensor(handle))
        assert "x-aclnn-session" in raised.value.details()
        chunks = list(stub.DownloadTensor(handle, metadata=(("x-aclnn-session", "alice"),)))
    assert b"".join(c.data for c in chunks) == b"abc"


def test_sessions_lapse_and_free_their_tensors(serve):
    address, server, _ = serve(session_ttl_s=0.3)
    upload(address, [pb.TensorChunk(total_size=5, data=b"hello")], session="gone")
    assert server.storage.counts() == (1, 0)
    wait_for(lambda: server.storage.counts() == (0, 0))
    wait_for(lambda: server.engine.ledger.held == 0)


def test_shared_memory_moves_no_tensor_bytes_through_messages(serve, rng):
    address, server, _ = serve()
    p = layer_norm_call(rng, (256, 1024))
    with Client(address, shared_memory=True) as c:
        for _ in range(3):  # regions are registered once and reused
            c.run(OP, **p)
            check(p)
        _, executor = c.get_workspace_size(OP, **p)
        c.execute(executor)
        check(p)
        assert server.storage.counts()[1] >= 1
        received = server.metrics.bytes_in.labels("Run")._value.get()
        sent = server.metrics.bytes_out.labels("Run")._value.get()
        assert received < 3 * 4096 and sent < 3 * 4096  # descriptors only: 1 MiB tensors went through memfds
    assert server.storage.counts() == (0, 0)  # close() unregistered them


def test_regions_are_freed_when_a_client_dies(serve, tmp_path):
    address, server, _ = serve(session_ttl_s=0.5)
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, numpy as np
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from layer_norm_cases import layer_norm_call
        from aclnn_client import Client
        c = Client({address!r}, shared_memory=True)
        c.run("{OP}", **layer_norm_call(np.random.default_rng(0), (64, 256)))
        print("ran", flush=True)
        sys.stdin.read()
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ran\n"
        assert server.storage.counts()[1] >= 1
        proc.kill()
        proc.wait()
        wait_for(lambda: server.storage.counts() == (0, 0))
    finally:
        proc.kill()


def test_async_calls_in_flight(serve):
    address, _, _ = serve(max_concurrency=2)
    calls = [layer_norm_call(np.random.default_rng(i), (16, 64)) for i in range(24)]
    with Client(address) as c:
        futures = [c.run_async(OP, **p) for p in calls]
        assert all(f.result(timeout=60) is None for f in futures)
    for p in calls:
        check(p)


def test_async_errors_arrive_in_the_future(serve, rng):
    address, _, _ = serve()
    p = layer_norm_call(rng, (4, 8))
    p["mean"] = None
    with Client(address) as c:
        error = c.run_async(OP, **p).exception(timeout=30)
    assert isinstance(error, AclnnError) and (error.code, error.param) == (161001, "mean")


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_same_stream_runs_in_submission_order(serve, transport):
    """Twelve calls write one output on one stream: the last submitted must be what remains."""
    from aclnn_server import LocalClient

    address, _, _ = serve(max_concurrency=2)
    client = Client(address) if transport == "grpc" else LocalClient()
    rng = np.random.default_rng(5)
    base = layer_norm_call(rng, (32, 128), mask=(False, False, True))
    out = base["gradBiasOut"]
    grads = [rng.uniform(-1, 1, (32, 128)).astype(np.float32) for _ in range(12)]
    with client:
        futures = [client.run_async(OP, stream=7, **dict(base, gradOut=g)) for g in grads]
        other = client.run_async(OP, stream=8, **layer_norm_call(rng, (4, 8)))
        for f in [*futures, other]:
            f.result(timeout=60)
        assert_close(out, t64(grads[-1]).sum(0))
        client.run_async(OP, stream=7, **dict(base, gradOut=grads[1]))
        client.run(OP, stream=7, **dict(base, gradOut=grads[0]))  # a sync call joins the stream's order
        assert_close(out, t64(grads[0]).sum(0))


@pytest.mark.slow
@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "grpc-chunks"])
def test_tensors_above_2_gib_round_trip(serve, data_channel):
    """A 2.1 GiB input goes up and a 2.1 GiB result comes back (about 9 GiB of RAM)."""
    address, _, _ = serve(max_message_bytes=64 * MIB)
    rows, n = 540_000, 1024  # 2.06 GiB of fp32
    rng = np.random.default_rng(7)
    base = rng.uniform(-1, 1, n).astype(np.float32)
    scale = (1 + np.arange(rows) % 7).astype(np.float32)[:, None]
    x = base * scale  # every row the same pattern, scaled: mean and rstd scale with it
    g = np.broadcast_to(rng.uniform(-1, 1, n).astype(np.float32), (rows, n))
    mean = (scale * base.astype(np.float64).mean()).astype(np.float32)
    rstd = (1 / (scale * base.astype(np.float64).std())).astype(np.float32)
    dx = np.empty((rows, n), np.float32)
    db = np.empty(n, np.float32)
    with Client(address, max_inline_bytes=64 * MIB, data_channel=data_channel) as c:
        c.run(
            OP,
            gradOut=g,
            input=x,
            normalizedShape=[n],
            mean=mean,
            rstd=rstd,
            outputMask=[True, False, True],
            gradInputOut=dx,
            gradBiasOut=db,
        )
    for row in (0, 1, 6, rows // 2, rows - 1):
        ref = torch.ops.aten.native_layer_norm_backward(
            t64(g[row : row + 1]),
            t64(x[row : row + 1]),
            [n],
            t64(mean[row : row + 1]),
            t64(rstd[row : row + 1]),
            torch.ones(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.float64),
            [True, False, False],
        )[0]
        assert_close(dx[row : row + 1], ref, f"row {row}")
    assert_close(db, t64(g[0]) * rows)
