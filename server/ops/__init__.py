"""The operator registry: each module defines one operator; this table names them."""

from __future__ import annotations

from ..registry import Operator
from . import (
    batch_norm,
    batch_norm_backward,
    batch_norm_elemt,
    batch_norm_elemt_backward,
    batch_norm_gather_stats_with_counts,
    batch_norm_reduce_backward,
    batch_norm_stats,
    group_norm,
    group_norm_backward,
    layer_norm,
    layer_norm_backward,
    layer_norm_grad,
    rms_norm,
    rms_norm_grad,
)

OPERATORS: dict[str, Operator] = {
    module.OPERATOR.name: module.OPERATOR
    for module in (
        layer_norm_backward,
        layer_norm_grad,
        batch_norm_backward,
        batch_norm_elemt_backward,
        layer_norm,
        rms_norm,
        rms_norm_grad,
        group_norm,
        group_norm_backward,
        batch_norm_stats,
        batch_norm_gather_stats_with_counts,
        batch_norm_elemt,
        batch_norm_reduce_backward,
        batch_norm,
    )
}
