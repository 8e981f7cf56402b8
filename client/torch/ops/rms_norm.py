"""RMSNorm: `aclnn::rms_norm` (aten's forward) and `aclnn::rms_norm_backward` (aclnnRmsNormGrad)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from aclnn_common.api import BaseClient

from ..clients import client_by_id, client_id, live_client
from ..gradients import MAX_RANK, empty_gradient, gradient_buffer
from ..local import differentiable_gradients, unserved_dtype, warn_not_served
from .eager import compiling, eager_function, transformed


def _rms_norm_forward(
    input: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float | None, client: int
) -> tuple[Tensor, Tensor]:
    """aten's _fused_rms_norm: (output, rstd), rstd in FLOAT with the normalized dims kept as 1, as
    aclnnRmsNormGrad takes it; `client` is for the backward."""
    return torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)


_rms_norm_op = torch.library.custom_op("aclnn::rms_norm", _rms_norm_forward, mutates_args=())
_rms_norm_op.register_fake(_rms_norm_forward)  # aten's kernel has a meta implementation


def _rms_norm_remote(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: list[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: list[bool],
    client: int,
) -> tuple[Tensor, Tensor]:
    """aclnnRmsNormGrad through the client. The operator has no output mask and needs a gamma: it
    always writes both gradients (an unwanted one comes back empty), with ones for a missing weight,
    gamma in dy's dtype or FLOAT (a weight in another is widened: PyTorch takes any float weight),
    and dgamma in FLOAT (cast to weight's dtype). Rows of no elements (which the operator refuses)
    have gradients of no elements: nothing to compute."""
    grad_input, grad_weight = _rms_norm_backward_fake(
        grad_out, input, normalized_shape, rstd, weight, output_mask, client
    )
    if not math.prod(normalized_shape):
        return grad_input, grad_weight
    dx = grad_input if output_mask[0] else torch.empty_like(input, memory_format=torch.contiguous_format)
    dgamma = grad_weight if output_mask[1] and grad_weight.dtype == torch.float32 else None
    if dgamma is None:
        dgamma = gradient_buffer(normalized_shape, torch.float32, input.device)
    if weight is None:
        gamma = torch.ones(normalized_shape, dtype=input.dtype, device=input.device)
    else:
        gamma = weight if weight.dtype in (grad_out.dtype, torch.float32) else weight.float()
    dy, x, rstd_, gamma_, dx_, dgamma_ = grad_out, input, rstd, gamma, dx, dgamma
    if input.dim() > MAX_RANK:  # the same rows as [M, N] (dx and dgamma are contiguous: views, written in place)
        n = math.prod(normalized_shape)
        m = input.numel() // n
        dy, x, dx_ = grad_out.reshape(m, n), input.reshape(m, n), dx.view(m, n)
        rstd_, gamma_, dgamma_ = rstd.reshape(m, 1), gamma.reshape(n), dgamma.view(n)
    client_by_id(client).run("aclnnRmsNormGrad", dy=dy, x=x, rstd=rstd_, gamma=gamma_, dxOut=dx_, dgammaOut=dgamma_)
    if output_mask[1] and dgamma is not grad_weight:
        grad_weight.copy_(dgamma)
    return grad_input, grad_weight


_rms_norm_backward_op = torch.library.custom_op("aclnn::rms_norm_backward", _rms_norm_remote, mutates_args=())


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(grad_out, input, normalized_shape, rstd, weight, output_mask, client):
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format) if output_mask[0] else empty_gradient(input),
        gradient_buffer(normalized_shape, weight.dtype, input.device) if output_mask[1] else empty_gradient(input),
    )


def _rms_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    input, normalized_shape, weight, eps, client = inputs
    ctx.mark_non_differentiable(output[1])
    if input.is_inference():  # PyTorch's RMSNorm trains on an inference-mode input too: keep a normal copy
        input = input.clone()
    ctx.save_for_backward(input, weight, output[1])
    ctx.normalized_shape, ctx.eps, ctx.client = normalized_shape, eps, client
    ctx.keep_alive = live_client(client)


def _rms_norm_backward(remote: Callable[..., tuple]) -> Callable[..., tuple]:
    """The backward, calling `remote` (the custom op, or in eager mode the function itself)."""

    def backward(ctx: Any, grad_out: Tensor, _grad_rstd: Tensor) -> tuple:
        input, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
        if not any(mask):
            return (None,) * 5
        if torch.is_grad_enabled():  # create_graph: the gradient is differentiated again (see local.py)
            forward = lambda x, w: F.rms_norm(x, ctx.normalized_shape, w, ctx.eps)  # noqa: E731
            gi, gw = differentiable_gradients(forward, (input, weight), mask, grad_out)
        else:
            gi, gw = remote(grad_out, input, ctx.normalized_shape, rstd, weight, mask, ctx.client)
        return gi if mask[0] else None, None, gw if mask[1] else None, None, None

    return backward


_rms_norm_op.register_autograd(_rms_norm_backward(_rms_norm_backward_op), setup_context=_rms_norm_setup)
_rms_norm_eager = eager_function(
    "RmsNormFunction", _rms_norm_forward, _rms_norm_setup, _rms_norm_backward(_rms_norm_remote)
)


def rms_norm(
    input: Tensor,
    normalized_shape: Sequence[int] | int,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    client: BaseClient,
) -> Tensor:
    """`torch.nn.functional.rms_norm` whose backward runs aclnnRmsNormGrad through `client`
    (PyTorch's own, with a NotServedWarning, for a dtype the service lacks: see local.py)."""
    dtype = unserved_dtype(input, weight)
    if dtype is not None:
        warn_not_served("aclnn_client.torch.rms_norm", dtype)
        shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
        return F.rms_norm(input, shape, weight, eps)
    return rms_norm_with_id(input, normalized_shape, weight, eps, client_id(client))


def rms_norm_with_id(
    input: Tensor, normalized_shape: Sequence[int] | int, weight: Tensor | None, eps: float | None, cid: int
) -> Tensor:
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    _check_rms_norm_inputs(input, shape, weight)
    if transformed():
        return F.rms_norm(input, shape, weight, eps)
    return (_rms_norm_op if compiling() else _rms_norm_eager)(input, shape, weight, eps, cid)[0]


def _check_rms_norm_inputs(input: Tensor, shape: list[int], weight: Tensor | None) -> None:
    """torch.rms_norm's checks, with its messages (aten's _fused_rms_norm, the forward here, makes none)."""
    if not shape:
        raise RuntimeError(
            "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, "
            f"but got normalized_shape = {shape}"
        )
    if weight is not None and list(weight.shape) != shape:
        raise RuntimeError(
            "Expected weight to be of same shape as normalized_shape, but got weight of shape "
            f"{list(weight.shape)} and normalized_shape = {shape}"
        )
    if input.dim() < len(shape) or list(input.shape[input.dim() - len(shape) :]) != shape:
        expected = ", ".join(str(d) for d in shape)
        raise RuntimeError(
            f"Given normalized_shape={shape}, expected input with shape [*{expected}], "
            f"but got input of size{list(input.shape)}"
        )
