"""The PyTorch RPC side of bench/transport.py: its worker (`serve`) and its client (`client`), each in
a process of its own. Both import this module (RPC pickles the remote function by name).

PyTorch RPC's default TensorPipe transport on one host (shared memory) busy-polls: each of the two
processes keeps one thread spinning, a whole core even when idle. On a small machine that would
slow every other path measured beside it, so the benchmark pauses both processes (SIGSTOP) outside
PyTorch RPC's own turns; during them PyTorch RPC runs as it always does, spinning included.
"""

from __future__ import annotations

import os


def layer_norm_backward(g, x, mean, rstd, w):
    """The remote function: aten's LayerNorm backward on the received tensors."""
    import torch

    n = x.shape[-1]
    return torch.ops.aten.native_layer_norm_backward(g, x, [n], mean, rstd, w, torch.zeros_like(w), [True, True, True])


def options(tcp: bool):
    """TensorPipe's options: its own choice (on one host, shared memory and cross-memory attach), or
    (`tcp`) TCP alone, tensors included: the reference for a transport that crosses hosts."""
    import torch.distributed.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"]) if tcp else None


def serve(port: int, tcp: bool = False) -> None:
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("server", rank=1, world_size=2, rpc_backend_options=options(tcp))
    rpc.shutdown()


def client(port: int, tcp: bool = False) -> None:
    """Answers one JSON command per line of stdin with one JSON line on stdout:
    {"inputs": [rows, n]}: the call's tensors from now on (transport.make_inputs);
    {"timed": count, "warmup": w}: that many call times, in seconds;
    {"loop": seconds, "threads": t}: calls made by t threads calling for that long, and the time taken;
    {"quit": true}: ends RPC (with the worker) and exits."""
    import concurrent.futures
    import json
    import sys
    import time

    import torch
    import torch.distributed.rpc as rpc
    from transport import make_inputs, timed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=options(tcp))
    args: tuple = ()

    def call() -> None:
        rpc.rpc_sync("server", layer_norm_backward, args)

    def loop(end: float) -> int:
        done = 0
        while time.monotonic() < end:
            call()
            done += 1
        return done

    for line in sys.stdin:
        command = json.loads(line)
        if "inputs" in command:
            inputs = make_inputs(*command["inputs"])
            args = tuple(torch.from_numpy(inputs[k]) for k in ("gradOut", "input", "mean", "rstd", "weightOptional"))
            answer: object = None
        elif "timed" in command:
            answer = timed(call, command["timed"], command["warmup"])
        elif "loop" in command:
            started, threads = time.monotonic(), command["threads"]
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                calls = sum(pool.map(loop, [started + command["loop"]] * threads))
            answer = [calls, time.monotonic() - started]
        else:
            break
        print(json.dumps(answer), flush=True)
    rpc.shutdown()
