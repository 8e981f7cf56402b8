"""Fused Triton kernels on CUDA for the fp32 pass of LayerNorm backward (aclnnLayerNormBackward);
the kernels themselves are in triton_kernels.py, imported only where Triton is.

The torch-op formula (formulas.layer_norm_backward) launches about twenty elementwise and reduction
kernels, each a pass over [M, N] in memory: on an H200 at 8192x4096 fp32 it took 4.3x aten's fused
kernel. These two kernels do the same arithmetic in two launches that read gradOut and input in
their own dtypes (widened in registers) and write only the results:

- rows: per row, Σ (g·w − (g·w)₀) and Σ g·w·x̂ over chunks of the row (a vector of partial sums,
  added as a tree at the end), then gradInput = ((g·w − (g·w)₀) − x̂·mean(g·w·x̂))·rstd −
  mean(g·w − (g·w)₀)·rstd: the formula's about-the-first-value form (a constant g·w is exactly its
  own mean), each step rounded as the torch ops round it: no multiply is fused into an add
  (`enable_fp_fusion=False`; a fused g·w − (g·w)₀ is g·w's rounding error, not 0, and a one-element
  row's gradient must be exactly 0).
- columns: fp32 sums of g·x̂ and g over runs of SUM_RUN rows per column, added in fp64 by torch
  (as `column_sums` does).

Block sizes and warps are fixed by N alone (no autotuning), so a call's bits do not depend on
what ran before it. The backend falls back to the torch formula where Triton is missing, the
device is not CUDA, a tensor's dtype is not fp32/fp16/bf16, or ACLNN_TORCH_FUSED=0 (the benchmark's
comparison, and an escape hatch); the fp64 repeat always runs the torch formula.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from ...ops.rows import SUM_RUN

# Read once; bench/gpu.py flips it to time the torch-op formula on the same process.
ENABLED = os.environ.get("ACLNN_TORCH_FUSED", "1") != "0"
ROW_BLOCK_LIMIT = 4096  # elements of a row per chunk: 16 KiB of fp32 registers across the block's warps
COLUMN_BLOCK = 128
SMALLEST_BLOCK = 16  # fewer distinct compiled variants for narrow rows
MAX_GRID = 2**31 - 1  # programs a grid's first axis holds
# Launches one at a time: Triton's first compile of a kernel variant is not safe from two threads at once.
_LAUNCHING = threading.Lock()


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    """The two jitted kernels (triton_kernels.py), or None where Triton does not import."""
    try:
        from .triton_kernels import columns, rows
    except ImportError:
        return None
    return rows, columns


def fusable(torch: Any, tensors: list[Any], rows: int) -> bool:
    """Whether the fused kernels can run these tensors (CUDA, fp32/fp16/bf16, Triton present, a grid
    CUDA can launch: one program per row)."""
    kinds = (torch.float32, torch.float16, torch.bfloat16)
    return (
        ENABLED and rows <= MAX_GRID and all(t.is_cuda and t.dtype in kinds for t in tensors) and _kernels() is not None
    )


def _rows_of(t: Any, m: int, n: int) -> Any:
    """[M, N] with unit column stride (a copy only for a view that has none)."""
    t = t.reshape(m, n)
    return t if t.stride(1) == 1 or n == 1 else t.contiguous()


def _block(n: int, limit: int) -> int:
    """The power of two at or above N, within [SMALLEST_BLOCK, limit]."""
    return min(limit, max(SMALLEST_BLOCK, 1 << (n - 1).bit_length()))


def fused_layer_norm_backward(c: Any, m: int, n: int) -> None:
    """The fp32 pass of formulas.layer_norm_backward on CUDA (M, N > 0), its results stored in `c`."""
    torch = c.torch
    rows, columns = _kernels()
    g, x = _rows_of(c.a["gradOut"], m, n), _rows_of(c.a["input"], m, n)
    mean, rstd = c.a["mean"].reshape(m).contiguous(), c.a["rstd"].reshape(m).contiguous()
    w = c.a.get("weightOptional")
    if c.wants("gradWeightOut") or c.wants("gradBiasOut"):
        block = _block(n, COLUMN_BLOCK)
        runs = -(-m // SUM_RUN)
        run_sums = torch.empty((2, runs, n), dtype=torch.float32, device=g.device)  # Σ g·x̂ and Σ g per run
        with _LAUNCHING:
            columns[(runs * -(-n // block),)](
                g, x, mean, rstd, run_sums[0], run_sums[1], m, n, g.stride(0), x.stride(0),
                RUN=SUM_RUN, BLOCK=block, num_warps=4, enable_fp_fusion=False,
            )  # fmt: skip
        gradient_weight, gradient_bias = run_sums.sum(1, dtype=torch.float64)  # one launch for both
        c.store("gradWeightOut", gradient_weight)
        c.store("gradBiasOut", gradient_bias)
    if c.wants("gradInputOut"):
        into = c.into("gradInputOut", (m, n))
        dx = torch.empty((m, n), dtype=torch.float32, device=g.device) if into is None else into
        block = _block(n, ROW_BLOCK_LIMIT)
        w_arg = g if w is None else w.reshape(n).contiguous()
        with _LAUNCHING:
            rows[(m,)](
                g, x, w_arg, mean, rstd, dx, n, g.stride(0), x.stride(0),
                HAS_W=w is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False,
            )  # fmt: skip
        c.store("gradInputOut", dx)
