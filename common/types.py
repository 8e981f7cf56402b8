"""CANN's enums (aclDataType, aclFormat), their NumPy dtypes, and torch tensors as NumPy views."""

from __future__ import annotations

import enum
import sys
from typing import Any

import ml_dtypes
import numpy as np


class DataType(enum.IntEnum):
    """aclDataType: values are CANN's."""

    FLOAT = 0
    FLOAT16 = 1
    INT8 = 2
    INT32 = 3
    UINT8 = 4
    INT16 = 6
    UINT16 = 7
    UINT32 = 8
    INT64 = 9
    UINT64 = 10
    DOUBLE = 11
    BOOL = 12
    COMPLEX64 = 16
    COMPLEX128 = 17
    BF16 = 27


class Format(enum.IntEnum):
    """aclFormat: values are CANN's."""

    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47


# NPU-internal tiled layouts: a tag this service never interprets.
PRIVATE_FORMATS = frozenset(
    {
        Format.NC1HWC0,
        Format.FRACTAL_Z,
        Format.NC1HWC0_C04,
        Format.FRACTAL_NZ,
        Format.NDC1HWC0,
        Format.FRACTAL_Z_3D,
    }
)

NUMPY_DTYPES: dict[DataType, np.dtype] = {
    DataType.FLOAT: np.dtype(np.float32),
    DataType.FLOAT16: np.dtype(np.float16),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT32: np.dtype(np.int32),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT16: np.dtype(np.int16),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.INT64: np.dtype(np.int64),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.DOUBLE: np.dtype(np.float64),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.COMPLEX64: np.dtype(np.complex64),
    DataType.COMPLEX128: np.dtype(np.complex128),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
}

_DATA_TYPES_BY_DTYPE = {dtype: data_type for data_type, dtype in NUMPY_DTYPES.items()}
# Keyed by plain int too: this lookup is on every call's hot path, an Enum construction is not cheap.
_NUMPY_DTYPES_BY_VALUE = {int(data_type): dtype for data_type, dtype in NUMPY_DTYPES.items()}


def numpy_dtype(data_type: int) -> np.dtype | None:
    """The NumPy dtype of an aclDataType value, or None for an unknown value."""
    return _NUMPY_DTYPES_BY_VALUE.get(data_type) if type(data_type) is not bool else None


def data_type_of(dtype: np.dtype) -> DataType:
    """The aclDataType of a NumPy dtype; raises TypeError for one CANN lacks."""
    try:
        return _DATA_TYPES_BY_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"NumPy dtype {np.dtype(dtype)} has no aclDataType") from None


def torch_array(obj: Any) -> np.ndarray | None:
    """A NumPy view sharing the storage of a CPU torch tensor (same strides; bf16 as ml_dtypes'), or
    None when `obj` is no torch tensor. Raises TypeError for a tensor NumPy cannot see in place.

    torch is never imported here: a tensor can only exist once the caller has imported it.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    try:  # asking `is_cpu` first would cost a small call as much as the view itself
        if obj.dtype == torch.bfloat16 and obj.is_cpu:
            return obj.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return (obj.detach() if obj.requires_grad else obj).numpy()
    except (TypeError, RuntimeError) as exc:  # not on the CPU, unsupported dtypes, sparse, conjugate or negative bits
        if not obj.is_cpu:
            raise TypeError(f"a torch tensor must be on the CPU, this one is on {obj.device}") from None
        raise TypeError(f"torch tensor {obj.dtype}{list(obj.shape)} has no NumPy view: {exc}") from None
