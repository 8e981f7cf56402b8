"""Client streams on the server (server/streams.py): their workers, order, failures and tenants —
on the queues themselves and through a server process of its own."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from oracle import assert_close
from rms_norm_cases import rms_norm_call
from test_device_memory import on_device
from test_shared_memory import start_server

from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc
from aclnn_server import LocalClient
from aclnn_server.admission import CallAbandoned
from aclnn_server.errors import CapacityError
from aclnn_server.streams import StreamQueues

RMS = "aclnnRmsNorm"
HANG_S = 30  # a deadline that only a hang reaches


def deadline() -> float:
    return time.monotonic() + HANG_S


def queue(queues: StreamQueues, key, work) -> None:
    queues.call(key, work, lambda: None, wait=False, deadline=deadline())


def test_a_stream_with_new_work_is_served_by_the_waiting_worker():
    """A worker whose stream ran out of work waits for the next stream that gets some, and ends at close."""
    queues = StreamQueues()
    ran: list[threading.Thread] = []
    for stream in (1, 2, 1, 3):  # each burst on a stream that went idle
        queue(queues, ("alice", "s", stream), lambda: ran.append(threading.current_thread()))
        queues.synchronize("alice", "s", stream, deadline())
    assert len(ran) == 4 and len(set(ran)) == 1 and ran[0] is not threading.current_thread()
    queues.close()
    ran[0].join(HANG_S)
    assert not ran[0].is_alive()


def test_a_blocked_stream_stalls_no_other_stream():
    """Each stream with work has a thread of its own: alice's blocked call (on the worker that served
    bob before) leaves bob's streams running, and keeps alice's later call on that stream behind it."""
    queues = StreamQueues()
    order: list[str] = []
    queue(queues, ("bob", "s", 1), lambda: order.append("bob warm"))
    queues.synchronize("bob", "s", 1, deadline())  # its worker now waits for work
    release = threading.Event()
    queue(queues, ("alice", "s", 1), lambda: (release.wait(HANG_S), order.append("alice 1")))
    queue(queues, ("alice", "s", 1), lambda: order.append("alice 2"))
    for stream in (1, 2):
        queue(queues, ("bob", "s", stream), lambda stream=stream: order.append(f"bob {stream}"))
    queues.synchronize("bob", "s", None, deadline())
    assert queues.active(("alice", "s", 1)) and order[-2:] != ["alice 1", "alice 2"]
    release.set()
    queues.synchronize("alice", "s", 1, deadline())
    assert order[0] == "bob warm" and set(order[1:3]) == {"bob 1", "bob 2"}
    assert order[3:] == ["alice 1", "alice 2"]
    queues.close()


def test_calls_from_many_threads_keep_each_streams_order():
    """Submission order per stream, whoever submits and however the streams go idle in between."""
    queues = StreamQueues()
    seen: dict[int, list[int]] = {stream: [] for stream in range(4)}
    locks = {stream: threading.Lock() for stream in seen}

    def submit(stream: int) -> None:
        for i in range(200):
            with locks[stream]:  # the submission order is this thread's
                queue(queues, ("alice", "s", stream), lambda i=i: seen[stream].append(i))
            if i % 37 == 0:
                queues.synchronize("alice", "s", stream, deadline())

    threads = [threading.Thread(target=submit, args=(stream,)) for stream in seen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_S)
    queues.synchronize("alice", "s", None, deadline())
    assert all(calls == list(range(200)) for calls in seen.values())
    queues.close()


def test_a_launching_call_on_an_idle_stream_runs_on_its_callers_thread():
    """`launch`: on an idle stream the call runs before `call` returns, on the caller's thread; its
    failure stays on the stream; behind queued work it waits its turn like any queued call."""
    queues = StreamQueues()
    key = ("alice", "s", 1)
    ran: list[threading.Thread] = []
    queues.call(key, lambda: ran.append(threading.current_thread()), lambda: None, False, deadline(), launch=True)
    assert ran == [threading.current_thread()] and not queues.active(key)

    def fail() -> None:
        raise AclnnError(507015, "the kernel faulted")

    assert queues.call(key, fail, lambda: None, False, deadline(), launch=True) is None
    with pytest.raises(AclnnError) as err:
        queues.synchronize("alice", "s", 1, deadline())
    assert "queued on stream 1 failed: the kernel faulted" in err.value.message
    release = threading.Event()
    queue(queues, key, lambda: release.wait(HANG_S))
    queues.call(key, lambda: ran.append(threading.current_thread()), lambda: None, False, deadline(), launch=True)
    assert len(ran) == 1  # behind the blocked call
    release.set()
    queues.synchronize("alice", "s", 1, deadline())
    assert len(ran) == 2 and ran[1] is not threading.current_thread()
    queues.close()


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma


class RmsChain:
    """RmsNorm steps on client `c`'s device buffers, each reading the previous step's output."""

    def __init__(self, c: Client, rng: np.random.Generator, stream: int, rows: int = 16, cols: int = 64) -> None:
        self.c, self.stream, self.shape = c, stream, (rows, cols)
        self.x = rng.uniform(-2, 2, self.shape).astype(np.float32)
        self.gamma = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        self.bufs = [c.malloc(self.x.nbytes) for _ in range(2)]
        self.g, self.stats = c.malloc(self.gamma.nbytes), c.malloc(4 * rows)
        c.memcpy(self.bufs[0], self.x)
        c.memcpy(self.g, self.gamma)
        self.steps = 0

    def call(self, gamma_shape: tuple[int, ...] | None = None) -> dict:
        rows, cols = self.shape
        source, target = self.bufs[self.steps % 2], self.bufs[1 - self.steps % 2]
        return dict(
            x=on_device(source, self.shape),
            gamma=on_device(self.g, gamma_shape or (cols,)),
            epsilon=1e-6,
            yOut=on_device(target, self.shape),
            rstdOut=on_device(self.stats, (rows, 1)),
            stream=self.stream,
        )

    def step(self) -> None:
        self.c.run(RMS, **self.call())
        self.steps += 1

    def check(self) -> None:
        want = self.x
        for _ in range(self.steps):
            want = rms_norm(want, self.gamma, 1e-6).astype(np.float32)
        got = np.empty_like(self.x)
        self.c.memcpy(got, self.bufs[self.steps % 2])
        assert_close(got, want, "yOut")


@pytest.fixture
def tenants_server(tmp_path):
    """A numpy-backend server process with two identities, each holding at most 12.5 MiB."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice\nbob\n")
    proc, address = start_server(
        "--port", "0", "--auth-token-file", str(tokens), "--memory-budget-bytes", str(25 << 20),
        "--max-tenant-bytes", str(25 << 19),
    )  # fmt: skip
    yield address
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "grpc"])
def test_streams_through_a_server_process(tenants_server, rng, data_channel):
    """Two tenants' chains of RmsNorm on device buffers, each call reading the previous one's output
    (so any reordering shows), in bursts with a synchronize between them; a bad call raises at the
    call and leaves the stream alone; a call that fails while queued surfaces at synchronize, once."""
    clients = {who: Client(tenants_server, token=who, data_channel=data_channel) for who in ("alice", "bob")}
    try:
        chains = {who: RmsChain(c, rng, stream=n + 1) for n, (who, c) in enumerate(clients.items())}
        for step in range(12):  # the tenants' calls interleaved, each on its own stream
            for chain in chains.values():
                chain.step()
                if step % 4 == 3:
                    chain.c.synchronize(chain.stream)
        for chain in chains.values():
            chain.c.synchronize(chain.stream)
            chain.check()

        alice, bob = clients["alice"], clients["bob"]
        with pytest.raises(AclnnError) as err:  # validation: at the call, as aclnnXGetWorkspaceSize
            alice.run(RMS, **chains["alice"].call(gamma_shape=(65,)))
        assert err.value.code == 161002 and err.value.param == "gamma"
        alice.synchronize(1)  # nothing failed on the stream

        # alice's buffers leave no room for the numpy LayerNorm's 4 MiB workspace: it fails while queued.
        rows, cols = 256, 4096
        xb, yb, stats = alice.malloc(4 * rows * cols), alice.malloc(4 * rows * cols), alice.malloc(8 * rows)
        alice.malloc(1 << 20)  # with the chain's, 9 of alice's 9.4 MiB for stored tensors: 3.5 MiB left to run in
        mean, rstd = on_device(stats, (rows, 1)), on_device(stats + 4 * rows, (rows, 1))
        alice.run(
            "aclnnLayerNorm",
            input=on_device(xb, (rows, cols)),
            normalizedShape=[cols],
            eps=1e-5,
            out=on_device(yb, (rows, cols)),
            meanOutOptional=mean,
            rstdOutOptional=rstd,
            stream=5,
        )  # queued: returns
        with pytest.raises(AclnnError) as err:
            alice.synchronize(5)
        assert "queued on stream 5 failed" in err.value.message and err.value.code == 561101
        alice.synchronize(5)  # reported once
        bob.synchronize()  # bob's streams know nothing of it
        chains["bob"].step()
        bob.synchronize(2)
        chains["bob"].check()
    finally:
        for c in clients.values():
            c.close()


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "grpc"])
def test_a_call_waiting_for_room_in_a_full_queue_keeps_its_deadline(serve, rng, data_channel):
    """A caller whose queued calls fill its share waits for room until its own deadline: then it is
    refused and its call never runs (the queued call's context, which has no deadline, waited on:
    the client was told DEADLINE_EXCEEDED and the call later ran and wrote its output)."""
    served = serve()
    served.engine.streams.max_queued = 1
    rows, cols = 8192, 4096  # ~0.1 s a call on the numpy backend (more when loaded): the queue stays full
    busy = Client(served.address, data_channel=data_channel)
    hurried = Client(served.address, data_channel=data_channel, timeout=0.03)
    try:
        x = rng.uniform(-2, 2, (rows, cols)).astype(np.float32)
        big = [busy.malloc(x.nbytes) for _ in range(2)]
        gamma, stats = busy.malloc(4 * cols), busy.malloc(4 * rows)
        busy.memcpy(big[0], x)
        busy.memcpy(gamma, np.ones(cols, np.float32))
        small_x, small_gamma, small_y, small_stats = (hurried.malloc(n) for n in (4 * 64, 4 * 16, 4 * 64, 4 * 4))
        hurried.memcpy(small_x, np.arange(64, dtype=np.float32))
        hurried.memcpy(small_gamma, np.ones(16, np.float32))
        for source, target in ((0, 1), (1, 0)):  # the first runs, the second fills the queue
            busy.run(RMS, x=on_device(big[source], (rows, cols)), gamma=on_device(gamma, (cols,)),
                     yOut=on_device(big[target], (rows, cols)), rstdOut=on_device(stats, (rows, 1)), epsilon=1e-6,
                     stream=1)  # fmt: skip
        started = time.monotonic()
        with pytest.raises(AclnnError) as err:  # every tensor on the device: a call to queue
            hurried.run(RMS, x=on_device(small_x, (4, 16)), gamma=on_device(small_gamma, (16,)), epsilon=1e-6,
                        yOut=on_device(small_y, (4, 16)), rstdOut=on_device(small_stats, (4, 1)), stream=2)  # fmt: skip
        assert time.monotonic() - started < HANG_S
        assert "calls queued" in err.value.message or "deadline" in str(err.value).lower()  # refused, or gone
        busy.synchronize()
        time.sleep(0.2)  # what the server would still do with the refused call, it has done by now
        y = np.empty(64, np.float32)
        hurried.memcpy(y, small_y)
        assert not y.any(), "the refused call ran and wrote its output"
    finally:
        busy.close()
        hurried.close()


def test_a_caller_gone_while_waiting_for_room_is_not_queued():
    """A full share of the queue: a cancelled caller is refused (CallAbandoned) and one past its
    deadline as busy (CapacityError); neither call ever runs, and the queue goes on."""
    queues = StreamQueues(max_queued=1)
    release, ran = threading.Event(), []
    queue(queues, ("alice", "s", 1), lambda: release.wait(HANG_S))  # runs, blocked
    queue(queues, ("alice", "s", 1), lambda: ran.append("second"))  # fills alice's share
    with pytest.raises(CallAbandoned):
        queues.call(("alice", "s", 2), lambda: ran.append("cancelled"), lambda: None, False, deadline(),
                    cancelled=lambda: True)  # fmt: skip
    with pytest.raises(CapacityError):
        queues.call(("alice", "s", 2), lambda: ran.append("late"), lambda: None, False, time.monotonic() + 0.05)
    release.set()
    queues.synchronize("alice", "s", None, deadline())
    assert ran == ["second"]
    queues.close()


@pytest.mark.parametrize("transport", ["data channel", "grpc", "local"])
def test_a_stream_id_is_a_signed_64_bit_integer_on_every_client(serve, transport):
    """The same ids are taken and refused by every client and transport (the data channel's header
    holds an int64; gRPC's metadata once took any length of digits, the data channel raised
    struct.error, and True or '3' passed on one and not the other): a refusal is 161002 naming
    `stream`, before anything is sent, and the outputs stay unwritten."""
    rng = np.random.default_rng(0)
    if transport == "local":
        c = LocalClient("numpy")
    else:
        c = Client(serve().address, data_channel=transport == "data channel")
    try:
        for good in (0, -1, 2**63 - 1, -(2**63), np.int64(7)):
            call = rms_norm_call(rng)
            c.run(RMS, **call, stream=good)
            c.synchronize(good)
            assert np.isfinite(call["yOut"]).all()
        for bad in (2**63, -(2**63) - 1, 10**400, True, 1.5, "3", np.float64(2)):
            call = rms_norm_call(rng)
            y = call["yOut"].copy()
            _, executor = c.get_workspace_size(RMS, **call)
            attempts = {
                "run": lambda call=call, bad=bad: c.run(RMS, **call, stream=bad),
                "run_async": lambda call=call, bad=bad: c.run_async(RMS, **call, stream=bad).result(),
                "execute": lambda executor=executor, bad=bad: c.execute(executor, stream=bad),
                "synchronize": lambda bad=bad: c.synchronize(bad),
            }
            for what, attempt in attempts.items():
                with pytest.raises(AclnnError) as err:
                    attempt()
                assert err.value.code == 161002 and err.value.message.startswith("stream"), (what, err.value)
                assert len(err.value.message) < 120
            np.testing.assert_array_equal(call["yOut"], y)
    finally:
        c.close()


def test_the_grpc_stream_header_takes_only_what_the_data_channel_can_carry(serve):
    """x-aclnn-stream from a client of its own: decimal int64, nothing longer or looser."""
    address = serve().address
    with grpc.insecure_channel(address) as channel:
        synchronize = pb_grpc.AclnnStub(channel).Synchronize
        for good in ("0", "-9223372036854775808", "9223372036854775807"):
            synchronize(pb.Empty(), metadata=(("x-aclnn-stream", good),), timeout=HANG_S)
        for bad in ("9223372036854775808", "-9223372036854775809", "9" * 4000, "+1", "1_0", "1.0", ""):
            with pytest.raises(grpc.RpcError) as err:
                synchronize(pb.Empty(), metadata=(("x-aclnn-stream", bad),), timeout=HANG_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "x-aclnn-stream must be a signed 64-bit integer" in err.value.details()
