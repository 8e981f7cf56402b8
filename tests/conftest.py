"""Fixtures: a real gRPC server on a loopback port, and clients over gRPC and in process."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def server_address(backend: str):
    server, port, engine = create_server(ServerOptions(host="127.0.0.1", port=0, backend=backend))
    engine.ready.wait()  # the backend loads in the background: started after it, the server is SERVING at once
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
    """Starts servers (numpy backend) with the given options on free loopback ports."""
    started = []

    def start(**options) -> Served:
        server, port, engine = create_server(ServerOptions(port=0, backend="numpy", **options))
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
