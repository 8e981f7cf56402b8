"""GroupNorm: `aclnn::group_norm` (aten's forward) and `aclnn::group_norm_backward` (aclnnGroupNormBackward)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._prims_common import suggest_memory_format  # aten's Tensor::suggest_memory_format

from aclnn_common.api import BaseClient

from ..clients import client_by_id, client_id, live_client
from ..gradients import MAX_RANK, copy_back, empty_gradient, gradient_buffer, staged
from ..local import differentiable_gradients, unserved_dtype, warn_not_served
from .eager import compiling, eager_function, transformed


def _group_sizes(input: Tensor) -> tuple[int, int, int]:
    """(N, C, HxW) of an [N, C, *] input, as aten's and aclnn's GroupNorm take them."""
    return input.shape[0], input.shape[1], math.prod(input.shape[2:])


def _group_norm_forward(
    input: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float, client: int
) -> tuple[Tensor, Tensor, Tensor]:
    """aten's native_group_norm: (output, mean, rstd), the statistics `[N, group]`; `client` is for the backward."""
    return torch.ops.aten.native_group_norm(input, weight, bias, *_group_sizes(input), num_groups, eps)


_group_norm_op = torch.library.custom_op("aclnn::group_norm", _group_norm_forward, mutates_args=())
_group_norm_op.register_fake(_group_norm_forward)  # aten's kernel has a meta implementation


def _group_norm_remote(
    grad_out: Tensor,
    input: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    num_groups: int,
    output_mask: list[bool],
    client: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnGroupNormBackward through the client; masked-off gradients come back empty.

    The service wants mean, rstd, gamma and the parameter gradients in one dtype, gradOut's or FLOAT:
    aten's (mean's) unless weight has another, then FLOAT, with the gradients cast to weight's dtype.
    """
    grad_input, grad_weight, grad_bias = _group_norm_backward_fake(
        grad_out, input, mean, rstd, weight, num_groups, output_mask, client
    )
    stats = mean.dtype if weight is None or weight.dtype == mean.dtype else torch.float32
    gamma = None if weight is None else weight.to(stats)
    remote = staged((grad_weight, grad_bias), (stats,), stats)
    n, c, hxw = _group_sizes(input)
    grad_out_, input_, grad_input_ = grad_out, input, grad_input
    if input.dim() > MAX_RANK:  # the same groups as [N, C, HxW] (gradInput is contiguous: a view, written in place)
        grad_out_, input_ = grad_out.reshape(n, c, hxw), input.reshape(n, c, hxw)
        grad_input_ = grad_input.view(n, c, hxw) if output_mask[0] else grad_input
    client_by_id(client).run(
        "aclnnGroupNormBackward",
        gradOut=grad_out_,
        input=input_,
        mean=mean.to(stats),
        rstd=rstd.to(stats),
        gamma=gamma,
        N=n,
        C=c,
        HxW=hxw,
        group=num_groups,
        outputMask=list(output_mask),
        gradInput=grad_input_ if output_mask[0] else None,
        gradGammaOut=remote[0] if output_mask[1] else None,
        gradBetaOut=remote[1] if output_mask[2] else None,
    )
    copy_back((grad_weight, grad_bias), remote)
    return grad_input, grad_weight, grad_bias


_group_norm_backward_op = torch.library.custom_op("aclnn::group_norm_backward", _group_norm_remote, mutates_args=())


@_group_norm_backward_op.register_fake
def _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask, client):
    c = input.shape[1]
    params_dtype = weight.dtype if weight is not None else mean.dtype
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format) if output_mask[0] else empty_gradient(input),
        gradient_buffer([c], params_dtype, input.device) if output_mask[1] else empty_gradient(input),
        gradient_buffer([c], params_dtype, input.device) if output_mask[2] else empty_gradient(input),
    )


def _group_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    input, num_groups, weight, bias, eps, client = inputs
    _out, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.num_groups, ctx.eps, ctx.client = num_groups, eps, client
    ctx.keep_alive = live_client(client)


def _group_norm_backward(remote: Callable[..., tuple]) -> Callable[..., tuple]:
    """The backward, calling `remote` (the custom op, or in eager mode the function itself)."""

    def backward(ctx: Any, grad_out: Tensor, _grad_mean: Tensor, _grad_rstd: Tensor) -> tuple:
        input, weight, bias, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[2], need[3]]
        if not any(mask):
            return (None,) * 6
        if torch.is_grad_enabled():  # create_graph: the gradient is differentiated again (see local.py)
            forward = lambda x, w, b: F.group_norm(x, ctx.num_groups, w, b, ctx.eps)  # noqa: E731
            gi, gw, gb = differentiable_gradients(forward, (input, weight, bias), mask, grad_out)
        else:
            gi, gw, gb = remote(grad_out, input, mean, rstd, weight, ctx.num_groups, mask, ctx.client)
        return gi if mask[0] else None, None, gw if mask[1] else None, gb if mask[2] else None, None, None

    return backward


_group_norm_op.register_autograd(_group_norm_backward(_group_norm_backward_op), setup_context=_group_norm_setup)
_group_norm_eager = eager_function(
    "GroupNormFunction", _group_norm_forward, _group_norm_setup, _group_norm_backward(_group_norm_remote)
)


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    client: BaseClient,
) -> Tensor:
    """`torch.nn.functional.group_norm` whose backward runs aclnnGroupNormBackward through `client`
    (PyTorch's own, with a NotServedWarning, for a dtype the service lacks: see local.py)."""
    dtype = unserved_dtype(input, weight, bias)
    if dtype is not None:
        warn_not_served("aclnn_client.torch.group_norm", dtype)
        return F.group_norm(input, num_groups, weight, bias, eps)
    return group_norm_with_id(input, num_groups, weight, bias, eps, client_id(client))


def group_norm_with_id(
    input: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float, cid: int
) -> Tensor:
    # F.group_norm's own checks, with its messages (aten checks the rest)
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    size = [input.shape[0] * input.shape[1] // num_groups, num_groups, *input.shape[2:]]
    if size[0] * math.prod(size[2:]) == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
    if transformed():
        return F.group_norm(input, num_groups, weight, bias, eps)
    # aten's group_norm makes the input contiguous before native_group_norm, which needs it: in its
    # suggested memory format on the CPU (channels_last stays so, and so does the output), else NCHW
    # (and while tracing, whose shapes and strides are tensors that suggest_memory_format cannot read)
    cpu = input.device.type in ("cpu", "xpu") and not torch.jit.is_tracing()
    layout = suggest_memory_format(input) if cpu else torch.contiguous_format
    return (_group_norm_op if compiling() else _group_norm_eager)(
        input.contiguous(memory_format=layout), num_groups, weight, bias, eps, cid
    )[0]
