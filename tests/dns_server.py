"""A tiny DNS server on a loopback UDP port for tests: A records that a test can change while clients run."""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading


class DnsServer:
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self._sock.recvfrom(512)
            except OSError:
                return
            reply = self._answer(query)
            if reply:
                self._sock.sendto(reply, peer)

    def _answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        ident = struct.unpack(">H", query[:2])[0]
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1 : i + 1 + query[i]].decode().lower())
            i += 1 + query[i]
        qtype, _qclass = struct.unpack(">HH", query[i + 1 : i + 5])
        question = query[12 : i + 5]
        name = ".".join(labels)
        self.queries += 1
        known = name in self.records
        answers = b""
        count = 0
        if qtype == 1:
            for address in self.records.get(name, []):
                answers += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 1, 4) + ipaddress.IPv4Address(address).packed
                count += 1
        rcode = 0 if known else 3
        header = struct.pack(">HHHHHH", ident, 0x8400 | rcode, 1, count, 0, 0)
        return header + question + answers
