"""LayerNorm: `aclnn::layer_norm` (aten's forward) and `aclnn::layer_norm_backward` (aclnnLayerNormBackward)."""

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


def _layer_norm_forward(
    input: Tensor, normalized_shape: list[int], weight: Tensor | None, bias: Tensor | None, eps: float, client: int
) -> tuple[Tensor, Tensor, Tensor]:
    """aten's native_layer_norm: (output, mean, rstd); `client` is for the backward. (torch's own
    binding of the op, not torch.ops.aten's: the same kernel without a Python frame per call.)"""
    return torch.native_layer_norm(input, normalized_shape, weight, bias, eps)


_layer_norm_op = torch.library.custom_op("aclnn::layer_norm", _layer_norm_forward, mutates_args=())
_layer_norm_op.register_fake(_layer_norm_forward)  # aten's kernel has a meta implementation


def _layer_norm_remote(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: list[int],
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    output_mask: list[bool],
    client: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnLayerNormBackward through the client; masked-off gradients come back empty."""
    grad_input, grad_weight, grad_bias = _layer_norm_backward_fake(
        grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask, client
    )
    shape, grad_out_, input_, mean_, rstd_ = list(normalized_shape), grad_out, input, mean, rstd
    weight_, grad_input_, grad_weight_, grad_bias_ = weight, grad_input, grad_weight, grad_bias
    if input.dim() > MAX_RANK:  # the same rows as [M, N] (the outputs are contiguous: views, written in place)
        n = math.prod(shape)
        m = math.prod(input.shape[: input.dim() - len(shape)])
        grad_out_, input_ = grad_out.reshape(m, n), input.reshape(m, n)
        mean_, rstd_ = mean.reshape(m, 1), rstd.reshape(m, 1)
        weight_ = None if weight is None else weight.reshape(n)
        grad_input_ = grad_input.reshape(m, n) if output_mask[0] else grad_input
        grad_weight_, grad_bias_ = grad_weight.reshape(-1), grad_bias.reshape(-1)
        shape = [n]
    client_by_id(client).run(
        "aclnnLayerNormBackward",
        gradOut=grad_out_,
        input=input_,
        normalizedShape=shape,
        mean=mean_,
        rstd=rstd_,
        weightOptional=weight_,
        biasOptional=None,  # not used by the math: no need to ship it
        outputMask=list(output_mask),
        gradInputOut=grad_input_ if output_mask[0] else None,
        gradWeightOut=grad_weight_ if output_mask[1] else None,
        gradBiasOut=grad_bias_ if output_mask[2] else None,
    )
    return grad_input, grad_weight, grad_bias


_layer_norm_backward_op = torch.library.custom_op("aclnn::layer_norm_backward", _layer_norm_remote, mutates_args=())


@_layer_norm_backward_op.register_fake
def _layer_norm_backward_fake(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask, client):
    params_dtype = weight.dtype if weight is not None else input.dtype
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format) if output_mask[0] else empty_gradient(input),
        gradient_buffer(normalized_shape, params_dtype, input.device) if output_mask[1] else empty_gradient(input),
        gradient_buffer(normalized_shape, bias.dtype if bias is not None else params_dtype, input.device)
        if output_mask[2]
        else empty_gradient(input),
    )


def _layer_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    input, normalized_shape, weight, bias, eps, client = inputs
    _out, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.normalized_shape, ctx.eps, ctx.client = normalized_shape, eps, client
    ctx.keep_alive = live_client(client)  # until the backward: a client made just for the call


def _layer_norm_backward(remote: Callable[..., tuple]) -> Callable[..., tuple]:
    """The backward, calling `remote` (the custom op, or in eager mode the function itself)."""

    def backward(ctx: Any, grad_out: Tensor, _grad_mean: Tensor, _grad_rstd: Tensor) -> tuple:
        input, weight, bias, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[2], need[3]]
        if not any(mask):
            return None, None, None, None, None, None
        if torch.is_grad_enabled():  # create_graph: the gradient is differentiated again (see local.py)
            forward = lambda x, w, b: F.layer_norm(x, ctx.normalized_shape, w, b, ctx.eps)  # noqa: E731
            gi, gw, gb = differentiable_gradients(forward, (input, weight, bias), mask, grad_out)
        else:
            gi, gw, gb = remote(grad_out, input, ctx.normalized_shape, mean, rstd, weight, bias, mask, ctx.client)
        return gi if mask[0] else None, None, gw if mask[1] else None, gb if mask[2] else None, None, None

    return backward


_layer_norm_op.register_autograd(_layer_norm_backward(_layer_norm_backward_op), setup_context=_layer_norm_setup)
_layer_norm_eager = eager_function(
    "LayerNormFunction", _layer_norm_forward, _layer_norm_setup, _layer_norm_backward(_layer_norm_remote)
)


def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int] | int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    client: BaseClient,
) -> Tensor:
    """`torch.nn.functional.layer_norm` whose backward runs aclnnLayerNormBackward through `client`
    (PyTorch's own, with a NotServedWarning, for a dtype the service lacks: see local.py)."""
    dtype = unserved_dtype(input, weight, bias)
    if dtype is not None:
        warn_not_served("aclnn_client.torch.layer_norm", dtype)
        shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
        return F.layer_norm(input, shape, weight, bias, eps)
    return layer_norm_with_id(input, normalized_shape, weight, bias, eps, client_id(client))


def layer_norm_with_id(
    input: Tensor,
    normalized_shape: Sequence[int] | int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    cid: int,
) -> Tensor:
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if transformed():
        return F.layer_norm(input, shape, weight, bias, eps)
    return (_layer_norm_op if compiling() else _layer_norm_eager)(input, shape, weight, bias, eps, cid)[0]
