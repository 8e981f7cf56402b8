"""LayerNormGrad (SPEC §4) on the aclnnLayerNormBackward row kernel.

mean's shape fixes the rows (`M = Π x.shape[:b]`, `N = Π x.shape[b:]`); rstd is
`(variance + 1e-12)^(-1/2)` in fp32 as the reference computes it. When gamma covers at most
the normalization axes (its G elements divide N) gamma is tiled to a row of N and the kernel's
column sums fold onto gamma's G positions in a fixed order. When gamma covers more axes than
the normalization (G > N) the operator's NumPy reference runs instead (`handles` says so).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...ops.layer_norm_grad import EPSILON, normalization_start
from ...registry import Plan
from ._jit import kernel_ready, views_ready
from .layer_norm_backward import compute_rows, scratch_bytes


def geometry(plan: Plan) -> tuple[int, int, int]:
    """(M, N, G): rows, row length, gamma's element count."""
    x, mean = plan.inputs["x"], plan.inputs["mean"]
    b = normalization_start(x.shape, mean.shape)
    return math.prod(x.shape[:b]), math.prod(x.shape[b:]), plan.inputs["gamma"].numel


def handles(plan: Plan) -> bool:
    m, n, g = geometry(plan)
    if g == 0 or n % g:
        return False
    return views_ready(plan, ("dy", "x"), (m, n))


def workspace_size(plan: Plan) -> int:
    m, n, _ = geometry(plan)
    return scratch_bytes(m, n) + 4 * m  # the variance widened before rstd


def compute(plan: Plan, args: dict[str, Any]) -> bool:
    """Returns whether a result was not finite (the call is then repeated in fp64)."""
    m, n, g = geometry(plan)
    dy, x = kernel_ready(args["dy"], (m, n)), kernel_ready(args["x"], (m, n))
    pd_x, pd_gamma, pd_beta = args["pd_x"], args["pd_gamma"], args["pd_beta"]
    want_cols = pd_gamma is not None or pd_beta is not None
    trouble = False
    if m * n:
        rstd = 1.0 / np.sqrt(args["variance"].reshape(-1).astype(np.float32) + np.float32(EPSILON))
        mean = args["mean"].reshape(-1).astype(np.float32)
        w = np.tile(args["gamma"].reshape(-1).astype(np.float32), n // g)
        dx = None if pd_x is None else pd_x.reshape(m, n)
        sums, trouble = compute_rows(dy, x, mean, rstd, w, dx, want_cols)
    else:
        sums = (np.zeros(n), np.zeros(n))
    # Column j of the rows is gamma position j mod G: fold the N sums onto G, in order.
    if pd_gamma is not None:
        pd_gamma.reshape(-1)[:] = sums[1].reshape(n // g, g).sum(axis=0)
    if pd_beta is not None:
        pd_beta.reshape(-1)[:] = sums[0].reshape(n // g, g).sum(axis=0)
    return trouble


def warm_up() -> None:
    """The row kernel is shared with aclnnLayerNormBackward, which warms it."""
