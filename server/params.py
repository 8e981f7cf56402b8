"""Operator signatures, and the checked access to a call's parameters that validation uses.

An operator module declares its parameters once (`Signature`); the framework then
rejects unknown names and bad descriptors before the operator's own error table runs,
and the operator reads its parameters through `CallParams`, whose methods raise
CANN's status codes naming the parameter.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aclnn_common.errors import invalid_error, null_error
from aclnn_common.tensor import BoolArray, IntArray, Value
from aclnn_common.types import PRIVATE_FORMATS, DataType

from .descriptors import TensorDesc, validate_tensor

FLOAT_TYPES = frozenset({DataType.FLOAT, DataType.FLOAT16, DataType.BF16})


class Kind(enum.StrEnum):
    TENSOR = "tensor"
    INT_ARRAY = "int_array"
    BOOL_ARRAY = "bool_array"
    BOOL = "bool"
    INT = "int"  # int64_t
    DOUBLE = "double"


@dataclass(frozen=True)
class ParamSpec:
    name: str
    kind: Kind
    output: bool = False
    optional: bool = False
    mask_index: int | None = None  # the outputMask entry that enables this output
    # The bool scalar that enables this output, for operators with one flag per output group instead of an
    # outputMask (aclnnBatchNormReduceBackward's inputG/weightG/biasG). Off: as if masked off.
    enabled_by: str | None = None
    # An input the call updates in place (CANN's running statistics): validated as an input, also
    # written as an output; clients ship its values and write the new ones back into the caller's array.
    inout: bool = False


def tensor(name: str, *, optional: bool = False) -> ParamSpec:
    return ParamSpec(name, Kind.TENSOR, optional=optional)


def inout(name: str) -> ParamSpec:
    """An optional tensor the call reads and then updates in place."""
    return ParamSpec(name, Kind.TENSOR, optional=True, inout=True)


def output(name: str, mask_index: int | None = None, *, enabled_by: str | None = None) -> ParamSpec:
    return ParamSpec(name, Kind.TENSOR, output=True, mask_index=mask_index, enabled_by=enabled_by)


def int_array(name: str) -> ParamSpec:
    return ParamSpec(name, Kind.INT_ARRAY)


def bool_array(name: str, *, optional: bool = False) -> ParamSpec:
    return ParamSpec(name, Kind.BOOL_ARRAY, optional=optional)


def scalar(name: str, kind: Kind) -> ParamSpec:
    return ParamSpec(name, kind)


@dataclass(frozen=True)
class Signature:
    """An operator's parameters in CANN's order; `mask` names the output mask, if any."""

    params: tuple[ParamSpec, ...]
    mask: str | None = None
    default_mask: tuple[bool, ...] | None = None  # when the mask is optional and null
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(p.name for p in self.params))

    def spec(self, name: str) -> ParamSpec:
        return next(p for p in self.params if p.name == name)

    def mask_if_wellformed(self, values: Mapping[str, Value]) -> tuple[bool, ...] | None:
        """The output mask when it can be read before validation, else None."""
        if self.mask is None:
            return None
        mask = values.get(self.mask)
        if mask is None:
            return self.default_mask
        if isinstance(mask, BoolArray) and len(mask) == 3:
            return tuple(mask)
        return None

    def enabled(self, spec: ParamSpec, values: Mapping[str, Value], mask: tuple[bool, ...] | None) -> bool:
        """False for an output its `mask` entry or its flag turns off, or whose gate is not well formed
        (a null flag or one of another kind: the operator's null and kind checks report it first)."""
        if spec.mask_index is not None and (mask is None or not mask[spec.mask_index]):
            return False
        return spec.enabled_by is None or values.get(spec.enabled_by) is True

    def checked_tensors(self, values: Mapping[str, Value]) -> dict[str, TensorDesc]:
        """Descriptor checks of every non-null tensor, before any operator rule (SPEC 1.4).

        A masked-off output (or one whose flag is false) is ignored entirely; when the mask or
        flag itself is malformed the outputs it gates are left to the operator, whose rule fails first.
        """
        mask = self.mask_if_wellformed(values)
        tensors = {}
        for spec in self.params:
            value = values.get(spec.name)
            if spec.kind is not Kind.TENSOR or value is None:
                continue
            if not self.enabled(spec, values, mask):
                continue
            tensors[spec.name] = validate_tensor(spec.name, value, spec.output or spec.inout)
        return tensors


_KIND_TYPES = {
    Kind.INT_ARRAY: (IntArray,),
    Kind.BOOL_ARRAY: (BoolArray,),
    Kind.BOOL: (bool,),
    Kind.INT: (int,),
    Kind.DOUBLE: (float, int),
}


class CallParams:
    """One call's parameters, read the way an operator's error table reads them."""

    def __init__(self, signature: Signature, values: Mapping[str, Value], tensors: dict[str, TensorDesc]) -> None:
        self.signature = signature
        self.values = values
        self.tensors = tensors

    def is_null(self, name: str) -> bool:
        return self.values.get(name) is None

    def require(self, *names: str) -> None:
        """161001 for the first null among `names`; then every given non-tensor value's type."""
        for name in names:
            if self.is_null(name):
                raise null_error(name)
        for spec in self.signature.params:
            value = self.values.get(spec.name)
            if spec.kind is Kind.TENSOR or value is None:
                continue
            if not _is_kind(value, spec.kind):
                raise invalid_error(spec.name, f"expected {spec.kind.value}, got {type(value).__name__} {value!r:.60}")

    def array(self, name: str) -> tuple:
        value = self.values.get(name)
        return tuple(value) if value is not None else ()

    def scalar(self, name: str) -> Any:
        return self.values.get(name)

    def tensor(self, name: str) -> TensorDesc | None:
        return self.tensors.get(name)

    def present(self, names: Iterable[str]) -> list[TensorDesc]:
        """The non-null tensors among `names`, in that order."""
        return [self.tensors[n] for n in names if n in self.tensors]

    def require_outputs(self, mask: tuple[bool, ...] | None = None) -> list[str]:
        """161001 for the first enabled output that is null (gated by the validated `mask`, or by its
        flag, already checked to be a bool); returns the enabled outputs."""
        enabled = [p for p in self.signature.params if p.output and self.signature.enabled(p, self.values, mask)]
        for p in enabled:
            if self.is_null(p.name):
                gate = f"{p.enabled_by} is" if p.enabled_by else "its outputMask entry is"
                raise null_error(p.name, f" when {gate} true")
        return [p.name for p in enabled]


def _is_kind(value: Value, kind: Kind) -> bool:
    if kind in (Kind.INT_ARRAY, Kind.BOOL_ARRAY) and isinstance(value, (IntArray, BoolArray)) and not value:
        return True  # an empty array has no element type
    if kind in (Kind.DOUBLE, Kind.INT) and isinstance(value, bool):
        return False
    return isinstance(value, _KIND_TYPES[kind])


def check(condition: bool, name: str, message: str) -> None:
    """161002 naming `name` unless `condition` holds."""
    if not condition:
        raise invalid_error(name, message)


def check_float_dtypes(tensors: Iterable[TensorDesc], allowed: frozenset[DataType] = FLOAT_TYPES) -> None:
    for t in tensors:
        check(t.data_type in allowed, t.name, f"data type {t.data_type.name} is not one of {_names(allowed)}")


def check_plain_formats(tensors: Iterable[TensorDesc]) -> None:
    for t in tensors:
        check(t.format not in PRIVATE_FORMATS, t.name, f"private format {t.format.name} is not supported")


def check_same_dtype(t: TensorDesc | None, ref: TensorDesc) -> None:
    if t is not None:
        check(
            t.data_type == ref.data_type,
            t.name,
            f"data type {t.data_type.name} must equal {ref.name}'s {ref.data_type.name}",
        )


def check_shape(t: TensorDesc | None, shape: tuple[int, ...], what: str) -> None:
    if t is not None:
        check(t.shape == tuple(shape), t.name, f"shape {list(t.shape)} must equal {what} {list(shape)}")


def _names(types: Iterable[DataType]) -> str:
    return "/".join(sorted(t.name for t in types))
