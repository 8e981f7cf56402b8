"""The pool as operators run it: a Service's DNS name (served by an in-test DNS server on loopback),
a certificate for that name only, replicas coming and going, TLS with system roots, no token in clear.

Replicas are in-process servers on 127.0.0.2, 127.0.0.3, ... sharing one port, as pods behind a
headless Service share theirs. All traffic stays on loopback.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from certs import DNS_NAME, make_certificates
from dns_server import DnsServer
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

from aclnn_client import AclnnError, Client
from aclnn_server import ServerOptions, create_server

OP = "aclnnLayerNormBackward"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def dns():
    server = DnsServer()
    yield server
    server.close()


class Replicas:
    """Servers on 127.0.0.N, all on one port; each counts the runs it served."""

    def __init__(self, **options) -> None:
        self.options, self.port, self.servers, self.runs = options, 0, {}, {}

    def start(self, ip: str) -> None:
        server, port, engine = create_server(ServerOptions(host=ip, port=self.port, backend="numpy", **self.options))
        self.port = port
        self.runs[ip] = 0

        def counted(run):
            def counting(*args, **kwargs):
                self.runs[ip] += 1
                return run(*args, **kwargs)

            return counting

        # Runs in full, and those served from the first like them on their connection (transport/repeats.py).
        engine.run, engine.run_prepared = counted(engine.run), counted(engine.run_prepared)
        server.start()
        self.servers[ip] = server

    def stop(self, ip: str) -> None:
        self.servers.pop(ip).stop(None)

    def close(self) -> None:
        for ip in list(self.servers):
            self.stop(ip)


@pytest.fixture
def replicas():
    made = []

    def make(**options) -> Replicas:
        made.append(Replicas(**options))
        return made[-1]

    yield make
    for r in made:
        r.close()


def check_run(client: Client, rng: np.random.Generator, shape=(4, 16)) -> None:
    p = layer_norm_call(rng, shape)
    client.run(OP, **p)
    assert_close(p["gradInputOut"], layer_norm_reference(p)[0])


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "grpc"])
def test_a_certificate_for_the_services_name_only(dns, replicas, certs, data_channel):
    """The server's certificate names the Service, no IP: gRPC (balanced and per-backend channels)
    and the data channel (TCP, TLS) verify it against the name the user gave, not the pod's address."""
    pool = replicas(tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"))
    pool.start("127.0.0.2")
    dns.records[DNS_NAME] = ["127.0.0.2"]
    target = f"dns://127.0.0.1:{dns.port}/{DNS_NAME}:{pool.port}"
    rng = np.random.default_rng(1)
    with Client(target, root_certificates=certs.ca.cert, unix_socket=False, data_channel=data_channel, timeout=30) as c:
        check_run(c, rng)  # small: stateless
        check_run(c, rng, (512, 1024))  # 2 MiB tensors: uploaded and kept results (a backend's state)
        _, executor = c.get_workspace_size(OP, **layer_norm_call(rng, (4, 16)))
        c.execute(executor)
        channels = [ch for ch in c._data_channels.values() if ch is not None]
        if data_channel:
            assert channels and all(ch.tls is not None and not ch.unix for ch in channels)
        else:
            assert not channels
    assert pool.runs["127.0.0.2"] >= 2
    # The same certificate dialled by address fails: the name is what is verified.
    with Client(f"127.0.0.2:{pool.port}", root_certificates=certs.ca.cert, timeout=10) as by_address:
        with pytest.raises(AclnnError) as info:
            by_address.list_operators()
        assert info.value.grpc_code.name == "UNAVAILABLE"


def test_replicas_added_and_removed_while_calls_run(dns, replicas):
    """An autoscaler adds pods (they get calls), a rolling update removes the first ones: no call fails."""
    pool = replicas()
    pool.start("127.0.0.2")
    dns.records["aclnn.pool.test"] = ["127.0.0.2"]
    failures, done, stop = [], [0], threading.Event()
    with Client(f"dns://127.0.0.1:{dns.port}/aclnn.pool.test:{pool.port}", timeout=30) as c:
        c._pool.resolve_interval = 0.2

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                try:
                    check_run(c, rng)
                    done[0] += 1
                except Exception as exc:  # collected: the test reports every failure
                    failures.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            for ip in ("127.0.0.3", "127.0.0.4"):
                pool.start(ip)
            dns.records["aclnn.pool.test"] = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
            wait(lambda: pool.runs["127.0.0.3"] > 5 and pool.runs["127.0.0.4"] > 5, "new replicas get no calls")
            # Rolling update: the first replica leaves the name, then goes away.
            dns.records["aclnn.pool.test"] = ["127.0.0.3", "127.0.0.4"]
            time.sleep(0.5)
            pool.stop("127.0.0.2")
            pool.start("127.0.0.5")
            dns.records["aclnn.pool.test"] = ["127.0.0.3", "127.0.0.4", "127.0.0.5"]
            wait(lambda: pool.runs["127.0.0.5"] > 5, "the replacement gets no calls")
            before = done[0]
            wait(lambda: done[0] > before + 20, "the load stalled")
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert not failures, failures[:3]


def wait(condition, message: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


@pytest.mark.parametrize(
    "target", ["10.255.255.1:50051", "dns:///aclnn-serve.example.com:50051", ["127.0.0.1:1", "10.255.255.1:1"]]
)
def test_a_token_is_never_sent_in_clear_off_this_host(target):
    """Refused when the client is made, before any connection (these addresses are never dialled)."""
    with pytest.raises(ValueError, match="in clear"):
        Client(target, token="secret")
    Client(target, token="secret", tls=True).close()  # TLS: fine
    Client(target, token="secret", allow_plaintext_token=True).close()  # the caller's explicit choice
    Client(target).close()  # no token: nothing to leak


def test_a_token_in_clear_to_this_host_is_allowed():
    Client("127.0.0.1:1", token="secret").close()
    Client("localhost:1", token="secret").close()


def test_tls_true_verifies_against_the_system_roots(replicas, certs):
    """A test CA is in no system trust store: tls=True alone refuses the server, its root accepts it."""
    pool = replicas(tls_cert=certs.path("server.pem"), tls_key=certs.path("server.key"))
    pool.start("127.0.0.1")
    address = f"127.0.0.1:{pool.port}"
    with Client(address, tls=True, timeout=10) as c, pytest.raises(AclnnError) as info:
        c.list_operators()
    assert info.value.grpc_code.name == "UNAVAILABLE"
    with Client(address, tls=True, root_certificates=certs.ca.cert, unix_socket=False, timeout=30) as c:
        check_run(c, np.random.default_rng(2))
        assert [ch.tls is not None for ch in c._data_channels.values()] == [True]
