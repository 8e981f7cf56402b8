"""BatchNorm: `aclnn::batch_norm` (aten's forward) and `aclnn::batch_norm_backward` (aclnnBatchNormBackward)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from aclnn_common.api import BaseClient

from ..clients import client_by_id, client_id, live_client
from ..gradients import MAX_RANK, copy_back, empty_gradient, gradient_buffer, staged
from ..local import differentiable_gradients, unserved_dtype, warn_not_served
from .eager import compiling, eager_function, transformed


def _batch_norm_forward(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    client: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """aten's batch norm: (output, save_mean, save_invstd, new running_mean, new running_var).

    Functional (a custom op with autograd cannot mutate its inputs): the caller copies the new
    running statistics into its buffers; they are aten's own update, bit for bit. They come back
    empty when there is nothing to update (inference, or no running statistics).
    """
    if not training:
        out, save_mean, save_invstd = torch.ops.aten._native_batch_norm_legit_no_training(
            input, weight, bias, running_mean, running_var, momentum, eps
        )
        return out, save_mean, save_invstd, empty_gradient(input), empty_gradient(input)
    if running_mean is None or running_var is None:
        out, save_mean, save_invstd = torch.ops.aten._native_batch_norm_legit.no_stats(
            input, weight, bias, True, momentum, eps
        )
        return out, save_mean, save_invstd, empty_gradient(input), empty_gradient(input)
    return torch.ops.aten._native_batch_norm_legit_functional(
        input, weight, bias, running_mean, running_var, True, momentum, eps
    )


_batch_norm_op = torch.library.custom_op("aclnn::batch_norm", _batch_norm_forward, mutates_args=())
_batch_norm_op.register_fake(_batch_norm_forward)  # aten's kernels have meta implementations


def _batch_norm_remote(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    save_mean: Tensor,
    save_invstd: Tensor,
    training: bool,
    eps: float,
    output_mask: list[bool],
    client: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnBatchNormBackward through the client; masked-off gradients come back empty."""
    grad_input, grad_weight, grad_bias = _batch_norm_backward_fake(
        grad_out,
        input,
        weight,
        bias,
        running_mean,
        running_var,
        save_mean,
        save_invstd,
        training,
        eps,
        output_mask,
        client,
    )
    # The service writes gradWeight/gradBias in weight's dtype (gradOut's without a weight) or FLOAT.
    allowed = (weight.dtype if weight is not None else grad_out.dtype, torch.float32)
    remote = staged((grad_weight, grad_bias), allowed, torch.float32)
    grad_out_, input_, grad_input_ = grad_out, input, grad_input
    if input.dim() > MAX_RANK:  # the same channels as [N, C, L] (gradInput is contiguous: a view, written in place)
        grad_out_, input_ = grad_out.flatten(2), input.flatten(2)
        grad_input_ = grad_input.view(*grad_input.shape[:2], -1) if output_mask[0] else grad_input
    client_by_id(client).run(
        "aclnnBatchNormBackward",
        gradOut=grad_out_,
        input=input_,
        weight=weight,
        runningMean=None if training else running_mean,
        runningVar=None if training else running_var,
        saveMean=save_mean if training else None,
        saveInvstd=save_invstd if training else None,
        training=training,
        eps=eps,
        outputMask=list(output_mask),
        gradInput=grad_input_ if output_mask[0] else None,
        gradWeight=remote[0] if output_mask[1] else None,
        gradBias=remote[1] if output_mask[2] else None,
    )
    copy_back((grad_weight, grad_bias), remote)
    return grad_input, grad_weight, grad_bias


_batch_norm_backward_op = torch.library.custom_op("aclnn::batch_norm_backward", _batch_norm_remote, mutates_args=())


@_batch_norm_backward_op.register_fake
def _batch_norm_backward_fake(
    grad_out,
    input,
    weight,
    bias,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    training,
    eps,
    output_mask,
    client,
):
    c = input.shape[1]
    weight_dtype = weight.dtype if weight is not None else input.dtype
    bias_dtype = bias.dtype if bias is not None else weight_dtype
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format) if output_mask[0] else empty_gradient(input),
        gradient_buffer([c], weight_dtype, input.device) if output_mask[1] else empty_gradient(input),
        gradient_buffer([c], bias_dtype, input.device) if output_mask[2] else empty_gradient(input),
    )


def _batch_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    input, weight, bias, running_mean, running_var, training, _momentum, eps, client = inputs
    _out, save_mean, save_invstd, new_mean, new_var = output
    ctx.mark_non_differentiable(save_mean, save_invstd, new_mean, new_var)
    if training:  # the running statistics change after this (in place): training's backward does not read them
        running_mean = running_var = None
    ctx.save_for_backward(input, weight, bias, running_mean, running_var, save_mean, save_invstd)
    ctx.training, ctx.eps, ctx.client = training, eps, client
    ctx.keep_alive = live_client(client)


def _batch_norm_backward(remote: Callable[..., tuple]) -> Callable[..., tuple]:
    """The backward, calling `remote` (the custom op, or in eager mode the function itself)."""

    def backward(ctx: Any, grad_out: Tensor, *_grad_stats: Tensor) -> tuple:
        input, weight, bias, running_mean, running_var, save_mean, save_invstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[1], need[2]]
        if not any(mask):
            return (None,) * 9
        if torch.is_grad_enabled():  # create_graph: the gradient is differentiated again (see local.py)
            training, eps = ctx.training, ctx.eps
            forward = lambda x, w, b: F.batch_norm(x, running_mean, running_var, w, b, training, 0.0, eps)  # noqa: E731
            gi, gw, gb = differentiable_gradients(forward, (input, weight, bias), mask, grad_out)
            return gi, gw, gb, *(None,) * 6
        gi, gw, gb = remote(
            grad_out,
            input,
            weight,
            bias,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            ctx.training,
            ctx.eps,
            mask,
            ctx.client,
        )
        return gi if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, *(None,) * 6

    return backward


_batch_norm_op.register_autograd(_batch_norm_backward(_batch_norm_backward_op), setup_context=_batch_norm_setup)
_batch_norm_eager = eager_function(
    "BatchNormFunction", _batch_norm_forward, _batch_norm_setup, _batch_norm_backward(_batch_norm_remote)
)


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    client: BaseClient,
) -> Tensor:
    """`torch.nn.functional.batch_norm` whose backward runs aclnnBatchNormBackward through `client`.

    In training, the running statistics (when given) are updated in place as PyTorch does. A dtype
    the service lacks runs PyTorch's own, with a NotServedWarning (see local.py).
    """
    dtype = unserved_dtype(input, running_mean, running_var, weight, bias)
    if dtype is not None:
        warn_not_served("aclnn_client.torch.batch_norm", dtype)
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if momentum is None:
        raise TypeError("momentum=None (a cumulative average) needs num_batches_tracked: offload the nn.BatchNorm")
    return batch_norm_with_id(
        input, running_mean, running_var, weight, bias, training, momentum, eps, client_id(client)
    )


def _check_per_channel(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
) -> None:
    """aten's batch_norm checks, in its order and with its messages: every per-channel tensor holds C
    elements (the kernels this module calls skip them, and would read or write past the end)."""
    channels = input.shape[1] if input.dim() > 1 else 0
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if t is None:
            if not training and name.startswith("running"):
                raise RuntimeError(f"{name} must be defined in evaluation mode")
        elif t.numel() != channels:
            raise RuntimeError(f"{name} should contain {channels} elements not {t.numel()}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither be None")


def batch_norm_with_id(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    cid: int,
) -> Tensor:
    # F.batch_norm's own checks, with its messages
    if training:
        per_channel = input.shape[0] * math.prod(input.shape[2:])
        if per_channel == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")
        if eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    elif eps < 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    if input.numel() and not transformed():  # aten's checks, before its kernels read C elements of each
        _check_per_channel(input, running_mean, running_var, weight, bias, training)
    if input.numel() == 0 or transformed():
        # Nothing to normalize (aten's batch_norm answers input·weight[0] + bias[0], empty but on the
        # autograd graph, running statistics untouched: no backward to send anywhere), or a transform
        # the service's results cannot carry (eager.transformed): PyTorch's own.
        return torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    out, _, _, new_mean, new_var = (_batch_norm_op if compiling() else _batch_norm_eager)(
        input, weight, bias, running_mean, running_var, training, float(momentum), eps, cid
    )
    if training and running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
    return out
