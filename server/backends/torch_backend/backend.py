"""TorchBackend: the operators on a torch device (cpu, cuda:N or npu:N), on host arrays and on device memory.

A call on host arrays (`compute`) runs on its client stream's CUDA stream: the inputs go up as
raw bytes and are converted there (transfer.py), the formula runs in fp32 (formulas.py), and when
fp32 could not hold the call (a flag read back: one small synchronization) it is repeated in fp64
on the same device tensors (on the cpu for a device without fp64); the results are cast to their
dtypes on the device and copied back into the output arrays once all of them were computed.

A call on device memory (`compute_resident`) runs the formula on views of the buffers' tensors and
copies its results into the output views, on the client stream's CUDA stream, with no host round
trip and no synchronization: it returns once launched, and `synchronize` waits for it and raises
what failed. Without a client stream it waits (as CANN's default stream) and so gets the fp64
repeat too; a queued call has none, since deciding it would synchronize every call: where fp32
cannot hold a call's squares, or its inputs hold Inf/NaN, a queued call gives fp32's IEEE results
(as an NPU's own kernels do) rather than the reference's fp64 ones.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...registry import Operator, Plan
from ...streams import StreamKey
from .formulas import FORMULAS, Call, Formula
from .memory import TorchBlock, TorchMemory
from .streams import DeviceStreams
from .transfer import download, torch_dtype, upload


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("the torch backend needs PyTorch: pip install torch (and torch_npu for npu:N)") from exc
    return torch


class TorchBackend:
    """The operators on a torch device; workspace is what the computation allocates beyond its outputs."""

    name = "torch"
    accepts_stream = True  # compute(..., stream=<client stream key>) runs on that stream's CUDA stream

    def __init__(self, device: str = "cpu") -> None:
        torch = self.torch = _import_torch()
        if str(device).startswith("npu"):
            try:
                import torch_npu  # noqa: F401  (registers the npu device with torch)
            except ImportError as exc:
                raise RuntimeError(f"torch device {device!r} needs torch_npu, which does not import") from exc
        try:
            self.device = torch.device(device)
            torch.empty(1, device=self.device)
        except (RuntimeError, AssertionError) as exc:
            raise RuntimeError(f"torch device {device!r} is not usable: {exc}") from exc
        # The fp64 repeat runs where fp64 is: on cpu and cuda the device itself (NPUs mostly lack it).
        self.wide_device = self.device if self.device.type in ("cpu", "cuda") else torch.device("cpu")
        self.streams = DeviceStreams(torch, self.device)
        self._memory: TorchMemory | None = None

    # ------------------------------------------------------------------ Backend protocol

    def supports(self, op: str) -> bool:
        return op in FORMULAS

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        """The inputs' bytes on the device and fp32 or fp64 temporaries (a bound, not an exact count)."""
        numel = sum(t.numel for t in plan.inputs.values()) + sum(t.numel for t in plan.outputs.values())
        return 8 * 3 * numel

    def compute(self, operator: Operator, plan: Plan, args: dict[str, Any], stream: StreamKey | None = None) -> None:
        formula = FORMULAS.get(operator.name)
        if formula is None:  # an operator this backend does not know: the reference
            operator.compute(**args)
            return
        torch = self.torch
        outputs = {name: args[name] for name in plan.outputs if args.get(name) is not None}
        with torch.no_grad(), self.streams.running(stream):
            tensors = upload(torch, self.device, {n: args[n] for n in plan.inputs if args.get(n) is not None})
            values = {name: v for name, v in args.items() if not isinstance(v, np.ndarray)} | tensors
            call = self._computed(formula, plan, values, {name: out.shape for name, out in outputs.items()})
            results = call.results.items()
            if not call.wide:
                cast = [(outputs[n], v.reshape(outputs[n].shape).to(_dtype(torch, outputs[n]))) for n, v in results]
                download(torch, cast)  # rounded to each output's dtype on the device
                return
            wide = {name: np.empty(outputs[name].shape, np.float64) for name in call.results}
            download(torch, [(wide[n], v.reshape(wide[n].shape).to(torch.float64)) for n, v in results])
        with np.errstate(over="ignore", invalid="ignore"):  # rounded once from fp64; beyond range ±Inf
            for name, value in wide.items():
                outputs[name][...] = value.astype(outputs[name].dtype)

    def compute_resident(
        self, operator: Operator, plan: Plan, resident: dict[str, tuple[TorchBlock, int]], stream: StreamKey | None
    ) -> None:
        """A call whose tensors all live in device buffers ((block, byte offset) each), computed on views
        of them (see the module docstring)."""
        torch, memory = self.torch, self._memory
        blocks = list({id(block): block for block, _ in resident.values()}.values())
        views = {
            name: _view(torch, block, offset, plan.outputs.get(name) or plan.inputs[name])
            for name, (block, offset) in resident.items()
        }
        with torch.no_grad(), self.streams.running(stream) as cuda_stream:
            if stream is None and cuda_stream is not None:
                memory.after_launches(blocks, cuda_stream)
            values = dict(plan.values) | {name: views[name] for name in plan.inputs}
            shapes = {name: desc.shape for name, desc in plan.outputs.items()}
            into = _destinations(torch, plan, resident, views)
            if stream is None:
                call = self._computed(FORMULAS[operator.name], plan, values, shapes, into)
            else:  # queued: no flag read back (see the module docstring)
                call = Call(torch, values, shapes, wide=False, destinations=into)
                FORMULAS[operator.name](call, plan)
            for name, value in call.results.items():  # after every result is computed: outputs may alias inputs
                if name not in into or value.data_ptr() != views[name].data_ptr():
                    views[name].copy_(value.reshape(views[name].shape))
            if cuda_stream is None:
                return
            if stream is None:
                self.streams.wait(cuda_stream)
            else:
                memory.launched(blocks, cuda_stream)

    @property
    def launches_resident(self) -> bool:
        """compute_resident on a client stream launches on its CUDA stream and returns (not on the cpu device)."""
        return self.streams.cuda

    def device_memory(self) -> TorchMemory:
        """Device buffers as uint8 tensors on the device (memory.py)."""
        if self._memory is None:
            self._memory = TorchMemory(self.torch, self.device, self.streams)
        return self._memory

    def synchronize(self, stream: StreamKey) -> None:
        """Waits for the calls launched on a client stream (every stream of its session when its id is None)."""
        self.streams.synchronize(stream)

    def end_session(self, owner: str | None, session: str) -> None:
        self.streams.end_session(owner, session)

    def close(self) -> None:
        """Nothing to release (torch owns its caches)."""

    # ------------------------------------------------------------------ helpers

    def _computed(
        self, formula: Formula, plan: Plan, values: dict[str, Any], shapes: dict[str, Any], into: Any = None
    ) -> Call:
        """The call computed in fp32, or, when fp32 could not hold it, in fp64 on `wide_device`."""
        torch = self.torch
        call = Call(torch, values, shapes, wide=False, destinations=into)
        formula(call, plan)
        checksum = call.checksum()
        if checksum is None or math.isfinite(float(checksum)):  # one value read back
            return call
        wide = {name: v.to(self.wide_device) if isinstance(v, torch.Tensor) else v for name, v in values.items()}
        call = Call(torch, wide, shapes, wide=True)
        formula(call, plan)
        return call


def _dtype(torch: Any, out: np.ndarray) -> Any:
    return torch_dtype(torch, out.dtype)


def _destinations(
    torch: Any, plan: Plan, resident: dict[str, tuple[TorchBlock, int]], views: dict[str, Any]
) -> dict[str, Any]:
    """Outputs a formula may write its last step into: fp32, contiguous, no input, and no byte shared
    with an input's storage (so that writing them early changes nothing the call still reads)."""
    spans = [(resident[n][0], resident[n][1], resident[n][1] + d.storage_nbytes) for n, d in plan.inputs.items()]
    found = {}
    for name, desc in plan.outputs.items():
        view = views[name]
        if name in plan.inputs or view.dtype != torch.float32 or not view.is_contiguous():
            continue
        block, start = resident[name]
        end = start + desc.storage_nbytes
        if not any(b is block and start < e and s < end for b, s, e in spans):
            found[name] = view
    return found


def _view(torch: Any, block: TorchBlock, offset: int, desc: Any) -> Any:
    """A descriptor's view of a device buffer's tensor, its storage starting `offset` bytes in."""
    dtype = torch_dtype(torch, desc.dtype)
    if desc.numel == 0:
        return torch.empty(desc.shape, dtype=dtype, device=block.tensor.device)
    strides = tuple(s if d > 1 else 0 for d, s in zip(desc.shape, desc.strides))  # size-1 dims address nothing
    itemsize = desc.dtype.itemsize  # `offset` is a multiple of it (ResidentStorage.check_fits)
    typed = block.as_dtype(dtype, itemsize)  # one strided view of a cached typed view: the call's hot path
    return typed.as_strided(desc.shape, strides, typed.storage_offset() + offset // itemsize + desc.offset)
