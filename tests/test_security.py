"""TLS, mutual TLS, bearer tokens, executor ownership and the loopback rule — over real sockets."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pydantic
import pytest
from certs import issue_workload_certificate, make_certificates
from layer_norm_cases import layer_norm_call
from oracle import Untouched

from aclnn_client import AclnnError, Client
from aclnn_server import ServerOptions

OP = "aclnnLayerNormBackward"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


def run_ok(client: Client, rng) -> None:
    p = layer_norm_call(rng, (2, 8))
    client.run(OP, **p)
    assert np.isfinite(p["gradInputOut"]).all()


def test_tls(serve, certs, rng):
    address, _, _ = serve(tls_cert=certs.path("server.pem"), tls_key=certs.path("server.key"))
    with Client(address, root_certificates=certs.ca.cert) as c:
        run_ok(c, rng)
    with Client(address, timeout=5) as plaintext, pytest.raises(AclnnError) as info:
        run_ok(plaintext, rng)
    assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(serve, certs, rng):
    address, _, _ = serve(
        tls_cert=certs.path("server.pem"), tls_key=certs.path("server.key"), tls_client_ca=certs.path("ca.pem")
    )
    with Client(
        address, root_certificates=certs.ca.cert, private_key=certs.client.key, certificate_chain=certs.client.cert
    ) as c:
        run_ok(c, rng)
    with Client(address, root_certificates=certs.ca.cert, timeout=5) as anonymous, pytest.raises(AclnnError) as info:
        run_ok(anonymous, rng)
    assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE


def test_certificates_without_a_common_name_are_tenants_of_their_own(serve, certs, rng):
    """SPIFFE-style certificates carry a URI name and no common name, which gRPC reports as one empty
    name: every such certificate was the tenant `cert:`, sharing one set of quotas (red-team finding).
    Now a certificate's URI name, or without any name its fingerprint, is its identity."""
    served = serve(
        tls_cert=certs.path("server.pem"),
        tls_key=certs.path("server.key"),
        tls_client_ca=certs.path("ca.pem"),
        max_tenant_executors=1,
    )
    workloads = [
        issue_workload_certificate(certs.ca, "spiffe://example.org/tenant-a"),
        issue_workload_certificate(certs.ca, "spiffe://example.org/tenant-b"),
        issue_workload_certificate(certs.ca, None),
        issue_workload_certificate(certs.ca, None),
    ]
    p = layer_norm_call(rng, (2, 8))
    clients = [
        Client(served.address, root_certificates=certs.ca.cert, private_key=w.key, certificate_chain=w.cert)
        for w in workloads
    ]
    try:
        for c in clients:  # each holds its one executor: no two are the same tenant
            c.get_workspace_size(OP, **p)
        owners = {entry.owner for entry in served.engine.executors._entries.values()}
        assert len(owners) == 4 and "cert:" not in owners
        assert {"cert-san:spiffe://example.org/tenant-a", "cert-san:spiffe://example.org/tenant-b"} <= owners
    finally:
        for c in clients:
            c.close()


def test_a_token_file_saved_with_a_byte_order_mark_keeps_its_first_token(serve, tmp_path, rng):
    """Editors on some systems begin a UTF-8 file with a byte-order mark: it is not part of the first token."""
    path = tmp_path / "tokens"
    path.write_text("first-token\nsecond-token\n", encoding="utf-8-sig")
    address, _, _ = serve(auth_token_file=path)
    for token in ("first-token", "second-token"):
        with Client(address, token=token) as c:
            run_ok(c, rng)


@pytest.mark.parametrize("variable", ["http_proxy", "grpc_proxy"])
def test_a_plaintext_token_never_goes_through_a_proxy(serve, tmp_path, rng, monkeypatch, variable):
    """A token goes in clear only to a loopback server: with a proxy in the environment, gRPC tunnelled
    the call, token and all, through it (red-team finding). Such a channel now ignores proxies."""
    path = tmp_path / "tokens"
    path.write_text("the-token\n")
    address, _, _ = serve(auth_token_file=path)
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen()
    proxy.settimeout(0.5)
    monkeypatch.setenv(variable, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    with proxy, Client(address, token="the-token", data_channel=False, timeout=10) as c:
        run_ok(c, rng)
        with pytest.raises(TimeoutError):
            proxy.accept()  # nobody came


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# one token per line\nalice-secret\n\nbob-secret\n")
    return path


@pytest.mark.parametrize("token", [None, "mallory", "alice-secret "[:-2]])
def test_missing_or_wrong_token_is_unauthenticated_and_runs_nothing(serve, token_file, rng, token):
    address, _, engine = serve(auth_token_file=token_file)
    p = layer_norm_call(rng, (2, 8))
    untouched = Untouched(p["gradInputOut"], p["gradWeightOut"], p["gradBiasOut"])
    with Client(address, token=token) as c:
        for call in (lambda: c.run(OP, **p), lambda: c.get_workspace_size(OP, **p)):
            with pytest.raises(AclnnError) as info:
                call()
            assert info.value.grpc_code == grpc.StatusCode.UNAUTHENTICATED
    untouched.check()
    assert len(engine.executors) == 0


def test_valid_token_and_open_health_check(serve, token_file, rng):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, _, _ = serve(auth_token_file=token_file)
    with Client(address, token="bob-secret") as c:
        run_ok(c, rng)
    with grpc.insecure_channel(address) as channel:  # probes carry no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_executors_belong_to_their_creator(serve, token_file, rng):
    address, _, _ = serve(auth_token_file=token_file)
    p = layer_norm_call(rng, (2, 8))
    with Client(address, token="alice-secret") as alice, Client(address, token="bob-secret") as bob:
        _, executor = alice.get_workspace_size(OP, **p)
        for steal in (bob.execute, bob.destroy_executor, bob.set_executor_repeatable):
            with pytest.raises(AclnnError) as info:
                steal(executor)
            assert (info.value.code, info.value.param) == (161002, "executor")
            assert "unknown" in str(info.value)
        alice.execute(executor)


@pytest.mark.parametrize(
    "options,accepted",
    [
        (dict(host="0.0.0.0"), False),
        (dict(host="0.0.0.0", insecure=True), True),
        (dict(host="::1"), True),
        (dict(host="localhost"), True),
        (dict(tls_cert="server.pem"), False),  # a certificate without its key
        (dict(tls_client_ca="ca.pem"), False),  # mutual TLS without a server certificate
    ],
)
def test_options_are_validated_at_start(certs, options, accepted):
    options = {k: certs.path(v) if k.startswith("tls") else v for k, v in options.items()}
    if accepted:
        ServerOptions(**options)
    else:
        with pytest.raises(pydantic.ValidationError):
            ServerOptions(**options)


def test_non_loopback_needs_tls_and_tokens(certs, token_file):
    tls = dict(tls_cert=certs.path("server.pem"), tls_key=certs.path("server.key"))
    with pytest.raises(pydantic.ValidationError, match="auth-token-file"):
        ServerOptions(host="0.0.0.0", **tls)
    ServerOptions(host="0.0.0.0", auth_token_file=token_file, **tls)
