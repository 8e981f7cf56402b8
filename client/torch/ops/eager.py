"""The custom ops' eager twins: outside torch.compile an offloaded layer runs as a plain
autograd.Function with the same forward, saved context and backward, whose backward calls the
remote function itself. Through the dispatcher a custom op pair costs ~0.3 ms of Python per layer
(forward and backward), several times aten's own LayerNorm on a small batch; torch.compile keeps
tracing the custom ops (one opaque node per remote call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad


def eager_function(
    name: str, forward: Callable[..., Any], setup_context: Callable[..., None], backward: Callable[..., tuple]
) -> Callable[..., Any]:
    """`apply` of an autograd.Function made of a custom op's parts; its backward runs as the custom
    op's does (with create_graph, grad mode on: the backward then differentiates PyTorch's formula).
    The forward takes `ctx` itself: a Function with a separate setup_context binds its arguments with
    inspect.signature on every call."""

    def forward_with_context(ctx: Any, *args: Any) -> Any:
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    function = type(
        name,
        (torch.autograd.Function,),
        {
            "__module__": __name__,
            "forward": staticmethod(forward_with_context),
            "backward": staticmethod(backward),
        },
    )
    return function.apply


def compiling() -> bool:
    """Whether torch.compile (or export) is tracing: then the custom ops, else their eager twins."""
    return torch.compiler.is_compiling()


def transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, jacrev, functionalize) or forward-mode AD is
    active: the offloaded Function has no batching rule and no jvp, and the service's results carry
    neither, so the layer then runs PyTorch's own implementation, forward and backward (as a
    gradient differentiated again runs PyTorch's formula: local.py). Never true while compiling
    (which traces the custom ops; the check is not traced)."""
    return not compiling() and (torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0)
