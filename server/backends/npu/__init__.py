"""The Ascend NPU backend: CANN's aclnn operators through a ctypes binding (acl.py)."""

from .backend import CachingAllocator, NpuBackend

__all__ = ["CachingAllocator", "NpuBackend"]
