"""The fp64 repeat: a call whose fp32 intermediates left fp32's range is computed again in fp64.

A backend's compute (the reference's blocks, a cpu kernel) reports that fp32 could not hold an
intermediate (`ops.rows.out_of_range`, `squares_out_of_range`, a kernel's non-finite flag); the
call is then computed again on the NumPy reference with fp64 blocks (`ops.rows.wide`). fp64 holds
the square of any fp32 value: finite inputs give the true result rounded once, and inputs holding
±Inf/NaN give what IEEE arithmetic gives on the reference's formulas, the same on every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..ops.rows import wide
from ..registry import Operator, Plan


def compute_in_range(operator: Operator, plan: Plan, args: dict[str, Any], compute: Callable[[], bool | None]) -> None:
    """Runs `compute`; when it returns True, restores the in/out tensors (running statistics) and
    runs the operator's reference in fp64. NaN and Inf are results, not errors (SPEC 1.5): NumPy's
    warnings about them are silenced."""
    in_range(operator, plan, lambda _: compute())(args)


def in_range(
    operator: Operator, plan: Plan, compute: Callable[[dict[str, Any]], bool | None]
) -> Callable[[dict[str, Any]], None]:
    """`compute_in_range` for one plan, its in/out tensors found once (a prepared call's)."""
    inout = tuple(plan.outputs.keys() & plan.inputs.keys())

    def run(args: dict[str, Any]) -> None:
        before = [(name, args[name].copy()) for name in inout]
        with np.errstate(all="ignore"):
            if not compute(args):
                return
            for name, values in before:
                args[name][...] = values
            with wide():
                operator.compute(**args)

    return run
