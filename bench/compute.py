"""Compute benchmark: each backend as a user pays for it, against PyTorch CPU on the same inputs.

    .venv/bin/python bench/compute.py            # small, medium, large shapes
    .venv/bin/python bench/compute.py --quick    # small and medium only, fewer repeats

For every operator, shape and dtype (fp32/fp16/bf16) it times, in this process and warm:
  * each backend through LocalClient: get_workspace_size + execute (validation, executor,
    input views and the compute itself, into the case's preallocated output arrays);
  * PyTorch CPU on the same arrays: aten.native_layer_norm_backward / native_batch_norm_backward /
    native_batch_norm (training, running statistics updated) / _fused_rms_norm /
    native_group_norm_backward (LayerNormGrad: its rstd from variance, then native_layer_norm_backward;
    ElemtBackward and RmsNormGrad, which have no CPU aten op: the same formula as composed torch ops);
in interleaved rounds, and prints a Markdown table of medians, the median per-round ratios to
PyTorch, the cpu backend's time
against the memory-traffic bound (reading and writing each full-size tensor once, at the copy
bandwidth measured in this run), the cpu backend's workspace_size, and the peak extra
resident memory of one call (VmHWM − VmRSS before it, outputs included). See bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from aclnn_client import DataType, Format, create_tensor
from aclnn_server import LocalClient

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}
DATA_TYPES = {np.dtype(np.float32): DataType.FLOAT, np.dtype(np.float16): DataType.FLOAT16, BF16: DataType.BF16}
TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, BF16: torch.bfloat16}
BACKENDS = ("numpy", "cpu")

LN_SHAPES = {"small": (64, 256), "medium": (1024, 1024), "large": (8192, 4096)}
BN_SHAPES = {"small": (8, 16, 14, 14), "medium": (16, 64, 28, 28), "large": (32, 256, 56, 56)}


def tt(a: np.ndarray) -> torch.Tensor:
    """A torch tensor over the same memory (bf16 through its bit pattern)."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@dataclass
class Case:
    op: str
    shape: tuple[int, ...]
    params: dict[str, Any]  # the call, outputs included
    torch_fn: Callable[[], Any]


def layer_norm_case(rng, shape, dtype) -> Case:
    _, n = shape
    x = rng.standard_normal(shape, np.float32)
    g = rng.standard_normal(shape, np.float32).astype(dtype)
    mean = x.mean(1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    x = x.astype(dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    p = dict(
        gradOut=g, input=x, normalizedShape=[n], mean=mean, rstd=rstd, weightOptional=w, biasOptional=None,
        outputMask=[True, True, True], gradInputOut=np.empty(shape, dtype), gradWeightOut=np.empty(n, dtype),
        gradBiasOut=np.empty(n, dtype),
    )  # fmt: skip
    t_stats = TORCH_DTYPES[np.dtype(dtype)]  # aten's CPU kernel wants mean/rstd in the input's dtype
    args = (tt(g), tt(x), [n], tt(mean).to(t_stats), tt(rstd).to(t_stats), tt(w), tt(w), [True, True, True])
    return Case("aclnnLayerNormBackward", shape, p, lambda: torch.ops.aten.native_layer_norm_backward(*args))


def layer_norm_grad_case(rng, shape, dtype) -> Case:
    _, n = shape
    x = rng.standard_normal(shape, np.float32)
    dy = rng.standard_normal(shape, np.float32).astype(dtype)
    mean, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    x = x.astype(dtype)
    stats = np.float32 if dtype == np.float32 else dtype
    gamma = rng.uniform(0.5, 1.5, n).astype(dtype)
    p = dict(
        dy=dy, x=x, variance=var.astype(stats), mean=mean.astype(stats), gamma=gamma,
        pd_x=np.empty(shape, dtype), pd_gamma=np.empty(n, dtype), pd_beta=np.empty(n, dtype),
    )  # fmt: skip
    t_dy, t_x, t_mean, t_var, t_gamma = (tt(p[k]) for k in ("dy", "x", "mean", "variance", "gamma"))

    def run():
        rstd = torch.rsqrt(t_var + 1e-12)
        return torch.ops.aten.native_layer_norm_backward(
            t_dy, t_x, [n], t_mean, rstd, t_gamma, t_gamma, [True, True, True]
        )

    return Case("LayerNormGrad", shape, p, run)


def batch_norm_case(rng, shape, dtype, channels_last: bool = False) -> Case:
    """`shape` is NCHW; channels_last stores the tensors NHWC (format tag NHWC; for PyTorch the
    same memory as a channels_last NCHW view)."""
    c = shape[1]
    x = rng.standard_normal(shape, np.float32)
    g = rng.standard_normal(shape, np.float32).astype(dtype)
    axes = (0, *range(2, len(shape)))
    mean, invstd = x.mean(axes), 1 / np.sqrt(x.var(axes) + 1e-5)
    x = x.astype(dtype)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    dx = np.empty(shape, dtype)
    t_g, t_x = tt(g), tt(x)
    if channels_last:
        g, x, dx = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (g, x, dx))
        t_g, t_x = (tt(a).permute(0, 3, 1, 2) for a in (g, x))
        g, x, dx = (nhwc(a) for a in (g, x, dx))
    p = dict(
        gradOut=g, input=x, weight=w, runningMean=None, runningVar=None, saveMean=mean, saveInvstd=invstd,
        training=True, eps=1e-5, outputMask=[True, True, True], gradInput=dx,
        gradWeight=np.empty(c, np.float32), gradBias=np.empty(c, np.float32),
    )  # fmt: skip
    args = (t_g, t_x, tt(w), None, None, tt(mean), tt(invstd), True, 1e-5, [True, True, True])
    return Case("aclnnBatchNormBackward", shape, p, lambda: torch.ops.aten.native_batch_norm_backward(*args))


def nhwc(a: np.ndarray) -> Any:
    """A C-contiguous NHWC array as a tensor tagged NHWC (as an output, results land in `a`)."""
    return create_tensor(a.shape, DATA_TYPES[a.dtype], [s // a.itemsize for s in a.strides], 0, Format.NHWC,
                         [a.size], a.reshape(-1))  # fmt: skip


def batch_norm_forward_case(rng, shape, dtype, channels_last: bool = False) -> Case:
    """Training, running statistics updated in place; parameters and statistics in fp32 (as autocast
    runs BatchNorm). `shape` is NCHW; channels_last as in `batch_norm_case`."""
    c = shape[1]
    x = rng.standard_normal(shape, np.float32).astype(dtype)
    w, b = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    y = np.empty(shape, dtype)
    t_x = tt(x)
    if channels_last:
        x, y = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (x, y))
        t_x = tt(x).permute(0, 3, 1, 2)
        x, y = nhwc(x), nhwc(y)
    p = dict(
        input=x, weight=w, bias=b, runningMean=rm, runningVar=rv, training=True, momentum=0.1, eps=1e-5,
        output=y, saveMean=np.empty(c, np.float32), saveInvstd=np.empty(c, np.float32),
    )  # fmt: skip
    args = (t_x, tt(w), tt(b), tt(rm.copy()), tt(rv.copy()), True, 0.1, 1e-5)  # torch's own running statistics
    return Case("aclnnBatchNorm", shape, p, lambda: torch.ops.aten.native_batch_norm(*args))


def elemt_case(rng, shape, dtype) -> Case:
    c = shape[1]
    x = rng.standard_normal(shape, np.float32)
    g = rng.standard_normal(shape, np.float32)
    axes = (0, *range(2, len(shape)))
    mean, invstd = x.mean(axes), 1 / np.sqrt(x.var(axes) + 1e-5)
    sum_dy, sum_dy_xmu = g.sum(axes), (g * (x - mean.reshape(1, c, 1, 1))).sum(axes)
    counter = np.full(1, math.prod(shape) // c, np.int32)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    g, x = g.astype(dtype), x.astype(dtype)
    p = dict(
        gradOut=g, input=x, mean=mean, invstd=invstd, weight=w, sumDy=sum_dy, sumDyXmu=sum_dy_xmu,
        counter=counter, gradInput=np.empty(shape, dtype),
    )  # fmt: skip
    view = (1, c) + (1,) * (len(shape) - 2)
    t_g, t_x = tt(g), tt(x)
    total = float(counter.sum())
    t_mean = tt(mean).reshape(view)
    t_shift = (tt(sum_dy) / total).reshape(view)
    t_slope = (tt(invstd) ** 2 * tt(sum_dy_xmu) / total).reshape(view)
    t_scale = (tt(invstd) * tt(w)).reshape(view)

    def run():  # batch_norm_backward_elemt has no CPU kernel in aten: the formula, in fp32
        return ((t_g.float() - t_shift - (t_x.float() - t_mean) * t_slope) * t_scale).to(t_g.dtype)

    return Case("aclnnBatchNormElemtBackward", shape, p, run)


def rms_norm_case(rng, shape, dtype) -> Case:
    m, n = shape
    x = rng.standard_normal(shape, np.float32).astype(dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    p = dict(x=x, gamma=w, epsilon=1e-6, yOut=np.empty(shape, dtype), rstdOut=np.empty((m, 1), np.float32))
    t_x, t_w = tt(x), tt(w)
    return Case("aclnnRmsNorm", shape, p, lambda: torch.ops.aten._fused_rms_norm(t_x, [n], t_w, 1e-6))


def rms_norm_grad_case(rng, shape, dtype) -> Case:
    m, n = shape
    x = rng.standard_normal(shape, np.float32)
    rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-6)).astype(np.float32)
    dy = rng.standard_normal(shape, np.float32).astype(dtype)
    x = x.astype(dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    p = dict(dy=dy, x=x, rstd=rstd, gamma=w, dxOut=np.empty(shape, dtype), dgammaOut=np.empty(n, np.float32))
    t_dy, t_x, t_w, t_rstd = tt(dy), tt(x), tt(w), tt(rstd).reshape(m, 1)

    def run():  # _fused_rms_norm_backward has no CPU kernel in aten: autograd's formula, in fp32
        xhat = t_x.float() * t_rstd
        gw = t_dy.float() * t_w.float()
        dx = ((gw - xhat * (gw * xhat).mean(1, keepdim=True)) * t_rstd).to(t_dy.dtype)
        return dx, (t_dy.float() * xhat).sum(0)

    return Case("aclnnRmsNormGrad", shape, p, run)


def group_norm_backward_case(rng, shape, dtype) -> Case:
    """`shape` is NCHW with min(32, C/2) groups; mean, rstd, gamma and their gradients in fp32."""
    n, c = shape[:2]
    hxw = math.prod(shape[2:])
    group = min(32, c // 2)
    x = rng.standard_normal(shape, np.float32)
    groups = x.reshape(n, group, -1)
    mean, rstd = groups.mean(2), 1 / np.sqrt(groups.var(2) + 1e-5)
    g = rng.standard_normal(shape, np.float32).astype(dtype)
    x = x.astype(dtype)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    p = dict(
        gradOut=g, input=x, mean=mean, rstd=rstd, gamma=w, N=n, C=c, HxW=hxw, group=group,
        outputMask=[True, True, True], gradInput=np.empty(shape, dtype), gradGammaOut=np.empty(c, np.float32),
        gradBetaOut=np.empty(c, np.float32),
    )  # fmt: skip
    args = (tt(g), tt(x), tt(mean), tt(rstd), tt(w), n, c, hxw, group, [True, True, True])
    return Case("aclnnGroupNormBackward", shape, p, lambda: torch.ops.aten.native_group_norm_backward(*args))


OPERATORS = [
    ("aclnnLayerNormBackward", layer_norm_case, LN_SHAPES),
    ("LayerNormGrad", layer_norm_grad_case, LN_SHAPES),
    ("aclnnBatchNormBackward", batch_norm_case, BN_SHAPES),
    ("aclnnBatchNormBackward NHWC", functools.partial(batch_norm_case, channels_last=True), BN_SHAPES),
    ("aclnnBatchNormElemtBackward", elemt_case, BN_SHAPES),
    ("aclnnBatchNorm", batch_norm_forward_case, BN_SHAPES),
    ("aclnnBatchNorm NHWC", functools.partial(batch_norm_forward_case, channels_last=True), BN_SHAPES),
    ("aclnnRmsNorm", rms_norm_case, LN_SHAPES),
    ("aclnnRmsNormGrad", rms_norm_grad_case, LN_SHAPES),
    ("aclnnGroupNormBackward", group_norm_backward_case, BN_SHAPES),
]


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_extra_mib(fn: Callable[[], Any]) -> float:
    """Peak resident memory one call adds (Linux: reset the high-water mark, then VmHWM − VmRSS)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    before = rss_kib("VmRSS")
    result = fn()
    peak = rss_kib("VmHWM")
    del result
    return max(0, peak - before) / 1024


def timed(fn: Callable[[], Any], budget_s: float, min_reps: int, max_reps: int) -> float:
    """Median seconds of repeated warm runs (after one untimed run)."""
    return statistics.median(timed_rounds({"fn": fn}, budget_s, min_reps, max_reps)["fn"])


def timed_rounds(
    fns: dict[str, Callable[[], Any]], budget_s: float, min_reps: int, max_reps: int
) -> dict[str, list[float]]:
    """Seconds of each function per round, after one untimed run of each. A round runs every function
    once, back to back, starting with a different one each round: a slow spell on a shared machine
    then slows all of them alike, and per-round ratios stay comparable."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    rounds = 0
    while rounds < max_reps and (rounds < min_reps or time.perf_counter() - started < budget_s * len(names)):
        for name in names[rounds % len(names) :] + names[: rounds % len(names)]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
        rounds += 1
    return times


def copy_bandwidth() -> float:
    """Bytes per second this machine moves in a multi-threaded copy (read + write, 256 MiB each way)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src), 1.0, 5, 20)


def traffic_bytes(params: dict[str, Any]) -> int:
    """Bytes a call must move at least: each full-size tensor (inputs and outputs) once."""
    arrays = [v if isinstance(v, np.ndarray) else getattr(v, "data", None) for v in params.values()]
    arrays = [a for a in arrays if isinstance(a, np.ndarray)]
    largest = max(a.size for a in arrays)
    return sum(a.nbytes for a in arrays if a.size == largest)


def backend_call(client: LocalClient, case: Case) -> Callable[[], Any]:
    def call():
        _, executor = client.get_workspace_size(case.op, **case.params)
        return client.execute(executor)

    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small and medium shapes only, shorter timing")
    ap.add_argument("--ops", nargs="*", help="operator names to run (default: all)")
    ap.add_argument("--sizes", nargs="*", choices=["small", "medium", "large"], help="shape sizes to run")
    ap.add_argument("--dtypes", nargs="*", choices=list(DTYPES), help="dtypes to run")
    args = ap.parse_args(argv)
    sizes = args.sizes or (["small", "medium"] if args.quick else ["small", "medium", "large"])
    budget, min_reps, max_reps = (0.3, 3, 20) if args.quick else (1.5, 5, 50)

    started = time.perf_counter()
    clients = {name: LocalClient(backend=name) for name in BACKENDS}  # the cpu backend warms up here
    bandwidth = copy_bandwidth()
    print(f"backends ready in {time.perf_counter() - started:.1f} s; torch {torch.__version__} "
          f"with {torch.get_num_threads()} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s",
          file=sys.stderr)  # fmt: skip
    cols = [f"{b} ms" for b in BACKENDS] + ["torch ms"] + [f"{b}/torch" for b in BACKENDS]
    cols += ["bound ms", "cpu/bound"]
    cols += ["cpu workspace MiB"] + [f"peak {b} MiB" for b in (*BACKENDS, "torch")]
    print("| operator | shape | dtype | " + " | ".join(cols) + " |")
    print("|" + "---|" * (3 + len(cols)))
    rng = np.random.default_rng(0)
    for label, make, shapes in OPERATORS:
        if args.ops and label.split()[0] not in args.ops:
            continue
        for size in sizes:
            for dname, dtype in DTYPES.items():
                if args.dtypes and dname not in args.dtypes:
                    continue
                case = make(rng, shapes[size], dtype)
                fns = {b: backend_call(c, case) for b, c in clients.items()}
                fns["torch"] = case.torch_fn
                times = timed_rounds(fns, budget, min_reps, max_reps)
                ms = {k: statistics.median(t) * 1e3 for k, t in times.items()}
                peaks = {k: peak_extra_mib(fn) for k, fn in fns.items()}
                ws, executor = clients["cpu"].get_workspace_size(case.op, **case.params)
                clients["cpu"].destroy_executor(executor)
                row = [f"{ms[b]:.2f}" for b in (*BACKENDS, "torch")]
                row += [f"{statistics.median(np.divide(times[b], times['torch'])):.2f}×" for b in BACKENDS]
                bound_ms = traffic_bytes(case.params) / bandwidth * 1e3
                row += [f"{bound_ms:.2f}", f"{ms['cpu'] / bound_ms:.2f}×"]
                row += [f"{ws / 2**20:.1f}"] + [f"{peaks[k]:.0f}" for k in (*BACKENDS, "torch")]
                shape = "×".join(map(str, shapes[size]))
                print(f"| {label} | {shape} ({size}) | {dname} | " + " | ".join(row) + " |", flush=True)
                del case, fns
                gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
