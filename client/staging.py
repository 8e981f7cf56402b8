"""One call's bytes outside its messages: uploads, shared-memory regions, results kept on the server."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from ._proto import aclnn_pb2 as pb
from .data_channel import NoConnection
from .errors import AclnnError
from .tensor import Tensor
from .transfer import Region, byte_view, receive_into
from .types import numpy_dtype
from .wire import decode_error, decode_output

if TYPE_CHECKING:
    from .grpc_client import Client


class Download:
    """A result kept on the server, streamed straight into the caller's output when written."""

    def __init__(self, client: Client, replica: int, output: pb.OutputTensor) -> None:
        self.client, self.replica, self.handle = client, replica, output.handle
        self.dtype, self.shape = numpy_dtype(output.data_type), tuple(output.dims)

    def write_into(self, view: np.ndarray) -> None:
        channel = self.client._data_channel(self.replica)
        if channel is not None:
            try:
                channel.download(self.handle, view, self.client._timeout)
                return
            except NoConnection as exc:
                self.client._no_connection(self.replica, exc)
        stub = self.client._pool.stub(self.replica)
        try:
            chunks = stub.DownloadTensor(
                pb.TensorHandle(handle=self.handle), metadata=self.client._metadata(), timeout=self.client._timeout
            )
            receive_into(view, chunks)
        except grpc.RpcError as error:
            raise decode_error(error) from None


class Staging:
    """One call's bytes outside its messages: uploads, shared-memory regions, kept results.

    Everything it takes is given back at exit, after the outputs were written. Regions of a
    call that did not end normally are retired, not reused: the server may still be writing
    its late results into them.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.handles: list[tuple[int, str]] = []
        self.regions: list[Region] = []
        self.output_regions: dict[str, Region] = {}
        self.kept = False  # results asked to stay on the server

    @property
    def stateless(self) -> bool:
        """Whether the call uses or makes no state on a server (then any backend may take it)."""
        return not (self.handles or self.regions or self.kept)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        self.reset(failed=exc_type is not None)

    def reset(self, failed: bool) -> None:
        """Gives back what an attempt took (at the end, or after a failed attempt before a retry)."""
        for replica, handle in self.handles:
            self.client._free(replica, handle)
        if failed:
            self.client._retire(self.regions)
        else:
            self.client._regions.release(self.regions)
        self.handles, self.regions, self.output_regions, self.kept = [], [], {}, False

    def input(self, replica: int, name: str, tensor: Tensor) -> bytes | pb.StorageRef:
        """The tensor's storage inline, as a shared-memory slice, or uploaded in chunks (large)."""
        data = byte_view(tensor.data)
        region = self._region(replica, data.nbytes)
        if region is not None:
            region[0].array[: data.nbytes] = np.frombuffer(data, np.uint8)
            return pb.StorageRef(region=pb.RegionSlice(region=region[1], offset=0, size=data.nbytes))
        if data.nbytes > self.client.max_inline_bytes:
            try:
                handle = self.client._upload(replica, data)
            except AclnnError as error:  # an upload refused for its size: the tensor's fault, by its name
                if error.param != "chunk":
                    raise
                message = error.message.removeprefix("chunk: ")
                raise AclnnError(error.code, f"{name}: {message}", name, error.grpc_code) from None
            self.handles.append((replica, handle))
            return pb.StorageRef(handle=handle)
        return data.tobytes()

    def place(self, replica: int, sizes: Mapping[str, int], placements: Any) -> None:
        """Large results stay on the server (then stream back); with shared memory they land in a region."""
        for name, size in sizes.items():
            region = self._region(replica, size)
            if region is not None:
                self.output_regions[name] = region[0]
                placements[name].region.CopyFrom(pb.RegionSlice(region=region[1], offset=0, size=size))
            elif size > self.client.max_inline_bytes:
                placements[name].keep_on_server = True
                self.kept = True

    def results(self, replica: int, outputs: Mapping[str, pb.OutputTensor]) -> dict[str, Any]:
        results: dict[str, Any] = {}
        for name, output in outputs.items():
            if output.handle:
                self.handles.append((replica, output.handle))
                results[name] = Download(self.client, replica, output)
            elif name in self.output_regions:
                dtype, dims = numpy_dtype(output.data_type), tuple(output.dims)
                buffer = self.output_regions[name].array[: math.prod(dims) * dtype.itemsize]
                results[name] = buffer.view(dtype).reshape(dims)
            else:
                results[name] = decode_output(output)
        return results

    def _region(self, replica: int, size: int) -> tuple[Region, str] | None:
        """A region for `size` bytes and its id on the replica; None: the bytes go another way."""
        if not self.client._shared_memory or size == 0:
            return None
        region = self.client._region(replica, size)
        if region is not None:
            self.regions.append(region[0])
        return region
