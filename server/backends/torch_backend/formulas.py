"""The operators' formulas on torch tensors, wherever they live (the torch backend's device).

A formula reads its input tensors (on the device, in their own dtype and strides), widens what it
reads to the call's work dtype and hands its results to `Call.store`; the backend casts them to
the outputs' dtypes. A call is computed in one of two work dtypes:

- float32, compensated (every call first). The reference's fp32 techniques, on the device: a mean
  μ of fp32 sums is corrected by the mean of x − μ (exact near μ), which also corrects the variance
  and x̂; a row's gradient sum is taken about the row's first value, so that a constant g·w is
  exactly its own mean (gradInput exactly 0); sums over many rows or channel elements are fp32
  sums of short runs added in fp64 (`column_sums`). Squares outside fp32's safe range and
  non-finite results are flagged (`Call.checksum`).
- float64, wide: the reference's formulas as written (docs/operators.md, "Non-finite values"),
  for a call flagged in fp32, so that ±Inf and NaN land where they land on every backend.

Formulas never write into an input tensor: on device memory an input is a view of a buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ...ops.rows import LARGEST_SAFE_SQUARE, SMALLEST_SAFE_SQUARE, SUM_RUN
from ...registry import Plan
from .fused import fusable, fused_layer_norm_backward

CHANNEL_LAST_RANK = {1: 4, 27: 5}  # aclFormat NHWC -> rank 4, NDHWC -> rank 5


class Call:
    """One call's tensors and values (`a`), the enabled outputs' shapes, and the results so far.
    `destinations`: outputs a formula may write its last step into (`into`), in the work dtype."""

    def __init__(
        self,
        torch: Any,
        args: Mapping[str, Any],
        outputs: Mapping[str, tuple[int, ...]],
        wide: bool,
        destinations: Mapping[str, Any] | None = None,
    ):
        self.torch = torch
        self.a = args
        self.outputs = outputs
        self.wide = wide
        self.destinations = {} if wide or destinations is None else destinations
        self.work = torch.float64 if wide else torch.float32
        self.results: dict[str, Any] = {}
        self._alarms: list[Any] = []  # device scalars, +Inf where fp32 could not hold a square

    def w(self, name: str) -> Any:
        """An input in the work dtype (the tensor itself when it has it: never written), or None."""
        t = self.a.get(name)
        return None if t is None else t.to(self.work)

    def f64(self, name: str) -> Any:
        t = self.a.get(name)
        return None if t is None else t.to(self.torch.float64)

    def wants(self, name: str) -> bool:
        return name in self.outputs

    def into(self, name: str, shape: tuple[int, ...]) -> Any:
        """The output's own (contiguous, work-dtype) memory seen as `shape`, for a last step's out=; or None."""
        t = self.destinations.get(name)
        return None if t is None else t.view(shape)

    def store(self, name: str, value: Any) -> None:
        if name in self.outputs:
            self.results[name] = value

    def fill(self, name: str, value: float) -> None:
        if name in self.outputs:
            self.results[name] = self.torch.full(self.outputs[name], value, dtype=self.work, device=self.device)

    def full(self, n: int, value: float) -> Any:
        return self.torch.full((n,), value, dtype=self.work, device=self.device)

    @property
    def device(self) -> Any:
        return next(t.device for t in self.a.values() if isinstance(t, self.torch.Tensor))

    def check_squares(self, squares: Any) -> None:
        """Flags mean squares (variance + eps) where fp32 squares may have underflowed or overflowed."""
        if not self.wide:
            safe = ((squares >= SMALLEST_SAFE_SQUARE) & (squares <= LARGEST_SAFE_SQUARE)).all()
            self._alarms.append(self.torch.where(safe, 0.0, math.inf))

    def checksum(self) -> Any:
        """A device fp64 scalar that is not finite when the fp32 computation must be repeated wide: the
        sum of every result's sum (a result that is not finite makes it so; one whose sum overflows
        fp32 too, which costs only a repeat) and of the flagged squares' +Inf. One stack and one sum,
        so that deciding costs few launches. None when wide or nothing was computed."""
        if self.wide:
            return None
        torch = self.torch
        parts = [v.sum().to(torch.float64) for v in self.results.values() if v.is_floating_point() and v.numel()]
        parts += [alarm.to(torch.float64) for alarm in self._alarms]
        return torch.stack(parts).sum() if parts else None


Formula = Callable[[Call, Plan], None]


def column_sums(c: Call, t: Any) -> Any:
    """Σ over axis 0 of [M, ...] in fp64: fp32 sums of runs of SUM_RUN rows, added in fp64 (an fp64
    sum of the whole tensor would first copy it to fp64)."""
    torch = c.torch
    whole = t.shape[0] - t.shape[0] % SUM_RUN
    total = t[:whole].reshape(whole // SUM_RUN, SUM_RUN, *t.shape[1:]).sum(1).sum(0, dtype=torch.float64)
    if whole < t.shape[0]:
        total = total + t[whole:].sum(0, dtype=torch.float64)
    return total


def channel_sums(c: Call, t: Any) -> Any:
    """Σ over axes 0 and 2 of [L, C, T] in fp64 (each channel's elements)."""
    return column_sums(c, t.sum(2))


def per_channel(c: Call, name: str, n: int, default: float) -> Any:
    """A [C] input in the work dtype, or `default` for each channel when it is null (or empty)."""
    t = c.w(name)
    return c.full(n, default) if t is None or t.numel() == 0 else t.reshape(n)


def input_gradient(
    c: Call, gw: Any, xhat: Any, rstd: Any, dot: Any = None, into: Any = None, x: Any = None, mean: Any = None
) -> Any:
    """(g·w − mean(g·w) − x̂·mean(g·w·x̂))·rstd along the rows of [M, N]: SPEC's formula as written, not
    aten's folded a·g·w + b·x + c (with N = 1, or x̂ = 0, the bracket cancels exactly). `dot`: Σ g·w·x̂
    per row when the caller has it; `into`: where the result goes; `x` and `mean` ([M, N], [M, 1]):
    wide, mean(g·w·x̂) is taken about each row's first x where that is finite (the NumPy reference's
    `far_statistics_dot`: statistics far beyond the data)."""
    n = gw.shape[1]
    mean_gw_xhat = (dot if dot is not None else (gw * xhat).sum(1, keepdim=True)) / n
    if c.wide and x is not None:
        first = x[:, :1]
        shifted = ((gw * (x - first)).mean(1, keepdim=True) + (first - mean) * gw.mean(1, keepdim=True)) * rstd
        mean_gw_xhat = c.torch.where(shifted.isfinite(), shifted, mean_gw_xhat)
    if c.wide:  # fp64 holds a constant row's sum exactly
        centered = gw - gw.sum(1, keepdim=True) / n
        return centered.addcmul_(xhat, mean_gw_xhat, value=-1).mul_(rstd)
    # About each row's first value: a constant row is exactly its own mean in fp32 too.
    shifted = gw - gw[:, :1]
    mean_shifted = shifted.sum(1, keepdim=True) / n
    shifted.addcmul_(xhat, mean_gw_xhat, value=-1)
    return c.torch.addcmul(-(mean_shifted * rstd), shifted, rstd, out=into)


def normalized_rows(c: Call, x: Any, eps: float) -> tuple[Any, Any, Any]:
    """(x̂, mean, rstd) along the last axis, population variance. fp32: about the rounded mean μ, its
    rounding corrected by mean(x − μ) in the mean, the variance and x̂ (as the reference does;
    x̂ = ((x − μ) − mean(x − μ))·rstd). Not torch.var_mean: on CUDA its fp32 Welford variance of data
    far from zero with a small spread missed SPEC 1.5's bound by 7x (H200, x = 1000.2 + 0.01·i)."""
    mean = x.mean(-1, keepdim=True)  # wide: the plain mean (an Inf stays one)
    centered = x - mean
    if c.wide:
        var = centered.square().mean(-1, keepdim=True)
    else:
        lost = centered.mean(-1, keepdim=True)
        var = (centered.square().mean(-1, keepdim=True) - lost * lost).clamp_(min=0)
        c.check_squares(var + eps)
    rstd = 1.0 / (var + eps).sqrt()
    if c.wide:
        return centered.mul_(rstd), mean, rstd
    return centered.sub_(lost).mul_(rstd), mean + lost, rstd


def scaled(c: Call, y: Any, w: Any, b: Any, into: Any) -> Any:
    """y·w + b (either may be None); with both, in fp32 one rounding, into `into` when given."""
    if w is not None and b is not None and not c.wide:
        return c.torch.addcmul(b, y, w, out=into)
    if w is not None:
        y *= w
    if b is not None:
        y += b
    return y


def channel_moments(c: Call, x: Any) -> tuple[Any, Any, Any, Any]:
    """Per-channel statistics of [L, C, T] (ops/batch_norm_stats.py): the fp64 mean and population
    variance, the work-dtype mean μ the data were centred on, and x − μ."""
    count = x.shape[0] * x.shape[2]
    first = channel_sums(c, x) / count
    mu = first.to(c.work)
    centered = x - mu.reshape(1, -1, 1)
    squares = channel_sums(c, centered.square()) / count
    if c.wide:
        return first, squares, mu, centered
    offset = channel_sums(c, centered) / count  # what the fp32 rounding of the first mean took
    torch = c.torch
    mean = torch.where(torch.isfinite(mu), mu + offset, first)
    return mean, (squares - offset * offset).clamp_(min=0), mu, centered


def channels_first(c: Call, name: str, plan: Plan) -> tuple[Any, tuple[int, ...], int]:
    """A BatchNorm tensor as [L, C, T] with its channel on axis 1 (moved there from the last axis for
    NHWC/NDHWC); returns it, the channel-first shape and the axis it came from."""
    t = c.w(name)
    channel_last = CHANNEL_LAST_RANK.get(int(plan.inputs["input"].format)) == t.ndim
    axis = t.ndim - 1 if channel_last else 1
    t = t.movedim(axis, 1)
    moved = tuple(t.shape)
    return t.reshape(moved[0], moved[1], -1), moved, axis


# ---------------------------------------------------------------------------------------- operators


def layer_norm_backward(c: Call, plan: Plan) -> None:
    x, norm = c.a["input"], [int(d) for d in c.a["normalizedShape"]]
    m, n = math.prod(x.shape[: x.ndim - len(norm)]), math.prod(norm)
    if n == 0:
        return
    if m == 0:
        c.fill("gradWeightOut", 0)
        c.fill("gradBiasOut", 0)
        return
    tensors = [c.a[k] for k in ("gradOut", "input", "mean", "rstd", "weightOptional") if c.a.get(k) is not None]
    if not c.wide and fusable(c.torch, tensors, m):  # CUDA: the same arithmetic in two kernels
        fused_layer_norm_backward(c, m, n)
        return
    xt, gt = c.w("input").reshape(m, n), c.w("gradOut").reshape(m, n)
    rstd, w = c.w("rstd").reshape(m, 1), c.w("weightOptional")
    xhat = (xt - c.w("mean").reshape(m, 1)).mul_(rstd)
    # The parameter gradients first: an in-place gradInput (over gradOut's storage) is written last.
    gx = gt * xhat if c.wants("gradWeightOut") or (c.wants("gradInputOut") and w is None) else None
    if c.wants("gradWeightOut"):
        c.store("gradWeightOut", column_sums(c, gx))
    if c.wants("gradBiasOut"):
        c.store("gradBiasOut", column_sums(c, gt))
    if c.wants("gradInputOut"):
        gw = gt if w is None else gt * w.reshape(1, n)
        dot = gx.sum(1, keepdim=True) if w is None else None  # Σ g·x̂: no weight, no second product
        into = c.into("gradInputOut", (m, n))
        c.store("gradInputOut", input_gradient(c, gw, xhat, rstd, dot, into, xt, c.w("mean").reshape(m, 1)))


def layer_norm_grad(c: Call, plan: Plan) -> None:
    from ...ops.layer_norm_grad import EPSILON, normalization_start

    x = c.a["x"]
    r = x.ndim
    b = normalization_start(tuple(x.shape), tuple(c.a["mean"].shape))
    stats = tuple(x.shape[:b]) + (1,) * (r - b)
    g, gamma = c.w("dy"), c.w("gamma")
    rstd = (c.w("variance").reshape(stats) + EPSILON).rsqrt()
    xhat = (c.w("x") - c.w("mean").reshape(stats)).mul_(rstd)
    if c.wants("pd_x"):
        m = math.prod(x.shape[:b])
        n = x.numel() // m if m else 0
        if m and n:  # no normalization axes (b = r): N = 1, each element its own row
            dyg = (g * gamma).reshape(m, n)
            grad = input_gradient(
                c, dyg, xhat.reshape(m, n), rstd.reshape(m, 1), x=c.w("x").reshape(m, n), mean=c.w("mean").reshape(m, 1)
            )
            c.store("pd_x", grad.reshape(x.shape))
        else:
            c.store("pd_x", xhat)  # no elements
    leading = r - gamma.ndim
    for name, value in (("pd_gamma", g * xhat), ("pd_beta", g)):
        if c.wants(name):
            rows = value.reshape(math.prod(x.shape[:leading]), gamma.numel())
            c.store(name, column_sums(c, rows) if leading else value)


def batch_norm_backward(c: Call, plan: Plan) -> None:
    """ChannelPasses' formulas (ops/batch_norm_backward.py): s multiplies the sums, as aten's does."""
    x = c.a["input"]
    if x.numel() == 0:
        c.fill("gradWeight", 0)
        c.fill("gradBias", 0)
        return
    xt, moved, axis = channels_first(c, "input", plan)
    gt = channels_first(c, "gradOut", plan)[0]
    n_c = moved[1]
    count = x.numel() // n_c
    training = bool(c.a["training"])
    # Eval mode reads the running statistics, whatever saveMean/saveInvstd hold (aten's CUDA kernel
    # for a rank-2 or channels-last input reads save_mean/save_invstd instead when they are non-empty).
    if training:
        mu, s = per_channel(c, "saveMean", n_c, 0.0), per_channel(c, "saveInvstd", n_c, 1.0)
    else:
        var = per_channel(c, "runningVar", n_c, 1.0)
        mu, s = per_channel(c, "runningMean", n_c, 0.0), 1.0 / (var + float(c.a["eps"])).sqrt()
    s64 = s.to(c.torch.float64)
    sums = training and c.wants("gradInput")
    xc = xt - mu.reshape(1, n_c, 1) if sums or c.wants("gradWeight") else None
    sum_g = channel_sums(c, gt) if sums or c.wants("gradBias") else None  # fp64
    sum_gxc = channel_sums(c, gt * xc) if xc is not None else None
    if c.wants("gradInput"):
        scale = (per_channel(c, "weight", n_c, 1.0) * s).reshape(1, n_c, 1)
        if training:
            slope = (sum_gxc * s64 / count * s64).to(c.work).reshape(1, n_c, 1)
            gi = (gt - (sum_g / count).to(c.work).reshape(1, n_c, 1)).addcmul_(xc, slope, value=-1).mul_(scale)
        else:
            gi = gt * scale
        c.store("gradInput", gi.reshape(moved).movedim(1, axis))
    if c.wants("gradWeight"):
        c.store("gradWeight", sum_gxc * s64)
    if c.wants("gradBias"):
        c.store("gradBias", sum_g)


def batch_norm_elemt_backward(c: Call, plan: Plan) -> None:
    x = c.a["input"]
    if x.numel() == 0:
        return
    n_c = x.shape[1]
    bshape = (1, n_c) + (1,) * (x.ndim - 2)
    # The per-channel factors in fp64 (the counts summed exactly), then rounded to the work dtype.
    total = c.a["counter"].to(c.torch.float64).sum()
    invstd = c.f64("invstd").reshape(n_c)
    factor = invstd if c.a.get("weight") is None else invstd * c.f64("weight").reshape(n_c)
    slope = invstd * invstd * c.f64("sumDyXmu").reshape(n_c) / total
    shift = c.f64("sumDy").reshape(n_c) / total
    xc = c.w("input") - c.w("mean").reshape(bshape)
    shifted = (c.w("gradOut") - shift.to(c.work).reshape(bshape)).addcmul_(
        xc, slope.to(c.work).reshape(bshape), value=-1
    )
    c.store("gradInput", shifted.mul_(factor.to(c.work).reshape(bshape)))


def layer_norm(c: Call, plan: Plan) -> None:
    x, norm = c.a["input"], [int(d) for d in c.a["normalizedShape"]]
    m, n = math.prod(x.shape[: x.ndim - len(norm)]), math.prod(norm)
    if m == 0:
        return
    if n == 0:  # CANN: mean 0, rstd NaN
        c.fill("meanOutOptional", 0)
        c.fill("rstdOutOptional", math.nan)
        return
    y, mean, rstd = normalized_rows(c, c.w("input").reshape(m, n), float(c.a["eps"]))
    w, b = (None if t is None else t.reshape(1, n) for t in (c.w("weightOptional"), c.w("biasOptional")))
    c.store("out", scaled(c, y, w, b, c.into("out", (m, n))))
    c.store("meanOutOptional", mean)
    c.store("rstdOutOptional", rstd)


def rms_norm(c: Call, plan: Plan) -> None:
    x, n = c.a["x"], c.a["gamma"].numel()
    m = x.numel() // n
    if m == 0:
        return
    xt, torch = c.w("x").reshape(m, n), c.torch
    # Not linalg.vector_norm: on the CPU its fp32 sum drifts with the row's length (a constant row
    # of 295,632 elements: 2.3e-4 relative, past SPEC 1.5's bound; 6e-3 at 4M); mean's does not.
    squares = xt.square().mean(1, keepdim=True) + float(c.a["epsilon"])
    c.check_squares(squares)
    rstd = squares.rsqrt()
    c.store("yOut", torch.mul(xt * rstd, c.w("gamma").reshape(1, n), out=c.into("yOut", (m, n))))
    c.store("rstdOut", rstd)


def rms_norm_grad(c: Call, plan: Plan) -> None:
    x, n = c.a["x"], c.a["gamma"].numel()
    m = x.numel() // n
    if m == 0:
        c.fill("dgammaOut", 0)
        return
    rstd = c.w("rstd").reshape(m, 1)
    dy, xhat = c.w("dy").reshape(m, n), c.w("x").reshape(m, n) * rstd
    dyg = dy * c.w("gamma").reshape(1, n)
    mean_dyg_xhat = (dyg * xhat).mean(1, keepdim=True)
    c.store("dxOut", dyg.addcmul_(xhat, mean_dyg_xhat, value=-1).mul_(rstd))
    c.store("dgammaOut", column_sums(c, dy * xhat))


def group_norm(c: Call, plan: Plan) -> None:
    if c.a["self"].numel() == 0:  # CANN: mean 0, rstd NaN
        c.fill("meanOut", 0)
        c.fill("rstdOut", math.nan)
        return
    n, n_c, hxw, group = (int(c.a[k]) for k in ("N", "C", "HxW", "group"))
    xhat, mean, rstd = normalized_rows(c, c.w("self").reshape(n, group, -1), float(c.a["eps"]))
    w, b = (None if t is None else t.reshape(1, n_c, 1) for t in (c.w("gamma"), c.w("beta")))
    c.store("out", scaled(c, xhat.reshape(n, n_c, hxw), w, b, c.into("out", (n, n_c, hxw))))
    c.store("meanOut", mean)
    c.store("rstdOut", rstd)


def group_norm_backward(c: Call, plan: Plan) -> None:
    """The reference's formulas (ops/group_norm_backward.py): x̂ per element, sums per (sample, group)."""
    n, n_c, hxw, group = (int(c.a[k]) for k in ("N", "C", "HxW", "group"))
    if n * n_c * hxw == 0:  # no elements: the parameter gradients are empty sums
        c.fill("gradGammaOut", 0)
        c.fill("gradBetaOut", 0)
        return
    g = c.w("gradOut").reshape(n, group, -1)
    rstd = c.w("rstd").reshape(n, group, 1)
    xhat = (c.w("input").reshape(n, group, -1) - c.w("mean").reshape(n, group, 1)).mul_(rstd)
    if c.wants("gradGammaOut"):
        c.store("gradGammaOut", channel_sums(c, (g * xhat).reshape(n, n_c, hxw)))
    if c.wants("gradBetaOut"):
        c.store("gradBetaOut", channel_sums(c, g.reshape(n, n_c, hxw)))
    if c.wants("gradInput"):
        gamma = c.w("gamma")
        gw = g if gamma is None else g.reshape(n, n_c, hxw) * gamma.reshape(1, n_c, 1)
        rows = gw.reshape(n * group, -1)
        c.store("gradInput", input_gradient(c, rows, xhat.reshape(rows.shape), rstd.reshape(n * group, 1)))


def batch_norm_stats(c: Call, plan: Plan) -> None:
    x = c.a["input"]
    if x.numel() == 0:  # CANN: mean 0, invstd NaN
        c.fill("mean", 0)
        c.fill("invstd", math.nan)
        return
    mean, var, _, _ = channel_moments(c, c.w("input").reshape(x.shape[0], x.shape[1], -1))  # channel dim 1
    squares = var + float(c.a["eps"])
    c.check_squares(squares)
    c.store("mean", mean)
    c.store("invstd", 1.0 / squares.sqrt())


def batch_norm_gather_stats(c: Call, plan: Plan) -> None:
    """Small [devices, C] inputs: fp64 throughout, wide or not."""
    if c.a["mean"].numel() == 0:  # no device statistics: meanAll 0, invstdAll NaN, running stats untouched
        c.fill("meanAll", 0)
        c.fill("invstdAll", math.nan)
        return
    eps, momentum = float(c.a["eps"]), float(c.a["momentum"])
    mean, invstd = c.f64("mean"), c.f64("invstd")
    counts = c.f64("counts").reshape(-1, 1)
    n = counts.sum()
    deviation = mean - mean[:1]  # from the first device's means, as the reference (`gather`)
    offset = (counts * deviation).sum(0) / n
    mean_all = mean[0] + offset
    spread = (counts * (invstd.square().reciprocal() + (deviation - offset).square())).sum(0) / n  # var + eps
    var = spread - eps
    c.store("meanAll", mean_all)
    c.store("invstdAll", spread.rsqrt())
    for name, value in (("runningMean", mean_all), ("runningVar", var * n / (n - 1))):  # unbiased variance
        if c.a.get(name) is not None:  # in/out: the input holds the current values
            c.store(name, (1 - momentum) * c.f64(name) + momentum * value)


def batch_norm_elemt(c: Call, plan: Plan) -> None:
    x = c.a["input"]
    if x.numel() == 0:
        return
    n_c = x.shape[1]
    bshape = (1, n_c) + (1,) * (x.ndim - 2)
    # invstd is the factor (eps unused), times the weight first, as the reference's `normalize`
    scale = per_channel(c, "invstd", n_c, 1.0) * per_channel(c, "weight", n_c, 1.0)
    y = (c.w("input") - per_channel(c, "mean", n_c, 0.0).reshape(bshape)).mul_(scale.reshape(bshape))
    c.store("output", y.add_(per_channel(c, "bias", n_c, 0.0).reshape(bshape)))


def batch_norm_reduce_backward(c: Call, plan: Plan) -> None:
    """Disabled outputs are not in `c.outputs`: their sums are not taken."""
    x = c.a["input"]
    if x.numel() == 0:  # CANN: zeros in the enabled outputs
        for name in ("sumDy", "sumDyXmu", "gradWeight", "gradBias"):
            c.fill(name, 0)
        return
    n_l, n_c = x.shape[0], x.shape[1]
    g = c.w("gradOut").reshape(n_l, n_c, -1)
    if c.wants("sumDy") or c.wants("gradBias"):
        sum_dy = channel_sums(c, g)
        c.store("sumDy", sum_dy)
        c.store("gradBias", sum_dy)
    if c.wants("sumDyXmu") or c.wants("gradWeight"):
        xm = c.w("input").reshape(n_l, n_c, -1) - c.w("mean").reshape(1, n_c, 1)
        sum_dy_xmu = channel_sums(c, g * xm)
        c.store("sumDyXmu", sum_dy_xmu)
        c.store("gradWeight", sum_dy_xmu * c.f64("invstd").reshape(n_c))


def batch_norm(c: Call, plan: Plan) -> None:
    """The reference's formulas (ops/batch_norm.py): mean and population variance (channel_moments),
    invstd = 1/√(var + eps) (Inf for a zero variance with eps 0), (x − mean)·(invstd·w) + b; in fp32
    x − mean is (x − μ) − (mean − μ), μ the mean rounded to fp32 (the reference moves mean − μ into the
    bias, which a rounded first mean of large values would cancel against)."""
    x = c.a["input"]
    if x.numel() == 0:  # CANN: saveMean 0 and saveInvstd NaN whenever given, nothing else written
        c.fill("saveMean", 0)
        c.fill("saveInvstd", math.nan)
        return
    torch = c.torch
    axis, training = c.a["channel_axis"], bool(c.a["training"])
    moved = c.w("input").movedim(axis, 1)  # channel-last tags: to channel-first
    n_c = moved.shape[1]
    xt = moved.reshape(moved.shape[0], n_c, -1)
    count = x.numel() // n_c
    if training:
        mean, var, mu, centered = channel_moments(c, xt)
    else:  # CANN's defaults when null: mean 0, variance 1
        mean = per_channel(c, "runningMean", n_c, 0.0).to(torch.float64)
        var = per_channel(c, "runningVar", n_c, 1.0).to(torch.float64)
        mu = mean.to(c.work)
        centered = xt - mu.reshape(1, n_c, 1)
    invstd = 1.0 / (var + float(c.a["eps"])).sqrt()
    scale = (invstd * per_channel(c, "weight", n_c, 1.0)).to(c.work).reshape(1, n_c, 1)
    if not c.wide:  # what rounding took from the mean, from x − μ before scaling (an infinite mean loses nothing)
        centered -= torch.where(torch.isfinite(mean), mean - mu, 0).to(c.work).reshape(1, n_c, 1)
    y = centered.mul_(scale).add_(per_channel(c, "bias", n_c, 0.0).reshape(1, n_c, 1))
    c.store("output", y.reshape(moved.shape).movedim(1, axis))
    if not training:
        return
    if not c.wide:
        c.check_squares(var + float(c.a["eps"]))
    c.store("saveMean", mean)
    c.store("saveInvstd", invstd)
    momentum = float(c.a["momentum"])
    for name, value in (("runningMean", mean), ("runningVar", var * count / (count - 1))):  # unbiased
        if c.a.get(name) is not None:  # in/out: the input holds the current values
            c.store(name, (1 - momentum) * c.f64(name) + momentum * value)


FORMULAS: dict[str, Formula] = {
    "aclnnLayerNormBackward": layer_norm_backward,
    "LayerNormGrad": layer_norm_grad,
    "aclnnBatchNormBackward": batch_norm_backward,
    "aclnnBatchNormElemtBackward": batch_norm_elemt_backward,
    "aclnnLayerNorm": layer_norm,
    "aclnnRmsNorm": rms_norm,
    "aclnnRmsNormGrad": rms_norm_grad,
    "aclnnGroupNorm": group_norm,
    "aclnnGroupNormBackward": group_norm_backward,
    "aclnnBatchNormStats": batch_norm_stats,
    "aclnnBatchNormGatherStatsWithCounts": batch_norm_gather_stats,
    "aclnnBatchNormElemt": batch_norm_elemt,
    "aclnnBatchNormReduceBackward": batch_norm_reduce_backward,
    "aclnnBatchNorm": batch_norm,
}
