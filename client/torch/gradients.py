"""Gradient buffers of the custom ops: placeholders for gradients nobody asked for, and staging for
gradients in a dtype the service does not write."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def empty_gradient(like: Tensor) -> Tensor:
    """What a custom op returns for a gradient nobody asked for (ops cannot return None)."""
    return like.new_empty(0)


def gradient_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(list(shape), dtype=dtype, device=device)


def staged(grads: tuple[Tensor, ...], accepted: tuple[torch.dtype, ...], staging: torch.dtype) -> list[Tensor]:
    """Each gradient itself when the service writes its dtype, else a `staging` scratch (see `_copy_back`)."""
    return [g if g.dtype in accepted else torch.empty_like(g, dtype=staging) for g in grads]


def copy_back(targets: tuple[Tensor, ...], staged: list[Tensor]) -> None:
    """Casts what the service wrote into scratch tensors back into the gradients they stand for."""
    for target, result in zip(targets, staged):
        if result is not target:
            target.copy_(result)


# The most dims the service takes in a tensor (CANN's limit); PyTorch's norms take any number.
MAX_RANK = 8
