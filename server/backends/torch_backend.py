"""TorchBackend: the operators as torch ops, on cpu, cuda:N or npu:N.

Every operator is its documented formula composed from torch ops, run wholly in the accumulation
dtype below (float64 on cpu and cuda: it holds the square of any fp32 value, so finite inputs
never overflow or underflow an intermediate), each output rounded once to its dtype (bf16 via
ml_dtypes on the host). The formulas are written as the NumPy reference writes them (see
docs/operators.md, "Non-finite values"), so that ±Inf and NaN land where they land there:
aten's own kernels differ (Welford means turn an Inf into NaN; native_batch_norm's folded
x·s + (β − μ·s) loses β when μ·s is large, and answers invstd 0 for a zero variance with eps 0).
BatchNorm's channel-last tensors are moved to channel-first first.

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
        return self.acc_dtype.itemsize * 3 * numel

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

    def _w(self, a: np.ndarray | None) -> Any:
        """An acc_dtype device tensor with the values of a NumPy view (any strides, any float dtype)."""
        if a is None:
            return None
        return self.torch.from_numpy(np.array(a, dtype=np.float64, order="C")).to(self.device, self.acc_dtype)

    def _store(self, out: np.ndarray | None, value: Any) -> None:
        """Casts to the output's dtype (round to nearest even; beyond its range ±Inf) and writes the result array."""
        if out is None:
            return
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = value.detach().cpu().numpy().reshape(out.shape).astype(out.dtype)

    def _full(self, n: int, value: float) -> Any:
        return self.torch.full((n,), value, dtype=self.acc_dtype, device=self.device)

    # ------------------------------------------------------------------ operators

    def _layer_norm_backward(self, a: dict[str, Any], plan: Plan) -> None:
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
        xt, gt = self._w(x).reshape(m, n), self._w(g).reshape(m, n)
        mean, rstd = self._w(a["mean"]).reshape(m, 1), self._w(a["rstd"]).reshape(m, 1)
        w = self._w(a["weightOptional"])
        xhat = (xt - mean) * rstd
        if dx is not None:
            # SPEC's formula as written, not aten's folded a·g·w + b·x + c: with N = 1 (or x̂ = 0) the
            # bracket cancels exactly, where aten's form leaves rstd-scaled rounding.
            gw = gt if w is None else gt * w.reshape(1, n)
            mean_gw = gw.sum(1, keepdim=True) / n
            mean_gw_xhat = (gw * xhat).sum(1, keepdim=True) / n
            self._store(dx, (gw - mean_gw - xhat * mean_gw_xhat) * rstd)
        self._store(dw, (gt * xhat).sum(0) if dw is not None else None)
        self._store(db, gt.sum(0) if db is not None else None)

    def _layer_norm_grad(self, a: dict[str, Any], plan: Plan) -> None:
        from ..ops.layer_norm_grad import EPSILON, normalization_start

        x = a["x"]
        r, b = x.ndim, normalization_start(x.shape, a["mean"].shape)
        stats = x.shape[:b] + (1,) * (r - b)
        xt, g, gamma = self._w(x), self._w(a["dy"]), self._w(a["gamma"])
        rstd = (self._w(a["variance"]).reshape(stats) + EPSILON).rsqrt()
        xhat = (xt - self._w(a["mean"]).reshape(stats)) * rstd
        if a["pd_x"] is not None:
            axes, n = tuple(range(b, r)), math.prod(x.shape[b:])
            dyg = g * gamma
            if axes:
                mean_dyg = dyg.sum(axes, keepdim=True) / n
                mean_dyg_xhat = (dyg * xhat).sum(axes, keepdim=True) / n
            else:  # no normalization axes: N = 1, each element is its own row
                mean_dyg, mean_dyg_xhat = dyg, dyg * xhat
            self._store(a["pd_x"], (dyg - mean_dyg - xhat * mean_dyg_xhat) * rstd)
        params = tuple(range(r - gamma.ndim))
        for out, value in ((a["pd_gamma"], g * xhat), (a["pd_beta"], g)):
            if out is not None:
                self._store(out, value.sum(params) if params else value)

    def _channels_first(self, a: np.ndarray, plan: Plan) -> tuple[Any, tuple[int, ...], int]:
        """A BatchNorm tensor as [L, C, T] with its channel on axis 1 (moved there from the last axis
        for NHWC/NDHWC); returns it, the channel-first shape and the axis it came from."""
        rank = a.ndim
        channel_last = CHANNEL_LAST_RANK.get(int(plan.inputs["input"].format)) == rank
        axis = rank - 1 if channel_last else 1
        t = self._w(a).movedim(axis, 1)
        moved = tuple(t.shape)
        return t.reshape(moved[0], moved[1], -1), moved, axis

    def _batch_norm_backward(self, a: dict[str, Any], plan: Plan) -> None:
        """ChannelPasses' formulas (ops/batch_norm_backward.py): s multiplies the sums, as aten's does."""
        x = a["input"]
        dx, dw, db = a["gradInput"], a["gradWeight"], a["gradBias"]
        if x.size == 0:
            for out in (dw, db):
                if out is not None:
                    out[...] = 0
            return
        xt, moved, axis = self._channels_first(x, plan)
        gt = self._channels_first(a["gradOut"], plan)[0]
        c, count = moved[1], x.size // moved[1]

        def per_channel(name: str, default: float) -> Any:
            t = self._w(a[name])
            return self._full(c, default) if t is None or t.numel() == 0 else t.reshape(c)

        training = bool(a["training"])
        if training:
            mu, s = per_channel("saveMean", 0.0), per_channel("saveInvstd", 1.0)
        else:
            mu, s = per_channel("runningMean", 0.0), 1.0 / (per_channel("runningVar", 1.0) + float(a["eps"])).sqrt()
        xc = xt - mu.reshape(1, c, 1)
        sum_g, sum_gxc = gt.sum((0, 2)), (gt * xc).sum((0, 2))
        if dx is not None:
            scale = (per_channel("weight", 1.0) * s).reshape(1, c, 1)
            if training:
                slope = (sum_gxc * s / count * s).reshape(1, c, 1)
                gi = (gt - (sum_g / count).reshape(1, c, 1) - xc * slope) * scale
            else:
                gi = gt * scale
            self._store(dx, gi.reshape(moved).movedim(1, axis))
        self._store(dw, sum_gxc * s if dw is not None else None)
        self._store(db, sum_g if db is not None else None)

    def _batch_norm_elemt_backward(self, a: dict[str, Any], plan: Plan) -> None:
        x = a["input"]
        if x.size == 0:
            return
        bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)

        def per_channel(name: str) -> Any:
            return self._w(a[name]).reshape(bshape)

        invstd = per_channel("invstd")
        w = 1.0 if a["weight"] is None else per_channel("weight")
        total = float(np.asarray(a["counter"], dtype=np.float64).sum())  # exact for INT32 counts
        slope = invstd * invstd * per_channel("sumDyXmu") / total
        shifted = self._w(a["gradOut"]) - per_channel("sumDy") / total - (self._w(x) - per_channel("mean")) * slope
        self._store(a["gradInput"], shifted * (invstd * w))

    def _normalized_rows(self, x: Any, eps: float) -> tuple[Any, Any, Any]:
        """(x̂, mean, rstd) along the last axis: the plain mean (an Inf stays one) and population variance."""
        mean = x.mean(-1, keepdim=True)
        centered = x - mean
        rstd = 1.0 / (centered.square().mean(-1, keepdim=True) + eps).sqrt()
        return centered * rstd, mean, rstd

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
        y, mean, rstd = self._normalized_rows(self._w(x).reshape(m, n), float(a["eps"]))
        w, b = self._w(a["weightOptional"]), self._w(a["biasOptional"])
        if w is not None:
            y = y * w.reshape(1, n)
        if b is not None:
            y = y + b.reshape(1, n)
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
        xhat, mean, rstd = self._normalized_rows(self._w(x).reshape(n, group, -1), float(a["eps"]))
        y = xhat.reshape(n, c, hxw)
        if a["gamma"] is not None:
            y = y * self._w(a["gamma"]).reshape(1, c, 1)
        if a["beta"] is not None:
            y = y + self._w(a["beta"]).reshape(1, c, 1)
        self._store(a["out"], y)
        self._store(a["meanOut"], mean)
        self._store(a["rstdOut"], rstd)

    def _group_norm_backward(self, a: dict[str, Any], plan: Plan) -> None:
        """The reference's formulas (ops/group_norm_backward.py): x̂ per element, sums per (sample, group)."""
        n, c, hxw, group = (int(a[k]) for k in ("N", "C", "HxW", "group"))
        dx, dgamma, dbeta = a["gradInput"], a["gradGammaOut"], a["gradBetaOut"]
        if n * c * hxw == 0:  # no elements: the parameter gradients are empty sums
            for out in (dgamma, dbeta):
                if out is not None:
                    out[...] = 0
            return
        g = self._w(a["gradOut"]).reshape(n, group, -1)
        mean, rstd = self._w(a["mean"]).reshape(n, group, 1), self._w(a["rstd"]).reshape(n, group, 1)
        xhat = (self._w(a["input"]).reshape(n, group, -1) - mean) * rstd
        self._store(dgamma, (g * xhat).reshape(n, c, hxw).sum((0, 2)) if dgamma is not None else None)
        self._store(dbeta, g.reshape(n, c, hxw).sum((0, 2)) if dbeta is not None else None)
        if dx is None:
            return
        gw = g if a["gamma"] is None else (g.reshape(n, c, hxw) * self._w(a["gamma"]).reshape(1, c, 1))
        gw = gw.reshape(n, group, -1)
        d = gw.shape[2]
        mean_gw, mean_gwx = gw.sum(2, keepdim=True) / d, (gw * xhat).sum(2, keepdim=True) / d
        self._store(dx, (gw - mean_gw - xhat * mean_gwx) * rstd)

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
        deviation = mean - mean[:1]  # from the first device's means, as the reference (`gather`)
        offset = (counts * deviation).sum(0) / n
        mean_all = mean[0] + offset
        spread = (counts * (invstd.square().reciprocal() + (deviation - offset).square())).sum(0) / n  # var + eps
        var = spread - eps
        self._store(a["meanAll"], mean_all)
        self._store(a["invstdAll"], spread.rsqrt())
        for name, value in (("runningMean", mean_all), ("runningVar", var * n / (n - 1))):  # unbiased variance
            if a[name] is not None:  # in place: the array holds the current values
                self._store(a[name], (1 - momentum) * self._w(a[name]) + momentum * value)

    def _batch_norm_elemt(self, a: dict[str, Any], plan: Plan) -> None:
        x = a["input"]
        if x.size == 0:
            return
        bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)

        def per_channel(name: str, default: float) -> Any:
            t = self._w(a[name])
            return self._full(x.shape[1], default).reshape(bshape) if t is None else t.reshape(bshape)

        # invstd is the factor (eps unused), times the weight first, as the reference's `normalize`
        scale = per_channel("invstd", 1.0) * per_channel("weight", 1.0)
        self._store(a["output"], (self._w(x) - per_channel("mean", 0.0)) * scale + per_channel("bias", 0.0))

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
        """The reference's formulas (ops/batch_norm.py): the plain mean and population variance,
        invstd = 1/√(var + eps) (Inf for a zero variance with eps 0), (x − mean)·(invstd·w) + b."""
        x = a["input"]
        if x.size == 0:  # CANN: saveMean 0 and saveInvstd NaN whenever given, nothing else written
            for name, value in (("saveMean", 0), ("saveInvstd", np.nan)):
                if a[name] is not None:
                    a[name][...] = value
            return
        axis, training = a["channel_axis"], bool(a["training"])
        moved = self._w(x).movedim(axis, 1)  # channel-last tags: to channel-first
        c = moved.shape[1]
        xt = moved.reshape(moved.shape[0], c, -1)
        count = x.size // c

        def per_channel(name: str, default: float) -> Any:
            t = self._w(a[name])
            return self._full(c, default) if t is None else t.reshape(c)

        if training:
            mean = xt.mean((0, 2))
            var = (xt - mean.reshape(1, c, 1)).square().mean((0, 2))
        else:  # CANN's defaults when null: mean 0, variance 1
            mean, var = per_channel("runningMean", 0.0), per_channel("runningVar", 1.0)
        invstd = 1.0 / (var + float(a["eps"])).sqrt()
        scale = (invstd * per_channel("weight", 1.0)).reshape(1, c, 1)
        y = (xt - mean.reshape(1, c, 1)) * scale + per_channel("bias", 0.0).reshape(1, c, 1)
        self._store(a["output"], y.reshape(moved.shape).movedim(1, axis))
        if not training:
            return
        self._store(a["saveMean"], mean)
        self._store(a["saveInvstd"], invstd)
        momentum = float(a["momentum"])
        for name, value in (("runningMean", mean), ("runningVar", var * count / (count - 1))):  # unbiased
            if a[name] is not None:  # in place: the array holds the current values
                self._store(a[name], (1 - momentum) * self._w(a[name]) + momentum * value)
