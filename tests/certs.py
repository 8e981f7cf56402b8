"""A throwaway CA with server and client certificates, for TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# The name of the DNS-only server certificate, like a Kubernetes Service's.
DNS_NAME = "aclnn-serve.pool.svc.cluster.local"


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if common_name else [])


def issue_workload_certificate(issuer: Pem, uri: str | None) -> Pem:
    """A client certificate without a common name, as SPIFFE issues them: a URI name, or (None) no name at all."""
    return _issue("", issuer, uri=uri)


def _issue(
    subject: str,
    issuer: Pem | None,
    *,
    ca: bool = False,
    server: bool = False,
    dns_only: bool = False,
    uri: str | None = None,
) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_cert = x509.load_pem_x509_certificate(issuer.cert) if issuer else None
    issuer_key = serialization.load_pem_private_key(issuer.key, None) if issuer else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_cert.subject if issuer_cert else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName(subject)]
        if not dns_only:
            names += [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if uri is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=True
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    return Pem(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


@dataclass
class Certificates:
    ca: Pem
    server: Pem
    client: Pem
    directory: pathlib.Path
    # Issued for DNS_NAME only (no IP address), as for a Kubernetes Service: server-dns.pem/.key.
    dns_server: Pem | None = None

    def path(self, name: str) -> pathlib.Path:
        return self.directory / name


def make_certificates(directory: pathlib.Path) -> Certificates:
    ca = _issue("aclnn-test-ca", None, ca=True)
    certs = Certificates(
        ca,
        _issue("localhost", ca, server=True),
        _issue("client-alice", ca),
        directory,
        _issue(DNS_NAME, ca, server=True, dns_only=True),
    )
    for name, data in {
        "ca.pem": ca.cert,
        "server.pem": certs.server.cert,
        "server.key": certs.server.key,
        "client.pem": certs.client.cert,
        "client.key": certs.client.key,
        "server-dns.pem": certs.dns_server.cert,
        "server-dns.key": certs.dns_server.key,
    }.items():
        (directory / name).write_bytes(data)
    return certs
