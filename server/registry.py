"""The operator registry: one module per operator, registered by its aclnn name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .descriptors import TensorDesc
from .params import CallParams, Signature


@dataclass(frozen=True)
class Plan:
    """A validated call: what GetWorkspaceSize hands to Execute."""

    inputs: dict[str, TensorDesc]  # the non-null input tensors
    outputs: dict[str, TensorDesc]  # the outputs to compute (mask true)
    values: dict[str, Any] = field(default_factory=dict)  # arrays and scalars, defaults applied


@dataclass(frozen=True)
class Operator:
    """An operator: its signature, its error table, and its NumPy reference computation.

    `compute` takes the operator's parameters by their CANN names: input tensors as
    read-only NumPy views (None when null), enabled outputs as arrays to fill (None
    when masked off), arrays and scalars as validated. It returns True when an fp32
    intermediate left fp32's range (`ops.rows.out_of_range`): the backend then runs it again
    in fp64 (`backends.widening`). `workspace_size` is the scratch, in bytes, that
    `compute` allocates beyond its outputs (in fp64 the blocks hold half the elements).
    """

    name: str
    signature: Signature
    validate: Callable[[CallParams], Plan]
    workspace_size: Callable[[Plan], int]
    compute: Callable[..., bool]
    notes: str = ""


def plan_from(p: CallParams, inputs: list[str], outputs: list[str], **values: Any) -> Plan:
    """The plan of a validated call: the named inputs that are present, and the outputs."""
    return Plan(
        inputs={n: p.tensors[n] for n in inputs if n in p.tensors},
        outputs={n: p.tensors[n] for n in outputs},
        values=values,
    )
