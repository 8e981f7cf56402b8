"""Fixtures: a real gRPC server on a loopback port, and clients over gRPC and in process.

Before the tests, the cpu backend's kernels are compiled (or loaded from the disk cache) once, with
progress lines on the terminal and a limit of their own (`pytest_collection_finish`): a cold cache
takes minutes on 2 cores, which no test's timeout should have to cover.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest
from fake_cann.build import FakeCann, build

from aclnn_client import Client
from aclnn_server import AclnnServer, Engine, LocalClient, ServerOptions, create_server
from aclnn_server.backends.npu import NpuBackend

# Backends every conformance test runs on; a new backend joins the suite by being listed here.
BACKENDS = ("numpy", "cpu")
# The torch backend's device in the torch tests: cpu here and in CI; bench/gpu.py runs them again on
# cuda:0, where the cross-backend tests leave the cpu backend out (its kernels compile for minutes).
TORCH_DEVICE = os.environ.get("ACLNN_TORCH_DEVICE", "cpu")
CROSS_BACKENDS = ("numpy", "cpu", "torch") if TORCH_DEVICE == "cpu" else ("numpy", "torch")
# How long the session-start compile of the cpu kernels may take (it took 7.3 minutes on a busy 2-core
# machine; 3 minutes of CPU) before the run stops, saying so.
KERNEL_COMPILE_LIMIT_S = 1800


def pytest_collection_finish(session: pytest.Session) -> None:
    """Compiles (or loads) the cpu kernels in this process before any test that may use them runs."""
    if not any(_uses_cpu_kernels(item) for item in session.items):
        return
    from aclnn_server.backends import cpu

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def show(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)

    failure: list[BaseException] = []

    def compile_kernels() -> None:
        try:
            cpu.warm_up(show)
        except BaseException as exc:  # shown below; the tests that need the kernels then fail on their own
            failure.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=compile_kernels, name="cpu-kernels", daemon=True)
    worker.start()
    worker.join(KERNEL_COMPILE_LIMIT_S)
    if worker.is_alive():
        pytest.exit(f"the cpu kernels did not compile within {KERNEL_COMPILE_LIMIT_S} s", returncode=3)
    if failure:
        show(f"cpu backend: kernels unusable after {time.monotonic() - started:.0f} s: {failure[0]!r}")


_MODULE_USES_CPU: dict[pathlib.Path, bool] = {}
_CPU_WORDS = ('"cpu"', '"auto"', "backends.cpu", "backends import cpu")


def _uses_cpu_kernels(item: pytest.Item) -> bool:
    """Whether a test may run the cpu backend: a `cpu` parameter, or a module that names the backend."""
    if "cpu" in item.nodeid:
        return True
    path = item.path
    if path not in _MODULE_USES_CPU:
        source = path.read_text() if path.suffix == ".py" else ""
        _MODULE_USES_CPU[path] = any(word in source for word in _CPU_WORDS)
    return _MODULE_USES_CPU[path]


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def server_address(backend: str):
    server, port, engine = create_server(ServerOptions(host="127.0.0.1", port=0, backend=backend))
    engine.ready.wait()  # the kernels were compiled at the session's start: this is a load from the cache
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(params=["grpc", "local"])
def client(request: pytest.FixtureRequest, backend: str):
    """The same API through a real gRPC server and through LocalClient."""
    if request.param == "grpc":
        c = Client(request.getfixturevalue("server_address"))
    else:
        c = LocalClient(backend=backend)
    yield c
    c.close()


class Served(NamedTuple):
    address: str
    server: AclnnServer
    engine: Engine


@pytest.fixture
def serve():
    """Starts servers (numpy backend unless told) with the given options on free loopback ports."""
    started = []

    def start(**options) -> Served:
        server, port, engine = create_server(ServerOptions(**{"port": 0, "backend": "numpy", **options}))
        engine.ready.wait()
        server.start()
        started.append(server)
        return Served(f"127.0.0.1:{port}", server, engine)

    yield start
    for server in started:
        server.stop(None)


@pytest.fixture(scope="session")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCann]:
    """A fake CANN (tests/fake_cann), compiled once and found by the NPU backend through ACLNN_CANN_LIB_DIR."""
    directory = build(tmp_path_factory.mktemp("fake_cann"))
    saved = os.environ.get("ACLNN_CANN_LIB_DIR")
    os.environ["ACLNN_CANN_LIB_DIR"] = str(directory)
    yield FakeCann(directory)
    if saved is None:
        os.environ.pop("ACLNN_CANN_LIB_DIR", None)
    else:
        os.environ["ACLNN_CANN_LIB_DIR"] = saved


@pytest.fixture(autouse=True)
def cann_only_where_faked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only tests that ask for the fake CANN find it: elsewhere `auto` means no NPU, whichever tests ran before."""
    if "fake" not in request.fixturenames:
        monkeypatch.delenv("ACLNN_CANN_LIB_DIR", raising=False)


@pytest.fixture(autouse=True)
def no_misuse(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that uses the fake CANN, it saw no misuse of the API (bad pointers, unknown
    handles, copies racing queued kernels...)."""
    if "fake" not in request.fixturenames:
        yield
        return
    fake = request.getfixturevalue("fake")
    before = fake.misuse[0]
    yield
    count, last = fake.misuse
    assert count == before, f"CANN API misuse: {last}"


@pytest.fixture(scope="module")
def npu_backend(fake: FakeCann) -> Iterator[NpuBackend]:
    """An NPU backend on the fake CANN, for one test module."""
    backend = NpuBackend(0)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def npu_address(npu_backend: NpuBackend) -> Iterator[str]:
    """A gRPC server whose engine computes on `npu_backend`."""
    server, port, _ = create_server(ServerOptions(host="127.0.0.1", port=0), engine=Engine(npu_backend))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture
def token_file(tmp_path):
    """A token file with two tenants' tokens, alice's and bob's."""
    path = tmp_path / "tokens"
    path.write_text("alice\nbob\n")
    return path


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261123)


@pytest.fixture
def server_process():
    """A server in a process of its own (numpy backend, a free port): (process, address)."""
    from test_shared_memory import start_server

    proc, address = start_server("--port", "0")
    yield proc, address
    proc.kill()
    proc.wait()
