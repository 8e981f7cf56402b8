"""`python -m aclnn_server.healthcheck`: exit 0 only when the server it is pointed at reports SERVING.

For container HEALTHCHECKs and Kubernetes exec probes, which must speak the server's TLS. The probe
takes the server's own settings: its flags (`--host`, `--port`, `--tls-cert`, `--tls-key`,
`--tls-client-ca`, `--insecure`, `--config`), each defaulting to the server's `ACLNN_*` variable and
the `ACLNN_CONFIG` file, as `aclnn-serve` reads them; it dials that address (on loopback when it is
a wildcard such as 0.0.0.0). It never guesses another server, and refuses arguments it does not know.

With TLS, the probe verifies the server's certificate against `--ca` (`ACLNN_HEALTHCHECK_CA`: the CA
that issued it, e.g. the `ca.crt` of a cert-manager Secret), else against the server's own certificate
file (`--tls-cert`, trusted as it stands: a self-signed certificate, or the chain's intermediates). It
checks the name the certificate was issued for, not the loopback address the probe dials: a
certificate for a Service's DNS name has no IP address to match. With mutual TLS the probe presents
`--cert`/`--key` (`ACLNN_HEALTHCHECK_CERT`/`ACLNN_HEALTHCHECK_KEY`), else the server's own certificate
and key, which the server accepts only when its client CA issued them for client use too.

Exit status: 0 SERVING; 1 anything else (NOT_SERVING, unreachable, TLS refused); 2 unusable settings
or arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import socket
import ssl
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from .config import ServerOptions, add_option_flags, flag, load_options

SERVICE = "aclnn.v1.Aclnn"
TIMEOUT_S = 3.0
# The probe's own settings, beside the server's.
CA_VARIABLE, CERT_VARIABLE, KEY_VARIABLE = "ACLNN_HEALTHCHECK_CA", "ACLNN_HEALTHCHECK_CERT", "ACLNN_HEALTHCHECK_KEY"
VARIABLES = (CA_VARIABLE, CERT_VARIABLE, KEY_VARIABLE)
PROBE_FILES = {"ca": CA_VARIABLE, "cert": CERT_VARIABLE, "key": KEY_VARIABLE}  # flag -> its variable
# The server's options the probe takes as flags (each defaults to its ACLNN_* variable, then the config file).
SERVER_FLAGS = ("host", "port", "tls_cert", "tls_key", "tls_client_ca", "insecure")
_WILDCARD_HOST = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class ProbeError(Exception):
    """The probe cannot be made as configured (exit status 2)."""


def target(options: ServerOptions) -> str:
    """host:port the probe dials: the server's own address, loopback when it binds every address."""
    if options.port == 0:
        raise ProbeError("the server's port is 0 (chosen at start): set ACLNN_PORT to the port it listens on")
    host = _WILDCARD_HOST.get(options.host, options.host)
    return f"[{host}]:{options.port}" if ":" in host else f"{host}:{options.port}"


def _file(flag: str, given: pathlib.Path | None, fallback: pathlib.Path | None) -> pathlib.Path | None:
    """The probe's own file: its flag, else its ACLNN_HEALTHCHECK_* variable, else the server's file."""
    variable = PROBE_FILES[flag]
    value = given or (pathlib.Path(os.environ[variable]) if os.environ.get(variable) else None)
    path = value or fallback
    if path is not None and not path.is_file():
        raise ProbeError(f"{f'--{flag}' if value else 'the fallback'} {path} is not a readable file")
    return path


def tls_files(
    options: ServerOptions, probe: dict[str, pathlib.Path | None]
) -> tuple[pathlib.Path, pathlib.Path | None, pathlib.Path | None]:
    """Roots to verify the server with, and the client certificate and key to present (mutual TLS).

    `probe` holds the probe's own flags (ca, cert, key), each None when not given."""
    roots = _file("ca", probe.get("ca"), options.tls_cert)
    if options.tls_client_ca is None:
        return roots, None, None
    given = {name: bool(probe.get(name) or os.environ.get(PROBE_FILES[name])) for name in ("cert", "key")}
    if given["cert"] != given["key"]:
        raise ProbeError(f"--cert and --key ({CERT_VARIABLE} and {KEY_VARIABLE}) go together")
    return roots, _file("cert", probe.get("cert"), options.tls_cert), _file("key", probe.get("key"), options.tls_key)


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


def channel(options: ServerOptions, address: str, probe: dict[str, pathlib.Path | None]) -> grpc.Channel:
    """A channel to the server, with its TLS (verified by name, see certified_name) when it has TLS."""
    if options.tls_cert is None:
        return grpc.insecure_channel(address)
    roots, cert, key = tls_files(options, probe)
    name = certified_name(address, roots, cert, key)
    credentials = grpc.ssl_channel_credentials(
        roots.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )
    return grpc.secure_channel(address, credentials, [("grpc.ssl_target_name_override", name)] if name else [])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aclnn_server.healthcheck",
        description="Exit 0 when the aclnn-serve server at --host/--port reports SERVING (1: it does not, or "
        "cannot be reached; 2: unusable settings).",
        epilog="The server's flags default to the server's own ACLNN_* variables and ACLNN_CONFIG file, as "
        "aclnn-serve reads them; a flag given here wins.",
    )
    add_option_flags(
        parser,
        SERVER_FLAGS,
        lambda name, field: f"the server's {flag(name)}: {field.description} (env ACLNN_{name.upper()})",
        "the server's TOML or JSON options file (env ACLNN_CONFIG)",
    )
    parser.add_argument(
        "--ca",
        type=pathlib.Path,
        help=f"the CA to verify the server's certificate with (env {CA_VARIABLE}; "
        "default: the server's --tls-cert, trusted as it stands)",
    )
    parser.add_argument(
        "--cert",
        type=pathlib.Path,
        help=f"the probe's client certificate for mutual TLS (env {CERT_VARIABLE}; default: the server's own)",
    )
    parser.add_argument("--key", type=pathlib.Path, help=f"the key of --cert (env {KEY_VARIABLE})")
    parser.add_argument("--timeout", type=_seconds, default=TIMEOUT_S, help=f"seconds to wait (default {TIMEOUT_S})")
    return parser


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (anything else: argparse's usage error, status 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    flags = vars(build_parser().parse_args(argv))  # an unknown argument exits with status 2
    config, timeout = flags.pop("config"), flags.pop("timeout")
    probe = {name: flags.pop(name) for name in PROBE_FILES}
    address = "the server"
    try:
        if config is not None and not config.is_file():
            raise ProbeError(f"--config {config} is not a readable file")
        # The probe serves nothing: a non-loopback --host without TLS or tokens is the server's to refuse.
        options = load_options({**flags, "insecure": True}, config)
        address = target(options)
        with channel(options, address, probe) as server:
            reply = health_pb2_grpc.HealthStub(server).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout
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
