"""Other local users, as an attacker on the same host would be one: a fresh Python process that imports
what it needs, then drops to that user's uid (the interpreter lives where other users cannot read it).
CI runs as root; elsewhere these tests are skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

NOBODY = 65534  # the attacker
OTHER = 65533  # a third user, where one is needed

_PRELUDE = """
import array, encodings.idna, fcntl, os, select, socket, struct, sys, time
import grpc, numpy as np
sys.path.insert(0, {tests!r})
import aclnn_client, aclnn_client.data_channel, aclnn_common.framing, aclnn_common.wire, aclnn_common.binding
from aclnn_client import AclnnError, Client
from aclnn_common._proto import aclnn_pb2 as pb, aclnn_pb2_grpc as pb_grpc
import layer_norm_cases
os.setgroups([])
os.setgid({uid})
os.setuid({uid})
"""


def needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as other local users")


def as_user(uid: int, code: str, timeout: float = 60) -> str:
    """Runs `code` as `uid`; returns its stdout (its failure fails the test)."""
    done = subprocess.run([sys.executable, "-c", script(uid, code)], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


def start_as_user(uid: int, code: str) -> subprocess.Popen:
    """Starts `code` as `uid` in the background, its stdout a pipe of text lines."""
    return subprocess.Popen([sys.executable, "-c", script(uid, code)], stdout=subprocess.PIPE, text=True)


def script(uid: int, code: str) -> str:
    tests = os.path.dirname(os.path.abspath(__file__))
    return _PRELUDE.format(tests=tests, uid=uid) + textwrap.dedent(code)


# A TCP relay owned by a user: one upstream connection from (address, port) to the server, for one
# client that connects to the port it prints. The server sees the relay's socket as its peer.
RELAY = """
import select
upstream = socket.socket()
upstream.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
upstream.bind(({source!r}, {source_port}))
upstream.connect(({server!r}, {server_port}))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], upstream.getsockname()[1], flush=True)
downstream, _ = listener.accept()
pair = {{upstream: downstream, downstream: upstream}}
while True:
    for sock in select.select(list(pair), [], [])[0]:
        data = sock.recv(65536)
        if not data:
            sys.exit(0)
        pair[sock].sendall(data)
"""


def relay(uid: int, server: str, source: str = "127.0.0.1", source_port: int = 0) -> tuple[subprocess.Popen, str, int]:
    """A relay owned by `uid` to `server` (host:port) from `source`:`source_port`; returns (process, the
    address a client connects to, the relay's own port towards the server)."""
    host, _, port = server.rpartition(":")
    proc = start_as_user(
        uid, RELAY.format(source=source, source_port=source_port, server=host.strip("[]"), server_port=int(port))
    )
    listen_port, upstream_port = (int(x) for x in proc.stdout.readline().split())
    return proc, f"127.0.0.1:{listen_port}", upstream_port
