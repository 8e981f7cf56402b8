"""What stays in PyTorch, here, and why.

- **Dtypes the service does not compute.** Its norms take float32, float16 and bfloat16. A layer or
  call with a float64 (or other) tensor runs PyTorch's own implementation, forward and backward,
  with a `NotServedWarning` naming it: what a PyTorch user expects of `model.double()` is that it
  keeps working, in full precision, rather than failing at `loss.backward()`.
- **Gradients that are differentiated again** (`create_graph=True`: gradient penalties, double
  backward). The service's results carry no autograd graph, so under `create_graph` an offloaded
  norm's gradient is computed by PyTorch's own differentiable formula here instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

SERVED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NotServedWarning(UserWarning):
    """A layer or call runs in PyTorch here, not on the service: one of its tensors has a dtype the
    service does not compute."""


def unserved_dtype(*tensors: Tensor | None) -> torch.dtype | None:
    """The first floating-point or complex dtype among `tensors` that the service does not compute, or None."""
    for t in tensors:
        if t is not None and (t.is_floating_point() or t.is_complex()) and t.dtype not in SERVED_DTYPES:
            return t.dtype
    return None


def warn_not_served(what: str, dtype: torch.dtype, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{what} runs in PyTorch here, forward and backward: {str(dtype).removeprefix('torch.')} is not served "
        "(the service computes float32, float16 and bfloat16)",
        NotServedWarning,
        stacklevel=stacklevel,
    )


def differentiable_gradients(
    forward: Callable[..., Tensor], inputs: Sequence[Tensor | None], mask: Sequence[bool], grad_out: Tensor
) -> list[Tensor | None]:
    """The gradients of `forward(*inputs)` for the inputs `mask` selects, by PyTorch's own formula with
    their own graph (`create_graph`), so that they can be differentiated again; None for the others.

    `forward` is the layer's PyTorch function (F.layer_norm, ...), computed again from the saved inputs.
    """
    wanted = [t for t, needed in zip(inputs, mask) if needed]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(forward(*inputs), wanted, grad_out, create_graph=True))
    return [next(grads) if needed else None for needed in mask]
