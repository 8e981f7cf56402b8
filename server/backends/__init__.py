"""Compute backends. Each runs every registered operator on validated inputs.

`numpy` is the reference (each operator module's own `compute`); further backends
register here under the names INTERFACE.md gives them.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..registry import Operator, Plan


class Backend(Protocol):
    name: str

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        """Scratch bytes `compute` will use for this plan beyond its outputs."""

    def compute(self, operator: Operator, plan: Plan, args: dict[str, Any]) -> None:
        """Fills the enabled output arrays in `args` (named as the operator's parameters)."""


class NumpyBackend:
    """The reference: each operator module's vectorized NumPy computation."""

    name = "numpy"

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        return operator.workspace_size(plan)

    def compute(self, operator: Operator, plan: Plan, args: dict[str, Any]) -> None:
        operator.compute(**args)


BACKENDS = ("numpy", "auto")


def create_backend(name: str) -> Backend:
    """The backend called `name`; `auto` picks the fastest one available here."""
    if name in ("numpy", "auto"):
        return NumpyBackend()
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
