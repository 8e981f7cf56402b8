"""Offloading a PyTorch model's normalization backward: time per training step against plain PyTorch.

    .venv/bin/python bench/torch_offload.py            # full size (LayerNorm-heavy model at 4096x2048 fp32)
    .venv/bin/python bench/torch_offload.py --quick    # smaller activations, fewer rounds

Three models, each trained with SGD (zero_grad, forward, loss, backward, step) on a fixed batch:
  * LayerNorm-heavy: `depth` residual blocks x = x + LayerNorm(x), activations rows x width fp32;
  * BatchNorm CNN: conv 3->32, BN, ReLU, conv 32->64 stride 2, BN, ReLU, pool, linear, BN1d;
  * small MLP: batch 64, 32->64->64->5 with two LayerNorm(64): a step of a few hundred us, where
    the fixed cost of each offloaded call (binding, validation, the transport) is what shows.
Three ways, in interleaved rounds (medians per step, ratios to plain PyTorch from this one run):
  * plain PyTorch (aten's own backward kernels);
  * offloaded through LocalClient("cpu") (the service's compiled CPU backend, in process);
  * offloaded through a local server process (backend cpu) over Client's default transport (the
    data channel on the server's Unix socket), and with shared memory (`shared_memory=True`).
For the default server path, the remote calls' time is broken down from the server's own phase metrics
(aclnn_request_phase_seconds: queue, validation, compute, transfer) and the client's wall time per
call; "client + wire" is the client's time minus everything the server accounted for.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import torch
from torch import nn

from aclnn_client import Client
from aclnn_client.torch import offload_norms
from aclnn_server import LocalClient

PHASES = ("queue", "validation", "compute", "transfer")
BROKEN_DOWN = "offloaded, local server (default transport)"  # the path whose server phases are reported


class LayerNormHeavy(nn.Module):
    """Residual LayerNorm blocks: nothing else to speak of, so the norms' backward dominates."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x = x + norm(x)
        return x


def bn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64 * 16, 128, bias=False),
        nn.BatchNorm1d(128),
    )


def small_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 5)
    )


def step_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    return step


class TimedClient:
    """Wraps a client's run to add up the wall time of its calls."""

    def __init__(self, client: Client) -> None:
        self.client, self.seconds, self.calls = client, 0.0, 0
        run = client.run

        def timed_run(op: str, **params: object) -> None:
            start = time.perf_counter()
            try:
                run(op, **params)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        client.run = timed_run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_seconds(metrics_port: int) -> dict[str, float]:
    """Sum over operators of aclnn_request_phase_seconds_sum, per phase."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    totals = dict.fromkeys(PHASES, 0.0)
    for match in re.finditer(r"^aclnn_request_phase_seconds_sum\{([^}]*)\} (\S+)$", text, re.M):
        phase = re.search(r'phase="(\w+)"', match[1])
        if phase and phase[1] in totals:
            totals[phase[1]] += float(match[2])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1024x2048 activations, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 3)")
    parser.add_argument("--only", default="", help="only the models whose label contains this (e.g. 'MLP')")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, rounds, steps = (1024, 3, 3) if args.quick else (4096, args.rounds or 5, 3)
    rounds = args.rounds or rounds

    metrics_port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--port", "0", "--backend", "cpu", "--log-level", "WARNING",
         "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    address = re.fullmatch(r"listening on (\S+)\n", server.stdout.readline())[1]
    local, remote, shared = LocalClient("cpu"), Client(address), Client(address, shared_memory=True)
    timed = TimedClient(remote)
    torch.manual_seed(0)
    workloads = {  # label: (model, batch, steps per round)
        f"LayerNorm-heavy, 4 x LayerNorm({2048}) on {rows}x2048 fp32": (
            LayerNormHeavy(2048, 4),
            torch.randn(rows, 2048),
            steps,
        ),
        "BatchNorm CNN, 32x3x64x64 fp32": (bn_cnn(), torch.randn(32, 3, 64, 64), steps),
        "small MLP 32-64-64-5, two LayerNorm(64), batch 64 fp32": (small_mlp(), torch.randn(64, 32), 20 * steps),
    }
    workloads = {label: w for label, w in workloads.items() if args.only.lower() in label.lower()}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rounds} rounds x {steps} steps each "
        f"(the small MLP {20 * steps}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )
    print("| model | path | ms per step | ratio to plain PyTorch |")
    print("|---|---|---|---|")
    breakdowns = []
    try:
        for label, (model, x, per_round) in workloads.items():
            paths = {
                "plain PyTorch": step_fn(model, x),
                "offloaded, LocalClient cpu": step_fn(offload_norms(copy.deepcopy(model), local), x),
                "offloaded, local server (default transport)": step_fn(offload_norms(copy.deepcopy(model), remote), x),
                "offloaded, local server (shared memory)": step_fn(offload_norms(copy.deepcopy(model), shared), x),
            }
            for step in paths.values():  # warm: compiled kernels, connections, allocator
                step()
                step()
            times: dict[str, list[float]] = {name: [] for name in paths}
            timed.seconds, timed.calls = 0.0, 0
            phases = dict.fromkeys(PHASES, 0.0)
            for _ in range(rounds):
                for name, step in paths.items():
                    before = phase_seconds(metrics_port) if name == BROKEN_DOWN else None
                    start = time.perf_counter()
                    for _ in range(per_round):
                        step()
                    times[name].append((time.perf_counter() - start) / per_round)
                    if before is not None:
                        phases = {k: phases[k] + v - before[k] for k, v in phase_seconds(metrics_port).items()}
            plain = statistics.median(times["plain PyTorch"])
            for name, samples in times.items():
                t = statistics.median(samples)
                ratios = [s / p for s, p in zip(samples, times["plain PyTorch"])]
                print(f"| {label if name == 'plain PyTorch' else ''} | {name} | {t * 1e3:.{1 if t > 0.01 else 3}f} | "
                      f"{statistics.median(ratios):.2f} |")  # fmt: skip
            n_steps = rounds * per_round
            server_total = sum(phases.values())
            breakdowns.append(
                (label, timed.calls / n_steps, timed.seconds / n_steps, {k: v / n_steps for k, v in phases.items()},
                 (timed.seconds - server_total) / n_steps, plain)
            )  # fmt: skip
        print("\nThe default server path's remote calls, per training step (ms):\n")
        print(
            "| model | calls | client wall time | server compute | server transfer | server queue + validation "
            "| client + wire (rest) |"
        )
        print("|---|---|---|---|---|---|---|")
        for label, calls, wall, phases, rest, _ in breakdowns:
            print(f"| {label} | {calls:.0f} | {wall * 1e3:.1f} | {phases['compute'] * 1e3:.1f} | "
                  f"{phases['transfer'] * 1e3:.1f} | {(phases['queue'] + phases['validation']) * 1e3:.1f} | "
                  f"{rest * 1e3:.1f} |")  # fmt: skip
    finally:
        remote.close()
        shared.close()
        local.close()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
