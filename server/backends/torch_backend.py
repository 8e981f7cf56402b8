"""TorchBackend: the operators through PyTorch's aten ops, on cpu, cuda:N or npu:N.

aclnnLayerNormBackward is `aten.native_layer_norm_backward`, aclnnBatchNormBackward is
`aten.native_batch_norm_backward` (channel-last tensors moved to channel-first, rank > 5
folded to `[N, C, -1]`); LayerNormGrad and aclnnBatchNormElemtBackward are composed from
torch ops. Their inputs are widened to float32 on the host, the math runs in float32 on the
device, and each result is cast to its output's dtype (bf16 via ml_dtypes on the host).
aclnnLayerNorm, aclnnGroupNorm and aclnnGroupNormBackward are `aten.native_layer_norm`,
`aten.native_group_norm` and `aten.native_group_norm_backward`, aclnnBatchNorm is
`aten.native_batch_norm` (laid out as its backward; aten updates the running statistics); the
RMSNorm pair and SyncBatchNorm's helpers (aclnnBatchNormStats, aclnnBatchNormGatherStatsWithCounts,
aclnnBatchNormElemt, aclnnBatchNormReduceBackward: aten has them on CUDA only) are their documented
formulas. These run wholly in the accumulation dtype below (float64 on cpu and cuda), each output
rounded once to its dtype.
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
# The operators computed wholly in acc_dtype (see the module docstring).
ACC_DTYPE_OPS = frozenset(
    {
        "aclnnLayerNorm",
        "aclnnRmsNorm",
        "aclnnRmsNormGrad",
        "aclnnGroupNorm",
        "aclnnGroupNormBackward",
        "aclnnBatchNormStats",
        "aclnnBatchNormGatherStatsWithCounts",
        "aclnnBatchNormElemt",
        "aclnnBatchNormReduceBackward",
        "aclnnBatchNorm",
    }
)


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
            "aclnnLayerNorm": self._layer_norm,
            "aclnnRmsNorm": self._rms_norm,
            "aclnnRmsNormGrad": self._rms_norm_grad,
            "aclnnGroupNorm": self._group_norm,
            "aclnnGroupNormBackward": self._group_norm_backward,
            "aclnnBatchNormStats": self._batch_norm_stats,
            "aclnnBatchNormGatherStatsWithCounts": self._batch_norm_gather_stats,
            "aclnnBatchNormElemt": self._batch_norm_elemt,
            "aclnnBatchNormReduceBackward": self._batch_norm_reduce_backward,
            "aclnnBatchNorm": self._batch_norm,
        }

    # ------------------------------------------------------------------ Backend protocol

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        """Copies of the inputs and the outputs on the device, float32 or acc_dtype (a bound, not an exact count)."""
        numel = sum(t.numel for t in plan.inputs.values()) + sum(t.numel for t in plan.outputs.values())
        itemsize = self.acc_dtype.itemsize if operator.name in ACC_DTYPE_OPS else 4
        return itemsize * 3 * numel

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

    def _w(self, a: np.ndarray | None) -> Any:
        """Like `_t`, in acc_dtype: the forward norms and their backwards run wholly in it."""
        if a is None:
            return None
        return self.torch.from_numpy(np.array(a, dtype=np.float64, order="C")).to(self.device, self.acc_dtype)

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

    def _layer_norm(self, a: dict[str, Any], plan: Plan) -> None:
        x, norm = a["input"], [int(d) for d in a["normalizedShape"]]
        lead = x.shape[: x.ndim - len(norm)]
        m, n = math.prod(lead), math.prod(norm)
        mean_out, rstd_out = a["meanOutOptional"], a["rstdOutOptional"]
        if m == 0:
            return
        if n == 0:  # CANN: mean 0, rstd NaN
            if mean_out is not None:
                mean_out[...] = 0
            if rstd_out is not None:
                rstd_out[...] = np.nan
            return
        w, b = self._w(a["weightOptional"]), self._w(a["biasOptional"])
        y, mean, rstd = self.torch.ops.aten.native_layer_norm(
            self._w(x).reshape(m, n),
            [n],
            None if w is None else w.reshape(n),
            None if b is None else b.reshape(n),
            float(a["eps"]),
        )
        self._store(a["out"], y)
        self._store(mean_out, mean)
        self._store(rstd_out, rstd)

    def _rms_norm(self, a: dict[str, Any], plan: Plan) -> None:
        x, gamma = a["x"], a["gamma"]
        n = gamma.size
        m = x.size // n
        if m == 0:
            return
        xt = self._w(x).reshape(m, n)
        rstd = (xt.square().mean(1, keepdim=True) + float(a["epsilon"])).rsqrt()
        self._store(a["yOut"], xt * rstd * self._w(gamma).reshape(1, n))
        self._store(a["rstdOut"], rstd)

    def _rms_norm_grad(self, a: dict[str, Any], plan: Plan) -> None:
        x, gamma, dgamma = a["x"], a["gamma"], a["dgammaOut"]
        n = gamma.size
        m = x.size // n
        if m == 0:
            dgamma[...] = 0
            return
        rstd = self._w(a["rstd"]).reshape(m, 1)
        dy, xhat = self._w(a["dy"]).reshape(m, n), self._w(x).reshape(m, n) * rstd
        dyg = dy * self._w(gamma).reshape(1, n)
        self._store(a["dxOut"], rstd * (dyg - xhat * (dyg * xhat).mean(1, keepdim=True)))
        self._store(dgamma, (dy * xhat).sum(0))

    def _group_norm(self, a: dict[str, Any], plan: Plan) -> None:
        x = a["self"]
        if x.size == 0:  # CANN: mean 0, rstd NaN
            a["meanOut"][...] = 0
            a["rstdOut"][...] = np.nan
            return
        n, c, hxw, group = (int(a[k]) for k in ("N", "C", "HxW", "group"))
        y, mean, rstd = self.torch.ops.aten.native_group_norm(
            self._w(x).reshape(n, c, hxw), self._w(a["gamma"]), self._w(a["beta"]), n, c, hxw, group, float(a["eps"])
        )
        self._store(a["out"], y)
        self._store(a["meanOut"], mean)
        self._store(a["rstdOut"], rstd)

    def _group_norm_backward(self, a: dict[str, Any], plan: Plan) -> None:
        n, c, hxw, group = (int(a[k]) for k in ("N", "C", "HxW", "group"))
        dx, dgamma, dbeta = a["gradInput"], a["gradGammaOut"], a["gradBetaOut"]
        if n * c * hxw == 0:  # no elements: the parameter gradients are empty sums
            for out in (dgamma, dbeta):
                if out is not None:
                    out[...] = 0
            return
        gamma = self._w(a["gamma"])  # aten's kernel needs a weight tensor: ones when it is null
        gamma = self.torch.ones(c, dtype=self.acc_dtype, device=self.device) if gamma is None else gamma.reshape(c)
        gi, gg, gb = self.torch.ops.aten.native_group_norm_backward(
            self._w(a["gradOut"]).reshape(n, c, hxw),
            self._w(a["input"]).reshape(n, c, hxw),
            self._w(a["mean"]).reshape(n, group),
            self._w(a["rstd"]).reshape(n, group),
            gamma,
            n,
            c,
            hxw,
            group,
            [dx is not None, dgamma is not None, dbeta is not None],
        )
        self._store(dx, gi)
        self._store(dgamma, gg)
        self._store(dbeta, gb)

    def _batch_norm_stats(self, a: dict[str, Any], plan: Plan) -> None:
        x = a["input"]
        if x.size == 0:  # CANN: mean 0, invstd NaN
            a["mean"][...] = 0
            a["invstd"][...] = np.nan
            return
        xt = self._w(x).movedim(1, 0).reshape(x.shape[1], -1)  # channel dim 1, whatever the format tag
        mean = xt.mean(1, keepdim=True)
        self._store(a["mean"], mean)
        self._store(a["invstd"], ((xt - mean).square().mean(1) + float(a["eps"])).rsqrt())

    def _batch_norm_gather_stats(self, a: dict[str, Any], plan: Plan) -> None:
        if a["mean"].size == 0:  # no device statistics: meanAll 0, invstdAll NaN, running stats untouched
            a["meanAll"][...] = 0
            a["invstdAll"][...] = np.nan
            return
        eps, momentum = float(a["eps"]), float(a["momentum"])
        mean, invstd = self._w(a["mean"]), self._w(a["invstd"])
        counts = self._w(a["counts"]).reshape(-1, 1)
        n = counts.sum()
        mean_all = (counts * mean).sum(0) / n
        var = (counts * (invstd.square().reciprocal() - eps + (mean - mean_all).square())).sum(0) / n
        self._store(a["meanAll"], mean_all)
        self._store(a["invstdAll"], (var + eps).rsqrt())
        for name, value in (("runningMean", mean_all), ("runningVar", var * n / (n - 1))):  # unbiased variance
            if a[name] is not None:  # in place: the array holds the current values
                self._store(a[name], (1 - momentum) * self._w(a[name]) + momentum * value)

    def _batch_norm_elemt(self, a: dict[str, Any], plan: Plan) -> None:
        x = a["input"]
        if x.size == 0:
            return
        bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)

        def per_channel(name: str) -> Any:
            t = self._w(a[name])
            return None if t is None else t.reshape(bshape)

        w, b = per_channel("weight"), per_channel("bias")
        y = (self._w(x) - per_channel("mean")) * per_channel("invstd")  # invstd is the factor; eps unused
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        self._store(a["output"], y)

    def _batch_norm_reduce_backward(self, a: dict[str, Any], plan: Plan) -> None:
        """Disabled outputs are None (their flag was false): _store skips them."""
        x = a["input"]
        if x.size == 0:  # CANN: zeros in the enabled outputs
            for name in ("sumDy", "sumDyXmu", "gradWeight", "gradBias"):
                if a[name] is not None:
                    a[name][...] = 0
            return
        c = x.shape[1]  # dim 1, whatever the format tag
        axes = [0, *range(2, x.ndim)]
        g = self._w(a["gradOut"])
        sum_dy = g.sum(axes)
        sum_dy_xmu = (g * (self._w(x) - self._w(a["mean"]).reshape((1, c) + (1,) * (x.ndim - 2)))).sum(axes)
        self._store(a["sumDy"], sum_dy)
        self._store(a["sumDyXmu"], sum_dy_xmu)
        self._store(a["gradWeight"], sum_dy_xmu * self._w(a["invstd"]).reshape(c))
        self._store(a["gradBias"], sum_dy)

    def _batch_norm(self, a: dict[str, Any], plan: Plan) -> None:
        x = a["input"]
        if x.size == 0:  # CANN: saveMean 0 and saveInvstd NaN whenever given, nothing else written
            for name, value in (("saveMean", 0), ("saveInvstd", np.nan)):
                if a[name] is not None:
                    a[name][...] = value
            return
        torch, axis, training = self.torch, a["channel_axis"], bool(a["training"])
        xt = self._w(x).movedim(axis, 1)  # channel-last tags: to channel-first
        moved = xt.shape
        c = moved[1]
        if x.ndim > 5:
            xt = xt.reshape(moved[0], c, -1)
        rm, rv = self._w(a["runningMean"]), self._w(a["runningVar"])
        if not training or (rm is None) != (rv is None):  # aten takes both or neither: CANN's defaults stand in
            rm = torch.zeros(c, dtype=self.acc_dtype, device=self.device) if rm is None else rm
            rv = torch.ones(c, dtype=self.acc_dtype, device=self.device) if rv is None else rv
        y, mean, invstd = torch.ops.aten.native_batch_norm(
            xt, self._w(a["weight"]), self._w(a["bias"]), rm, rv, training, float(a["momentum"]), float(a["eps"])
        )
        self._store(a["output"], y.reshape(moved).movedim(1, axis))
        if training:  # aten updated rm/rv in place (unbiased variance)
            self._store(a["saveMean"], mean)
            self._store(a["saveInvstd"], invstd)
            self._store(a["runningMean"], rm)
            self._store(a["runningVar"], rv)
