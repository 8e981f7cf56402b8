"""The torch backend on a CUDA GPU: the conformance suites and the timings on cuda:0 (issue 28).

    python bench/gpu.py [--rows 8192 --cols 4096] [--rounds 15] [--tests-timeout 300] [--out DIR]
    python bench/gpu.py --device cpu --rows 256 --cols 512 --skip-tests   # a dry run where no GPU is

Timings first (LayerNorm backward, rows x cols fp32, medians):
- in process (LocalClient, host arrays in and out) against PyTorch's own CUDA kernel with the same
  copies (the inputs' host->device copies, aten's native_layer_norm_backward, device->host copies
  into the same output arrays). Target: <= 1.2x.
- the kernels alone (CUDA events): aten's, and the backend's formula on device tensors (the fused
  Triton kernels, and the torch-op formula they replace).
- on device buffers: in process and through a local server process (the call queued on a stream,
  then synchronize), and through the server shipping the tensors. Target: device-resident through
  the server <= kernel time + 1 ms.
Then the torch tests with ACLNN_TORCH_DEVICE=cuda:0 (the conformance suites through LocalClient and
gRPC, numerics edge cases, the cross-backend fuzz against the numpy reference, device memory, the
tests marked gpu), each group under a time limit. Also shown: why aten's eval-mode BatchNorm backward
of a rank-2 input differs on CUDA (the old backend's four failing cases).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pathlib
import pstats
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from device_memory import start_server, tensor

from aclnn_client import Client
from aclnn_server import LocalClient
from aclnn_server.backends.torch_backend import TorchBackend, fused
from aclnn_server.backends.torch_backend.formulas import FORMULAS, Call

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_GROUPS = {
    "conformance (LocalClient + gRPC)": ["tests/test_torch_backend.py"],
    "numerics (torch, edges, fuzz)": [
        "tests/test_torch_backend_numerics.py",
        "tests/test_numerics_edges.py",
        "tests/test_backend_agreement.py",
    ],
    "device memory, gpu, forward norms": [
        "tests/test_torch_device_memory.py",
        "tests/test_gpu.py",
        "tests/test_norm_backends.py::test_torch_backend_computes_it",
        "tests/test_norm_backends.py::test_torch_group_norm_backward_honours_the_mask",
    ],
}


def median_ms(fn, rounds: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def event_ms(fn, rounds: int) -> float:
    """Median GPU time of `fn`'s launches on the current stream (CUDA events; wall time on the cpu)."""
    if not torch.cuda.is_available():
        return median_ms(fn, rounds)
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def aten_eval_batch_norm_backward() -> str:
    """The old backend's call: aten's native_batch_norm_backward, eval mode, [N, C] input, save stats
    given (zeros/ones, as it passed for absent ones). CPU reads the running statistics; CUDA does not."""
    rng = np.random.default_rng(0)
    g, x = (torch.from_numpy(rng.standard_normal((4, 6))) for _ in range(2))
    w, rm = torch.ones(6, dtype=torch.float64), torch.from_numpy(rng.uniform(-0.5, 0.5, 6))
    rv = torch.from_numpy(rng.uniform(0.5, 2.0, 6))
    sm, si = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    lines = []
    for mask in ([True, True, True], [False, True, False], [True, False, False]):
        cpu = torch.ops.aten.native_batch_norm_backward(g, x, w, rm, rv, sm, si, False, 1e-5, mask)
        on = [t.cuda() for t in (g, x, w, rm, rv, sm, si)]
        cuda = torch.ops.aten.native_batch_norm_backward(*on, False, 1e-5, mask)
        diffs = [
            f"{name} {float((a.cpu() - b).abs().max()):.3g}"
            for name, a, b in zip(("gradInput", "gradWeight", "gradBias"), cuda, cpu)
            if a is not None and b is not None
        ]
        empty = [t.cuda() for t in (g, x, w, rm, rv)] + [torch.empty(0, dtype=torch.float64, device="cuda")] * 2
        fixed = torch.ops.aten.native_batch_norm_backward(*empty, False, 1e-5, mask)
        agree = [
            f"{float((a.cpu() - b).abs().max()):.3g}" for a, b in zip(fixed, cpu) if a is not None and b is not None
        ]
        lines.append(f"  mask {mask}: CUDA - CPU: {', '.join(diffs)}; with empty save stats: {', '.join(agree)}")
    return "\n".join(lines)


def timings(device: str, rows: int, cols: int, rounds: int, profile: bool = False) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    dy = rng.standard_normal((rows, cols), dtype=np.float32)
    w, b = rng.uniform(0.5, 1.5, cols).astype(np.float32), np.zeros(cols, np.float32)
    mean = x.mean(1, keepdims=True, dtype=np.float64).astype(np.float32)
    rstd = (1 / np.sqrt(x.var(1, keepdims=True, dtype=np.float64) + 1e-5)).astype(np.float32)
    dx, dw, db = np.empty_like(x), np.empty(cols, np.float32), np.empty(cols, np.float32)
    host = dict(gradOut=dy, input=x, normalizedShape=[cols], mean=mean, rstd=rstd, weightOptional=w,
                biasOptional=b, outputMask=[True, True, True], gradInputOut=dx, gradWeightOut=dw,
                gradBiasOut=db)  # fmt: skip
    cuda = torch.device(device)
    backend = TorchBackend(device)
    local = LocalClient(backend)
    ms: dict[str, float] = {}

    started = time.perf_counter()  # Triton compiles the fused kernels (or loads them from its disk cache)
    local.run("aclnnLayerNormBackward", **host)
    ms["in process, the first call"] = (time.perf_counter() - started) * 1e3
    ms["in process, host arrays (LocalClient)"] = median_ms(lambda: local.run("aclnnLayerNormBackward", **host), rounds)
    wide = [torch.from_numpy(a).double() for a in (dy, x, mean, rstd, w, b)]
    ref = torch.ops.aten.native_layer_norm_backward(wide[0], wide[1], [cols], *wide[2:], [True] * 3)
    errors = {
        n: float(np.abs(o - r.numpy()).max() / np.abs(r.numpy()).max())
        for n, o, r in zip("dx dw db".split(), (dx, dw, db), ref)
    }
    outs = [torch.from_numpy(a) for a in (dx, dw, db)]

    def torch_with_copies() -> None:
        tensors = [torch.from_numpy(a).to(cuda) for a in (dy, x, mean, rstd, w, b)]
        results = torch.ops.aten.native_layer_norm_backward(tensors[0], tensors[1], [cols], *tensors[2:], [True] * 3)
        for out, result in zip(outs, results):
            out.copy_(result)

    ms["PyTorch's kernel with the same copies"] = median_ms(torch_with_copies, rounds)
    on_gpu = [torch.from_numpy(a).to(cuda) for a in (dy, x, mean, rstd, w, b)]
    ms["kernel alone: aten native_layer_norm_backward"] = event_ms(
        lambda: torch.ops.aten.native_layer_norm_backward(on_gpu[0], on_gpu[1], [cols], *on_gpu[2:], [True] * 3), 50
    )
    results = [torch.empty_like(on_gpu[1]), torch.empty_like(on_gpu[4]), torch.empty_like(on_gpu[4])]
    values = dict(gradOut=on_gpu[0], input=on_gpu[1], mean=on_gpu[2], rstd=on_gpu[3], weightOptional=on_gpu[4],
                  biasOptional=on_gpu[5], normalizedShape=[cols], outputMask=[True] * 3)  # fmt: skip
    shapes = {"gradInputOut": (rows, cols), "gradWeightOut": (cols,), "gradBiasOut": (cols,)}

    def formula() -> None:  # as compute_resident runs it: gradInput's last step into its output
        call = Call(torch, values, shapes, wide=False, destinations={"gradInputOut": results[0]})
        FORMULAS["aclnnLayerNormBackward"](call, None)
        for out, name in zip(results, shapes):
            if call.results[name].data_ptr() != out.data_ptr():
                out.copy_(call.results[name].reshape(out.shape))

    with torch.no_grad():
        ms["kernel alone: the backend's formula"] = event_ms(formula, 50)
        fused.ENABLED = False  # the torch-op formula that the fused kernels replace on CUDA
        ms["kernel alone: the torch-op formula (ACLNN_TORCH_FUSED=0)"] = event_ms(formula, 50)
        fused.ENABLED = True
        if profile and torch.cuda.is_available():  # where the formula's time goes, kernel by kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                formula()
                torch.cuda.synchronize()
            try:
                print(prof.key_averages().table(sort_by="device_time_total", row_limit=20), flush=True)
            except Exception as exc:  # the profiler's table names vary across torch versions
                print(f"(no kernel table: {exc})")

    def on_device(c):
        bufs = {name: c.malloc(a.nbytes) for name, a in (("x", x), ("dy", dy), ("dx", x))}
        bufs.update({name: c.malloc(a.nbytes) for name, a in (("mean", mean), ("rstd", rstd), ("w", w), ("b", b))})
        bufs.update(dw=c.malloc(dw.nbytes), db=c.malloc(db.nbytes))
        for name, a in (("x", x), ("dy", dy), ("mean", mean), ("rstd", rstd), ("w", w), ("b", b)):
            c.memcpy(bufs[name], a)
        t = {name: tensor(bufs[name], (rows, cols)) for name in ("x", "dy", "dx")}
        t.update(mean=tensor(bufs["mean"], (rows, 1)), rstd=tensor(bufs["rstd"], (rows, 1)))
        t.update({name: tensor(bufs[name], (cols,)) for name in ("w", "b", "dw", "db")})

        def call(stream: int | None = 1) -> None:
            c.run("aclnnLayerNormBackward", gradOut=t["dy"], input=t["x"], normalizedShape=[cols], mean=t["mean"],
                  rstd=t["rstd"], weightOptional=t["w"], biasOptional=t["b"], outputMask=[True] * 3,
                  gradInputOut=t["dx"], gradWeightOut=t["dw"], gradBiasOut=t["db"], stream=stream)  # fmt: skip
            if stream is not None:
                c.synchronize(stream)

        def queued(n: int = 10) -> None:
            for _ in range(n):
                c.run("aclnnLayerNormBackward", gradOut=t["dy"], input=t["x"], normalizedShape=[cols], mean=t["mean"],
                      rstd=t["rstd"], weightOptional=t["w"], biasOptional=t["b"], outputMask=[True] * 3,
                      gradInputOut=t["dx"], gradWeightOut=t["dw"], gradBiasOut=t["db"], stream=1)  # fmt: skip
            c.synchronize(1)

        return call, queued, bufs

    call, queued, _ = on_device(local)
    if profile and torch.cuda.is_available():  # where a call on device buffers spends its time beyond the kernels
        call(None)
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [call(None) for _ in range(50)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    ms["device buffers, in process (run + synchronize)"] = median_ms(call, rounds * 4)
    ms["device buffers, in process (run without a stream)"] = median_ms(lambda: call(None), rounds * 4)
    ms["device buffers, in process, per call of 10 queued"] = median_ms(queued, rounds) / 10
    os.environ["ACLNN_TORCH_DEVICE"] = device  # the server process's torch device
    proc, address = start_server("torch")
    try:
        client = Client(address)
        call, queued, bufs = on_device(client)
        ms["device buffers, local server (run + synchronize)"] = median_ms(call, rounds * 4)
        ms["device buffers, local server (run without a stream)"] = median_ms(lambda: call(None), rounds * 4)
        ms["device buffers, local server, per call of 10 queued"] = median_ms(queued, rounds) / 10
        ms["one round trip, local server (synchronize an idle stream)"] = median_ms(lambda: client.synchronize(2), 60)
        back = np.empty_like(x)
        client.memcpy(back, bufs["dx"])
        errors["dx (server, device buffers)"] = float(
            np.abs(back - ref[0].numpy()).max() / np.abs(ref[0].numpy()).max()
        )
        ms["tensors shipped, local server (default transport)"] = median_ms(
            lambda: client.run("aclnnLayerNormBackward", **host), max(3, rounds // 3)
        )
        client.close()
    finally:
        proc.terminate()
        proc.wait()
    os.environ["ACLNN_TORCH_FUSED"] = "0"  # the same server running the torch-op formula, for comparison
    proc, address = start_server("torch")
    try:
        client = Client(address)
        call, _, _ = on_device(client)
        ms["device buffers, local server, torch-op formula (run + synchronize)"] = median_ms(call, rounds * 4)
        ms["device buffers, local server, torch-op formula (run without a stream)"] = median_ms(
            lambda: call(None), rounds * 4
        )
        client.close()
    finally:
        del os.environ["ACLNN_TORCH_FUSED"]
        proc.terminate()
        proc.wait()
    ms["one round trip, in process (synchronize an idle stream)"] = median_ms(lambda: local.synchronize(2), 60)
    local.close()
    return ms | {f"relative error {n}": e for n, e in errors.items()}


def run_tests(timeout: int, out: pathlib.Path | None) -> dict[str, str]:
    env = dict(os.environ, ACLNN_TORCH_DEVICE="cuda:0", PYTHONUNBUFFERED="1")
    summary = {}
    for name, args in TEST_GROUPS.items():
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
            text = done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            text += f"\nTIMED OUT after {timeout} s"
        if out is not None:
            slug = re.sub(r"[^a-z]+", "_", name.lower()).strip("_")
            (out / f"pytest_{slug}.log").write_text(text)
        lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)|TIMED OUT|error", ln)]
        failed = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        summary[name] = f"{lines[-1] if lines else text[-300:]} ({time.perf_counter() - started:.0f} s)"
        for line in failed[:15]:
            summary[name] += "\n    " + line
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda:0", help="cpu: a dry run of this script (no aten CUDA check, no tests)"
    )
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--tests-timeout", type=int, default=300, help="seconds for each group (the first may compile the cpu kernels)"
    )
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--profile", action="store_true", help="list the formula's CUDA kernels")
    parser.add_argument("--skip-timings", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="a folder for the logs and results.json")
    options = parser.parse_args()
    gpu = options.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        print("no CUDA device: nothing to run (--device cpu for a dry run)")
        return 1
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0) if gpu else "cpu (dry run)"
    print(f"card: {card}; torch {torch.__version__}; CUDA {torch.version.cuda}", flush=True)
    report: dict = {"card": card, "torch": torch.__version__}
    if gpu:
        print("aten's eval-mode native_batch_norm_backward of a [4, 6] input, float64:", flush=True)
        report["aten_eval_batch_norm"] = aten_eval_batch_norm_backward()
        print(report["aten_eval_batch_norm"], flush=True)
    if not options.skip_timings:
        ms = timings(options.device, options.rows, options.cols, options.rounds, options.profile)
        report["timings_ms"] = ms
        print(f"\nLayerNorm backward {options.rows}x{options.cols} fp32 on {card}, medians:")
        for name, value in ms.items():
            print(f"  {name:<58} {value:10.3f}" if "error" not in name else f"  {name:<58} {value:10.2e}")
        in_process, reference = ms["in process, host arrays (LocalClient)"], ms["PyTorch's kernel with the same copies"]
        print(f"  in process / PyTorch with the same copies: {in_process / reference:.2f} (target <= 1.2)")
        kernel = ms["kernel alone: the backend's formula"]
        served = ms["device buffers, local server (run + synchronize)"]
        aten = ms["kernel alone: aten native_layer_norm_backward"]
        waited = ms["device buffers, local server (run without a stream)"]
        for what, value in (("run + synchronize", served), ("run without a stream", waited)):
            print(f"  through a local server, {what}: less the backend's kernel time {value - kernel:.3f} ms, "
                  f"less aten's {value - aten:.3f} ms (target <= 1 ms)", flush=True)  # fmt: skip
    if gpu and not options.skip_tests:
        report["tests"] = run_tests(options.tests_timeout, options.out)
        print("\ntorch tests on cuda:0:")
        for name, line in report["tests"].items():
            print(f"  {name}: {line}")
    if options.out is not None:
        (options.out / "results.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
