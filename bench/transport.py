"""Transport benchmark: aclnn-serve (data channel, gRPC unary and streaming, shared memory) against PyTorch RPC.

Both servers run in their own process on this machine and are reached over TCP loopback;
every number is a median (or percentile) measured in this one run, so ratios compare like
with like on a noisy machine.

    .venv/bin/python bench/transport.py            # full: 8192x4096 large call
    .venv/bin/python bench/transport.py --quick    # smaller and shorter
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
from rpc_udf import layer_norm_backward

OP = "aclnnLayerNormBackward"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_inputs(rows: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n), dtype=np.float32)
    return dict(
        gradOut=rng.standard_normal((rows, n), dtype=np.float32),
        input=x,
        mean=x.mean(1, keepdims=True),
        rstd=1 / np.sqrt(x.var(1, keepdims=True) + 1e-5),
        weightOptional=np.ones(n, np.float32),
    )


def aclnn_params(inputs: dict[str, np.ndarray]) -> dict:
    rows, n = inputs["input"].shape
    return dict(
        inputs,
        normalizedShape=[n],
        outputMask=[True, True, True],
        gradInputOut=np.empty((rows, n), np.float32),
        gradWeightOut=np.empty(n, np.float32),
        gradBiasOut=np.empty(n, np.float32),
    )


def timed(fn, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller large call, fewer repeats")
    parser.add_argument("--backend", default="auto", help="aclnn-serve backend (default auto)")
    args = parser.parse_args()
    import torch
    import torch.distributed.rpc as rpc

    from aclnn_client import Client

    large_rows, repeats, small_calls = (2048, 5, 300) if args.quick else (8192, 7, 1000)
    server = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--port", "0", "--backend", args.backend,
         "--max-message-bytes", str(2**31 - 1), "--log-level", "WARNING", "--max-queue", "256"],
        stdout=subprocess.PIPE, text=True,
    )
    address = re.fullmatch(r"listening on (\S+)\n", server.stdout.readline())[1]
    rpc_port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    worker = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import rpc_udf; rpc_udf.serve({rpc_port})"]
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rpc_port))
    rpc.init_rpc("client", rank=0, world_size=2)
    rows_out: list[tuple[str, str, float, float]] = []
    try:
        # Large call: end to end, inputs up and all three outputs back.
        inputs = make_inputs(large_rows, 4096)
        torch_args = tuple(torch.from_numpy(inputs[k]) for k in ("gradOut", "input", "mean", "rstd", "weightOptional"))
        rpc_large = statistics.median(timed(lambda: rpc.rpc_sync("server", layer_norm_backward, torch_args), repeats))
        rows_out.append((f"large {large_rows}x4096 fp32", "PyTorch RPC (TensorPipe)", rpc_large, 1.0))
        for label, kwargs in [
            ("aclnn-serve default (data channel)", {}),
            ("aclnn-serve gRPC unary", dict(data_channel=False, max_inline_bytes=2**31)),
            ("aclnn-serve gRPC streaming (1 MiB chunks)", dict(data_channel=False, max_inline_bytes=1 << 20)),
            ("aclnn-serve shared memory", dict(shared_memory=True)),
        ]:
            with Client(address, **kwargs) as c:
                p = aclnn_params(inputs)
                t = statistics.median(timed(lambda c=c, p=p: c.run(OP, **p), repeats))
            rows_out.append(("", label, t, t / rpc_large))

        # Small call latency: p50 and p99 over many calls.
        small = make_inputs(4, 1024)
        small_torch = tuple(torch.from_numpy(small[k]) for k in ("gradOut", "input", "mean", "rstd", "weightOptional"))
        rpc_small = timed(lambda: rpc.rpc_sync("server", layer_norm_backward, small_torch), small_calls, warmup=50)
        small_rows = [("PyTorch RPC (TensorPipe)", rpc_small)]
        paths = [("aclnn-serve Run, data channel", {}), ("aclnn-serve Run, gRPC", dict(data_channel=False))]
        for label, kwargs in paths:
            with Client(address, **kwargs) as c:
                p = aclnn_params(small)
                small_rows.append((label, timed(lambda c=c, p=p: c.run(OP, **p), small_calls, warmup=50)))
        for label, samples in small_rows:
            p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
            rows_out.append(("small 4x1024 fp32 p50 / p99", label, p50, p99))

        # Throughput: several concurrent clients of small calls for a fixed time.
        clients, seconds = 4, 2.0 if args.quick else 4.0

        def ours_loop(kwargs: dict) -> int:
            with Client(address, **kwargs) as c:
                p, done, end = aclnn_params(small), 0, time.monotonic() + seconds
                while time.monotonic() < end:
                    c.run(OP, **p)
                    done += 1
                return done

        def rpc_loop(_: dict) -> int:
            done, end = 0, time.monotonic() + seconds
            while time.monotonic() < end:
                rpc.rpc_sync("server", layer_norm_backward, small_torch)
                done += 1
            return done

        for label, loop, kwargs in [
            ("PyTorch RPC (TensorPipe)", rpc_loop, {}),
            ("aclnn-serve Run, data channel", ours_loop, {}),
            ("aclnn-serve Run, gRPC", ours_loop, dict(data_channel=False)),
        ]:
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                total = sum(pool.map(loop, [kwargs] * clients))
            rows_out.append((f"throughput, {clients} client threads", label, total / seconds, 0.0))
    finally:
        rpc.shutdown()
        worker.wait(timeout=60)
        server.terminate()
        server.wait(timeout=60)

    print(f"\nTransport benchmark ({'quick' if args.quick else 'full'}; aclnn-serve backend {args.backend}; "
          f"{os.cpu_count()} cores; loopback TCP)\n")
    print("| case | path | time | vs PyTorch RPC |")
    print("|---|---|---|---|")
    for case, label, value, extra in rows_out:
        if case.startswith("small"):
            print(f"| {case} | {label} | {value * 1e3:.3f} ms / {extra * 1e3:.3f} ms | "
                  f"{value / percentile(rpc_small, 0.5):.2f}x (p50) |")
        elif case.startswith("throughput"):
            print(f"| {case} | {label} | {value:.0f} calls/s | |")
        else:
            print(f"| {case} | {label} | {value * 1e3:.1f} ms | {extra:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
