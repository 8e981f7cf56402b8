"""Binds a call's Python arguments to parameter values, and writes results back.

Shared by the gRPC Client and the in-process LocalClient: one place decides how a
NumPy array, a list or a scalar becomes an aclnn parameter, and how a result lands
in the caller's preallocated output. A CPU torch tensor is taken as the NumPy view of
its own storage, so everything after binding (transports included) sees only NumPy.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chunks import copy_bytes
from .device import DeviceBuffer
from .errors import AclnnError, Status, invalid_error
from .tensor import BoolArray, IntArray, Tensor, Value, tensor_from_array
from .types import numpy_dtype, torch_array

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what CANN's integer parameters hold


def to_value(name: str, arg: Any, storage: bool = True) -> Value:
    """The parameter value for one Python argument (None is a null pointer); with `storage` False an
    array or a Tensor becomes its descriptor alone."""
    if arg is None or isinstance(arg, str):
        return arg
    if isinstance(arg, Tensor):  # device storage is a pointer, not bytes: it always travels
        for value in (*arg.view_dims, *arg.strides, arg.offset, *arg.storage_dims):  # aclCreateTensor's int64_t
            _int64(name, value)
        return arg if storage or arg.data is None or isinstance(arg.data, DeviceBuffer) else arg.without_data()
    if isinstance(arg, np.ndarray):
        try:
            return tensor_from_array(arg, storage)
        except TypeError as exc:
            raise invalid_error(name, str(exc)) from None
    if isinstance(arg, (bool, np.bool_)):
        return bool(arg)
    if isinstance(arg, (int, np.integer)):
        return _int64(name, int(arg))
    if isinstance(arg, (float, np.floating)):
        return float(arg)
    if isinstance(arg, (list, tuple)):
        if arg and all(isinstance(v, (bool, np.bool_)) for v in arg):
            return BoolArray(bool(v) for v in arg)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in arg):
            return IntArray(_int64(name, int(v)) for v in arg)
    raise invalid_error(name, f"cannot be sent as an aclnn parameter: {type(arg).__name__} {arg!r:.80}")


def _int64(name: str, value: int) -> int:
    """An integer as CANN takes it (int64_t, aclIntArray's elements); a larger one is refused here,
    in process and remote alike, rather than by the wire's encoder."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise invalid_error(name, f"integer {value} is outside the int64 range")
    return value


@dataclass
class BoundCall:
    """One operator call: its parameter values, and where its outputs go."""

    op: str
    values: dict[str, Value]  # every parameter; tensors carry their storage
    output_targets: dict[str, Any]  # output name -> the caller's ndarray or Tensor (host memory only)
    inout: frozenset[str] = frozenset()  # outputs that are also inputs (updated in place): their bytes ship

    def descriptors(self) -> dict[str, Value]:
        """The values without host storage: what validation needs (device storage stays: the plan
        binds it, as CANN's executor binds device addresses)."""
        return {
            n: v.without_data() if isinstance(v, Tensor) and not _on_device(v) else v for n, v in self.values.items()
        }

    def inputs(self) -> dict[str, Tensor]:
        """Input tensors with host storage, read from the caller's arrays now."""
        return {
            n: v
            for n, v in self.values.items()
            if isinstance(v, Tensor) and not _on_device(v) and (n not in self.output_targets or n in self.inout)
        }

    def device_buffers(self) -> list[DeviceBuffer]:
        """The device pointers the call's tensors name."""
        return [v.data for v in self.values.values() if isinstance(v, Tensor) and _on_device(v)]

    def write_outputs(self, results: Mapping[str, np.ndarray]) -> None:
        """Writes each result into its output's view; checks every target before writing any.

        Every result is in hand (downloads were received first: see Staging.results), so nothing
        here can fail midway; a result that is the view itself (see `destinations`) is in place.
        """
        # In the order the call passed its outputs, whatever order the results came in (a reply's map
        # has none): outputs sharing memory end as the last one passed wrote them, on every path.
        order = [name for name in self.output_targets if name in results] + [
            n for n in results if n not in self.output_targets
        ]
        views = {name: _output_view(name, self.output_targets.get(name), results[name]) for name in order}
        for name, view in views.items():
            result = results[name]
            if _same_elements(view, result):
                continue  # computed in place
            elif view.flags.c_contiguous and result.flags.c_contiguous:
                copy_bytes(view.reshape(-1).view(np.uint8), result.reshape(-1).view(np.uint8))
            else:
                view[...] = result

    def destinations(self) -> dict[str, np.ndarray]:
        """The caller's output arrays, for an in-process backend to compute straight into; empty
        unless every output can take that: writeable, C-contiguous and aligned (what a backend
        allocates itself), sharing no memory with an input or another output. All or none, so
        that a call whose last output is refused has written nothing to the others."""
        views: dict[str, np.ndarray] = {}
        for name, target in self.output_targets.items():
            try:
                view = target if isinstance(target, np.ndarray) else _storage_view(name, target)
            except AclnnError:
                return {}
            if not (view.flags.writeable and view.flags.c_contiguous and view.flags.aligned):
                return {}
            views[name] = view
        # An in/out tensor's input is its own destination (the engine reads it there before computing):
        # it is checked against the other outputs as a view, not against itself as an input.
        inputs = [t.data for n, t in self.inputs().items() if n not in self.inout and isinstance(t.data, np.ndarray)]
        return views if disjoint(views, inputs) else {}


def disjoint(views: Mapping[str, np.ndarray], inputs: list[np.ndarray]) -> bool:
    """Whether no output view shares memory with an input or with another output view."""
    for name, view in views.items():
        others = [v for n, v in views.items() if n != name]
        if any(np.may_share_memory(view, other) for other in inputs + others):
            return False
    return True


def bind(
    op: str, params: Mapping[str, Any], output_names: frozenset[str], inout_names: frozenset[str] = frozenset()
) -> BoundCall:
    """`inout_names`: tensors the operator reads and updates in place (also among the results)."""
    if "torch" in sys.modules:  # torch tensors exist only once the caller imported torch
        params = {name: _host_array(name, arg) for name, arg in params.items()}
    # Outputs never ship bytes: the server allocates results and they come back here.
    outputs = output_names - inout_names
    values = {name: to_value(name, arg, name not in outputs) for name, arg in params.items()}
    written = output_names | inout_names
    targets = {  # in the call's order (write_outputs keeps it)
        n: arg
        for n, arg in params.items()
        if n in written and isinstance(arg, np.ndarray | Tensor) and not _on_device(values[n])
    }
    return BoundCall(op, values, targets, inout_names & targets.keys())


def _on_device(value: Value) -> bool:
    """Whether a value is a tensor whose storage lives in device memory on the server."""
    return isinstance(value, Tensor) and isinstance(value.data, DeviceBuffer)


def _host_array(name: str, arg: Any) -> Any:
    """A torch tensor as the NumPy view of its storage (also as a create_tensor's data); else `arg`.

    Results written to the view land in the tensor itself: outputs are filled in place.
    """
    try:
        array = torch_array(arg)
        if array is not None:
            return array
        if isinstance(arg, Tensor):
            data = torch_array(arg.data)
            if data is not None:
                return dataclasses.replace(arg, data=data)
    except TypeError as exc:
        raise invalid_error(name, str(exc)) from None
    return arg


def _same_elements(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides


def _output_view(name: str, target: Any, result: Any) -> np.ndarray:
    """The caller's elements a result is written to, after checking they fit it."""
    if isinstance(target, np.ndarray):
        view = target
    elif isinstance(target, Tensor):
        view = _storage_view(name, target)
    else:
        raise AclnnError(Status.INNER, f"server returned an output {name!r} that was not requested", name)
    if view.shape != result.shape or view.dtype != result.dtype:
        raise AclnnError(
            Status.INNER,
            f"{name}: result {result.dtype}{list(result.shape)} does not match {view.dtype}{list(view.shape)}",
            name,
        )
    if not view.flags.writeable:
        raise invalid_error(name, "output array is read-only")
    return view


def _storage_view(name: str, tensor: Tensor) -> np.ndarray:
    """The view a create_tensor output describes, over its NumPy storage array."""
    data = tensor.data
    dtype = numpy_dtype(tensor.data_type)
    if not isinstance(data, np.ndarray) or not data.flags.c_contiguous or dtype is None:
        raise invalid_error(name, "an output's data must be a C-contiguous NumPy array")
    storage = data.reshape(-1).view(np.uint8)
    # Size-1 dims address nothing; zeroing their strides keeps byte strides in range.
    strides = [s * dtype.itemsize if d > 1 else 0 for d, s in zip(tensor.view_dims, tensor.strides)]
    try:
        return np.ndarray(
            tensor.view_dims, dtype, buffer=storage, offset=tensor.offset * dtype.itemsize, strides=strides
        )
    except (ValueError, TypeError, OverflowError) as exc:  # an offset or stride past what NumPy takes
        raise invalid_error(name, f"output view does not fit its storage array: {exc}") from None


def array_layout(op: str, params: Mapping[str, Any]) -> tuple[Hashable, dict[str, np.ndarray]] | None:
    """What binding and validation read of a call's arguments (a key: calls of one layout bind alike),
    and its arrays (torch tensors as their NumPy views); None for a call outside the repeated-layout
    fast paths (LocalClient, Client with shared memory): non-contiguous arrays, descriptors, others."""
    arrays: dict[str, np.ndarray] = {}
    key: list[Hashable] = [op]
    for name, arg in params.items():
        kind = type(arg)
        if kind in _PLAIN:  # a float by its bits (0.0 and -0.0 are different calls)
            key.append((name, kind, arg.hex() if kind is float else arg))
        elif kind is list or kind is tuple:
            kinds = tuple(map(type, arg))
            if not _PLAIN.issuperset(kinds):
                return None
            values = tuple(v.hex() if type(v) is float else v for v in arg) if float in kinds else tuple(arg)
            key.append((name, kind, kinds, values))
        else:
            try:
                array = arg if kind is np.ndarray else torch_array(arg)
            except TypeError:
                return None
            if array is None:
                return None
            flags = array.flags
            if not flags.c_contiguous:
                return None
            arrays[name] = array
            key.append((name, array.dtype, array.shape, array.strides, flags.writeable, flags.aligned))
    return tuple(key), arrays


_PLAIN = frozenset({type(None), bool, int, float, str})
