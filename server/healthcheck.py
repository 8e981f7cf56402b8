"""`python -m aclnn_server.healthcheck`: exit 0 only when the local server reports SERVING.

For container HEALTHCHECKs and Kubernetes exec probes, which must speak the server's TLS: the probe
reads the server's own settings (`ACLNN_*` variables and the `ACLNN_CONFIG` file, as `aclnn-serve`
does) and connects to the port the server listens on, on loopback when it binds every address.

With TLS, the probe verifies the server's certificate against `ACLNN_HEALTHCHECK_CA` (the CA that
issued it, e.g. the `ca.crt` of a cert-manager Secret), else against the server's own certificate
file (`ACLNN_TLS_CERT`, trusted as it stands: a self-signed certificate, or the chain's
intermediates). It checks the name the certificate was issued for, not the loopback address the probe
dials: a certificate for a Service's DNS name has no IP address to match. With mutual TLS the probe
presents `ACLNN_HEALTHCHECK_CERT`/`ACLNN_HEALTHCHECK_KEY`, else the server's own certificate and key,
which the server accepts only when its client CA issued them for client use too.

Exit status: 0 SERVING; 1 anything else (NOT_SERVING, unreachable, TLS refused); 2 unusable settings.
"""

from __future__ import annotations

import os
import pathlib
import socket
import ssl
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from .config import ServerOptions, load_options

SERVICE = "aclnn.v1.Aclnn"
TIMEOUT_S = 3.0
# The probe's own settings, beside the server's.
CA_VARIABLE, CERT_VARIABLE, KEY_VARIABLE = "ACLNN_HEALTHCHECK_CA", "ACLNN_HEALTHCHECK_CERT", "ACLNN_HEALTHCHECK_KEY"
VARIABLES = (CA_VARIABLE, CERT_VARIABLE, KEY_VARIABLE)
_WILDCARD_HOST = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class ProbeError(Exception):
    """The probe cannot be made as configured (exit status 2)."""


def target(options: ServerOptions) -> str:
    """host:port the probe dials: the server's own address, loopback when it binds every address."""
    if options.port == 0:
        raise ProbeError("the server's port is 0 (chosen at start): set ACLNN_PORT to the port it listens on")
    host = _WILDCARD_HOST.get(options.host, options.host)
    return f"[{host}]:{options.port}" if ":" in host else f"{host}:{options.port}"


def _file(variable: str, fallback: pathlib.Path | None) -> pathlib.Path | None:
    value = os.environ.get(variable)
    path = pathlib.Path(value) if value else fallback
    if path is not None and not path.is_file():
        raise ProbeError(f"{variable if value else 'the fallback'} {path} is not a readable file")
    return path


def tls_files(options: ServerOptions) -> tuple[pathlib.Path, pathlib.Path | None, pathlib.Path | None]:
    """Roots to verify the server with, and the client certificate and key to present (mutual TLS)."""
    roots = _file(CA_VARIABLE, options.tls_cert)
    if options.tls_client_ca is None:
        return roots, None, None
    if bool(os.environ.get(CERT_VARIABLE)) != bool(os.environ.get(KEY_VARIABLE)):
        raise ProbeError(f"{CERT_VARIABLE} and {KEY_VARIABLE} go together")
    return roots, _file(CERT_VARIABLE, options.tls_cert), _file(KEY_VARIABLE, options.tls_key)


def certified_name(
    address: str, roots: pathlib.Path, cert: pathlib.Path | None, key: pathlib.Path | None
) -> str | None:
    """A name the server's certificate was issued for, once a TLS handshake has verified it against `roots`.

    gRPC always checks the certificate against a name, and the loopback address the probe dials is rarely
    in it; None when it is. Raises ssl.SSLError when the certificate does not verify.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the name is read from the verified certificate below
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a trusted server certificate needs no CA
    context.load_verify_locations(roots)
    if cert is not None:
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT_S) as raw:
        with context.wrap_socket(raw) as tls:
            peer = tls.getpeercert()
    if ("IP Address", host.strip("[]")) in peer.get("subjectAltName", ()):
        return None
    dns = [value for kind, value in peer.get("subjectAltName", ()) if kind == "DNS"]
    if dns:
        return dns[0].replace("*", "healthcheck", 1)  # any name a wildcard covers
    common = [value for rdn in peer.get("subject", ()) for field, value in rdn if field == "commonName"]
    if not common:
        raise ssl.SSLError("the server's certificate names no host (no subjectAltName, no common name)")
    return common[0]


def channel(options: ServerOptions, address: str) -> grpc.Channel:
    """A channel to the server, with its TLS (verified by name, see certified_name) when it has TLS."""
    if options.tls_cert is None:
        return grpc.insecure_channel(address)
    roots, cert, key = tls_files(options)
    name = certified_name(address, roots, cert, key)
    credentials = grpc.ssl_channel_credentials(
        roots.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )
    return grpc.secure_channel(address, credentials, [("grpc.ssl_target_name_override", name)] if name else [])


def main() -> int:
    config = os.environ.get("ACLNN_CONFIG")
    address = "the server"
    try:
        options = load_options({}, pathlib.Path(config) if config else None)
        address = target(options)
        with channel(options, address) as probe:
            reply = health_pb2_grpc.HealthStub(probe).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT_S
            )
    except OSError as error:  # unreachable, or TLS refused (ssl.SSLError; checked first: some are ValueErrors too)
        print(f"{address}: {error}", file=sys.stderr)
        return 1
    except (ValidationError, ProbeError, ValueError) as error:
        print(f"healthcheck: unusable settings: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        print(f"{address}: {error.code().name} {error.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
