"""NpuBackend: the operators on an Ascend NPU through CANN's aclnn two-phase API.

Lifetime. The constructor loads CANN (acl.py), calls aclInit (once per process; shared
by every NpuBackend and finalized when the last one closes), aclrtSetDevice, creates a
context and a pool of ACL streams, lent to client streams (streams.py). They belong to the
backend until `close()`, which waits for queued launches, destroys the streams and the
context, frees every device allocation, resets the device and finalizes ACL. Every thread
that calls in first makes the backend's context current (aclrtSetCurrentContext), so gRPC
worker threads and the engine's stream workers can share the device.

One call on host arrays (`compute`), on the ACL stream lent to its client stream (after the
work queued there) or on an idle one:
  1. layout: each input is a NumPy view (possibly strided, possibly stride 0). Only the
     storage span the view addresses is copied to the device — from its first addressed
     element to its last — and the aclTensor keeps the view's own strides with offset 0
     (storage dims = the view's shape when the view is C-contiguous, else `[span]`). So a
     transposed input is not made contiguous on the host and a broadcast (stride-0) input
     ships one copy of its values; CANN's aclnn operators accept non-contiguous tensors.
     Outputs are the engine's fresh C-contiguous result arrays: contiguous device tensors.
  2. device buffers from the caching allocator, aclCreateTensor / aclCreateIntArray /
     aclCreateBoolArray for every parameter (null for absent optional inputs and
     masked-off outputs), aclnnXGetWorkspaceSize, then aclSetAclOpExecutorRepeatable, so
     that the executor's lifetime is explicit: it is destroyed by aclDestroyAclOpExecutor
     whatever happens, never left to an implicit release on launch (a failed launch would
     otherwise leak it).
  3. the input spans are copied host -> device (aclrtMemcpy); a workspace block is taken
     from the allocator only when CANN asks for more than 0 bytes; aclnnX(workspace, size,
     executor, stream); aclrtSynchronizeStream (a failure of work queued earlier on the stream
     surfaces here too); then each enabled output is copied back into its result array
     (device -> host) and the workspace block returns to the allocator.
  A plan computed again (the engine's repeatable executors: validate once, run many
  times) reuses its CANN executor and device buffers: the new input bytes are copied
  into the same buffers and the executor is launched again. The executor, its tensors and
  buffers are released when the plan is garbage-collected (the engine dropped it) or at
  close().

One call whose tensors all live in device buffers (`compute_resident`): aclTensors over the
buffers' own memory (pointer + byte offset, with the client's strides and element offset), a
fresh executor, a workspace block when CANN asks for one, and aclnnX on the client stream's ACL
stream; nothing is copied and, on a client stream, nothing waits: the executor, its tensors and
the workspace are released once the stream is next synchronized (by the client, by a transfer of
a buffer the launch uses, at the end of its session, or when its ACL stream is wanted elsewhere).
`synchronize` waits for a client stream's ACL stream and reports its failure. Device buffers
themselves are memory.py's (`device_memory()`).

workspace_size(): CANN's own figure, from aclnnXGetWorkspaceSize on exactly the tensor
descriptors compute will create (same shapes, strides, storage dims, dtypes, formats) with
null data pointers; that executor is made repeatable and destroyed at once.

Memory: a caching allocator over aclrtMalloc/aclrtFree with size-class free lists
(powers of two from 512 B to 1 MiB, then multiples of 2 MiB); blocks return to their
list, not to the driver. When aclrtMalloc fails the cached blocks are freed and the
allocation retried once; close() frees everything.

Operators without an aclnn API (LayerNormGrad is a graph-mode op only), and any operator not yet
bound in acl.APIS, run on the NumPy reference (their module's own compute), logged once per operator.

Errors: aclnn statuses pass through unchanged; ACL runtime failures are 361001 with the ACL
error code and message (see acl.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aclnn_common.errors import AclnnError, Status

from ...descriptors import TensorDesc
from ...registry import Operator, Plan
from ...streams import StreamKey
from ..widening import compute_in_range
from .acl import ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, APIS, Acl, AclnnApi
from .memory import NpuMemory
from .streams import MAX_STREAMS, MAX_STREAMS_PER_IDENTITY, AclStream, DeviceBlock, StreamPool

log = logging.getLogger("aclnn_server.npu")

NO_ACLNN_API = frozenset({"LayerNormGrad"})  # operators CANN serves only as graph ops, never through aclnn

MIN_BLOCK = 512
SMALL_LIMIT = 1 << 20
LARGE_ROUND = 2 << 20


class CachingAllocator:
    """Device memory in size classes; freed blocks are kept on per-class free lists."""

    def __init__(self, acl: Acl) -> None:
        self.acl = acl
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = defaultdict(list)
        self._size: dict[int, int] = {}  # every block aclrtMalloc gave us -> its size class
        self.mallocs = self.hits = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        if nbytes <= MIN_BLOCK:
            return MIN_BLOCK
        if nbytes <= SMALL_LIMIT:
            return 1 << (nbytes - 1).bit_length()
        return -(-nbytes // LARGE_ROUND) * LARGE_ROUND

    def alloc(self, nbytes: int) -> int:
        size = self.size_class(nbytes)
        with self._lock:
            if self._free[size]:
                self.hits += 1
                return self._free[size].pop()
        try:
            ptr = self.acl.malloc(size)
        except AclnnError:
            if not self.empty_cache():
                raise
            ptr = self.acl.malloc(size)  # once more, with the cache returned to the driver
        with self._lock:
            self.mallocs += 1
            self._size[ptr] = size
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            self._free[self._size[ptr]].append(ptr)

    def empty_cache(self) -> int:
        """Returns every cached (unused) block to the driver; the number of bytes freed."""
        with self._lock:
            blocks = [(p, s) for s, ptrs in self._free.items() for p in ptrs]
            self._free.clear()
            for p, _ in blocks:
                del self._size[p]
        for p, _ in blocks:
            self.acl.free(p)
        return sum(s for _, s in blocks)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(s * len(ptrs) for s, ptrs in self._free.items())

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(self._size.values())

    def close(self) -> None:
        """Frees every block, cached or still in use."""
        with self._lock:
            blocks = list(self._size)
            self._size.clear()
            self._free.clear()
        for p in blocks:
            self.acl.free(p)


@dataclass(frozen=True)
class DeviceLayout:
    """How one tensor is laid out on the device (see the module docstring, step 1)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_dims: tuple[int, ...]
    nbytes: int


def input_layout(desc: TensorDesc) -> DeviceLayout:
    """The addressed storage span of an input view, with its strides kept and offset 0."""
    strides = tuple(s if d > 1 else 0 for d, s in zip(desc.shape, desc.strides))
    if desc.numel == 0:
        return DeviceLayout(desc.shape, strides, (0,), 0)
    if strides == contiguous_strides(desc.shape, keep_unit=False):
        return DeviceLayout(desc.shape, contiguous_strides(desc.shape), desc.shape, desc.numel * desc.dtype.itemsize)
    span = 1 + sum((d - 1) * s for d, s in zip(desc.shape, strides))
    return DeviceLayout(desc.shape, strides, (span,), span * desc.dtype.itemsize)


def output_layout(desc: TensorDesc) -> DeviceLayout:
    """The engine's result arrays are C-contiguous."""
    return DeviceLayout(desc.shape, contiguous_strides(desc.shape), desc.shape, desc.numel * desc.dtype.itemsize)


def resident_layout(desc: TensorDesc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Strides and storage dims of a tensor in a device buffer: the client's strides (row-major ones
    for size-1 dims, which address nothing) over storage of its element count, or of its shape when
    it is exactly that."""
    contiguous = contiguous_strides(desc.shape)
    strides = tuple(s if d > 1 else c for d, s, c in zip(desc.shape, desc.strides, contiguous))
    if strides == contiguous and desc.offset == 0 and desc.storage_size == desc.numel:
        return strides, desc.shape
    return strides, (desc.storage_size,)


def contiguous_strides(shape: Sequence[int], keep_unit: bool = True) -> tuple[int, ...]:
    """Row-major strides; with keep_unit=False, size-1 dims get 0 (they address nothing)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step if keep_unit or d > 1 else 0)
        step *= d
    return tuple(reversed(strides))


@dataclass
class _Prepared:
    """A CANN executor with its tensors, arrays and device buffers, reusable for its plan."""

    api: AclnnApi
    executor: int | None = None
    workspace_size: int = 0
    tensors: list[int] = field(default_factory=list)
    arrays: list[tuple[str, int]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    inputs: list[tuple[str, int, int]] = field(default_factory=list)  # name, device ptr, bytes
    outputs: list[tuple[str, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finalizer: Any = None


class _AclRuntime:
    """aclInit / aclFinalize are once per process: shared by every NpuBackend, counted."""

    lock = threading.Lock()
    users = 0

    @classmethod
    def acquire(cls, acl: Acl) -> None:
        with cls.lock:
            if cls.users == 0:
                acl.init()
            cls.users += 1

    @classmethod
    def release(cls, acl: Acl) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                acl.finalize()


class NpuBackend:
    """The aclnn operators on NPU `device`; LayerNormGrad on the NumPy reference.

    `streams` ACL streams are made at start, up to `max_streams` as client streams need them, at
    most `max_streams_per_identity` lent to one identity's client streams (see streams.py).
    """

    name = "npu"
    accepts_stream = True  # compute(..., stream=<client stream key>) runs on the ACL stream lent to it
    launches_resident = True  # compute_resident on a client stream launches on its ACL stream, not waited for
    plans_on_device = True  # workspace_size is CANN's GetWorkspaceSize: asked for each call, never cached

    def __init__(
        self,
        device: int = 0,
        streams: int = 4,
        max_streams: int = MAX_STREAMS,
        max_streams_per_identity: int = MAX_STREAMS_PER_IDENTITY,
    ) -> None:
        self.device = device
        self.acl = Acl()  # RuntimeError with the search path when CANN is missing
        self._closed = True
        self._lock = threading.RLock()
        self._prepared: dict[int, _Prepared] = {}
        self._fallback_logged: set[str] = set()
        self._context: int | None = None
        self._device_set = False
        self.allocator = CachingAllocator(self.acl)
        _AclRuntime.acquire(self.acl)
        try:
            self.acl.set_device(device)
            self._device_set = True
            self._context = self.acl.create_context(device)
            self.streams = StreamPool(self.acl, self.allocator.free, streams, max_streams, max_streams_per_identity)
        except AclnnError as exc:
            self._release_runtime()
            raise RuntimeError(f"NPU device {device} is not usable: {exc.message}") from exc
        self._closed = False

    # ------------------------------------------------------------------ Backend protocol

    def supports(self, operator_name: str) -> bool:
        """True when the operator runs on the NPU (False: the NumPy reference runs it)."""
        return operator_name in APIS

    def workspace_size(self, operator: Operator, plan: Plan) -> int:
        api = APIS.get(operator.name)
        if api is None:
            return operator.workspace_size(plan)
        self._enter()
        prepared = _Prepared(api)
        try:
            args = self._create_parameters(prepared, plan, plan.values, data=False)
            prepared.workspace_size, prepared.executor = self.acl.get_workspace_size(api.name, args)
            self.acl.set_repeatable(prepared.executor)  # so that destroying it is the documented path
            return prepared.workspace_size
        finally:
            self._destroy(prepared)

    def compute(self, operator: Operator, plan: Plan, args: dict[str, Any], stream: StreamKey | None = None) -> None:
        """Runs one call on host arrays and waits for it: on the ACL stream lent to the client stream
        `stream` (after the work queued there, whose failure it reports), or on an idle one."""
        api = APIS.get(operator.name)
        if api is None:
            self._fallback(operator, plan, args)
            return
        self._enter()
        with self.streams.lend(stream) as acl_stream:
            prepared = self._prepare(api, plan, args)
            with prepared.lock:
                try:
                    self._run(prepared, args, acl_stream)
                except BaseException:
                    self._discard(plan)  # after a failed launch or stream, start afresh next time
                    raise

    def compute_resident(
        self,
        operator: Operator,
        plan: Plan,
        resident: Mapping[str, tuple[DeviceBlock, int]],
        stream: StreamKey | None,
    ) -> None:
        """Runs a call whose tensors all live in device buffers ((block, byte offset) each) over that
        memory, copying nothing. On a client stream it is queued on the stream's ACL stream and not
        waited for; without one it waits, after the work queued on its buffers (as CANN's default stream)."""
        api = APIS[operator.name]
        blocks = {block for block, _ in resident.values()}
        self._enter()
        if stream is None:
            self.streams.quiesce(blocks)
        with self.streams.lend(stream) as acl_stream:
            launch, workspace = _Prepared(api), None
            try:
                parameters = self._create_parameters(launch, plan, plan.values, data=False, resident=resident)
                launch.workspace_size, launch.executor = self.acl.get_workspace_size(api.name, parameters)
                self.acl.set_repeatable(launch.executor)  # destroyed explicitly, once it has run
                if launch.workspace_size > 0:
                    workspace = self.allocator.alloc(launch.workspace_size)
                self.acl.launch(api.name, workspace, launch.workspace_size, launch.executor, acl_stream.handle)
            except BaseException:
                self._release_launch(launch, workspace)
                raise
            release = functools.partial(self._release_launch, launch, workspace)
            if stream is not None:
                self.streams.launched(acl_stream, blocks, [release])
                return
            try:
                self.streams.finish(acl_stream)
            finally:
                release()

    def synchronize(self, stream: StreamKey) -> None:
        """Waits for the launches queued on a client stream (every stream of its session when its id is
        None) and raises the first failure among them, once."""
        self._enter()
        self.streams.synchronize(*stream)

    def end_session(self, owner: str | None, session: str) -> None:
        """An identity's client session ended: its queued launches are waited for and its ACL streams unbound."""
        if not self._closed:
            self._enter()
            self.streams.end_session(owner, session)

    def device_memory(self) -> NpuMemory:
        """Device buffers in NPU memory from the caching allocator (see memory.py)."""
        return NpuMemory(self.acl, self.allocator.alloc, self.streams, self._enter)

    def close(self) -> None:
        """Releases executors, device memory, streams, the context and the device; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            prepared = list(self._prepared.values())
            self._prepared.clear()
        self.acl.set_current_context(self._context)
        self.streams.close()  # waits for queued launches and releases what they used
        for p in prepared:
            p.finalizer.detach()
            self._destroy(p)
        self.allocator.close()
        self._release_runtime()

    def __enter__(self) -> NpuBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _release_runtime(self) -> None:
        try:
            if self._context is not None:
                self.acl.destroy_context(self._context)
                self._context = None
            if self._device_set:
                self.acl.reset_device(self.device)
                self._device_set = False
        finally:
            _AclRuntime.release(self.acl)

    def _enter(self) -> None:
        if self._closed:
            raise AclnnError(Status.RUNTIME_ERROR, "the NPU backend is closed")
        self.acl.set_current_context(self._context)

    def _fallback(self, operator: Operator, plan: Plan, args: dict[str, Any]) -> None:
        if operator.name not in self._fallback_logged:
            self._fallback_logged.add(operator.name)
            reason = "has no aclnn API in CANN" if operator.name in NO_ACLNN_API else "has no aclnn binding here yet"
            log.warning("%s %s; the npu backend runs it on the NumPy reference", operator.name, reason)
        compute_in_range(operator, plan, args, lambda: operator.compute(**args))

    def _prepare(self, api: AclnnApi, plan: Plan, args: dict[str, Any]) -> _Prepared:
        """The plan's executor and buffers: made on the plan's first compute, reused after."""
        with self._lock:
            prepared = self._prepared.get(id(plan))
        if prepared is not None:
            return prepared
        prepared = _Prepared(api)
        try:
            parameters = self._create_parameters(prepared, plan, args, data=True)
            prepared.workspace_size, prepared.executor = self.acl.get_workspace_size(api.name, parameters)
            self.acl.set_repeatable(prepared.executor)
        except BaseException:
            self._destroy(prepared)
            raise
        with self._lock:
            existing = self._prepared.get(id(plan))
            if existing is None:
                self._prepared[id(plan)] = prepared
                prepared.finalizer = weakref.finalize(plan, self._forget, id(plan))
        if existing is not None:  # another thread prepared the same plan meanwhile
            self._destroy(prepared)
            return existing
        return prepared

    def _discard(self, plan: Plan) -> None:
        with self._lock:
            prepared = self._prepared.get(id(plan))
        if prepared is not None:
            prepared.finalizer()  # runs _forget once and detaches it

    def _forget(self, key: int) -> None:
        """The plan is gone (the engine dropped its executor): release what it held."""
        with self._lock:
            prepared = self._prepared.pop(key, None)
            if prepared is None or self._closed:
                return
        try:
            self.acl.set_current_context(self._context)
            self._destroy(prepared)
        except Exception:  # called from garbage collection: log, never raise
            log.exception("releasing an NPU executor failed")

    def _create_parameters(
        self,
        prepared: _Prepared,
        plan: Plan,
        values: Mapping[str, Any],
        data: bool,
        resident: Mapping[str, tuple[DeviceBlock, int]] | None = None,
    ) -> list[Any]:
        """The aclnn call's arguments in CANN order; device buffers too when `data`; the `resident`
        tensors over their device buffers."""
        out: list[Any] = []
        for kind, name in prepared.api.params:
            if kind == "tensor" and resident and name in resident:
                out.append(self._create_resident_tensor(prepared, plan, name, *resident[name]))
            elif kind == "tensor":
                out.append(self._create_tensor(prepared, plan, name, data))
            elif kind == "int_array":
                out.append(self._array(prepared, kind, self.acl.create_int_array(list(values[name]))))
            elif kind == "bool_array":
                out.append(self._array(prepared, kind, self.acl.create_bool_array(list(values[name]))))
            elif kind == "bool":
                out.append(bool(values[name]))
            elif kind == "int":
                out.append(int(values[name]))
            else:
                out.append(float(values[name]))
        return out

    @staticmethod
    def _array(prepared: _Prepared, kind: str, handle: int) -> int:
        prepared.arrays.append((kind, handle))
        return handle

    def _create_tensor(self, prepared: _Prepared, plan: Plan, name: str, data: bool) -> int | None:
        if name in plan.inputs and name in plan.outputs:  # in/out (running statistics): the result array both ways
            return self._create_inout_tensor(prepared, plan, name, data)
        if name in plan.inputs:
            desc, layout, role = plan.inputs[name], input_layout(plan.inputs[name]), prepared.inputs
        elif name in plan.outputs:
            desc, layout, role = plan.outputs[name], output_layout(plan.outputs[name]), prepared.outputs
        elif name in plan.values.get("placeholders", {}):
            # A tensor CANN requires that this call neither reads nor writes (aclnnBatchNorm's output
            # on an empty input): its descriptor, without device memory.
            desc = plan.values["placeholders"][name]
            layout, role, data = output_layout(desc), prepared.outputs, False
        else:
            return None  # an absent optional input or a masked-off output: a null pointer
        ptr = None
        if data and layout.nbytes:
            ptr = self.allocator.alloc(layout.nbytes)
            prepared.blocks.append(ptr)
            role.append((name, ptr, layout.nbytes))
        handle = self.acl.create_tensor(
            layout.shape, desc.data_type, layout.strides, 0, desc.format, layout.storage_dims, ptr
        )
        prepared.tensors.append(handle)
        return handle

    def _create_resident_tensor(
        self, prepared: _Prepared, plan: Plan, name: str, block: DeviceBlock, offset: int
    ) -> int:
        """A tensor over its device buffer as the client described it (in/out ones updated there in place)."""
        desc = plan.outputs.get(name) or plan.inputs[name]
        strides, storage_dims = resident_layout(desc)
        handle = self.acl.create_tensor(
            desc.shape, desc.data_type, strides, desc.offset, desc.format, storage_dims, block.ptr + offset
        )
        prepared.tensors.append(handle)
        return handle

    def _create_inout_tensor(self, prepared: _Prepared, plan: Plan, name: str, data: bool) -> int:
        """The engine's result array holds the current values: uploaded, updated in place, copied back."""
        desc = plan.outputs[name]
        layout = output_layout(desc)
        ptr = None
        if data and layout.nbytes:
            ptr = self.allocator.alloc(layout.nbytes)
            prepared.blocks.append(ptr)
            prepared.inputs.append((name, ptr, layout.nbytes))
            prepared.outputs.append((name, ptr, layout.nbytes))
        handle = self.acl.create_tensor(
            layout.shape, desc.data_type, layout.strides, 0, desc.format, layout.storage_dims, ptr
        )
        prepared.tensors.append(handle)
        return handle

    def _upload(self, prepared: _Prepared, args: dict[str, Any]) -> None:
        for name, ptr, nbytes in prepared.inputs:
            view: np.ndarray = args[name]
            host = view.__array_interface__["data"][0]  # the first addressed element
            self.acl.memcpy(ptr, host, nbytes, ACL_MEMCPY_HOST_TO_DEVICE)

    def _run(self, prepared: _Prepared, args: dict[str, Any], stream: AclStream) -> None:
        self._upload(prepared, args)
        workspace = self.allocator.alloc(prepared.workspace_size) if prepared.workspace_size > 0 else None
        try:
            self.acl.launch(prepared.api.name, workspace, prepared.workspace_size, prepared.executor, stream.handle)
            self.streams.finish(stream)
        finally:
            if workspace is not None:
                self.allocator.free(workspace)
        for name, ptr, nbytes in prepared.outputs:
            result: np.ndarray = args[name]
            if result.nbytes != nbytes or not result.flags.c_contiguous:
                raise AclnnError(Status.INNER, f"{name}: result array does not match its device buffer")
            self.acl.memcpy(result.ctypes.data, ptr, nbytes, ACL_MEMCPY_DEVICE_TO_HOST)

    def _release_launch(self, launch: _Prepared, workspace: int | None) -> None:
        """What one launch over device buffers used: its executor, tensors and arrays, and its workspace."""
        self._destroy(launch)
        if workspace is not None:
            self.allocator.free(workspace)

    def _destroy(self, prepared: _Prepared) -> None:
        """Destroys the executor, tensors and arrays; returns the buffers to the allocator."""
        errors = []
        steps: list[tuple[Any, int]] = []
        if prepared.executor is not None:
            steps.append((self.acl.destroy_executor, prepared.executor))
        steps += [(self.acl.aclDestroyTensor, t) for t in prepared.tensors]
        steps += [
            (self.acl.aclDestroyIntArray if kind == "int_array" else self.acl.aclDestroyBoolArray, a)
            for kind, a in prepared.arrays
        ]
        for fn, handle in steps:
            try:
                code = fn(handle)
                if code:
                    errors.append(f"{getattr(fn, '__name__', fn)} returned {code}")
            except AclnnError as exc:
                errors.append(exc.message)
        for ptr in prepared.blocks:
            self.allocator.free(ptr)
        prepared.executor, prepared.tensors, prepared.arrays, prepared.blocks = None, [], [], []
        if errors:
            log.warning("releasing CANN objects: %s", "; ".join(errors))
