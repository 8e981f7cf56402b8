"""Start-up of the cpu backend: a cold kernel cache is announced at once and served NOT_SERVING while
it compiles; a warm one compiles nothing and reaches `listening on` far sooner."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_processes import free_port

_COLD: dict[str, float] = {}


class ServerProcess:
    """`aclnn-serve --backend cpu` on a fixed port, its stdout and stderr lines read as they come."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aclnn_server",
                "--backend",
                "cpu",
                "--port",
                str(self.port),
                "--data-port",
                "-1",
                "--log-level",
                "INFO",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=lambda s=stream: [self.lines.put(line) for line in s], daemon=True).start()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s")

    def health(self) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            request = health_pb2.HealthCheckRequest(service="aclnn.v1.Aclnn")
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10, wait_for_ready=True).status

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.slow
@pytest.mark.cold_cache  # not in the default run: `pytest -m cold_cache` (CI runs it)
def test_a_cold_cache_is_announced_and_served_not_serving_until_compiled(tmp_path):
    """A machine without the kernels in its cache: the server says so at once, listens, and reports
    NOT_SERVING until the kernels are built (about 2.5 minutes on 2 cores: this test is slow)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    server = ServerProcess({**env, "XDG_CACHE_HOME": str(tmp_path)})
    try:
        server.wait_for(r"compiling its kernels", timeout=30)
        announced = time.monotonic() - server.started
        assert server.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        server.wait_for(r"^listening on ", timeout=600)
        _COLD["seconds"] = time.monotonic() - server.started
        assert server.health() == health_pb2.HealthCheckResponse.SERVING
        assert announced < _COLD["seconds"] / 4, "the compile was not announced before it ran"
    finally:
        server.close()


def test_a_warm_cache_compiles_nothing():
    """The second start on a machine (or an image whose cache was warmed when it was built) only loads."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    first = ServerProcess(env)  # warms the cache if nothing did yet
    try:
        first.wait_for(r"^listening on ", timeout=600)
    finally:
        first.close()
    server = ServerProcess(env)
    try:
        match = server.wait_for(r"kernels ready in \S+ s \((\d+) loaded from the disk cache, (\d+) compiled\)", 120)
        assert int(match[1]) > 0 and int(match[2]) == 0
        server.wait_for(r"^listening on ", timeout=60)
        warm = time.monotonic() - server.started
        assert server.health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.close()
    if "seconds" in _COLD:  # the cold start of this run (when the slow test ran before)
        assert warm < _COLD["seconds"] / 5, f"warm start {warm:.1f} s against a cold one of {_COLD['seconds']:.1f} s"
