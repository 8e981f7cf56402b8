"""`python -m aclnn_server.healthcheck` as an exec probe runs it: a subprocess with the server's ACLNN_* settings.

The servers are real (plaintext, TLS with a certificate issued for a DNS name only, mutual TLS); the
probe must speak their TLS, verify them, and exit 0 only when they report SERVING.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
from certs import make_certificates
from grpc_health.v1 import health_pb2

from aclnn_server.healthcheck import SERVICE


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text("probe-test-token\n")
    return path


def probe(port: int | str | None, *args: str, **settings: object) -> subprocess.CompletedProcess:
    """The healthcheck module with these arguments and exactly these ACLNN_* settings (none inherited)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACLNN_")}
    if port is not None:
        env["ACLNN_PORT"] = str(port)
    env.update({f"ACLNN_{name.upper()}": str(value) for name, value in settings.items()})
    return subprocess.run(
        [sys.executable, "-m", "aclnn_server.healthcheck", *args], capture_output=True, text=True, timeout=60, env=env
    )


def free_port() -> int:
    """A port nothing listens on once this returns."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return unused.getsockname()[1]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_plaintext_server(serve):
    result = probe(port_of(serve().address))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("SERVING")


def test_tls_server_with_a_dns_name_certificate_bound_to_every_address(serve, certs, token_file):
    """The manifests' setup: 0.0.0.0, TLS for the Service's name only, tokens; the probe trusts the server's file."""
    tls = dict(tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"))
    served = serve(host="0.0.0.0", auth_token_file=token_file, **tls)
    result = probe(port_of(served.address), host="0.0.0.0", auth_token_file=token_file, **tls)
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout


def test_tls_server_verified_against_its_ca(serve, certs):
    tls = dict(tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"))
    result = probe(port_of(serve(**tls).address), healthcheck_ca=certs.path("ca.pem"), **tls)
    assert result.returncode == 0, result.stderr


def test_tls_server_with_an_untrusted_certificate_fails(serve, certs, tmp_path):
    """A CA that did not issue the server's certificate: the probe refuses it (and says why)."""
    other = make_certificates(tmp_path)
    tls = dict(tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"))
    result = probe(port_of(serve(**tls).address), healthcheck_ca=other.path("ca.pem"), **tls)
    assert result.returncode == 1
    assert "CERTIFICATE_VERIFY_FAILED" in result.stderr


@pytest.mark.parametrize("own_certificate", [False, True])
def test_mutual_tls_server(serve, certs, own_certificate):
    """The probe presents the server's certificate (issued by the client CA too), or its own client certificate."""
    tls = dict(
        tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"), tls_client_ca=certs.path("ca.pem")
    )
    mine = dict(healthcheck_cert=certs.path("client.pem"), healthcheck_key=certs.path("client.key"))
    result = probe(port_of(serve(**tls).address), **tls, **(mine if own_certificate else {}))
    assert result.returncode == 0, result.stderr


def test_mutual_tls_refuses_a_certificate_its_client_ca_did_not_issue(serve, certs, tmp_path):
    other = make_certificates(tmp_path)
    tls = dict(
        tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"), tls_client_ca=certs.path("ca.pem")
    )
    mine = dict(healthcheck_cert=other.path("client.pem"), healthcheck_key=other.path("client.key"))
    assert probe(port_of(serve(**tls).address), **tls, **mine).returncode == 1


def test_not_serving(serve):
    served = serve()
    served.server.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    result = probe(port_of(served.address))
    assert result.returncode == 1
    assert "NOT_SERVING" in result.stdout


def test_no_server():
    port = free_port()
    result = probe(port)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


def test_unusable_settings():
    """Port 0 (the server picked one) cannot be probed (2); a host beyond loopback without TLS or tokens, which
    the server would refuse to serve on, the probe still dials (here nothing listens: 1)."""
    assert probe(0).returncode == 2
    assert probe(free_port(), host="0.0.0.0").returncode == 1
    for timeout in ("-1", "0", "nan", "inf", "soon"):  # each once "unhealthy" (1): a deadline already past
        result = probe(free_port(), "--timeout", timeout)
        assert result.returncode == 2 and "--timeout" in result.stderr, (timeout, result.stderr)


def test_flags_point_the_probe_and_win_over_the_environment(serve):
    """--port and --host name the server probed; the server's own settings (ACLNN_PORT here) are only defaults,
    and a probe pointed elsewhere never reports on the server those settings name."""
    served = port_of(serve().address)
    elsewhere = free_port()
    result = probe(served, "--port", str(elsewhere))
    assert result.returncode == 1 and "SERVING" not in result.stdout
    assert f"127.0.0.1:{elsewhere}: UNAVAILABLE" in result.stderr
    result = probe(elsewhere, "--host", "127.0.0.1", "--port", str(served))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"127.0.0.1:{served}: SERVING"
    assert probe(None, "--port", str(served)).returncode == 0  # no ACLNN_* setting at all


def test_tls_settings_as_flags(serve, certs):
    """A TLS server probed with flags alone: the server's certificate and key, and the CA that issued them."""
    tls = dict(tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"))
    port = port_of(serve(**tls).address)
    flags = ["--tls-cert", str(tls["tls_cert"]), "--tls-key", str(tls["tls_key"])]
    assert probe(None, "--port", str(port), *flags, "--ca", str(certs.path("ca.pem"))).returncode == 0
    assert probe(None, "--port", str(port)).returncode == 1  # plaintext to a TLS server: refused


def test_a_server_bound_to_every_address_probed_by_hand_with_flags_alone(serve, certs, token_file):
    """By hand, outside the server's container: --host 0.0.0.0 and the TLS files as flags, no token file in
    sight. The probe refused them (a non-loopback host without tokens is the server's rule, and its advice,
    --auth-token-file, was no flag of the probe's); it serves nothing, so the rule is not its to apply."""
    tls = dict(tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"))
    port = port_of(serve(host="0.0.0.0", auth_token_file=token_file, **tls).address)
    flags = [
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--tls-cert",
        str(tls["tls_cert"]),
        "--tls-key",
        str(tls["tls_key"]),
    ]
    result = probe(None, *flags)
    assert result.returncode == 0, result.stderr


def test_mutual_tls_settings_as_flags(serve, certs):
    tls = dict(
        tls_cert=certs.path("server-dns.pem"), tls_key=certs.path("server-dns.key"), tls_client_ca=certs.path("ca.pem")
    )
    port = port_of(serve(**tls).address)
    flags = [f"--{name.replace('_', '-')}={path}" for name, path in tls.items()]
    mine = ["--cert", str(certs.path("client.pem")), "--key", str(certs.path("client.key"))]
    assert probe(None, "--port", str(port), *flags, *mine).returncode == 0
    result = probe(None, "--port", str(port), *flags, "--cert", str(certs.path("client.pem")))
    assert result.returncode == 2 and "--cert and --key" in result.stderr


def test_help_and_unknown_arguments():
    help_text = probe(None, "--help").stdout
    for flag in ("--host", "--port", "--tls-cert", "--tls-key", "--tls-client-ca", "--ca", "--cert", "--key"):
        assert flag in help_text
    result = probe(None, "--port", "50051", "--config", "/nonexistent.toml")
    assert result.returncode == 2 and "--config /nonexistent.toml is not a readable file" in result.stderr
    result = probe(50051, "--prot", "50099")
    assert result.returncode == 2 and "unrecognized arguments: --prot" in result.stderr
    assert result.stdout == ""
