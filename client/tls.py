"""TLS for the gRPC channels and the data channel, from the same settings; no bearer token in clear."""

from __future__ import annotations

import os
import ssl
import tempfile

import grpc


def system_roots() -> bytes | None:
    """The system's trust store as PEM (the file OpenSSL uses); None: gRPC's own bundled roots."""
    cafile = ssl.get_default_verify_paths().cafile
    if cafile:
        try:
            with open(cafile, "rb") as f:
                return f.read()
        except OSError:
            pass
    return None


class Tls:
    """The client's TLS: PEM bytes (all optional) and the trust they mean; `None` roots = the system's."""

    def __init__(self, root_certificates: bytes | None, private_key: bytes | None, certificate_chain: bytes | None):
        self.root_certificates, self.private_key, self.certificate_chain = (
            root_certificates,
            private_key,
            certificate_chain,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        roots = self.root_certificates or system_roots()
        return grpc.ssl_channel_credentials(roots, self.private_key, self.certificate_chain)

    def context(self) -> ssl.SSLContext:
        """The data channel's TLS: the same roots (the system's without any) and client certificate."""
        context = ssl.create_default_context(cadata=self.root_certificates.decode() if self.root_certificates else None)
        if self.private_key and self.certificate_chain:
            # ssl loads a client certificate only from files: they live for this call, readable by us alone.
            with tempfile.TemporaryDirectory() as directory:
                paths = [os.path.join(directory, name) for name in ("chain.pem", "key.pem")]
                for path, pem in zip(paths, (self.certificate_chain, self.private_key)):
                    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                        f.write(pem)
                context.load_cert_chain(*paths)
        return context


def settings(
    tls: bool, root_certificates: bytes | None, private_key: bytes | None, certificate_chain: bytes | None
) -> Tls | None:
    """TLS when asked for (`tls=True`: the system's roots) or implied by any PEM argument; else None."""
    if tls or root_certificates or private_key or certificate_chain:
        return Tls(root_certificates, private_key, certificate_chain)
    return None


def check_token(token: str | None, tls: Tls | None, loopback: bool, allow_plaintext_token: bool) -> None:
    """A bearer token read off the network is a stolen identity: never sent in clear beyond this host."""
    if token and tls is None and not loopback and not allow_plaintext_token:
        raise ValueError(
            "a token would be sent in clear to a server off this host: use tls=True (or root_certificates), "
            "or pass allow_plaintext_token=True if the network itself is trusted (a service mesh)"
        )
