"""Device memory on the server: buffers, calls on them, streams — through Client (both transports) and LocalClient."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from oracle import assert_close
from test_data_channel import connect, reply, request, ticket
from test_transport import wait_for

from aclnn_client import AclnnError, Client, DataType, Format, create_tensor
from aclnn_client.data_channel import recv_exact
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_common.device import DeviceBuffer
from aclnn_common.framing import READ_BUFFER, REPLY
from aclnn_server import LocalClient

# The tests that take any backend's `device_client`: the modules for the torch and NPU backends'
# memory run them again with their own (`collect_into`, `clients_of`).
ANY_BACKEND = (
    "test_transfers_round_trip",
    "test_fresh_memory_is_zero",
    "test_bad_transfers_are_refused",
    "test_layer_norm_forward_and_backward_stay_on_the_server",
    "test_host_outputs_and_executors_on_device_inputs",
    "test_device_bounds_are_checked_like_any_storage",
    "test_free_while_queued_is_safe",
)


def collect_into(namespace: dict) -> None:
    for name in ANY_BACKEND:
        namespace[name] = globals()[name]


def clients_of(request: pytest.FixtureRequest, backend: object, address_fixture: str) -> Iterator:
    """A `device_client` fixture's body for a backend (or its name): in process, or through the server that
    the fixture `address_fixture` runs (gRPC alone, or with the data channel)."""
    if request.param == "local":
        c = LocalClient(backend)
    else:
        c = Client(request.getfixturevalue(address_fixture), data_channel=request.param == "data-channel")
    yield c
    c.close()


@pytest.fixture(params=["grpc", "data-channel", "local"])
def device_client(request: pytest.FixtureRequest, backend: str):
    yield from clients_of(request, backend, "server_address")


def on_device(buf: DeviceBuffer, shape: tuple[int, ...], data_type: int = DataType.FLOAT):
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return create_tensor(shape, data_type, strides, 0, Format.ND, shape, buf)


def test_transfers_round_trip(device_client, rng):
    """host -> device -> device -> host, memset, pointer offsets; sizes below and above one message."""
    for nbytes in (24, 40_000, 3 << 20):
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        a, b = device_client.malloc(nbytes), device_client.malloc(nbytes + 8)
        device_client.memcpy(a, data)
        device_client.memcpy(b + 8, a, nbytes)
        device_client.memset(b, 0xAB, 8)
        back = np.empty(nbytes + 8, np.uint8)
        device_client.memcpy(back, b)
        assert (back[:8] == 0xAB).all() and np.array_equal(back[8:], data)
        part = np.empty(8, np.uint8)
        device_client.memcpy(part, b.at(nbytes), 8)
        assert np.array_equal(part, data[-8:])
        device_client.free(a)
        device_client.free(b)


def test_fresh_memory_is_zero(device_client):
    buf = device_client.malloc(4096)
    back = np.full(4096, 9, np.uint8)
    device_client.memcpy(back, buf)
    assert not back.any()
    device_client.free(buf)


def test_bad_transfers_are_refused(device_client):
    buf = device_client.malloc(64)
    with pytest.raises(AclnnError) as err:
        device_client.memcpy(buf + 32, np.zeros(64, np.uint8))
    assert err.value.code == 161002
    with pytest.raises(AclnnError) as err:
        buf + 65
    assert err.value.param == "offset"
    with pytest.raises(AclnnError) as err:
        device_client.memset(buf, 256, 4)
    assert err.value.param == "value"
    with pytest.raises(AclnnError) as err:
        device_client.memcpy(buf, buf + 8)  # device -> device needs a size
    assert err.value.param == "nbytes"
    with pytest.raises(AclnnError) as err:
        device_client.free(buf + 8)
    assert err.value.param == "buf"
    device_client.free(buf)
    with pytest.raises(AclnnError) as err:
        device_client.free(buf)
    assert err.value.code == 161002 and "unknown or freed" in err.value.message


@pytest.mark.parametrize(
    "call,param",
    [
        (lambda c: c.malloc(-1), "size"),
        (lambda c: c.malloc(2**64), "size"),
        (lambda c: c.memset(c.malloc(8), -1, 4), "value"),
        (lambda c: c.memset(c.malloc(8), 7, -1), "size"),
    ],
    ids=["malloc -1", "malloc 2^64", "memset value -1", "memset -1 bytes"],
)
def test_counts_out_of_range_are_refused_by_name(device_client, call, param):
    """Counts the wire's unsigned fields cannot carry: 161002 naming the parameter on every client
    (through the server the encoder raised a bare ValueError, and in process memset of -1 bytes ran;
    found by a device-memory fuzz)."""
    with pytest.raises(AclnnError) as err:
        call(device_client)
    assert (err.value.code, err.value.param) == (161002, param), str(err.value)


@pytest.mark.parametrize("unix_socket", [True, False], ids=["unix", "tcp"])
def test_an_empty_write_keeps_the_data_channel_in_step(server_address, unix_socket):
    """An empty write's inline bytes read as none on the server, which took it for a raw write and
    answered twice: the next call over the connection read the stale reply (found by a device-memory fuzz)."""
    with Client(server_address, unix_socket=unix_socket) as c:
        buf = c.malloc(8)
        c.memcpy(buf, np.arange(8, dtype=np.uint8))
        c.memcpy(buf, np.zeros(0, np.uint8))
        back = np.zeros(4, np.uint8)
        c.memcpy(back, buf + 2)
        assert back.tolist() == [2, 3, 4, 5]
        c.free(buf)


def test_a_freed_buffer_is_named_by_the_parameter_using_it(device_client):
    """Through the server as in process: `dst`, `src`, or the tensor's own parameter (not `buffer`)."""
    buf = device_client.malloc(64)
    device_client.free(buf)
    x = on_device(buf, (2, 4))
    uses = {
        "dst": lambda: device_client.memcpy(buf, np.zeros(4, np.uint8)),
        "src": lambda: device_client.memcpy(np.zeros(4, np.uint8), buf),
        "input": lambda: device_client.run(
            "aclnnLayerNorm", input=x, normalizedShape=[4], weightOptional=None, biasOptional=None, eps=1e-5,
            out=np.zeros((2, 4), np.float32), meanOutOptional=None, rstdOutOptional=None,
        ),
    }  # fmt: skip
    for param, use in uses.items():
        with pytest.raises(AclnnError) as err:
            use()
        assert (err.value.code, err.value.param) == (161002, param), str(err.value)


def test_a_freed_buffer_is_reported_after_what_the_descriptors_are_refused_for(device_client):
    """The documented order (design.md): the operator, its parameter names and the error table, then
    storage. A call refused for both is refused for the first (it was the freed pointer, remotely)."""
    buf = device_client.malloc(64)
    device_client.free(buf)
    x = on_device(buf, (2, 4))
    base = dict(normalizedShape=[4], weightOptional=None, biasOptional=None, eps=1e-5)
    base.update(out=np.zeros((2, 4), np.float32), meanOutOptional=None, rstdOutOptional=None)
    calls = {
        "op": ("aclnnLayerNorms", {**base, "input": x}, 161002),
        "inputt": ("aclnnLayerNorm", {**base, "inputt": x}, 161002),
        "out": ("aclnnLayerNorm", {**base, "input": x, "out": None}, 161001),
        "weightOptional": ("aclnnLayerNorm", {**base, "input": x, "weightOptional": on_device(buf, (5,))}, 161002),
    }
    for param, (op, params, code) in calls.items():
        before = {n: v.copy() for n, v in params.items() if isinstance(v, np.ndarray)}
        with pytest.raises(AclnnError) as err:
            device_client.run(op, **params)
        assert (err.value.code, err.value.param) == (code, param), str(err.value)
        assert all(np.array_equal(params[n], v) for n, v in before.items())


def layer_norm_reference(x: np.ndarray, dy: np.ndarray, w: np.ndarray, b: np.ndarray):
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    y, mean, rstd = torch.ops.aten.native_layer_norm(t(x), [x.shape[1]], t(w), t(b), 1e-5)
    mean32, rstd32 = mean.numpy().astype(np.float32), rstd.numpy().astype(np.float32)
    grads = torch.ops.aten.native_layer_norm_backward(
        t(dy), t(x), [x.shape[1]], t(mean32), t(rstd32), t(w), t(b), [True] * 3
    )
    return y, mean, rstd, *grads


@pytest.mark.parametrize("stream", [None, 3])
def test_layer_norm_forward_and_backward_stay_on_the_server(device_client, rng, stream):
    """A chain whose tensors all live in device buffers: nothing ships until the results are copied back."""
    rows, cols = 16, 96
    x, dy = rng.uniform(-2, 2, (2, rows, cols)).astype(np.float32)
    w, b = rng.uniform(0.5, 1.5, cols).astype(np.float32), rng.uniform(-1, 1, cols).astype(np.float32)
    c = device_client
    big = c.malloc(4 * (4 * rows * cols + 2 * rows + 4 * cols))  # one allocation, carved by pointer offsets
    offsets = np.cumsum([0, rows * cols, rows * cols, rows * cols, rows * cols, rows, rows, cols, cols, cols]) * 4
    xb, yb, dyb, dxb, meanb, rstdb, wb, bb, dwb, dbb = (big + int(o) for o in offsets)
    for host, buf in ((x, xb), (dy, dyb), (w, wb), (b, bb)):
        c.memcpy(buf, host)
    xd, yd, dyd, dxd = (on_device(p, (rows, cols)) for p in (xb, yb, dyb, dxb))
    meand, rstdd = on_device(meanb, (rows, 1)), on_device(rstdb, (rows, 1))
    wd, bd, dwd, dbd = (on_device(p, (cols,)) for p in (wb, bb, dwb, dbb))
    c.run("aclnnLayerNorm", input=xd, normalizedShape=[cols], weightOptional=wd, biasOptional=bd, eps=1e-5,
          out=yd, meanOutOptional=meand, rstdOutOptional=rstdd, stream=stream)  # fmt: skip
    c.run("aclnnLayerNormBackward", gradOut=dyd, input=xd, normalizedShape=[cols], mean=meand, rstd=rstdd,
          weightOptional=wd, biasOptional=bd, outputMask=[True, True, True], gradInputOut=dxd, gradWeightOut=dwd,
          gradBiasOut=dbd, stream=stream)  # fmt: skip
    c.synchronize(stream)
    results = {}
    for name, buf, shape in (("y", yb, (rows, cols)), ("mean", meanb, (rows, 1)), ("rstd", rstdb, (rows, 1)),
                             ("dx", dxb, (rows, cols)), ("dw", dwb, (cols,)), ("db", dbb, (cols,))):  # fmt: skip
        results[name] = np.empty(shape, np.float32)
        c.memcpy(results[name], buf)
    for name, ref in zip(("y", "mean", "rstd", "dx", "dw", "db"), layer_norm_reference(x, dy, w, b)):
        assert_close(results[name], ref.reshape(results[name].shape), name)
    c.free(big)


def test_host_outputs_and_executors_on_device_inputs(device_client, rng):
    """Inputs in device buffers, outputs in host arrays (returned as usual); and a repeatable executor
    planned on device memory, executed on a stream after its input changed."""
    c, rows, cols = device_client, 8, 32
    x = rng.uniform(-2, 2, (rows, cols)).astype(np.float32)
    xb, yb = c.malloc(x.nbytes), c.malloc(x.nbytes)
    c.memcpy(xb, x)
    y = np.empty_like(x)
    c.run("aclnnRmsNorm", x=on_device(xb, x.shape), gamma=np.ones(cols, np.float32), epsilon=1e-6, yOut=y,
          rstdOut=np.empty((rows, 1), np.float32), stream=1)  # fmt: skip
    rms = lambda a: a / np.sqrt((a.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6)  # noqa: E731
    assert_close(y, rms(x), "yOut")
    rstd = c.malloc(rows * 4)
    params = dict(x=on_device(xb, x.shape), gamma=np.ones(cols, np.float32), epsilon=1e-6)
    _, executor = c.get_workspace_size(
        "aclnnRmsNorm", yOut=on_device(yb, x.shape), rstdOut=on_device(rstd, (rows, 1)), **params
    )
    c.set_executor_repeatable(executor)
    for scale in (1.0, 3.0):
        c.memcpy(xb, x * scale)
        c.execute(executor, stream=2)
        c.synchronize(2)
        c.memcpy(y, yb)
        assert_close(y, rms(x * scale), "yOut")
    c.destroy_executor(executor)
    for buf in (xb, yb, rstd):
        c.free(buf)


def test_device_bounds_are_checked_like_any_storage(device_client):
    c = device_client
    buf = c.malloc(64)
    x = on_device(buf + 32, (4, 4))  # 64 bytes from byte 32 of 64
    with pytest.raises(AclnnError) as err:
        c.run("aclnnRmsNorm", x=x, gamma=np.ones(4, np.float32), epsilon=1e-6, yOut=np.empty((4, 4), np.float32),
              rstdOut=np.empty((4, 1), np.float32))  # fmt: skip
    assert (err.value.code, err.value.param) == (161002, "x")
    misaligned = create_tensor((2,), DataType.FLOAT, (1,), 0, Format.ND, (2,), buf + 2)
    with pytest.raises(AclnnError) as err:
        c.run("aclnnRmsNorm", x=misaligned, gamma=np.ones(2, np.float32), epsilon=1e-6,
              yOut=np.empty(2, np.float32), rstdOut=np.empty(1, np.float32))  # fmt: skip
    assert (err.value.code, err.value.param) == (161002, "x")
    c.free(buf)


def test_free_while_queued_is_safe(device_client, rng):
    """Freeing a buffer that queued calls still use: they finish on its memory, which goes with them."""
    c, rows, cols = device_client, 256, 1024
    x = rng.uniform(-2, 2, (rows, cols)).astype(np.float32)
    xb, yb, statsb = c.malloc(x.nbytes), c.malloc(x.nbytes), c.malloc(rows * 8)
    c.memcpy(xb, x)
    for _ in range(4):
        c.run("aclnnLayerNorm", input=on_device(xb, x.shape), normalizedShape=[cols], eps=1e-5,
              out=on_device(yb, x.shape), meanOutOptional=on_device(statsb, (rows, 1)),
              rstdOutOptional=on_device(statsb + rows * 4, (rows, 1)), stream=5)  # fmt: skip
    c.free(xb)  # queued calls still read it
    c.synchronize(5)
    y = np.empty_like(x)
    c.memcpy(y, yb)
    assert_close(y, layer_norm_reference(x, x, np.ones(cols), np.zeros(cols))[0], "out")
    c.free(yb)
    c.free(statsb)


def test_a_queued_failure_surfaces_at_synchronize_once(rng):
    """A queued call that cannot run (its identity's buffers leave no room for its 4 MiB workspace) fails
    on its stream: later calls there are not run, the failure surfaces once, and the stream works again."""
    c = LocalClient("numpy", memory_budget_bytes=25 << 19)  # 12.5 MiB: 9.4 for stored tensors
    rows, cols = 256, 4096
    x = rng.uniform(-2, 2, (rows, cols)).astype(np.float32)
    xb, yb, stats = c.malloc(x.nbytes), c.malloc(x.nbytes), c.malloc(rows * 8)
    mean, rstd = on_device(stats, (rows, 1)), on_device(stats + rows * 4, (rows, 1))
    call = dict(input=on_device(xb, x.shape), normalizedShape=[cols], eps=1e-5, out=on_device(yb, x.shape))
    call.update(meanOutOptional=mean, rstdOutOptional=rstd)
    filler = c.malloc(1 << 20)  # leaves 3.5 MiB
    c.run("aclnnLayerNorm", stream=1, **call)  # queued: returns at once
    try:
        c.run("aclnnLayerNorm", stream=1, **call)  # the next call made on the stream, if the failure came first
    except AclnnError as err:
        failure = err
    else:  # queued behind the failed call: not run, and the failure surfaces at synchronize
        with pytest.raises(AclnnError) as err:
            c.synchronize(1)
        failure = err.value
        assert "1 calls queued after it were not run" in failure.message
    assert "queued on stream 1 failed" in failure.message and failure.code == 561101
    c.synchronize(1)  # reported once
    c.free(filler)
    c.memcpy(xb, x)
    c.run("aclnnLayerNorm", stream=1, **call)
    c.synchronize(1)
    y = np.empty_like(x)
    c.memcpy(y, yb)
    assert_close(y, layer_norm_reference(x, x, np.ones(cols), np.zeros(cols))[0], "out")
    c.close()


def test_buffers_are_counted_capped_and_end_with_the_session(serve):
    served = serve(session_ttl_s=0.5, memory_budget_bytes=64 << 20, max_tenant_bytes=32 << 20)
    engine = served.engine
    c = Client(served.address)
    a = c.malloc(1 << 20)
    assert engine.ledger.held_by_kind()["buffer"] == 1 << 20
    with pytest.raises(AclnnError) as err:  # more than the stored share of one identity can ever hold
        c.malloc(30 << 20)
    assert (err.value.code, err.value.param) == (161002, "size")
    engine.buffers.max_per_identity = 2
    c.malloc(16)
    with pytest.raises(AclnnError) as err:
        c.malloc(16)
    assert err.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    c.free(a)
    # A caller that goes away without freeing (no keepalive): its session lapses and its buffers go.
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        stub.MallocBuffer(pb.MallocRequest(size=4096), metadata=(("x-aclnn-session", "abandoned"),))
    assert len(engine.buffers) == 2
    c.close()
    for _ in range(100):
        if not len(engine.buffers):
            break
        served.server.storage.reap()
        time.sleep(0.05)
    assert len(engine.buffers) == 0 and engine.ledger.held_by_kind().get("buffer", 0) == 0


def test_an_idle_client_keeps_its_buffers_on_a_server_with_a_short_lease(serve):
    """A server's --session-ttl-s below the client's fixed 10 s renewal ended an idle client's session and
    freed its buffers under it (red-team finding). The server states its lease (KeepAlive's reply) and
    the client renews within a third of it: idle for many leases, its buffer is there, bytes intact."""
    served = serve(session_ttl_s=0.6)
    data = np.arange(4096, dtype=np.uint8)
    with Client(served.address) as c:
        c.free(c.malloc(16))  # the lease learned; then renewals that find nothing held keep it (they forgot it)
        time.sleep(0.5)
        buf = c.malloc(data.nbytes)
        c.memcpy(buf, data)
        deadline = time.monotonic() + 3.0  # five leases with no call of the client's own
        while time.monotonic() < deadline:
            served.server.storage.reap()
            time.sleep(0.1)
        back = np.empty_like(data)
        c.memcpy(back, buf)
        np.testing.assert_array_equal(back, data)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_freed_buffer_stays_held_while_a_reply_still_sends_it(serve, backend):
    """Freeing a buffer whose bytes a ReadBuffer reply is still sending (to a reader that stalls) ends
    nothing in the ledger: the reply's view keeps the memory, so it stays its owner's until the last
    byte went. Given back at the free, a tenant could hold many times its share this way."""
    served = serve(backend=backend, memory_budget_bytes=64 << 20, max_tenant_bytes=32 << 20)  # 24 MiB stored
    size = 20 << 20
    session = (("x-aclnn-session", "s1"),)
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.AclnnStub(channel)
        buf = stub.MallocBuffer(pb.MallocRequest(size=size), metadata=session).buffer
        stub.FillBuffer(pb.BufferFill(dst=pb.DeviceSlice(buffer=buf), size=size, value=0x41), metadata=session)
        reader = connect(ticket(served.address, "s1"))
        assert reply(reader) == (True, b"")
        message = pb.BufferRange(buffer=buf, offset=0, size=size).SerializeToString()
        reader.sendall(request(READ_BUFFER, len(message)) + message)
        ok, length = REPLY.unpack(recv_exact(reader, REPLY.size))  # and nothing more, for now
        assert ok and length == size
        stub.FreeBuffer(pb.BufferRef(buffer=buf), metadata=session)
        assert served.engine.ledger.held_by_kind().get("buffer", 0) >= size
        with pytest.raises(grpc.RpcError) as err:
            stub.MallocBuffer(pb.MallocRequest(size=size), metadata=session)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert bytes(recv_exact(reader, size)) == b"\x41" * size
        wait_for(lambda: served.engine.ledger.held_by_kind().get("buffer", 0) == 0)
        stub.FreeBuffer(stub.MallocBuffer(pb.MallocRequest(size=size), metadata=session), metadata=session)
        reader.close()


def test_another_session_or_a_forged_id_is_not_a_buffer(server_address):
    with Client(server_address) as owner, Client(server_address) as other:
        buf = owner.malloc(64)
        owner.memcpy(buf, np.arange(16, dtype=np.float32))
        stolen = DeviceBuffer(buf.id, buf.size, other, buf.replica)
        forged = DeviceBuffer("0" * 32, 64, other, buf.replica)
        for pointer in (stolen, forged):
            with pytest.raises(AclnnError) as err:
                other.memcpy(np.empty(16, np.float32), pointer)
            assert err.value.code == 161002 and "unknown or freed" in err.value.message
        with pytest.raises(AclnnError) as err:
            other.memcpy(np.empty(16, np.float32), buf)  # refused before it leaves this process
        assert "another client" in err.value.message


def test_execute_takes_an_input_from_a_device_buffer_checked_to_hold_it(serve):
    """An executor planned on shipped bytes, executed with its input named in a device buffer
    (ExecuteRequest.input_refs): computed from the buffer, and a buffer too small for the storage
    is 161002 naming the input (it reached the backend unbound: 561000, a traceback logged)."""
    served = serve()
    rows, cols = 4, 8
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    with Client(served.address, data_channel=False) as c, grpc.insecure_channel(served.address) as channel:
        stats = np.empty((rows, 1), np.float32)
        _, executor = c.get_workspace_size("aclnnLayerNorm", input=x, normalizedShape=[cols], eps=1e-5,
                                           out=np.empty_like(x), meanOutOptional=stats,
                                           rstdOutOptional=stats.copy())  # fmt: skip
        c.set_executor_repeatable(executor)
        small, buf = c.malloc(16), c.malloc(x.nbytes)
        moved = x[::-1].copy()  # other values than the planned ones: the buffer's are the ones computed
        c.memcpy(buf, moved)
        stub, session = pb_grpc.AclnnStub(channel), tuple(c._base_metadata)

        def execute(buffer: DeviceBuffer, offset: int = 0) -> pb.ExecuteResponse:
            ref = pb.StorageRef(device=pb.DeviceSlice(buffer=buffer.id, offset=offset))
            request = pb.ExecuteRequest(executor=executor.id.split("/")[-1], input_refs={"input": ref})
            return stub.Execute(request, metadata=session)

        for offset in (0, 16):
            with pytest.raises(grpc.RpcError) as err:
                execute(small, offset)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("input:")
        out = np.frombuffer(execute(buf).outputs["out"].data, np.float32).reshape(rows, cols)
    m = moved.astype(np.float64)
    assert_close(out, (m - m.mean(1, keepdims=True)) / np.sqrt(m.var(1, keepdims=True) + 1e-5), "out")
