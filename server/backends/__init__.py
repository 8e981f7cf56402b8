"""Compute backends. Each runs every registered operator on validated inputs.

`numpy` is the reference (each operator module's own `compute`); `cpu` (Numba kernels),
`torch` (aten ops on a torch device) and `npu` (CANN through ctypes) compute the same
operators; `auto` picks the best one present.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from ..registry import Operator, Plan
from .widening import compute_in_range


class Backend(Protocol):
    """What every backend has. The engine also uses, when a backend has them: `supports(op)`;
    `device_memory()` (its DeviceMemory for device buffers, server/buffers.py);
    `compute_resident(operator, plan, {name: (block, byte offset)}, stream)` (a call whose tensors
    all live in its device memory, computed there); `synchronize(stream)` (waits for what it
    launched without waiting); `launches_resident` (compute_resident on a client stream returns
    once its work is queued on a device stream, which orders it: the engine then launches such a
    call on its caller's thread); `plans_on_device` (workspace_size asks the device library, for
    every call: the engine never keeps its answer); `end_session(owner, session)`; `accepts_stream` (compute takes
    `stream=`); and `prepare(operator, plan)` (`compute` of that plan as a function of its args,
    with what depends on the plan alone done once: see Engine.prepare; a backend without it runs
    every call in full). `stream` is the client stream's key (identity, session, stream id), or
    None for a call without one; synchronize's id is None for every stream of the session."""

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
        compute_in_range(operator, plan, args, lambda: operator.compute(**args))

    def prepare(self, operator: Operator, plan: Plan) -> Callable[[dict[str, Any]], None]:
        return functools.partial(self.compute, operator, plan)


BACKENDS = ("auto", "numpy", "cpu", "torch", "npu")


def create_backend(name: str, *, device: int = 0, torch_device: str = "cpu") -> Backend:
    """The backend called `name`; `auto` picks the best available: the NPU, else the fastest CPU one.

    Heavy imports (Numba, torch, CANN) happen only for the backend asked for.
    """
    if name == "auto":
        npu = npu_if_present(device)
        if npu is not None:
            return npu
        name = fastest_cpu_backend()
    if name == "numpy":
        return NumpyBackend()
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend()
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(torch_device)
    if name == "npu":
        from .npu import NpuBackend

        return NpuBackend(device)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def npu_if_present(device: int) -> Backend | None:
    """The NPU backend when CANN and a device are here, else None."""
    from .npu import NpuBackend

    try:
        return NpuBackend(device)
    except RuntimeError:
        return None  # no CANN or no device here


def fastest_cpu_backend() -> str:
    """`cpu` when Numba (the server extra's) is installed, else `numpy`."""
    try:
        import numba  # noqa: F401  (the cpu backend's one extra dependency)
    except ImportError:
        return "numpy"
    return "cpu"
