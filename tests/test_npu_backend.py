"""The NPU backend against a fake CANN (tests/fake_cann): no Ascend hardware needed.

The fake is compiled once per session and found through ACLNN_CANN_LIB_DIR (conftest's `fake`). The operator
conformance suites run through LocalClient(backend=NpuBackend(0)) and through a real gRPC
server whose engine holds another NpuBackend; the rest checks how the backend drives CANN:
call order, workspace, status mapping, executors, streams, and that nothing leaks.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from conformance import collect_into
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import Untouched, assert_close

from aclnn_client import AclnnError, Client
from aclnn_server import LocalClient
from aclnn_server.backends.npu import CachingAllocator, NpuBackend

OP = "aclnnLayerNormBackward"
LN_OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")
TESTS_DIR = Path(__file__).parent

# The operator conformance suites, run here again with this module's `client` fixture.
collect_into(globals())


@pytest.fixture(scope="module")
def server_address(npu_address: str) -> str:
    """The conformance suites' server: conftest's, on the NPU backend."""
    return npu_address


@pytest.fixture(params=["grpc", "local"])
def client(request: pytest.FixtureRequest, fake, npu_backend):
    c = Client(request.getfixturevalue("server_address")) if request.param == "grpc" else LocalClient(npu_backend)
    yield c
    c.close()


@pytest.fixture
def local(fake, npu_backend):
    return LocalClient(npu_backend)


def check_ln(p: dict) -> None:
    for name, ref, enabled in zip(LN_OUTPUTS, layer_norm_reference(p), p["outputMask"]):
        if enabled:
            assert_close(p[name], ref.reshape(p[name].shape), name)


def index(log: list[str], pattern: str, start: int = 0) -> int:
    for i in range(start, len(log)):
        if re.search(pattern, log[i]):
            return i
    raise AssertionError(f"{pattern!r} not in the call log after line {start}:\n" + "\n".join(log))


# --------------------------------------------------------------------------- driving CANN


def test_call_sequence(fake, local, rng):
    """GetWorkspaceSize, workspace, launch, synchronize, and only then the copy back."""
    p = layer_norm_call(rng, (6, 4, 8))
    fake.clear_log()
    local.run(OP, **p)
    check_ln(p)
    log = fake.log()
    probe = index(log, r"^aclnnLayerNormBackwardGetWorkspaceSize workspace=(\d+)")
    assert re.search(r"workspace=128 ", log[probe])  # the fake's figure: 2·N doubles
    build = index(log, r"^aclnnLayerNormBackwardGetWorkspaceSize", probe + 1)
    index(log, r"^aclSetAclOpExecutorRepeatable", build)
    upload = index(log, r"^aclrtMemcpy kind=1 ", build)
    launch = index(log, r"^aclnnLayerNormBackward executor=\d+ stream=\d+ workspaceSize=128$", upload)
    sync = index(log, r"^aclrtSynchronizeStream", launch)
    kernel = index(log, r"^kernel aclnnLayerNormBackward .* -> 0$", sync)
    copy_back = index(log, r"^aclrtMemcpy kind=2 ", kernel)
    assert not any("kind=2" in line for line in log[:kernel]), "a result was copied before the kernel ran"
    assert copy_back > sync
    index(log, r"^aclDestroyAclOpExecutor", copy_back)


def test_workspace_allocated_only_when_cann_asks(fake, local, npu_backend, rng, monkeypatch):
    sizes: list[int] = []
    alloc = npu_backend.allocator.alloc
    monkeypatch.setattr(npu_backend.allocator, "alloc", lambda n: sizes.append(n) or alloc(n))
    p = layer_norm_call(rng, (5, 12), mask=(True, False, False))
    workspace_size, executor = local.get_workspace_size(OP, **p)
    assert workspace_size == 0  # the fake needs no scratch without parameter gradients
    local.execute(executor)
    check_ln(p)
    assert len(sizes) == 7  # six inputs, one output, no workspace
    sizes.clear()
    p = layer_norm_call(rng, (5, 12))
    workspace_size, executor = local.get_workspace_size(OP, **p)
    assert workspace_size == 2 * 12 * 8
    local.execute(executor)
    check_ln(p)
    assert len(sizes) == 10 and sizes[-1] == workspace_size  # + two outputs + the workspace


def test_strided_input_ships_only_its_span(fake, local, rng):
    """A stride-0 input uploads one row; a transposed one keeps its strides (no host copy)."""
    base = layer_norm_call(rng, (64, 16))
    g_b = np.broadcast_to(base["gradOut"][:1], (64, 16))
    x_t = np.ascontiguousarray(base["input"].T).T
    p = dict(base, gradOut=g_b, input=x_t)
    fake.clear_log()
    local.run(OP, **p)
    check_ln(dict(p, gradOut=np.ascontiguousarray(g_b)))
    uploads = [int(m.group(1)) for line in fake.log() if (m := re.match(r"aclrtMemcpy kind=1 count=(\d+)", line))]
    assert 16 * 4 in uploads  # the broadcast gradOut: one row
    assert uploads.count(64 * 16 * 4) == 1  # only the transposed input is full size


def test_aclnn_status_passes_through(fake, client, rng):
    p = layer_norm_call(rng, (4, 6))
    untouched = Untouched(*(p[n] for n in LN_OUTPUTS))
    fake.fail_next("aclnnLayerNormBackward", 561002)
    with pytest.raises(AclnnError) as err:
        client.run(OP, **p)
    assert err.value.code == 561002 and "561002" in str(err.value)
    untouched.check()
    fake.fail_next("aclnnLayerNormBackwardGetWorkspaceSize", 561103)
    with pytest.raises(AclnnError) as err:
        client.get_workspace_size(OP, **p)
    assert err.value.code == 561103
    client.run(OP, **p)  # and the next call works
    check_ln(p)


def test_acl_runtime_failure_is_361001(fake, client, npu_backend, rng):
    p = layer_norm_call(rng, (4, 6))
    untouched = Untouched(*(p[n] for n in LN_OUTPUTS))
    fake.fail_next("aclrtSynchronizeStream", 507035)  # once is enough: a device failure is not replayed
    with pytest.raises(AclnnError) as err:
        client.run(OP, **p)
    assert err.value.code == 361001
    assert "aclrtSynchronizeStream" in err.value.message and "507035" in err.value.message
    assert "injected failure" in err.value.message  # aclGetRecentErrMsg's text travels
    untouched.check()
    npu_backend.allocator.empty_cache()
    fake.fail_next("aclrtMalloc", 207001)
    with pytest.raises(AclnnError) as err:
        LocalClient(npu_backend).run(OP, **p)
    assert err.value.code == 361001 and "aclrtMalloc" in err.value.message
    client.run(OP, **p)
    check_ln(p)


def test_allocator_retries_after_emptying_its_cache(fake, local, npu_backend, rng):
    local.run(OP, **layer_norm_call(rng, (8, 32)))  # leaves blocks in the cache
    assert npu_backend.allocator.cached_bytes > 0
    fake.fail_next("aclrtMalloc", 207001)
    ptr = npu_backend.allocator.alloc(3 << 20)  # not cached: malloc fails, cache freed, retried
    assert npu_backend.allocator.cached_bytes == 0
    npu_backend.allocator.free(ptr)


def test_size_classes():
    sc = CachingAllocator.size_class
    assert [sc(1), sc(512), sc(513), sc(1 << 20), sc((1 << 20) + 1), sc(5 << 20)] == [
        512,
        512,
        1024,
        1 << 20,
        2 << 20,
        6 << 20,
    ]


def test_repeatable_executor_reuses_one_cann_executor(fake, local, rng):
    p = layer_norm_call(rng, (6, 10))
    gws, launches = fake.calls("aclnnLayerNormBackwardGetWorkspaceSize"), fake.calls("aclnnLayerNormBackward")
    live = fake.live("executor")
    _, executor = local.get_workspace_size(OP, **p)
    local.set_executor_repeatable(executor)
    for i in range(3):
        p["input"][...] = rng.uniform(-2, 2, p["input"].shape)  # in process: the engine reads these bytes
        p["gradOut"][...] = i + 1
        local.execute(executor)
        check_ln(p)
    assert fake.calls("aclnnLayerNormBackwardGetWorkspaceSize") - gws == 2  # plan probe + the one executor
    assert fake.calls("aclnnLayerNormBackward") - launches == 3
    assert fake.live("executor") == live + 1  # kept for the next execute
    local.destroy_executor(executor)
    gc.collect()
    assert fake.live("executor") == live


def test_streams_order_calls(fake, rng):
    """Same client stream: one ACL stream, launches in submission order, each synchronized; four
    client streams share a pool of two ACL streams, one at a time."""
    fake.clear_log()
    backend = NpuBackend(0, streams=2, max_streams=2)
    try:
        ids = [int(m.group(1)) for line in fake.log() if (m := re.match(r"aclrtCreateStream stream=(\d+)", line))]
        local = LocalClient(backend)  # the engine hands each call's stream to the backend
        fake.clear_log()
        for stream in (0, 1, 0, 0, 1):
            local.run(OP, stream=stream, **layer_norm_call(rng, (3, 5)))
        launched = [int(m.group(1)) for line in fake.log() if (m := re.match(rf"{OP} executor=\d+ stream=(\d+)", line))]
        assert launched == [ids[s] for s in (0, 1, 0, 0, 1)]

        errors: list[BaseException] = []

        def worker(stream: int) -> None:
            try:
                for _ in range(4):
                    p = layer_norm_call(np.random.default_rng(stream), (16, 24))
                    local.run(OP, stream=stream, **p)
                    check_ln(p)
            except BaseException as exc:  # reported below
                errors.append(exc)

        fake.clear_log()
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        pending: dict[int, int] = {}
        for line in fake.log():  # per stream: launch, synchronize, launch, ...
            if m := re.match(rf"{OP} executor=\d+ stream=(\d+)", line):
                assert pending.get(int(m.group(1)), 0) == 0, "two launches on one stream without a synchronize"
                pending[int(m.group(1))] = 1
            elif m := re.match(r"aclrtSynchronizeStream stream=(\d+)", line):
                pending[int(m.group(1))] = 0
        assert set(pending) == set(ids)
    finally:
        backend.close()


def test_no_leaks_and_close_releases_everything(fake, rng):
    gc.collect()
    before = fake.snapshot()
    backend = NpuBackend(0)
    local = LocalClient(backend)
    for shape in ((6, 4, 8), (0, 8), (3, 0), (100, 33)):
        p = layer_norm_call(rng, shape)
        local.run(OP, **p)
        check_ln(p)
    _, executor = local.get_workspace_size(OP, **layer_norm_call(rng, (4, 4)))
    local.execute(executor)
    _, executor = local.get_workspace_size(OP, **layer_norm_call(rng, (4, 4)))
    local.set_executor_repeatable(executor)
    local.execute(executor)
    local.execute(executor)
    local.destroy_executor(executor)
    fake.fail_next("aclnnLayerNormBackward", 561002)
    with pytest.raises(AclnnError):
        local.run(OP, **layer_norm_call(rng, (4, 4)))
    gc.collect()
    during = fake.snapshot()
    for kind in ("tensor", "intArray", "boolArray", "executor"):
        assert during[kind] == before[kind], kind
    assert during["alloc"] - before["alloc"] == len(backend.allocator._size)  # cached, not leaked
    assert during["stream"] - before["stream"] == 4 and during["context"] - before["context"] == 1
    fake.clear_log()
    backend.close()
    backend.close()  # idempotent
    assert fake.snapshot() == before
    log = fake.log()
    index(log, "aclrtResetDevice 0", index(log, "aclrtDestroyContext", index(log, "aclrtDestroyStream")))
    with pytest.raises(AclnnError) as err:
        local.run(OP, **layer_norm_call(rng, (4, 4)))
    assert err.value.code == 361001 and "closed" in err.value.message


def test_lifecycle_in_a_clean_process(fake):
    """Alone in a process: aclInit ... aclFinalize, and the fake ends with nothing alive."""
    script = textwrap.dedent(
        """
        import sys, numpy as np
        sys.path.insert(0, sys.argv[1])
        from pathlib import Path
        from fake_cann.build import FakeCann
        from layer_norm_cases import layer_norm_call
        from aclnn_server import Engine, LocalClient, ServerOptions, create_server
        from aclnn_server.backends.npu import NpuBackend
        fake = FakeCann(Path(sys.argv[2]))
        backend = NpuBackend(0)
        server, port, _ = create_server(ServerOptions(host="127.0.0.1", port=0), engine=Engine(backend))
        server.start()
        from aclnn_client import Client
        with Client(f"127.0.0.1:{port}") as c:
            c.run("aclnnLayerNormBackward", **layer_norm_call(np.random.default_rng(0), (4, 8)))
        server.stop(None).wait()
        import time
        for _ in range(100):  # the server closes its backend on a release thread
            if fake.live("init") == 0:
                break
            time.sleep(0.05)
        print(fake.snapshot(), fake.misuse[0])
        print("\\n".join(l for l in fake.log() if l.startswith(("aclInit", "aclFinalize", "aclrtResetDevice"))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(TESTS_DIR), os.environ["ACLNN_CANN_LIB_DIR"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    zero = "{'tensor': 0, 'intArray': 0, 'boolArray': 0, 'executor': 0, 'stream': 0, 'context': 0, 'alloc': 0, "
    assert out[0] == zero + "'device': 0, 'init': 0} 0", out
    assert out[1:] == ["aclInit config=(null) -> 0", "aclrtResetDevice 0 -> 0", "aclFinalize -> 0"], out


def test_missing_cann_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ACLNN_CANN_LIB_DIR", str(tmp_path))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"libascendcl\.so not found.*ASCEND_HOME_PATH"):
        NpuBackend(0)


def test_unusable_device_is_a_clear_error(fake):
    before = fake.snapshot()
    fake.fail_next("aclrtSetDevice", 107001)
    with pytest.raises(RuntimeError, match=r"NPU device 0 is not usable.*107001"):
        NpuBackend(0)
    with pytest.raises(RuntimeError, match="NPU device 9 is not usable"):
        NpuBackend(9)
    assert fake.snapshot() == before


def test_layer_norm_grad_runs_on_the_reference_logged_once(fake, local, npu_backend, rng, caplog):
    import test_layer_norm_grad as suite

    npu_backend._fallback_logged.discard("LayerNormGrad")
    assert not npu_backend.supports("LayerNormGrad") and npu_backend.supports(OP)
    calls = fake.calls("aclnnLayerNormBackwardGetWorkspaceSize")
    with caplog.at_level(logging.WARNING, logger="aclnn_server.npu"):
        for _ in range(2):
            suite.test_output_mask(local, rng, (True, True, True))
    assert [r.getMessage() for r in caplog.records] == [
        "LayerNormGrad has no aclnn API in CANN; the npu backend runs it on the NumPy reference"
    ]
    assert fake.calls("aclnnLayerNormBackwardGetWorkspaceSize") == calls


@pytest.mark.parametrize("backend", ["npu", "auto"])
def test_aclnn_serve_process_on_the_fake_npu(fake, rng, backend):
    """The console entry point with the fake CANN found through ACLNN_CANN_LIB_DIR: `auto` picks the NPU."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--backend", backend, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ACLNN_CANN_LIB_DIR": str(fake.directory)},
    )
    try:
        line = proc.stdout.readline()
        address = re.fullmatch(r"listening on (\S+)\n", line)[1]
        with Client(address) as c:
            p = layer_norm_call(rng, (6, 32))
            c.run(OP, **p)
            check_ln(p)
            bad = dict(p, rstd=None)
            with pytest.raises(AclnnError) as info:
                c.run(OP, **bad)
            assert (info.value.code, info.value.param) == (161001, "rstd")
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert "backend npu" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
