"""Chunk-size sweep for the gRPC streaming path (UploadTensor / DownloadTensor) over TCP loopback.

The server runs in its own process with the chunk size under test (it sets the size of
the download's chunks; the client sets the upload's). Prints MB/s each way per size.

    .venv/bin/python bench/chunks.py            # 256 MiB tensor, sizes 256 KiB .. 16 MiB
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np

from aclnn_common import chunks
from aclnn_common._proto import aclnn_pb2_grpc as pb_grpc

SERVER = """
import sys
from aclnn_common import chunks
chunks.CHUNK_BYTES = int(sys.argv[1])
from aclnn_server.cli import main
sys.exit(main(["--port", "0", "--backend", "numpy", "--log-level", "WARNING"]))
"""


def sweep_one(chunk_bytes: int, data: np.ndarray, repeats: int) -> tuple[float, float]:
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(chunk_bytes)], stdout=subprocess.PIPE, text=True)
    try:
        address = re.fullmatch(r"listening on (\S+)\n", server.stdout.readline())[1]
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        with grpc.insecure_channel(address, options) as channel:
            stub = pb_grpc.AclnnStub(channel)
            metadata = (("x-aclnn-session", "sweep"),)
            view = chunks.byte_view(data)
            out = np.empty_like(data)
            up, down = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                handle = stub.UploadTensor(chunks.to_chunks(view, chunk_bytes), metadata=metadata)
                up.append(time.perf_counter() - started)
                started = time.perf_counter()
                chunks.receive_into(out, stub.DownloadTensor(handle, metadata=metadata))
                down.append(time.perf_counter() - started)
                stub.FreeTensor(handle, metadata=metadata)
            assert np.array_equal(out, data)
        return data.nbytes / statistics.median(up) / 1e6, data.nbytes / statistics.median(down) / 1e6
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="tensor size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = np.random.default_rng(0).integers(0, 255, args.mib << 20, dtype=np.uint8)
    print(f"\ngRPC streaming chunk sweep: {args.mib} MiB tensor, medians of {args.repeats}\n")
    print("| chunk | upload MB/s | download MB/s |")
    print("|---|---|---|")
    for kib in (256, 1024, 2048, 4096, 8192, 16384):
        up, down = sweep_one(kib << 10, data, args.repeats)
        print(f"| {kib // 1024 if kib >= 1024 else kib} {'MiB' if kib >= 1024 else 'KiB'} | {up:.0f} | {down:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
