"""The torch backend: the operators as torch ops on cpu, cuda:N or npu:N (`npu:N` needs torch_npu).

backend.py holds TorchBackend (host arrays and device memory), formulas.py the operators' formulas
on tensors (fused.py and triton_kernels.py: LayerNorm backward's fused kernels on CUDA), transfer.py
the bytes between host and device, streams.py client streams on CUDA streams, memory.py device
buffers as tensors. torch is imported lazily: it is a test-only
dependency, and constructing a TorchBackend without it raises a RuntimeError saying so.
"""

from .backend import TorchBackend

__all__ = ["TorchBackend"]
