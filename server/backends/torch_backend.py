"""TorchBackend: the operators through PyTorch's aten ops, on cpu, cuda:N or npu:N.

aclnnLayerNormBackward is `aten.native_layer_norm_backward`, aclnnBatchNormBackward is
`aten.native_batch_norm_backward` (channel-last tensors moved to channel-first, rank > 5
folded to `[N, C, -1]`); LayerNormGrad and aclnnBatchNormElemtBackward are composed from
torch ops. Inputs are widened to float32 on the host, the math runs in float32 on the
device, and each result is cast to its output's dtype (bf16 via ml_dtypes on the host).
Parameter gradients of LayerNorm (sums over all rows) are taken in float64 where the device
has it (cpu, cuda), so that long reductions meet SPEC 1.5's fp32 tolerance. LayerNorm's
gradInput follows SPEC 3.2's formula (row sums in that precision too) rather than aten's
folded one, which on a one-element row (gradInput exactly 0) leaves rstd-scaled rounding.

torch is imported lazily: it is a test-only dependency, and constructing a TorchBackend
without it raises a RuntimeError saying so. `npu:N` needs torch_npu.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..registry import Operator, Plan

CHANNEL_LAST_RANK = {1: 4, 27: 5}  # aclFormat NHWC -> rank 4, NDHWC -> rank 5


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("the torch backend needs PyTorch: pip install torch (and torch_npu for npu:N)") from exc
    return torch


class TorchBackend:
    """The operators on a torch device; workspace is what the computation allocates beyond its outputs."""

    name = "torch"

    def __init__(self, device: str = "cpu") -> None:
        torch = self.torch = _import_torch()
        if str(device).startswith("npu"):
            try:
                import torch_npu  # noqa: F401  (registers the npu device with torch)
            except ImportError as exc:
                raise RuntimeError(f"torch device {device!r} needs torch_npu, which does not import") from exc
        try:
            self.device = torch.device(device)
            torch.empty(1, device=self.device)
        except (RuntimeError, AssertionError) as exc:
            raise RuntimeError(f"torch device {device!r} is not usable: {exc}") from exc
        # float64 accumulation where the device has it (NPUs mostly do not)
        self.acc_dtype = torch.float64 if self.device.type in ("cpu", "cuda") else torch.float32
        self._compute = {
            "aclnnLayerNormBackward": self._layer_norm_backward,
            "LayerNormGrad": self._layer_norm_grad,
            "aclnnBatchNormBackward": self._batch_norm_backward,
            "aclnnBatchNormElemtBackward": self._batch_norm_elemt_backward,
        }

    # ------------------------------------------------------------------ Backend protocol

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        """Float32 copies of the inputs and the outputs on the device (a bound, not an exact count)."""
        numel = sum(t.numel for t in plan.inputs.values()) + sum(t.numel for t in plan.outputs.values())
        return 4 * 3 * numel

    def compute(self, operator: Operator, plan: Plan, args: dict[str, Any]) -> None:
        fn = self._compute.get(operator.name)
        if fn is None:  # an operator this backend does not know: the reference
            operator.compute(**args)
            return
        with self.torch.no_grad():
            fn(args, plan)

    def close(self) -> None:
        """Nothing to release (torch owns its caches)."""

    # ------------------------------------------------------------------ helpers

    def _t(self, a: np.ndarray | None) -> Any:
        """A float32 device tensor with the values of a NumPy view (any strides, any float dtype)."""
        if a is None:
            return None
        return self.torch.from_numpy(np.array(a, dtype=np.float32, order="C")).to(self.device)

    def _store(self, out: np.ndarray | None, value: Any) -> None:
        """Casts to the output's dtype (round to nearest even) and writes the result array."""
        if out is None:
            return
        out[...] = value.detach().cpu().numpy().reshape(out.shape).astype(out.dtype)

    def _ones(self, n: int) -> Any:
        return self.torch.ones(n, dtype=self.torch.float32, device=self.device)

    def _zeros(self, n: int) -> Any:
        return self.torch.zeros(n, dtype=self.torch.float32, device=self.device)

    # ------------------------------------------------------------------ operators

    def _layer_norm_backward(self, a: dict[str, Any], plan: Plan) -> None:
        torch = self.torch
        x, g = a["input"], a["gradOut"]
        norm = [int(d) for d in a["normalizedShape"]]
        lead = x.shape[: x.ndim - len(norm)]
        m, n = math.prod(lead), math.prod(norm)
        dx, dw, db = a["gradInputOut"], a["gradWeightOut"], a["gradBiasOut"]
        if n == 0:
            return
        if m == 0:
            for out in (dw, db):
                if out is not None:
                    out[...] = 0
            return
        stats = tuple(lead) + (1,) * len(norm)
        xt, gt = self._t(x), self._t(g)
        mean, rstd = self._t(a["mean"]).reshape(stats), self._t(a["rstd"]).reshape(stats)
        w = self._t(a["weightOptional"])
        w = w.reshape(norm) if w is not None else torch.ones(norm, dtype=torch.float32, device=self.device)
        xhat = (xt.reshape(m, n) - mean.reshape(m, 1)) * rstd.reshape(m, 1)
        if dx is not None:
            # SPEC's formula as written, not aten's folded a·g·w + b·x + c: with N = 1 (or x̂ = 0) the
            # bracket cancels exactly, where aten's form leaves rstd-scaled rounding. Row sums in acc_dtype.
            gw = gt.reshape(m, n) * w.reshape(1, n)
            mean_gw = gw.sum(1, keepdim=True, dtype=self.acc_dtype) / n
            mean_gw_xhat = (gw * xhat).sum(1, keepdim=True, dtype=self.acc_dtype) / n
            self._store(dx, rstd.reshape(m, 1) * (gw - mean_gw.float() - xhat * mean_gw_xhat.float()))
        if dw is not None or db is not None:
            g2 = gt.reshape(m, n).to(self.acc_dtype)
            if dw is not None:
                self._store(dw, (g2 * xhat.to(self.acc_dtype)).sum(0))
            if db is not None:
                self._store(db, g2.sum(0))

    def _layer_norm_grad(self, a: dict[str, Any], plan: Plan) -> None:
        from ..ops.layer_norm_grad import EPSILON, normalization_start

        x = a["x"]
        r, b = x.ndim, normalization_start(x.shape, a["mean"].shape)
        stats = x.shape[:b] + (1,) * (r - b)
        xt, g, gamma = self._t(x), self._t(a["dy"]), self._t(a["gamma"])
        rstd = (self._t(a["variance"]).reshape(stats) + EPSILON).rsqrt()
        xhat = (xt - self._t(a["mean"]).reshape(stats)) * rstd
        if a["pd_x"] is not None:
            axes, n = tuple(range(b, r)), math.prod(x.shape[b:])
            dyg = g * gamma
            if axes:
                mean_dyg = dyg.to(self.acc_dtype).sum(axes, keepdim=True) / n
                mean_dyg_xhat = (dyg * xhat).to(self.acc_dtype).sum(axes, keepdim=True) / n
            else:  # no normalization axes: N = 1, each element is its own row
                mean_dyg, mean_dyg_xhat = dyg, dyg * xhat
            self._store(a["pd_x"], rstd * (dyg - mean_dyg.float() - xhat * mean_dyg_xhat.float()))
        params = tuple(range(r - gamma.ndim))
        for out, value in ((a["pd_gamma"], g * xhat), (a["pd_beta"], g)):
            if out is not None:
                value = value.to(self.acc_dtype)
                self._store(out, value.sum(params) if params else value)

    def _batch_norm_backward(self, a: dict[str, Any], plan: Plan) -> None:
        torch = self.torch
        x = a["input"]
        rank = x.ndim
        channel_last = CHANNEL_LAST_RANK.get(int(plan.inputs["input"].format)) == rank
        ca = rank - 1 if channel_last else 1
        c = x.shape[ca]
        mask = [bool(v) for v in a["outputMask"]]
        dx, dw, db = a["gradInput"], a["gradWeight"], a["gradBias"]
        if x.size == 0:
            for out in (dw, db):
                if out is not None:
                    out[...] = 0
            return
        xt, gt = self._t(x), self._t(a["gradOut"])
        if channel_last:  # to channel-first
            perm = (0, rank - 1, *range(1, rank - 1))
            xt, gt = xt.permute(perm), gt.permute(perm)
        shape_cf = tuple(xt.shape)
        if rank > 5:
            xt, gt = xt.reshape(shape_cf[0], c, -1), gt.reshape(shape_cf[0], c, -1)
        training = bool(a["training"])

        def per_channel(name: str, default: Any) -> Any:
            t = self._t(a[name])
            return default if t is None or t.numel() == 0 else t.reshape(c)

        w = per_channel("weight", self._ones(c))
        rm, rv = per_channel("runningMean", self._zeros(c)), per_channel("runningVar", self._ones(c))
        sm, si = per_channel("saveMean", self._zeros(c)), per_channel("saveInvstd", self._ones(c))
        gi, gw, gb = torch.ops.aten.native_batch_norm_backward(
            gt.contiguous(), xt.contiguous(), w, rm, rv, sm, si, training, float(a["eps"]), mask
        )
        if dx is not None:
            gi = gi.reshape(shape_cf)
            if channel_last:
                gi = gi.permute(0, *range(2, rank), 1)
            self._store(dx, gi)
        self._store(dw, gw)
        self._store(db, gb)

    def _batch_norm_elemt_backward(self, a: dict[str, Any], plan: Plan) -> None:
        torch = self.torch
        x = a["input"]
        if x.size == 0:
            return
        c = x.shape[1]
        bshape = (1, c) + (1,) * (x.ndim - 2)
        xt, g = self._t(x), self._t(a["gradOut"])
        mean, invstd = self._t(a["mean"]).reshape(bshape), self._t(a["invstd"]).reshape(bshape)
        w = self._t(a["weight"])
        w = w.reshape(bshape) if w is not None else torch.ones(bshape, device=self.device)
        total = float(np.asarray(a["counter"], dtype=np.float64).sum())  # exact for INT32 counts
        sum_dy = self._t(a["sumDy"]).reshape(bshape) / total
        sum_dy_xmu = self._t(a["sumDyXmu"]).reshape(bshape) / total
        self._store(a["gradInput"], (g - sum_dy - (xt - mean) * invstd * invstd * sum_dy_xmu) * invstd * w)
