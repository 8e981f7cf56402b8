"""Device memory: calls on tensors that stay on the server against calls that ship their tensors.

A local server process (`--backend cpu` by default) and, for reference, the same backend in this
process (`LocalClient`, outputs preallocated). Rows, medians of interleaved rounds:

- LayerNorm backward, 8192x4096 fp32: in process; through the server on device buffers (queued on
  a stream, then synchronize); through the server shipping its tensors (the default transport).
  Target: device-resident <= 1.2 x in process + 1 ms.
- A chain of LayerNorm forward + backward: on device buffers (one stream, one synchronize at the
  end) against the same calls shipping their tensors each time.

    .venv/bin/python bench/device_memory.py [--backend cpu] [--rows 8192 --cols 4096] [--rounds 5]

`--small` times what a call on device buffers costs beyond its kernel instead: LayerNorm backward
on 64x64 and 1024x1024 with every tensor in a device buffer, in process and through the server,
run without a stream (it waits), run on a stream + synchronize, and calls queued on a stream with
one synchronize after them (per call). Minimum over rounds of the median per call, in microseconds:

    .venv/bin/python bench/device_memory.py --small [--backend cpu|torch] [--rounds 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from aclnn_client import Client, DataType, Format, create_tensor
from aclnn_server import LocalClient


def tensor(buf, shape):
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return create_tensor(shape, DataType.FLOAT, strides, 0, Format.ND, shape, buf)


def start_server(backend: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aclnn_server", "--port", "0", "--backend", backend, "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[-1]


def timed(fn, rounds: int) -> float:
    fn()  # warm: plans cached, pages faulted in
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def resident_backward_calls(c, rows: int, cols: int) -> dict[str, Any]:
    """LayerNorm backward with every tensor in a device buffer of client `c`: each path's callable
    and how many calls one invocation makes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    host = dict(
        x=x,
        dy=rng.standard_normal((rows, cols), dtype=np.float32),
        mean=x.mean(1, keepdims=True, dtype=np.float64).astype(np.float32),
        rstd=(1 / np.sqrt(x.var(1, keepdims=True, dtype=np.float64) + 1e-5)).astype(np.float32),
        w=np.ones(cols, np.float32),
        b=np.zeros(cols, np.float32),
    )
    shapes = dict(dx=(rows, cols), dw=(cols,), db=(cols,)) | {name: a.shape for name, a in host.items()}
    t = {}
    for name, shape in shapes.items():
        buf = c.malloc(int(np.prod(shape)) * 4)
        if name in host:
            c.memcpy(buf, host[name])
        t[name] = tensor(buf, shape)
    params = dict(gradOut=t["dy"], input=t["x"], mean=t["mean"], rstd=t["rstd"], normalizedShape=[cols],
                  weightOptional=t["w"], biasOptional=t["b"], outputMask=[True, True, True],
                  gradInputOut=t["dx"], gradWeightOut=t["dw"], gradBiasOut=t["db"])  # fmt: skip
    queued = 10

    def run_waited() -> None:
        c.run("aclnnLayerNormBackward", **params)

    def run_and_synchronize() -> None:
        c.run("aclnnLayerNormBackward", stream=1, **params)
        c.synchronize(1)

    def run_queued() -> None:
        for _ in range(queued):
            c.run("aclnnLayerNormBackward", stream=1, **params)
        c.synchronize(1)

    return {
        "run without a stream": (run_waited, 1),
        "run on a stream + synchronize": (run_and_synchronize, 1),
        f"{queued} queued on a stream + 1 synchronize, per call": (run_queued, queued),
    }


def small_calls(options: argparse.Namespace) -> int:
    """The per-call cost of calls on device buffers, in process against through a server process."""
    proc, address = start_server(options.backend)
    local, remote = LocalClient(options.backend), Client(address)
    try:
        print(f"backend {options.backend}; LayerNorm backward, every tensor in a device buffer; "
              f"min over {options.rounds} rounds of the median of {options.calls} calls; us per call")  # fmt: skip
        print(f"{'size':<10} {'path':<52} {'in process':>10} {'server':>9} {'server-in':>9} {'ratio':>6}")
        for size in (64, 1024):
            calls = {
                where: resident_backward_calls(client, size, size)
                for where, client in (("in process", local), ("server", remote))
            }
            samples: dict[tuple[str, str], list[float]] = {}
            for _ in range(options.rounds):  # interleaved: each round times every path on both sides
                for where, paths in calls.items():
                    for name, (fn, count) in paths.items():
                        fn()  # warm
                        times = []
                        for _ in range(max(1, options.calls // count)):
                            started = time.perf_counter()
                            fn()
                            times.append((time.perf_counter() - started) / count)
                        samples.setdefault((where, name), []).append(statistics.median(times))
            for name in calls["server"]:
                local_us, server_us = (min(samples[(where, name)]) * 1e6 for where in ("in process", "server"))
                print(f"{size}x{size:<5} {name:<52} {local_us:10.0f} {server_us:9.0f} "
                      f"{server_us - local_us:9.0f} {server_us / local_us:6.2f}")  # fmt: skip
    finally:
        remote.close()
        local.close()
        proc.terminate()
        proc.wait()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chain", type=int, default=4, help="forward+backward pairs in the chain")
    parser.add_argument("--small", action="store_true", help="the per-call overhead on small device-buffer calls")
    parser.add_argument("--calls", type=int, default=200, help="--small: calls per path and round")
    options = parser.parse_args()
    if options.small:
        return small_calls(options)
    rows, cols = options.rows, options.cols
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    dy = rng.standard_normal((rows, cols), dtype=np.float32)
    w, b = np.ones(cols, np.float32), np.zeros(cols, np.float32)
    mean = x.mean(1, keepdims=True, dtype=np.float64).astype(np.float32)
    rstd = (1 / np.sqrt(x.var(1, keepdims=True, dtype=np.float64) + 1e-5)).astype(np.float32)
    dx, dw, db = np.empty_like(x), np.empty(cols, np.float32), np.empty(cols, np.float32)
    backward = dict(normalizedShape=[cols], weightOptional=w, biasOptional=b, outputMask=[True, True, True])

    local = LocalClient(options.backend)
    in_process = lambda: local.run(  # noqa: E731
        "aclnnLayerNormBackward", gradOut=dy, input=x, mean=mean, rstd=rstd, gradInputOut=dx,
        gradWeightOut=dw, gradBiasOut=db, **backward)  # fmt: skip

    proc, address = start_server(options.backend)
    try:
        c = Client(address)
        bufs = {name: c.malloc(a.nbytes) for name, a in (("x", x), ("dy", dy), ("dx", x), ("y", x))}
        small = {name: c.malloc(a.nbytes) for name, a in (("mean", mean), ("rstd", rstd), ("w", w), ("b", b))}
        small.update(dw=c.malloc(dw.nbytes), db=c.malloc(db.nbytes))
        for name, host in (("x", x), ("dy", dy)):
            c.memcpy(bufs[name], host)
        for name, host in (("mean", mean), ("rstd", rstd), ("w", w), ("b", b)):
            c.memcpy(small[name], host)
        t = {name: tensor(buf, (rows, cols)) for name, buf in bufs.items()}
        t.update(mean=tensor(small["mean"], (rows, 1)), rstd=tensor(small["rstd"], (rows, 1)))
        t.update({name: tensor(small[name], (cols,)) for name in ("w", "b", "dw", "db")})
        device_backward = dict(normalizedShape=[cols], weightOptional=t["w"], biasOptional=t["b"],
                               outputMask=[True, True, True])  # fmt: skip

        def resident_backward() -> None:
            c.run("aclnnLayerNormBackward", gradOut=t["dy"], input=t["x"], mean=t["mean"], rstd=t["rstd"],
                  gradInputOut=t["dx"], gradWeightOut=t["dw"], gradBiasOut=t["db"], stream=1,
                  **device_backward)  # fmt: skip
            c.synchronize(1)

        def shipped_backward() -> None:
            c.run("aclnnLayerNormBackward", gradOut=dy, input=x, mean=mean, rstd=rstd, gradInputOut=dx,
                  gradWeightOut=dw, gradBiasOut=db, **backward)  # fmt: skip

        def resident_chain() -> None:
            for _ in range(options.chain):
                c.run("aclnnLayerNorm", input=t["x"], normalizedShape=[cols], weightOptional=t["w"],
                      biasOptional=t["b"], eps=1e-5, out=t["y"], meanOutOptional=t["mean"],
                      rstdOutOptional=t["rstd"], stream=1)  # fmt: skip
                c.run("aclnnLayerNormBackward", gradOut=t["dy"], input=t["x"], mean=t["mean"], rstd=t["rstd"],
                      gradInputOut=t["dx"], gradWeightOut=t["dw"], gradBiasOut=t["db"], stream=1,
                      **device_backward)  # fmt: skip
            c.synchronize(1)

        y, m, r = np.empty_like(x), np.empty_like(mean), np.empty_like(rstd)

        def shipped_chain() -> None:
            for _ in range(options.chain):
                c.run("aclnnLayerNorm", input=x, normalizedShape=[cols], weightOptional=w, biasOptional=b,
                      eps=1e-5, out=y, meanOutOptional=m, rstdOutOptional=r)  # fmt: skip
                shipped_backward()

        # Interleaved rounds: each round times every path once, so drifts of the machine hit all alike.
        paths = {
            "backward, in process (LocalClient)": in_process,
            "backward, server, device-resident": resident_backward,
            "backward, server, tensors shipped": shipped_backward,
            f"chain of {options.chain} forward+backward, device-resident": resident_chain,
            f"chain of {options.chain} forward+backward, tensors shipped": shipped_chain,
        }
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            fn()
        for _ in range(options.rounds):
            for name, fn in paths.items():
                started = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - started)
        ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
        print(f"backend {options.backend}, {rows}x{cols} fp32, median of {options.rounds} interleaved rounds")
        print(f"{'path':<52} {'ms':>9}")
        for name, value in ms.items():
            print(f"{name:<52} {value:9.1f}")
        local_ms, resident_ms = ms["backward, in process (LocalClient)"], ms["backward, server, device-resident"]
        bound = 1.2 * local_ms + 1.0
        verdict = "meets" if resident_ms <= bound else "misses"
        ratio = resident_ms / local_ms
        print(f"device-resident / in process: {ratio:.2f} (target <= 1.2 x + 1 ms = {bound:.1f} ms: {verdict})")
        chain = [v for k, v in ms.items() if k.startswith("chain")]
        print(f"chain, shipped / device-resident: {chain[1] / chain[0]:.2f}")
        c.close()
    finally:
        proc.terminate()
        proc.wait()
        local.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
