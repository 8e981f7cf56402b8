"""SyncBatchNorm on the service: statistics, normalization and backward remote, the cross-process
reductions here through torch.distributed (gloo on CPU processes included)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from aclnn_common.api import BaseClient

from .clients import client_by_id


class SyncBatchNormFunction(torch.autograd.Function):
    """torch.nn.modules._functions.SyncBatchNorm with every computation on the service:
    aclnnBatchNormStats, aclnnBatchNormGatherStatsWithCounts (which also updates the running
    statistics in place), aclnnBatchNormElemt; backward aclnnBatchNormReduceBackward (see
    `_reduce_backward`) and aclnnBatchNormElemtBackward. Only the collectives run here, through torch.distributed (any
    backend, gloo on CPU included: all_gather of the per-process statistics, all_reduce of sumDy
    and sumDyXmu). Statistics travel in FLOAT, as aclnnBatchNormStats writes them."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        process_group: Any,
        world_size: int,
        cid: int,
    ) -> Tensor:
        client = client_by_id(cid)
        c = input.shape[1]
        count = input.numel() // c
        combined = torch.zeros(2 * c + 1, dtype=torch.float32)
        if count:
            mean, invstd = combined[:c], combined[c : 2 * c]
            client.run("aclnnBatchNormStats", input=input, eps=eps, mean=mean, invstd=invstd)
            combined[2 * c] = count
        # all_gather, not all_reduce: the counts may differ between processes. A process with an
        # empty batch takes part with a zero count, which is then left out.
        gathered = [torch.empty_like(combined) for _ in range(world_size)]
        dist.all_gather(gathered, combined, process_group)
        stats = torch.stack(gathered)
        stats = stats[stats[:, 2 * c] >= 1]
        mean, invstd = torch.empty(c), torch.empty(c)
        client.run(
            "aclnnBatchNormGatherStatsWithCounts",
            input=input[:0],  # read for its dtype and channel count only: no need to ship the batch
            mean=stats[:, :c],
            invstd=stats[:, c : 2 * c],
            runningMean=running_mean,
            runningVar=running_var,
            momentum=momentum,
            eps=eps,
            counts=stats[:, 2 * c],
            meanAll=mean,
            invstdAll=invstd,
        )
        ctx.save_for_backward(input, weight, mean, invstd, stats[:, 2 * c].to(torch.int32))
        ctx.process_group, ctx.cid, ctx.keep_alive = process_group, cid, client
        out = torch.empty_like(input)
        if count:
            client.run(
                "aclnnBatchNormElemt",
                input=input,
                weight=weight,
                bias=bias,
                mean=mean,
                invstd=invstd,
                eps=eps,
                output=out,
            )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        if torch.is_grad_enabled():  # create_graph: refused now rather than at the second backward
            raise RuntimeError(
                "a SyncBatchNorm offloaded by offload_norms cannot be differentiated twice (create_graph=True), "
                "like PyTorch's own SyncBatchNorm: use BatchNorm layers where gradients are differentiated again"
            )
        input, weight, mean, invstd, counts = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        c = input.shape[1]
        grad_input = grad_weight = grad_bias = None
        sums = torch.zeros(2 * c, dtype=torch.float32)
        if input.numel():
            grad_weight, grad_bias = _reduce_backward(
                client_by_id(ctx.cid), grad_out, input, mean, invstd, weight, need_input, need_weight, need_bias, sums
            )
        if need_input:  # every process takes part, an empty one with zeros
            dist.all_reduce(sums, dist.ReduceOp.SUM, ctx.process_group)
            if input.numel():
                grad_input = torch.empty_like(input)
                client_by_id(ctx.cid).run(
                    "aclnnBatchNormElemtBackward",
                    gradOut=grad_out,
                    input=input,
                    mean=mean,
                    invstd=invstd,
                    weight=weight,
                    sumDy=sums[:c],
                    sumDyXmu=sums[c:],
                    counter=counts,
                    gradInput=grad_input,
                )
        # The parameter gradients stay per process: distributed training all-reduces them.
        return grad_input, grad_weight, grad_bias, *(None,) * 7


def _reduce_backward(
    client: BaseClient,
    grad_out: Tensor,
    input: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
    sums: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    """SyncBatchNorm's reduce step, aclnnBatchNormReduceBackward with the global statistics: per-channel
    sumDy = Σdy and sumDyXmu = Σdy·(x − mean) straight into `sums` (when the input needs a gradient),
    and the parameter gradients gradWeight = sumDyXmu·invstd and gradBias = Σdy (those needed), in
    FLOAT and then the parameters' dtype. Each flag asks only for what autograd needs."""
    if not (need_input or need_weight or need_bias):
        return None, None
    c = input.shape[1]
    grad_weight = torch.empty(c) if need_weight else None
    grad_bias = torch.empty(c) if need_bias else None
    client.run(
        "aclnnBatchNormReduceBackward",
        gradOut=grad_out,
        input=input,
        mean=mean,
        invstd=invstd,
        weight=None,  # CANN's code never reads it: no need to ship it
        inputG=need_input,
        weightG=need_weight,
        biasG=need_bias,
        sumDy=sums[:c] if need_input else None,
        sumDyXmu=sums[c:] if need_input else None,
        gradWeight=grad_weight,
        gradBias=grad_bias,
    )
    params_dtype = weight.dtype if weight is not None else torch.float32
    return (
        None if grad_weight is None else grad_weight.to(params_dtype),
        None if grad_bias is None else grad_bias.to(params_dtype),
    )
