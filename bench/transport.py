"""Transport benchmark: aclnn-serve (data channel over TCP and over the Unix socket, gRPC unary and
streaming, shared memory) against PyTorch RPC.

Both servers run in their own process on this machine and are reached over loopback (aclnn-serve
also over its Unix domain socket);
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


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_turns(labels: list[str], turn: int) -> list[str]:
    """The labels in this turn's order, from a Williams design: over len(labels) turns (twice that
    when odd) each runs right after every other exactly once, so that no path gains or loses from
    the one before it (a turn can leave the machine busy for the next)."""
    n = len(labels)
    steps = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    order = [(turn + step) % n for step in steps]
    if n % 2 and turn // n % 2:
        order.reverse()
    return [labels[i] for i in order]


def interleaved(calls: dict[str, object], count: int, batch: int = 50) -> dict[str, list[float]]:
    """`count` timings of each call, taken in batches that take turns (after a few warm-up calls each)."""
    samples: dict[str, list[float]] = {label: [] for label in calls}
    for turn in range(-(-count // batch)):
        for label in in_turns(list(calls), turn):
            samples[label] += timed(calls[label], batch, warmup=5)
    return samples


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
    from aclnn_client._proto import aclnn_pb2 as pb

    large_rows, repeats, small_calls = (2048, 5, 300) if args.quick else (8192, 7, 1000)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aclnn_server",
            "--port",
            "0",
            "--backend",
            args.backend,
            "--max-message-bytes",
            str(2**31 - 1),
            "--log-level",
            "WARNING",
            "--max-queue",
            "256",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    address = re.fullmatch(r"listening on (\S+)\n", server.stdout.readline())[1]
    rpc_port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    worker = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import rpc_udf; rpc_udf.serve({rpc_port})"]
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rpc_port))
    rpc.init_rpc("client", rank=0, world_size=2)
    rows_out: list[tuple[str, str, float, float | tuple[float, float]]] = []
    try:
        # Large call: end to end, inputs up and all three outputs back.
        inputs = make_inputs(large_rows, 4096)
        torch_args = tuple(torch.from_numpy(inputs[k]) for k in ("gradOut", "input", "mean", "rstd", "weightOptional"))
        rpc_large = statistics.median(timed(lambda: rpc.rpc_sync("server", layer_norm_backward, torch_args), repeats))
        rows_out.append((f"large {large_rows}x4096 fp32", "PyTorch RPC (TensorPipe)", rpc_large, 1.0))
        for label, kwargs in [
            ("aclnn-serve default (data channel, Unix socket)", {}),
            ("aclnn-serve data channel, TCP", dict(unix_socket=False)),
            ("aclnn-serve gRPC unary", dict(data_channel=False, max_inline_bytes=2**31)),
            ("aclnn-serve gRPC streaming (1 MiB chunks)", dict(data_channel=False, max_inline_bytes=1 << 20)),
            ("aclnn-serve shared memory (memfds, Unix socket)", dict(shared_memory=True)),
        ]:
            with Client(address, **kwargs) as c:
                p = aclnn_params(inputs)
                t = statistics.median(timed(lambda c=c, p=p: c.run(OP, **p), repeats))
            rows_out.append(("", label, t, t / rpc_large))

        # Small calls, then the transport alone (an empty call, KeepAlive): p50 and p99 over many calls,
        # in interleaved batches of 50 per path, so that a slow spell of the machine hits every path alike.
        small = make_inputs(4, 1024)
        small_torch = tuple(torch.from_numpy(small[k]) for k in ("gradOut", "input", "mean", "rstd", "weightOptional"))
        paths = {
            "Unix socket (default)": {},
            "Unix socket + shared memory": dict(shared_memory=True),
            "data channel TCP": dict(unix_socket=False),
            "gRPC": dict(data_channel=False),
        }
        ours = {label: Client(address, **kwargs) for label, kwargs in paths.items()}
        try:
            p = aclnn_params(small)
            calls = {"PyTorch RPC (TensorPipe)": lambda: rpc.rpc_sync("server", layer_norm_backward, small_torch)}
            calls.update({f"aclnn-serve Run, {label}": lambda c=c: c.run(OP, **p) for label, c in ours.items()})
            measured = interleaved(calls, small_calls)
            rpc_small = measured["PyTorch RPC (TensorPipe)"]  # the reference of the ratios
            for label, samples in measured.items():
                p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
                rows_out.append(("small 4x1024 fp32 p50 / p99", label, p50, p99))
            empty = {
                f"aclnn-serve {label}": lambda c=ours[label]: c._call_on(0, "KeepAlive", pb.Empty())
                for label in ("Unix socket (default)", "data channel TCP", "gRPC")
            }
            for label, samples in interleaved(empty, small_calls).items():
                p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
                rows_out.append(("empty call round trip p50 / p99", label, p50, p99))
        finally:
            for client in ours.values():
                client.close()

        # Throughput: several concurrent clients of small calls, each path in interleaved slices.
        clients, seconds, slices = 4, 2.0 if args.quick else 4.0, 8

        def ours_loop(client: Client, end: float) -> int:
            p, done = aclnn_params(small), 0
            while time.monotonic() < end:
                client.run(OP, **p)
                done += 1
            return done

        def rpc_loop(_: object, end: float) -> int:
            done = 0
            while time.monotonic() < end:
                rpc.rpc_sync("server", layer_norm_backward, small_torch)
                done += 1
            return done

        # Each path's loop, client options, and serving process (whose CPU per call is reported).
        loops = {
            "PyTorch RPC (TensorPipe)": (rpc_loop, {}, worker.pid),
            "aclnn-serve Run, Unix socket (default)": (ours_loop, {}, server.pid),
            "aclnn-serve Run, data channel TCP": (ours_loop, dict(unix_socket=False), server.pid),
            "aclnn-serve Run, gRPC": (ours_loop, dict(data_channel=False), server.pid),
        }
        pools = {label: [Client(address, **kwargs) for _ in range(clients)] for label, (_, kwargs, _) in loops.items()}
        done = dict.fromkeys(loops, 0)
        # CPU per call, steadier than calls/s on a shared machine: the serving process's, and this one's.
        cpu = {label: [0.0, 0.0] for label in loops}
        try:
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for turn in range(slices):
                    for label in in_turns(list(loops), turn):
                        loop, _, serving = loops[label]
                        served_before, client_before = cpu_seconds(serving), time.process_time()
                        end = time.monotonic() + seconds / slices
                        done[label] += sum(pool.map(loop, pools[label], [end] * clients))
                        cpu[label][0] += cpu_seconds(serving) - served_before
                        cpu[label][1] += time.process_time() - client_before
        finally:
            for pooled in pools.values():
                for client in pooled:
                    client.close()
        for label, total in done.items():
            per_call = (cpu[label][0] / total, cpu[label][1] / total)
            rows_out.append((f"throughput, {clients} client threads", label, total / seconds, per_call))
    finally:
        rpc.shutdown()
        worker.wait(timeout=60)
        server.terminate()
        server.wait(timeout=60)

    print(
        f"\nTransport benchmark ({'quick' if args.quick else 'full'}; aclnn-serve backend {args.backend}; "
        f"{os.cpu_count()} cores; loopback TCP and a Unix socket)\n"
    )
    print("| case | path | time | vs PyTorch RPC |")
    print("|---|---|---|---|")
    for case, label, value, extra in rows_out:
        if case.startswith("small"):
            print(
                f"| {case} | {label} | {value * 1e3:.3f} ms / {extra * 1e3:.3f} ms | "
                f"{value / percentile(rpc_small, 0.5):.2f}x (p50) |"
            )
        elif case.startswith("empty"):
            print(f"| {case} | {label} | {value * 1e6:.0f} µs / {extra * 1e6:.0f} µs | |")
        elif case.startswith("throughput"):
            server_cpu, client_cpu = extra
            print(
                f"| {case} | {label} | {value:.0f} calls/s | CPU per call: server {server_cpu * 1e6:.0f} µs, "
                f"client {client_cpu * 1e6:.0f} µs |"
            )
        else:
            print(f"| {case} | {label} | {value * 1e3:.1f} ms | {extra:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
