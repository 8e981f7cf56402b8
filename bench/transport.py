"""Transport benchmark: aclnn-serve (data channel over TCP and over the Unix socket, gRPC unary and
streaming, shared memory) against PyTorch RPC.

Both servers run in their own process on this machine and are reached over loopback (aclnn-serve
also over its Unix domain socket); PyTorch RPC's client runs in a process of its own too, paused
with its worker outside its turns (see rpc_udf.py: TensorPipe busy-polls a core in each). Every
number is a median (or percentile) measured in this one run, so ratios compare like with like on
a noisy machine.

    .venv/bin/python bench/transport.py            # full: 8192x4096 large call
    .venv/bin/python bench/transport.py --quick    # smaller and shorter
    .venv/bin/python bench/transport.py --sweep    # every path at tensor sizes 64 KiB .. 64 MiB, and a plot
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

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


def interleaved(
    batches: dict[str, Callable[[int], list[float]]], count: int, batch: int = 50
) -> dict[str, list[float]]:
    """`count` timings of each path, taken in batches that take turns; `batches[label](k)` times k calls
    (after a few warm-up calls)."""
    samples: dict[str, list[float]] = {label: [] for label in batches}
    for turn in range(-(-count // batch)):
        for label in in_turns(list(batches), turn):
            samples[label] += batches[label](batch)
    return samples


class RpcClient:
    """PyTorch RPC's client process (rpc_udf.client), paused with its worker between requests: their
    busy-polling threads would otherwise take a core each from every other path."""

    def __init__(self, here: str, tcp: bool = False) -> None:
        """A worker and its client on a free port; `tcp`: TensorPipe on TCP alone (rpc_udf.options)."""
        port = free_port()
        start = f"import sys; sys.path.insert(0, {here!r}); import rpc_udf; rpc_udf."
        self.worker = subprocess.Popen([sys.executable, "-c", f"{start}serve({port}, tcp={tcp})"])
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"{start}client({port}, tcp={tcp})"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def ask(self, **command: object) -> object:
        self._signal(signal.SIGCONT)
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("PyTorch RPC's client process ended (its error is above)")
        self._signal(signal.SIGSTOP)
        return json.loads(line)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        self.process.stdin.close()  # the client ends RPC with the worker, and both exit
        try:
            self.process.wait(timeout=60)
            self.worker.wait(timeout=60)
        finally:
            for process in (self.process, self.worker):
                if process.poll() is None:
                    process.kill()

    def _signal(self, which: signal.Signals) -> None:
        for process in (self.process, self.worker):
            process.send_signal(which)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# The sweep: LayerNorm backward on [rows, SWEEP_WIDTH] fp32, so a tensor of rows * 4 KiB; gradOut and
# input travel in, gradInput back (and the small mean, rstd, weight, gradWeight, gradBias).
SWEEP_WIDTH = 1024
SWEEP_SIZES = [(64 << 10) << k for k in range(11)]  # bytes per tensor: 64 KiB .. 64 MiB
SWEEP_PATHS = {  # label -> Client options (None: LocalClient in this process, the floor)
    "in process (LocalClient)": None,
    "default (data channel, Unix socket)": {},
    "shared memory": dict(shared_memory=True),
    "data channel over TCP": dict(unix_socket=False),
    "gRPC (data_channel=False)": dict(data_channel=False),
}
RPC = "PyTorch RPC (TensorPipe)"
# TensorPipe picks shared memory on one host; this one is held to TCP, as the TCP path is (rpc_udf.options).
RPC_TCP = "PyTorch RPC over TCP"
# The ratio targets of the transport issue, per path: at most this many times PyTorch RPC's time.
SWEEP_TARGETS = {"default (data channel, Unix socket)": 1.0, "shared memory": 0.5, "data channel over TCP": 1.0}
# Like for like: the TCP path against PyTorch RPC on TCP too (a column and a dashed line beside the targets').
TCP_PAIR = ("data channel over TCP", RPC_TCP)


def sweep_batch(nbytes: int) -> int:
    """Calls per path per turn: about the same time per turn up to 2 MiB (small calls vary more), two beyond."""
    return max(2, min(16, (4 << 20) // nbytes))


def parse_sizes(text: str) -> list[int]:
    """Sizes such as 256K,1M (powers of two of at least 64 KiB: whole rows of SWEEP_WIDTH fp32)."""
    units = {"K": 1 << 10, "M": 1 << 20}
    return [int(size[:-1]) * units[size[-1].upper()] for size in text.split(",")]


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def sweep(
    address: str, backend: str, references: dict[str, RpcClient], turns: int, sizes: list[int]
) -> dict[int, dict[str, list[float]]]:
    """Each path's call times at each size, in turns (Williams order) of a few calls per path."""
    from aclnn_client import Client
    from aclnn_server import LocalClient

    clients = {
        label: LocalClient(backend) if kwargs is None else Client(address, **kwargs)
        for label, kwargs in SWEEP_PATHS.items()
    }
    results: dict[int, dict[str, list[float]]] = {}
    try:
        for nbytes in sizes:
            rows = nbytes // (4 * SWEEP_WIDTH)
            p = aclnn_params(make_inputs(rows, SWEEP_WIDTH))
            batch = sweep_batch(nbytes)
            batches: dict[str, Callable[[int], list[float]]] = {}
            for label, rpc in references.items():
                rpc.ask(inputs=[rows, SWEEP_WIDTH])
                batches[label] = lambda k, rpc=rpc: rpc.ask(timed=k, warmup=1)
            for label, client in clients.items():
                batches[label] = lambda k, c=client, p=p: timed(lambda: c.run(OP, **p), k, warmup=1)
            results[nbytes] = interleaved(batches, turns * batch, batch)
            line = ", ".join(f"{label} {statistics.median(t) * 1e3:.2f} ms" for label, t in results[nbytes].items())
            print(f"{size_label(nbytes)}: {line}", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            client.close()
    return results


def sweep_table(results: dict[int, dict[str, list[float]]]) -> str:
    """Medians per size and path, the targeted paths' ratios to PyTorch RPC and TCP's to PyTorch RPC on TCP
    (ratios of the medians)."""
    labels = [RPC, RPC_TCP, *SWEEP_PATHS]
    head = ["tensor", *[f"{label} ms" for label in labels], *[f"{label} / RPC" for label in SWEEP_TARGETS]]
    head.append(f"{TCP_PAIR[0]} / {TCP_PAIR[1]}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for nbytes, samples in results.items():
        cells = [size_label(nbytes)] + [f"{statistics.median(samples[label]) * 1e3:.2f}" for label in labels]
        rpc = statistics.median(samples[RPC])
        cells += [f"{statistics.median(samples[label]) / rpc:.2f}x" for label in SWEEP_TARGETS]
        cells.append(f"{statistics.median(samples[TCP_PAIR[0]]) / statistics.median(samples[TCP_PAIR[1]]):.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_plot(results: dict[int, dict[str, list[float]]], path: str, title: str) -> None:
    """Time per call against tensor size, one line per path (log-log), and the ratios to PyTorch RPC."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    labels = [RPC, RPC_TCP, *SWEEP_PATHS]
    colors = dict(zip(labels, ["black", "grey", *plt.get_cmap("tab10").colors]))  # a path's color in both panels
    fig, (times, ratios) = plt.subplots(1, 2, figsize=(13, 5.2))
    for label in labels:
        medians = [statistics.median(results[s][label]) * 1e3 for s in sizes]
        width = 2.5 if label in (RPC, RPC_TCP) else 1.5
        times.plot(sizes, medians, marker="o", markersize=4, label=label, color=colors[label], linewidth=width)

    def ratio(label: str, reference: str) -> list[float]:
        return [statistics.median(results[s][label]) / statistics.median(results[s][reference]) for s in sizes]

    for label, target in SWEEP_TARGETS.items():
        ratios.plot(sizes, ratio(label, RPC), marker="o", markersize=4, label=label, color=colors[label])
        ratios.axhline(target, color=colors[label], linestyle=":", linewidth=1)
    tcp, reference = TCP_PAIR
    ratios.plot(
        sizes,
        ratio(tcp, reference),
        marker="s",
        markersize=4,
        linestyle="--",
        color=colors[tcp],
        label=f"{tcp}, against {reference}",
    )
    for axis in (times, ratios):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [size_label(s) for s in sizes], rotation=45)
        axis.set_xlabel("bytes per tensor (gradOut, input and gradInput each)")
        axis.grid(True, which="major", alpha=0.3)
    times.set_yscale("log")
    times.set_ylabel("ms per call (median)")
    times.set_title("time per call")
    times.legend(fontsize=8)
    ratios.set_ylabel("time / PyTorch RPC's (dotted: target)")
    ratios.set_ylim(bottom=0)
    ratios.set_title("against PyTorch RPC")
    ratios.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller large call, fewer repeats")
    # Not auto: it serves from the NumPy reference until the cpu kernels are in, and a timed call could land there;
    # a backend named prints `listening on` once it is ready.
    parser.add_argument("--backend", default="cpu", help="aclnn-serve backend (default cpu)")
    parser.add_argument("--sweep", action="store_true", help="only the size sweep (64 KiB .. 64 MiB per tensor)")
    parser.add_argument(
        "--turns", type=int, default=14, help="sweep: turns per size (default 14: balanced for its 7 paths)"
    )
    parser.add_argument("--plot", default="docs/transport_sweep.png", help="sweep: where the PNG goes")
    parser.add_argument(
        "--sizes", type=parse_sizes, default=SWEEP_SIZES, help="sweep: bytes per tensor, e.g. 1M,2M,4M (default all)"
    )
    args = parser.parse_args()
    from aclnn_client import Client
    from aclnn_common._proto import aclnn_pb2 as pb

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
            "--log-level",
            "WARNING",
            "--max-queue",
            "256",
            # The large gRPC unary call needs messages beyond the default; the sweep uses the defaults.
            *([] if args.sweep else ["--max-message-bytes", str(2**31 - 1)]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    address = re.fullmatch(r"listening on (\S+)\n", server.stdout.readline())[1]
    here = os.path.dirname(os.path.abspath(__file__))
    torch_rpc = RpcClient(here)
    rows_out: list[tuple[str, str, float, float | tuple[float, float]]] = []
    try:
        if args.sweep:
            rpc_tcp = RpcClient(here, tcp=True)
            try:
                results = sweep(address, args.backend, {RPC: torch_rpc, RPC_TCP: rpc_tcp}, args.turns, args.sizes)
            finally:
                rpc_tcp.close()
            title = (
                f"LayerNorm backward, [rows, {SWEEP_WIDTH}] fp32, aclnn-serve backend {args.backend}, "
                f"{os.cpu_count()} cores, one run (load average {os.getloadavg()[0]:.1f})"
            )
            print(f"\nTransport size sweep: {title}\n")
            print(sweep_table(results))
            try:
                sweep_plot(results, args.plot, title)
            except ImportError:
                print("\nno plot: it needs matplotlib (pip install -e '.[bench]')")
            else:
                print(f"\nplot: {args.plot}")
            return 0
        # Large call: end to end, inputs up and all three outputs back.
        inputs = make_inputs(large_rows, 4096)
        torch_rpc.ask(inputs=[large_rows, 4096])
        rpc_large = statistics.median(torch_rpc.ask(timed=repeats, warmup=2))
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
        torch_rpc.ask(inputs=[4, 1024])
        paths = {
            "Unix socket (default)": {},
            "Unix socket + shared memory": dict(shared_memory=True),
            "data channel TCP": dict(unix_socket=False),
            "gRPC": dict(data_channel=False),
        }
        ours = {label: Client(address, **kwargs) for label, kwargs in paths.items()}
        try:
            p = aclnn_params(small)
            batches = {"PyTorch RPC (TensorPipe)": lambda k: torch_rpc.ask(timed=k, warmup=5)}
            for label, c in ours.items():
                batches[f"aclnn-serve Run, {label}"] = lambda k, c=c: timed(lambda: c.run(OP, **p), k, warmup=5)
            measured = interleaved(batches, small_calls)
            rpc_small = measured["PyTorch RPC (TensorPipe)"]  # the reference of the ratios
            for label, samples in measured.items():
                p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
                rows_out.append(("small 4x1024 fp32 p50 / p99", label, p50, p99))
            empty = {
                f"aclnn-serve {label}": lambda k, c=ours[label]: timed(
                    lambda: c._call_on(0, "KeepAlive", pb.Empty()), k, 5
                )
                for label in ("Unix socket (default)", "data channel TCP", "gRPC")
            }
            for label, samples in interleaved(empty, small_calls).items():
                p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
                rows_out.append(("empty call round trip p50 / p99", label, p50, p99))
        finally:
            for client in ours.values():
                client.close()

        # Throughput: several concurrent clients of small calls, each path in interleaved slices.
        # Short slices, many turns: a slow spell of the machine (seconds long here) falls on every path alike.
        clients, seconds, slices = 4, 2.0 if args.quick else 4.0, 16

        def ours_loop(client: Client, end: float) -> int:
            p, done = aclnn_params(small), 0
            while time.monotonic() < end:
                client.run(OP, **p)
                done += 1
            return done

        def ours_turn(pooled: list[Client]) -> tuple[int, float]:
            """(calls made, seconds to the last call's end) by `clients` threads for one slice."""
            started = time.monotonic()
            calls = sum(pool.map(ours_loop, pooled, [started + seconds / slices] * clients))
            return calls, time.monotonic() - started

        # Each path's turn, and its serving and client processes (whose CPU per call is reported).
        pools = {
            label: [Client(address, **kwargs) for _ in range(clients)]
            for label, kwargs in [
                ("Unix socket (default)", {}),
                ("data channel TCP", dict(unix_socket=False)),
                ("gRPC", dict(data_channel=False)),
            ]
        }
        turns = {
            "PyTorch RPC (TensorPipe)": (
                lambda: torch_rpc.ask(loop=seconds / slices, threads=clients),
                torch_rpc.worker.pid,
                torch_rpc.process.pid,
            )
        }
        for label, pooled in pools.items():
            turns[f"aclnn-serve Run, {label}"] = (lambda pooled=pooled: ours_turn(pooled), server.pid, os.getpid())
        done, elapsed = dict.fromkeys(turns, 0), dict.fromkeys(turns, 0.0)
        # CPU per call, steadier than calls/s on a shared machine: the serving process's, and the client's.
        cpu = {label: [0.0, 0.0] for label in turns}
        try:
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for turn in range(slices):
                    for label in in_turns(list(turns), turn):
                        run_turn, serving, calling = turns[label]
                        served_before, client_before = cpu_seconds(serving), cpu_seconds(calling)
                        calls, took = run_turn()
                        done[label] += calls
                        elapsed[label] += took
                        cpu[label][0] += cpu_seconds(serving) - served_before
                        cpu[label][1] += cpu_seconds(calling) - client_before
        finally:
            for pooled in pools.values():
                for client in pooled:
                    client.close()
        for label, total in done.items():
            per_call = (cpu[label][0] / total, cpu[label][1] / total)
            rows_out.append((f"throughput, {clients} client threads", label, total / elapsed[label], per_call))
    finally:
        server.terminate()
        torch_rpc.close()
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
