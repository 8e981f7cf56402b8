"""One call's bytes outside its messages: uploads, shared-memory regions, results kept on the server."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from aclnn_common._proto import aclnn_pb2 as pb
from aclnn_common.chunks import byte_view, copy_bytes
from aclnn_common.errors import AclnnError
from aclnn_common.framing import aligned
from aclnn_common.tensor import Tensor
from aclnn_common.types import numpy_dtype
from aclnn_common.wire import decode_output

from .data_channel import Attachments
from .regions import Region

# Over the Unix socket, results of RESULT_REGION_BYTES up to MAX_RESULT_REGION_BYTES land in a region
# of the client's (regions.Region, `results`) even without shared_memory=True: the server computes them
# there and holds nothing for it, the client copies them out once. Through the socket a result costs
# two copies more, and a reply of several MiB crosses it in ~36 KiB pieces that can wake the client
# once each (bench/transport.py --sweep: 2-4x the call's time in some runs).
RESULT_REGION_BYTES = 1 << 20
MAX_RESULT_REGION_BYTES = 64 << 20


class Transfers(Protocol):
    """What staging needs of its client: moving bytes to and from one replica outside the call's message."""

    shared_memory: bool

    def max_inline_bytes(self, replica: int, retried: bool = False) -> int:
        """Larger tensors are uploaded to the replica, larger results kept on it. `retried`: for the
        tensors of a call asked again after a refusal, when the replica holds inline bytes as they come
        (over TCP), not in turn: a smaller limit, so that the memory of more of them is reserved in turn."""

    def max_attached_bytes(self, replica: int, results: bool = False) -> int | None:
        """A call's inline tensors in all, at most (the largest are uploaded beyond it), or (`results`)
        its results sent back inline (the largest kept on the server beyond it); None: no limit."""

    def reads_in_place(self, replica: int) -> bool:
        """Whether the replica may compute on a call's attached tensors where the client wrote them (a
        Unix socket's mailbox): then a reservation names them, to hold their memory with the call's."""

    def upload(self, replica: int, data: memoryview, reservation: str = "") -> str:
        """Stores the bytes on the replica (in the memory of a call's reservation); returns their handle."""

    def reserve(self, replica: int, request: pb.CallReservation) -> str:
        """Reserves a call's memory on the replica (waiting its turn); returns the reservation."""

    def release_reservation(self, replica: int, reservation: str) -> None:
        """Gives back a reservation no call used (best effort: it ends by itself otherwise)."""

    def download(self, replica: int, handle: str, view: np.ndarray) -> None:
        """Writes a result kept on the replica into `view`."""

    def scratch(self, nbytes: int) -> np.ndarray:
        """`nbytes` (uint8) to receive a call's kept results into before they are written to its outputs."""

    def free(self, replica: int, handle: str) -> None:
        """Frees a handle (best effort: the session's lease ends it otherwise)."""

    def region(self, replica: int, size: int, results: bool = False) -> tuple[Region, str] | None:
        """A shared-memory region of at least `size` bytes (a `results` one: see RESULT_REGION_BYTES) and
        its id on the replica, or None."""

    def attaches(self, replica: int) -> bool:
        """Whether calls to the replica go over its data channel, which carries tensor bytes raw beside them."""

    def release(self, regions: list[Region]) -> None:
        """Gives regions back for reuse."""

    def retire(self, regions: list[Region]) -> None:
        """Regions of a call that did not end normally: never reused."""

    def keep(self, staged: StagedLayout) -> None:
        """Keeps a call's staging, with its regions, for the next call of its layout."""


@dataclass(frozen=True)
class StagedLayout:
    """A shared-memory call's staging, kept by its client for the next call of the same layout (every
    tensor and result in a region): the request as built, and the regions it names, which stay this
    layout's (out of the pool) while it is kept; a call takes it out, and gives it back once it ended
    normally. Its next call only copies its inputs in (a call's staging costs ~100 us of Python)."""

    key: tuple
    request: pb.OpCall
    inputs: dict[str, Region]
    outputs: dict[str, Region]
    ids: tuple[tuple[Region, str], ...]  # each region with the id the request names it by

    @property
    def regions(self) -> list[Region]:
        return [region for region, _ in self.ids]

    @property
    def nbytes(self) -> int:
        return sum(region.size for region, _ in self.ids)

    def copy_in(self, inputs: Mapping[str, memoryview | np.ndarray]) -> None:
        """Copies each input's bytes (flat: a memoryview or a uint8 array) into its region."""
        for name, data in inputs.items():
            copy_bytes(self.inputs[name].array[: data.nbytes], data)


class Staging:
    """One call's bytes outside its messages: uploads, shared-memory regions, kept results.

    Everything it takes is given back at exit, after the outputs were written. Regions of a
    call that did not end normally are retired, not reused: the server may still be writing
    its late results into them.
    """

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self.handles: list[tuple[int, str]] = []
        self.regions: list[Region] = []
        self.input_regions: dict[str, Region] = {}
        self.output_regions: dict[str, Region] = {}
        self.region_ids: list[tuple[Region, str]] = []
        self.staged: StagedLayout | None = None  # kept for the layout after the call, when it ends normally
        self.kept = False  # results asked to stay on the server
        self.reservation = ""  # the call's memory on its replica, reserved before its uploads
        self._reserved_on = 0
        # Inline tensors and results, raw beside the call's message (over a data channel); None: inside it.
        self.attachments: Attachments | None = None
        self.retried = False  # an attempt after a refused one: see Transfers.max_inline_bytes

    @property
    def all_attached(self) -> bool:
        """Whether every tensor and result of the call travels raw beside its messages (a data channel's)."""
        return self.attachments is not None and self.stateless and not self.reservation

    def attach(self, views: Mapping[str, memoryview]) -> None:
        """Attaches the inputs' bytes in order, as `inputs` does when all of them travel attached."""
        self.attachments = Attachments()
        for view in views.values():
            self.attachments.add(view)

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
        if failed and self.reservation:  # a call that ran used it up; one that did not may not have
            self.transfers.release_reservation(self._reserved_on, self.reservation)
        for replica, handle in self.handles:
            self.transfers.free(replica, handle)
        if failed:
            self.transfers.retire(self.regions)
        elif self.staged is not None:
            self.transfers.keep(self.staged)
        else:
            self.transfers.release(self.regions)
        self.handles, self.regions, self.output_regions, self.kept = [], [], {}, False
        self.input_regions, self.region_ids, self.staged = {}, [], None
        self.reservation = ""
        self.attachments = None

    def inputs(
        self, replica: int, tensors: Mapping[str, Tensor], reservation: pb.CallReservation
    ) -> dict[str, bytes | pb.StorageRef]:
        """Each tensor's storage inline (raw beside the message over a data channel), as a shared-memory
        slice, or uploaded (large ones).

        Uploads come after the call's memory was reserved as one unit (`reservation`: the call's
        descriptors and placements, placed already), so that no call holds its first upload while
        waiting for memory another call's first upload holds."""
        data = {name: byte_view(tensor.data) for name, tensor in tensors.items()}
        regions = {name: self._region(replica, view.nbytes) for name, view in data.items()}
        uploads = self._uploads(replica, {n: view.nbytes for n, view in data.items() if regions[n] is None})
        if uploads:
            reservation.uploads.extend(uploads)
            if self.transfers.reads_in_place(replica):
                reservation.in_place.extend(n for n in data if regions[n] is None and n not in uploads)
            self.reservation, self._reserved_on = self.transfers.reserve(replica, reservation), replica
        staged: dict[str, bytes | pb.StorageRef] = {}
        for name, view in data.items():
            region = regions[name]
            if region is not None:
                copy_bytes(region[0].array[: view.nbytes], view)
                self.input_regions[name] = region[0]
                staged[name] = pb.StorageRef(region=pb.RegionSlice(region=region[1], offset=0, size=view.nbytes))
            elif name in uploads:
                staged[name] = pb.StorageRef(handle=self._upload(replica, name, view))
            elif self._attaching(replica):
                staged[name] = pb.StorageRef(attached=self.attachments.add(view))
            else:
                staged[name] = view.tobytes()
        return staged

    def _uploads(self, replica: int, sizes: Mapping[str, int]) -> list[str]:
        """The tensors uploaded rather than sent inline: those above the inline limit, then the largest
        others while the inline ones are more than the call may attach."""
        limit = self.transfers.max_inline_bytes(replica, self.retried)
        uploads = [name for name, size in sizes.items() if size > limit]
        most = self.transfers.max_attached_bytes(replica)
        if most is not None:
            inline = sorted((size, name) for name, size in sizes.items() if size <= limit)
            total = sum(aligned(size) for size, _ in inline)
            while total > most:
                size, name = inline.pop()
                uploads.append(name)
                total -= aligned(size)
        return uploads

    def _upload(self, replica: int, name: str, data: memoryview) -> str:
        try:
            handle = self.transfers.upload(replica, data, self.reservation)
        except AclnnError as error:  # an upload refused for its size: the tensor's fault, by its name
            if error.param != "chunk":
                raise
            message = error.message.removeprefix("chunk: ")
            raise AclnnError(error.code, f"{name}: {message}", name, error.grpc_code) from None
        self.handles.append((replica, handle))
        return handle

    def place(self, replica: int, sizes: Mapping[str, int], placements: Any) -> None:
        """Results land in a region with shared memory (large ones without: RESULT_REGION_BYTES); larger
        ones stay on the server (then stream back); over a data channel the others come back raw beside
        the reply, up to what a call may attach in all (the largest stay on the server beyond it: the
        server sends no reply over its message limit)."""
        room = self.transfers.max_attached_bytes(replica, results=True)
        for name, size in sorted(sizes.items(), key=lambda item: item[1]):
            results = not self.transfers.shared_memory and RESULT_REGION_BYTES <= size <= MAX_RESULT_REGION_BYTES
            region = self._region(replica, size, results)
            if region is not None:
                self.output_regions[name] = region[0]
                placements[name].region.CopyFrom(pb.RegionSlice(region=region[1], offset=0, size=size))
            elif size > self.transfers.max_inline_bytes(replica) or (room is not None and aligned(size) > room):
                placements[name].keep_on_server = True
                self.kept = True
            elif self._attaching(replica):
                placements[name].attached = True
                room = None if room is None else room - aligned(size)

    def results(self, replica: int, outputs: Mapping[str, pb.OutputTensor]) -> dict[str, np.ndarray]:
        """Every result in hand. A result kept on the server is downloaded into an array of its own, never
        straight into the caller's output: a download cut off midway (the server stopped, the connection
        lost) fails the call with its outputs unwritten, and the call can be run again elsewhere."""
        results: dict[str, np.ndarray] = {}
        sizes = {n: math.prod(o.dims) * numpy_dtype(o.data_type).itemsize for n, o in outputs.items() if o.handle}
        scratch, offset = self.transfers.scratch(sum(aligned(size) for size in sizes.values())), 0
        for name, output in outputs.items():
            if output.handle:
                self.handles.append((replica, output.handle))
                taken = scratch[offset : offset + sizes[name]]
                received = taken.view(numpy_dtype(output.data_type)).reshape(tuple(output.dims))
                offset += aligned(sizes[name])
                self.transfers.download(replica, output.handle, received)
                results[name] = received
            elif name in self.output_regions:
                dtype, dims = numpy_dtype(output.data_type), tuple(output.dims)
                buffer = self.output_regions[name].array[: math.prod(dims) * dtype.itemsize]
                results[name] = buffer.view(dtype).reshape(dims)
            elif output.HasField("attached") and self.attachments is not None:
                results[name] = decode_output(output, self.attachments.result(output.attached))
            else:
                results[name] = decode_output(output)
        return results

    def _attaching(self, replica: int) -> bool:
        if self.attachments is None and self.transfers.attaches(replica):
            self.attachments = Attachments()
        return self.attachments is not None

    def _region(self, replica: int, size: int, results: bool = False) -> tuple[Region, str] | None:
        """A region for `size` bytes (with shared memory, or a `results` one) and its id on the replica;
        None: the bytes go another way."""
        if not (self.transfers.shared_memory or results) or size == 0:
            return None
        region = self.transfers.region(replica, size, results)
        if region is not None:
            self.regions.append(region[0])
            self.region_ids.append(region)
        return region

    def keep(
        self, key: tuple, request: pb.OpCall, inputs: Mapping[str, memoryview], outputs: Mapping[str, int]
    ) -> None:
        """Keeps this call's staging for its layout `key` once it ends normally, when every input and
        result went to a region (nothing uploaded, attached or kept on the server)."""
        in_regions = self.input_regions.keys() == inputs.keys() and self.output_regions.keys() == outputs.keys()
        if in_regions and not (self.handles or self.kept or self.reservation or self.attachments is not None):
            kept = pb.OpCall()
            kept.CopyFrom(request)
            self.staged = StagedLayout(key, kept, self.input_regions, self.output_regions, tuple(self.region_ids))

    def adopt(self, staged: StagedLayout, inputs: Mapping[str, memoryview]) -> pb.OpCall:
        """Stages a call in a kept layout's regions (its inputs copied in); its request."""
        self.regions, self.region_ids = staged.regions, list(staged.ids)
        self.input_regions, self.output_regions, self.staged = staged.inputs, staged.outputs, staged
        staged.copy_in(inputs)
        request = pb.OpCall()
        request.CopyFrom(staged.request)
        return request
