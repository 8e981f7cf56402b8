"""Device memory on the NPU backend, against the fake CANN: buffers in NPU memory, calls over them
without host copies, ACL streams lent to client streams without per-call synchronization.

The fake runs a kernel only when its stream is synchronized, and counts a copy, memset or free of
device memory that a queued kernel still addresses as misuse (conftest's `no_misuse`), so a
transfer that does not wait for queued work, or memory released under it, fails these tests.
"""

from __future__ import annotations

import gc
import re
import threading
import time

import numpy as np
import pytest
import test_device_memory as suite
from oracle import assert_close
from test_device_memory import layer_norm_reference, on_device

from aclnn_client import AclnnError, Client
from aclnn_common.device import DeviceBuffer
from aclnn_server import Engine, LocalClient, ServerOptions, create_server
from aclnn_server.backends.npu import NpuBackend
from aclnn_server.engine import CallContext

LN = "aclnnLayerNorm"
ROWS, COLS = 8, 32

# The device-memory suite, run here again with this module's `device_client` (NPU memory).
suite.collect_into(globals())


@pytest.fixture(params=["grpc", "data-channel", "local"])
def device_client(request: pytest.FixtureRequest, npu_backend):
    yield from suite.clients_of(request, npu_backend, "npu_address")


class TenantClient(LocalClient):
    """LocalClient calling as `owner` (an identity, as the transports set from a caller's credentials)."""

    def __init__(self, backend: NpuBackend, owner: str) -> None:
        super().__init__(backend)
        self.owner = owner

    def _call(self, stream: int | None = None) -> CallContext:
        return CallContext(owner=self.owner, session=self._session, stream=stream)

    def _storage(self, buf: DeviceBuffer, name: str):
        return self.engine.buffers.slice(self.owner, self._session, buf.id, buf.offset, name)


class LayerNormOnDevice:
    """x, out, mean and rstd of a LayerNorm in one device allocation of client `c`."""

    def __init__(self, c: LocalClient | Client, x: np.ndarray) -> None:
        self.c, self.x = c, x
        self.buf = c.malloc(2 * x.nbytes + 8 * x.shape[0])
        self.xb, self.yb, self.stats = self.buf, self.buf + x.nbytes, self.buf + 2 * x.nbytes
        c.memcpy(self.xb, x)

    def run(self, stream: int | None) -> None:
        rows, cols = self.x.shape
        self.c.run(
            LN,
            input=on_device(self.xb, (rows, cols)),
            normalizedShape=[cols],
            eps=1e-5,
            out=on_device(self.yb, (rows, cols)),
            meanOutOptional=on_device(self.stats, (rows, 1)),
            rstdOutOptional=on_device(self.stats + 4 * rows, (rows, 1)),
            stream=stream,
        )

    def check(self, x: np.ndarray | None = None) -> None:
        x = self.x if x is None else x
        y = np.empty_like(x)
        self.c.memcpy(y, self.yb)
        assert_close(y, layer_norm_reference(x, x, np.ones(x.shape[1]), np.zeros(x.shape[1]))[0], "out")


def launches(fake, start: int = 0) -> list[int]:
    """The ACL stream of each aclnnLayerNorm launch in the fake's log."""
    return [int(m[1]) for line in fake.log()[start:] if (m := re.match(rf"{LN} executor=\d+ stream=(\d+)", line))]


def wait_for_launches(fake, count: int) -> None:
    """Calls queued behind others are launched by the engine's stream workers: waits until `count` were launched."""
    deadline = time.monotonic() + 10
    while fake.calls(LN) < count:
        assert time.monotonic() < deadline, "the queued calls were never launched"
        time.sleep(0.005)


def in_use(backend: NpuBackend) -> int:
    """Device bytes the caching allocator has lent out (not cached for reuse)."""
    return backend.allocator.reserved_bytes - backend.allocator.cached_bytes


def test_a_chain_on_device_memory_copies_nothing_and_never_waits(fake, npu_backend, rng):
    """Launches over the buffers' own memory, all queued before anything synchronizes; one synchronize runs them."""
    c = LocalClient(npu_backend)
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    ln = LayerNormOnDevice(c, x)
    copies, syncs, launched = fake.calls("aclrtMemcpy"), fake.calls("aclrtSynchronizeStream"), fake.calls(LN)
    queued = fake.queued()
    fake.clear_log()
    for _ in range(5):
        ln.run(stream=1)
    wait_for_launches(fake, launched + 5)
    assert fake.queued() == queued + 5  # launched, none run: nobody waited for them
    assert fake.calls("aclrtMemcpy") == copies and fake.calls("aclrtSynchronizeStream") == syncs
    c.synchronize(1)
    assert fake.queued() == queued and fake.calls("aclrtSynchronizeStream") == syncs + 1
    log = fake.log()
    assert len(set(launches(fake))) == 1  # one ACL stream, in submission order
    first_sync = next(i for i, line in enumerate(log) if line.startswith("aclrtSynchronizeStream"))
    assert all(i < first_sync for i, line in enumerate(log) if line.startswith(f"{LN} executor="))
    assert [line for line in log if line.startswith("kernel ")] == [
        line for line in log[first_sync:] if line.startswith("kernel ")
    ]
    assert fake.calls("aclrtMemcpy") == copies
    ln.check()
    c.close()


@pytest.mark.parametrize("transport", ["data-channel", "grpc", "local"])
def test_a_call_on_an_idle_stream_is_launched_before_run_returns(fake, npu_backend, npu_address, rng, transport):
    """As aclnnX launches on its caller's thread: the server launches it while the caller waits for
    the reply (no hand-off to a stream worker), and nobody waits for the kernel."""
    c = LocalClient(npu_backend) if transport == "local" else Client(npu_address, data_channel=transport != "grpc")
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    ln = LayerNormOnDevice(c, x)
    c.synchronize()
    launched, queued, syncs = fake.calls(LN), fake.queued(), fake.calls("aclrtSynchronizeStream")
    for i in range(3):
        ln.run(stream=2)
        assert fake.calls(LN) == launched + i + 1  # launched when run returned
    assert fake.queued() == queued + 3 and fake.calls("aclrtSynchronizeStream") == syncs  # none ran yet
    c.synchronize(2)
    assert fake.queued() == queued
    ln.check()
    c.close()


def test_a_call_finding_no_free_slot_is_launched_by_its_stream_worker(fake, npu_backend, rng):
    """Its caller does not wait for an execution slot: the call is queued, and launched once one frees."""
    c = LocalClient(npu_backend, max_concurrency=1)
    ln = LayerNormOnDevice(c, rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32))
    c.synchronize()
    launched = fake.calls(LN)
    with c.engine.admission.slot({}):  # another call's execution
        ln.run(stream=2)
        assert fake.calls(LN) == launched
    wait_for_launches(fake, launched + 1)
    c.synchronize(2)
    ln.check()
    c.close()


def test_transfers_wait_for_the_launches_queued_on_their_buffers(fake, npu_backend, rng):
    """A read sees what queued calls wrote; a write lands after the queued calls that read the old bytes."""
    c = LocalClient(npu_backend)
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    ln = LayerNormOnDevice(c, x)
    ln.run(stream=2)
    ln.check()  # no synchronize: the read waits for the launch
    ln.run(stream=2)
    c.memcpy(ln.xb, 3 * x)  # overwrites the input the queued call reads: after it ran
    ln.check(x)
    ln.run(stream=2)
    copy = c.malloc(x.nbytes)
    c.memcpy(copy, ln.yb, x.nbytes)  # device -> device: after the queued call wrote
    y = np.empty_like(x)
    c.memcpy(y, copy)
    assert_close(y, layer_norm_reference(3 * x, x, np.ones(COLS), np.zeros(COLS))[0], "out")
    ln.run(stream=2)
    c.memset(ln.yb, 0, x.nbytes)  # after the queued call wrote
    c.memcpy(y, ln.yb)
    assert not y.any()
    c.synchronize(2)

    scratch = c.malloc(64)
    c.memcpy(scratch, np.arange(64, dtype=np.uint8))
    c.memcpy(scratch + 8, scratch, 48)  # overlapping ranges of one buffer, as memmove
    back = np.empty(64, np.uint8)
    c.memcpy(back, scratch)
    assert np.array_equal(back, np.r_[0:8, 0:48, 56:64])
    c.close()


def test_a_device_fault_surfaces_at_synchronize_once(fake, npu_backend, rng):
    c = LocalClient(npu_backend)
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    ln = LayerNormOnDevice(c, x)
    fake.fail_next(f"kernel:{LN}", 507015)
    launched = fake.calls(LN)
    ln.run(stream=3)  # queued: returns at once
    ln.run(stream=3)
    wait_for_launches(fake, launched + 2)
    streams = fake.created("stream")
    with pytest.raises(AclnnError) as err:
        c.synchronize(3)
    assert err.value.code == 361001
    assert "stream 3 failed on the device" in err.value.message and "507015" in err.value.message
    c.synchronize(3)  # reported once
    assert fake.created("stream") == streams + 1  # the failed ACL stream was replaced
    ln.run(stream=3)  # and the stream works again
    c.synchronize(3)
    ln.check()

    # Found by a transfer: kept for the stream, reported at its next call (skipping the calls after
    # it, as any failure on a stream) and at its synchronize.
    fake.fail_next(f"kernel:{LN}", 507015)
    ln.run(stream=3)
    c.memcpy(np.empty(4, np.uint8), ln.yb, 4)  # waits for the launch, which fails: not this copy's failure
    ln.run(stream=3)
    with pytest.raises(AclnnError) as err:
        c.synchronize(3)
    assert "earlier call queued on this stream failed on the device" in err.value.message
    assert "507015" in err.value.message
    c.synchronize(3)

    # A call on host arrays made on the stream runs after what is queued there, and reports its fault.
    fake.fail_next(f"kernel:{LN}", 507015)
    ln.run(stream=3)
    rows, cols = x.shape
    host = dict(input=x, normalizedShape=[cols], eps=1e-5, out=np.empty_like(x))
    host.update(meanOutOptional=np.empty((rows, 1), np.float32), rstdOutOptional=np.empty((rows, 1), np.float32))
    with pytest.raises(AclnnError) as err:
        c.run(LN, stream=3, **host)
    assert err.value.code == 361001 and "507015" in err.value.message
    c.synchronize(3)
    c.run(LN, stream=3, **host)
    assert_close(host["out"], layer_norm_reference(x, x, np.ones(cols), np.zeros(cols))[0], "out")
    c.close()


def test_a_failed_launch_surfaces_at_synchronize_and_leaks_nothing(fake, npu_backend, rng):
    c = LocalClient(npu_backend)
    ln = LayerNormOnDevice(c, rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32))
    c.synchronize()
    gc.collect()
    executors, tensors = fake.live("executor"), fake.live("tensor")
    fake.fail_next(LN, 561002)
    ln.run(stream=4)
    with pytest.raises(AclnnError) as err:
        c.synchronize(4)
    assert err.value.code == 561002 and "queued on stream 4 failed" in err.value.message
    assert (fake.live("executor"), fake.live("tensor")) == (executors, tensors)
    c.close()


def test_queued_launches_keep_what_they_use_until_they_ran(fake, npu_backend, rng):
    """Executors, tensors and workspaces live until the stream is synchronized; a buffer freed meanwhile goes
    back to the allocator then; a session that ends without synchronizing or freeing leaves nothing."""
    gc.collect()
    before = fake.snapshot()
    used = in_use(npu_backend)
    c = LocalClient(npu_backend)
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    ln = LayerNormOnDevice(c, x)
    dy = c.malloc(x.nbytes)
    c.memcpy(dy, x)
    grads = c.malloc(x.nbytes + 8 * COLS)
    ln.run(stream=5)
    c.run(
        "aclnnLayerNormBackward",
        gradOut=on_device(dy, x.shape),
        input=on_device(ln.xb, x.shape),
        normalizedShape=[COLS],
        mean=on_device(ln.stats, (ROWS, 1)),
        rstd=on_device(ln.stats + 4 * ROWS, (ROWS, 1)),
        outputMask=[True, True, True],
        gradInputOut=on_device(grads, x.shape),
        gradWeightOut=on_device(grads + x.nbytes, (COLS,)),
        gradBiasOut=on_device(grads + x.nbytes + 4 * COLS, (COLS,)),
        stream=5,
    )
    deadline = time.monotonic() + 10
    while fake.queued() < 2:  # both launched by the stream's worker, neither run
        assert time.monotonic() < deadline, "the queued calls were never launched"
        time.sleep(0.005)
    assert fake.live("executor") == before["executor"] + 2
    c.free(dy)  # the queued backward still reads it
    with_workspace = in_use(npu_backend)
    c.synchronize(5)
    assert fake.live("executor") == before["executor"]
    assert in_use(npu_backend) < with_workspace  # dy and the backward's workspace went back to the allocator
    launched = fake.calls(LN)
    ln.run(stream=6)
    ln.run(stream=7)
    wait_for_launches(fake, launched + 2)
    c.close()  # the session ends: its queued launches run, its buffers and ACL streams go
    gc.collect()
    assert fake.queued() == 0 and in_use(npu_backend) == used
    for kind in ("tensor", "intArray", "boolArray", "executor"):
        assert fake.live(kind) == before[kind], kind


def test_closing_the_backend_with_queued_launches_leaves_nothing(fake, rng):
    gc.collect()
    before = fake.snapshot()
    backend = NpuBackend(0)
    c = LocalClient(backend)
    ln = LayerNormOnDevice(c, rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32))
    launched = fake.calls(LN)
    for stream in (1, 2, 3):
        ln.run(stream=stream)
    wait_for_launches(fake, launched + 3)
    backend.close()
    assert fake.snapshot() == before
    c.close()  # after the backend: nothing left to release


def test_session_lapse_on_a_server_releases_device_memory(fake, rng):
    backend = NpuBackend(0)
    server, port, engine = create_server(
        ServerOptions(host="127.0.0.1", port=0, session_ttl_s=0.3), engine=Engine(backend)
    )
    server.start()
    try:
        used = in_use(backend)
        c = Client(f"127.0.0.1:{port}")
        x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
        ln = LayerNormOnDevice(c, x)
        ln.run(stream=1)
        ln.run(stream=2)
        c.close()  # goes away without freeing or synchronizing
        for _ in range(100):
            server.storage.reap()
            if not len(engine.buffers):
                break
            time.sleep(0.05)
        gc.collect()
        assert len(engine.buffers) == 0 and in_use(backend) == used and fake.queued() == 0
    finally:
        server.stop(None).wait()
        backend.close()


def test_tenants_never_share_an_acl_stream(fake, rng):
    """Two identities' stream 1 run on two ACL streams; a fault in one surfaces only at its own
    synchronize, also when a third tenant takes its ACL stream over (the pool's cap) before it synchronized."""
    backend = NpuBackend(0, streams=1, max_streams=2)
    alice, bob, carol = (TenantClient(backend, name) for name in ("alice", "bob", "carol"))
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    calls = {c.owner: LayerNormOnDevice(c, x * (i + 1)) for i, c in enumerate((alice, bob, carol))}
    try:
        start = len(fake.log())
        fake.fail_next(f"kernel:{LN}", 507015)
        for client in (alice, bob):
            launched = fake.calls(LN)
            calls[client.owner].run(stream=1)
            wait_for_launches(fake, launched + 1)
        a, b = launches(fake, start)
        assert a != b  # same stream id, different identities: different ACL streams
        launched, streams = fake.calls(LN), fake.created("stream")
        calls["carol"].run(stream=1)  # the pool is full: carol takes over the least recently used, alice's
        wait_for_launches(fake, launched + 1)
        assert fake.created("stream") == streams + 1  # alice's work, synchronized first, failed: a fresh stream
        assert launches(fake, start)[-1] not in (a, b)
        bob.synchronize(1)
        carol.synchronize(1)
        calls["bob"].check()
        calls["carol"].check()
        with pytest.raises(AclnnError) as err:
            alice.synchronize(1)
        assert "507015" in err.value.message and "stream 1" in err.value.message
        alice.synchronize(1)
    finally:
        for client in (alice, bob, carol):
            client.close()
        backend.close()


def test_one_identity_holds_at_most_its_share_of_acl_streams(fake, rng):
    """Past its cap, an identity's client streams take over its own least recently used ACL streams, in
    order: each call still runs after the earlier ones on its stream."""
    backend = NpuBackend(0, streams=1, max_streams=8, max_streams_per_identity=2)
    c = TenantClient(backend, "alice")
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    lns = [LayerNormOnDevice(c, x * (i + 1)) for i in range(4)]
    try:
        start = len(fake.log())
        for _ in range(2):
            for stream, ln in enumerate(lns):
                ln.run(stream=stream)
        c.synchronize()
        assert len(set(launches(fake, start))) == 2
        for ln in lns:
            ln.check()
    finally:
        c.close()
        backend.close()


def test_a_full_launch_queue_is_synchronized_before_the_next_launch(fake, rng):
    backend = NpuBackend(0)
    backend.streams.max_queued = 3
    c = LocalClient(backend)
    ln = LayerNormOnDevice(c, rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32))
    try:
        syncs = fake.calls("aclrtSynchronizeStream")
        for _ in range(7):
            ln.run(stream=1)
        c.synchronize(1)
        assert fake.calls("aclrtSynchronizeStream") - syncs == 3  # after launches 3 and 6, and at synchronize
        ln.check()
    finally:
        c.close()
        backend.close()


def test_tenants_and_streams_at_once_on_a_small_pool(fake, rng):
    """Three identities, two streams each, running, copying and synchronizing at once on three ACL
    streams: every result is right, and nothing waits forever."""
    backend = NpuBackend(0, streams=1, max_streams=3, max_streams_per_identity=2)
    clients = [TenantClient(backend, name) for name in ("alice", "bob", "carol")]
    errors: list[BaseException] = []

    def work(c: TenantClient, stream: int, seed: int) -> None:
        try:
            x = np.random.default_rng(seed).uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
            ln = LayerNormOnDevice(c, x)
            for i in range(6):
                ln.run(stream=stream)
                if i % 3 == 2:
                    c.synchronize(stream)
                ln.check()  # waits for the launch, whichever ACL stream it is on by now
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(c, stream, 10 * i + stream))
        for i, c in enumerate(clients)
        for stream in (1, 2)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a worker is stuck"
        assert not errors, errors
        assert len(backend.streams) <= 3  # the cap
    finally:
        for c in clients:
            c.close()
        backend.close()


def test_two_tokens_on_one_server_keep_their_faults_apart(fake, rng, tmp_path):
    """Through gRPC: each bearer token is an identity with its own ACL stream for its stream 1, so
    bob's synchronize runs only bob's kernel, never alice's faulty one queued before it."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice\nbob\n")
    backend = NpuBackend(0)
    options = ServerOptions(host="127.0.0.1", port=0, auth_token_file=tokens)
    server, port, _ = create_server(options, engine=Engine(backend))
    server.start()
    x = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32)
    try:
        with Client(f"127.0.0.1:{port}", token="alice") as alice, Client(f"127.0.0.1:{port}", token="bob") as bob:
            mine, theirs = LayerNormOnDevice(alice, x), LayerNormOnDevice(bob, 2 * x)
            gamma = alice.malloc(4 * COLS)
            alice.memcpy(gamma, np.ones(COLS, np.float32))
            start, launched, ran = len(fake.log()), fake.calls("aclnnRmsNorm"), fake.calls("kernel:aclnnRmsNorm")
            fake.fail_next("kernel:aclnnRmsNorm", 507015)
            alice.run(
                "aclnnRmsNorm",
                x=on_device(mine.xb, x.shape),
                gamma=on_device(gamma, (COLS,)),
                epsilon=1e-6,
                yOut=on_device(mine.yb, x.shape),
                rstdOut=on_device(mine.stats, (ROWS, 1)),
                stream=1,
            )
            deadline = time.monotonic() + 10
            while fake.calls("aclnnRmsNorm") == launched:  # alice's launch, queued before bob's
                assert time.monotonic() < deadline
                time.sleep(0.005)
            theirs.run(stream=1)
            bob.synchronize(1)
            theirs.check()
            assert fake.calls("kernel:aclnnRmsNorm") == ran  # alice's kernel has not run: not on bob's stream
            with pytest.raises(AclnnError) as err:
                alice.synchronize(1)
            assert "507015" in err.value.message and "stream 1" in err.value.message
            rms = [line for line in fake.log()[start:] if line.startswith("aclnnRmsNorm executor=")]
            assert len(rms) == 1 and launches(fake, start)[0] != int(re.search(r"stream=(\d+)", rms[0])[1])
    finally:
        server.stop(None).wait()
        backend.close()
