"""Tenants contending for one server: calls per second of one identity's clients together against one
client alone (whole-call admission), and one tenant's small call while another keeps the queue full
(admission in turn). Prints ratios measured in the same run.

    .venv/bin/python bench/tenants.py                  # the review's setting: 512 MiB, 64 MiB calls, 8 clients
    .venv/bin/python bench/tenants.py --seconds 5 --rows 1024
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from layer_norm_cases import layer_norm_call
from test_processes import broadcast_call

from aclnn_client import AclnnError, Client
from aclnn_server import ServerOptions, create_server

OP = "aclnnLayerNormBackward"
MiB = 1 << 20


def serve(**options):
    server, port, engine = create_server(ServerOptions(port=0, backend="numpy", **options))
    engine.ready.wait()
    server.start()
    return server, f"127.0.0.1:{port}"


def throughput(address: str, p: dict, clients: int, seconds: float, token: str | None = None) -> tuple[float, dict]:
    """Calls per second completed by `clients` clients (one identity), and the outcomes."""
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def worker() -> None:
        with Client(address, token=token, timeout=120) as c:
            out = np.empty_like(p["gradInputOut"])
            while time.monotonic() < stop_at:
                try:
                    c.run(OP, **{**p, "gradInputOut": out})
                    outcome = "ok"
                except AclnnError as error:
                    outcome = error.grpc_code.name if error.grpc_code else str(error.code)
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker) for _ in range(clients)]:
            future.result()
    return outcomes.get("ok", 0) / (time.monotonic() - started), outcomes


def contention(args: argparse.Namespace) -> None:
    server, address = serve(memory_budget_bytes=args.budget_mib * MiB)
    p = layer_norm_call(np.random.default_rng(0), (args.rows, 4096))  # gradOut, input, gradInput: rows x 16 KiB
    try:
        alone, _ = throughput(address, p, 1, args.seconds)
        together, outcomes = throughput(address, p, args.clients, args.seconds)
    finally:
        server.stop(None)
    tensor_mib = args.rows * 4096 * 4 / MiB
    print(
        f"whole-call admission: {args.clients} clients of one identity, {tensor_mib:.0f} MiB tensors, "
        f"{args.budget_mib} MiB budget: {together:.2f} calls/s against {alone:.2f} alone "
        f"= {together / alone:.2f}x; outcomes {outcomes}"
    )


def fairness(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokens = pathlib.Path(tmp) / "tokens"
        tokens.write_text("alice\nbob\n")
        server, address = serve(auth_token_file=tokens, max_concurrency=1, max_queue=64)
        busy, small = broadcast_call(0, rows=8192), broadcast_call(1, rows=8)
        try:
            with Client(address, token="bob") as bob:
                bob.run(OP, **small)
                alone = []
                for _ in range(20):
                    started = time.perf_counter()
                    bob.run(OP, **small)
                    alone.append(time.perf_counter() - started)
                stop = threading.Event()

                alice_calls: list[float] = []

                def alice() -> None:
                    with Client(address, token="alice", timeout=120) as c:
                        while not stop.is_set():
                            started = time.perf_counter()
                            c.run(OP, **busy)
                            alice_calls.append(time.perf_counter() - started)

                with concurrent.futures.ThreadPoolExecutor(30) as pool:
                    callers = [pool.submit(alice) for _ in range(30)]
                    time.sleep(2)
                    loaded = []
                    for _ in range(20):
                        started = time.perf_counter()
                        bob.run(OP, **small)
                        loaded.append(time.perf_counter() - started)
                    stop.set()
                    for caller in callers:
                        caller.result()
        finally:
            server.stop(None)
    a, b = statistics.median(alone), statistics.median(loaded)
    compute = len(alice_calls) and statistics.median(alice_calls) / 30  # one slot: each call waits for ~30
    print(
        f"admission in turn: bob's small call, median {a * 1e3:.1f} ms alone, {b * 1e3:.1f} ms while alice "
        f"keeps 30 callers queued on one slot, each of her calls computing ~{compute * 1e3:.1f} ms: bob waits "
        f"{b / compute:.1f} of her calls (in arrival order he would wait ~30)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4096, help="rows of 4096 fp32: 4096 rows = 64 MiB tensors")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    contention(args)
    fairness(args)


if __name__ == "__main__":
    main()
