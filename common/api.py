"""The two-phase call API, shared by the gRPC Client and the in-process LocalClient."""

from __future__ import annotations

import abc
import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .binding import INT64_MAX, INT64_MIN, BoundCall, bind
from .device import DeviceBuffer, buffer_size, byte_count, byte_value, host_bytes, host_target
from .errors import AclnnError, Status, invalid_error
from .tensor import Value


class Executor:
    """What get_workspace_size returns: the server's executor and the call's outputs."""

    def __init__(self, executor_id: str, call: BoundCall, workspace_size: int) -> None:
        self.id = executor_id  # the transport's reference to the server-side executor
        self.call = call
        self.workspace_size = workspace_size
        self.repeatable = False

    @property
    def op(self) -> str:
        return self.call.op

    def __repr__(self) -> str:
        return f"Executor({self.op}, id={self.id[:8]}, workspace_size={self.workspace_size})"


class BaseClient(abc.ABC):
    """get_workspace_size / execute / run / set_executor_repeatable / destroy_executor.

    Subclasses supply the transport: six primitive calls on parameter values.
    """

    def __init__(self) -> None:
        self._async = _AsyncState()
        self._closed_by_user = False

    @property
    def closed(self) -> bool:
        """Whether close() was called (or the client's with block ended): every call then raises."""
        return self._closed_by_user

    def get_workspace_size(self, op: str, /, **params: Any) -> tuple[int, Executor]:
        """Validates and plans a call on the server; returns (workspace_size, executor)."""
        self._check_open()
        call = bind(op, params, self._output_names(op), self._inout_names(op))
        workspace_size, executor_id = self._get_workspace_size(op, call.descriptors())
        return workspace_size, Executor(executor_id, call, workspace_size)

    def execute(self, executor: Executor, *, stream: int | None = None) -> None:
        """Runs a planned call, reading the inputs' current contents, and fills its outputs in place.

        Calls naming the same `stream` run in submission order; other streams may overlap.
        """
        self._check_open()
        stream = stream_number(stream)
        if not isinstance(executor, Executor):
            raise invalid_error("executor", f"expected an Executor from get_workspace_size, got {executor!r:.60}")
        self._in_order(stream, lambda: self._execute(executor, stream)).result()

    def run(self, op: str, /, *, stream: int | None = None, **params: Any) -> None:
        """Both phases in one round trip; fills the outputs in place."""
        self._check_open()
        stream = stream_number(stream)
        call = bind(op, params, self._output_names(op), self._inout_names(op))
        self._in_order(stream, lambda: self._run(call, stream)).result()

    def run_async(self, op: str, /, *, stream: int | None = None, **params: Any) -> concurrent.futures.Future:
        """`run` in the background: the future's result is None once the outputs are filled."""
        self._check_open()
        stream = stream_number(stream)
        call = bind(op, params, self._output_names(op), self._inout_names(op))
        return self._in_order(stream, lambda: self._run(call, stream), background=True)

    def _in_order(
        self, stream: int | None, work: Callable[[], None], background: bool = False
    ) -> concurrent.futures.Future:
        """Runs `work` after every earlier call on `stream` has finished (at once without a stream).

        Submission order is kept by chaining each stream's calls; the pool is FIFO, so a
        call's predecessor always started before it and the chain cannot deadlock.
        """
        state = self._async
        with state.lock:
            previous = state.tails.get(stream) if stream is not None else None
            inline = not background and previous is None
            if inline:
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_running_or_notify_cancel()
            else:
                future = state.pool().submit(_after, previous, work)
            if stream is not None:
                state.tails[stream] = future
        if inline:
            try:
                work()
                future.set_result(None)
            except BaseException as exc:
                future.set_exception(exc)
        return future

    def set_executor_repeatable(self, executor: Executor) -> None:
        """Keeps the executor usable until destroy_executor (call before its first execute)."""
        self._check_open()
        self._set_executor_repeatable(self._executor_id(executor))
        executor.repeatable = True

    def destroy_executor(self, executor: Executor) -> None:
        self._check_open()
        self._destroy_executor(self._executor_id(executor))

    # Device memory ----------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> DeviceBuffer:
        """`nbytes` of device memory on the server (zero-filled), of this client's session."""
        return self._malloc(buffer_size(int(nbytes)))

    def free(self, buf: DeviceBuffer) -> None:
        """Frees an allocation; calls queued on it finish first (its memory lives until they do)."""
        self._own(buf, "buf")
        if buf.offset:
            raise invalid_error("buf", f"points {buf.offset} bytes into its allocation: free its start")
        self._free_buffer(buf)

    def memcpy(self, dst: Any, src: Any, nbytes: int | None = None) -> None:
        """Copies bytes host -> device, device -> host (into the array, in place) or device -> device.

        Each side is a DeviceBuffer or a host array (NumPy, CPU torch tensor; a source may be bytes),
        C-contiguous. `nbytes` defaults to the host side's size (device -> device: required). A
        transfer waits for the calls queued on its buffers, as CANN's synchronous aclrtMemcpy does
        on the device.
        """
        if isinstance(dst, DeviceBuffer) and isinstance(src, DeviceBuffer):
            self._own(dst, "dst")
            self._own(src, "src")
            if nbytes is None:
                raise invalid_error("nbytes", "a device -> device copy needs nbytes")
            self._copy(dst, src, _count(nbytes, dst.nbytes, "nbytes"))
        elif isinstance(dst, DeviceBuffer):
            self._own(dst, "dst")
            data = host_bytes(src, "src")
            self._write(dst, data[: _count(nbytes, data.nbytes, "src")])
        elif isinstance(src, DeviceBuffer):
            self._own(src, "src")
            target = host_target(dst, "dst")
            self._read(src, target[: _count(nbytes, target.nbytes, "dst")])
        else:
            raise invalid_error("dst", "memcpy needs a DeviceBuffer on one side at least")

    def memset(self, buf: DeviceBuffer, value: int, nbytes: int) -> None:
        """Sets `nbytes` bytes from `buf` to `value` (0-255)."""
        self._own(buf, "buf")
        self._fill(buf, byte_value(int(value)), byte_count(int(nbytes)))

    def synchronize(self, stream: int | None = None) -> None:
        """Waits for the calls on `stream` (every stream when None), raising the first failure of a
        call queued there, once (as aclrtSynchronizeStream)."""
        stream = stream_number(stream)
        with self._async.lock:
            tails = [f for s, f in self._async.tails.items() if stream is None or s == stream]
        concurrent.futures.wait(tails)  # run_async calls of this client reach the server first
        self._synchronize(stream)

    def _own(self, buf: Any, name: str) -> None:
        if not isinstance(buf, DeviceBuffer):
            raise invalid_error(name, f"expected a DeviceBuffer from malloc, got {type(buf).__name__}")
        if buf.client is not self:
            raise invalid_error(name, "is device memory of another client")

    def close(self) -> None:
        """Waits for background calls, then releases the transport; later calls raise (see `_check_open`).
        Closing again does nothing."""
        self._closed_by_user = True
        if self._async.executor is not None:
            self._async.executor.shutdown(wait=True)

    def _check_open(self) -> None:
        """A closed client never reconnects behind its user's back: each call says it is closed."""
        if self._closed_by_user:
            raise AclnnError(
                Status.RUNTIME_ERROR,
                f"this {type(self).__name__} is closed (by close() or the end of its with block): make a new one",
                "client",
            )

    def __enter__(self) -> BaseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def _executor_id(executor: Executor) -> str:
        if not isinstance(executor, Executor):
            raise invalid_error("executor", f"expected an Executor from get_workspace_size, got {executor!r:.60}")
        return executor.id

    @abc.abstractmethod
    def _output_names(self, op: str) -> frozenset[str]:
        """The output parameter names of an operator (empty for an unknown one)."""

    @abc.abstractmethod
    def _inout_names(self, op: str) -> frozenset[str]:
        """The tensors an operator reads and updates in place (written back like outputs)."""

    @abc.abstractmethod
    def _get_workspace_size(self, op: str, values: Mapping[str, Value]) -> tuple[int, str]: ...

    @abc.abstractmethod
    def _execute(self, executor: Executor, stream: int | None) -> None:
        """Runs the executor on the call's current inputs and writes its outputs (call.write_outputs)."""

    @abc.abstractmethod
    def _run(self, call: BoundCall, stream: int | None) -> None:
        """Runs the call in one round trip and writes its outputs (call.write_outputs)."""

    @abc.abstractmethod
    def _set_executor_repeatable(self, executor_id: str) -> None: ...

    @abc.abstractmethod
    def _malloc(self, nbytes: int) -> DeviceBuffer: ...

    @abc.abstractmethod
    def _free_buffer(self, buf: DeviceBuffer) -> None: ...

    @abc.abstractmethod
    def _write(self, dst: DeviceBuffer, data: memoryview) -> None:
        """Host -> device: all of `data` at `dst`."""

    @abc.abstractmethod
    def _read(self, src: DeviceBuffer, target: np.ndarray) -> None:
        """Device -> host: `target.nbytes` bytes from `src` into `target` (uint8)."""

    @abc.abstractmethod
    def _copy(self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _fill(self, dst: DeviceBuffer, value: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _synchronize(self, stream: int | None) -> None: ...

    @abc.abstractmethod
    def _destroy_executor(self, executor_id: str) -> None: ...


def _count(nbytes: int | None, available: int, name: str) -> int:
    """A transfer's byte count: `available` by default; more than that is 161002 naming the side short of it."""
    if nbytes is None:
        return available
    if not 0 <= int(nbytes) <= available:
        raise invalid_error(name, f"holds {available} bytes, fewer than the {nbytes} to copy")
    return int(nbytes)


def _after(previous: concurrent.futures.Future | None, work: Callable[[], None]) -> None:
    if previous is not None:
        concurrent.futures.wait([previous])  # its outcome is its own caller's business
    work()


def stream_number(stream: Any) -> int | None:
    """A call's `stream` as the wire carries it (a signed 64-bit id, as an aclrtStream handle is one
    word), or None; anything else is refused here, alike on every transport."""
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise invalid_error("stream", f"must be an integer stream id or None, got {type(stream).__name__}")
    if not INT64_MIN <= int(stream) <= INT64_MAX:
        raise invalid_error("stream", f"{str(int(stream))[:24]} is outside the signed 64-bit range of stream ids")
    return int(stream)


class _AsyncState:
    """The background pool and, per stream, the future of its latest call."""

    WORKERS = 16

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tails: dict[int | None, concurrent.futures.Future] = {}
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.executor is None:
            self.executor = concurrent.futures.ThreadPoolExecutor(self.WORKERS, thread_name_prefix="aclnn-client")
        return self.executor
