"""Runs served again from the first like them on their connection.

A training loop sends the same Run call after call: the same descriptors and scalars, its tensors and
results at the same offsets of the same shared-memory regions (Client(shared_memory=True) keeps a
layout's staging for that), or raw beside the same message (the default client keeps the message of a
layout whose tensors and results all travel attached). A data-channel Run whose request is byte for
byte one that ran in full before on the same connection (a client's, in one session, serving one
request at a time: the store is the connection's, and goes with it), with every input read from a region or from the
request's attached part and every result computed in place in a region or sent back attached, is served
from what that run derived: its prepared run (the error table's verdict, the plan, the kernel), where
its tensors lie, and its reply (which names only those regions and attached ranges). Per call, only the
region slices are looked up again (one unregistered since: the call runs in full, which says so), the
attached ranges checked to lie in this request's attached part (else the call runs in full, which
refuses it), the bytes checked to hold each tensor, and the call admitted and computed like any other:
decoding, validation and placement, ~0.15 ms of Python, are skipped. Region ids are never reused, and a
memfd is mapped at most once at a time, so the same ids and offsets are the same memory: what the first
run checked of them (in bounds, aligned, results apart from each other and from the inputs) still
holds. Attached results are computed into fresh arrays, as in full, and sent at the offsets the reply
names. Attached inputs read in place (a mailbox above 16 MiB) are held with their call, as in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aclnn_common._proto import aclnn_pb2 as pb

from ..engine import CallContext, PreparedRun

MAX_MESSAGE_BYTES = 2048  # a request's bytes are its key: larger ones are not kept (a LayerNorm backward's: ~700)
MAX_PER_CONNECTION = 16  # layouts kept per connection, the oldest forgotten first

RegionPlace = tuple[str, int, int]  # region id, offset, size
AttachedPlace = tuple[int, int]  # offset and size in the request's (or the reply's) attached part


@dataclass(frozen=True)
class RepeatedRun:
    """What a Run that ran in full leaves for its repeats."""

    prepared: PreparedRun
    placed: frozenset[str]
    kept: frozenset[str]
    inputs: tuple[tuple[str, RegionPlace], ...]
    results: tuple[tuple[str, RegionPlace, tuple[int, ...], np.dtype], ...]
    attached_inputs: tuple[tuple[str, AttachedPlace], ...]
    attached_results: tuple[tuple[str, int], ...]  # each with its offset in the reply's attached part
    reply: pb.RunResponse

    def attached_storage(self, part: memoryview | None) -> dict[str, memoryview] | None:
        """The attached inputs' bytes in this request's attached part; None when one lies outside it."""
        storage = {}
        for name, (offset, size) in self.attached_inputs:
            if part is None or offset + size > part.nbytes:
                return None
            storage[name] = part[offset : offset + size]
        return storage


def keep(repeats: dict[bytes, RepeatedRun], key: bytes, run: RepeatedRun) -> None:
    repeats.pop(key, None)
    repeats[key] = run
    while len(repeats) > MAX_PER_CONNECTION:
        del repeats[next(iter(repeats))]


def repeated_run(
    prepared: PreparedRun,
    request: pb.OpCall,
    call: CallContext,
    outputs: Mapping[str, np.ndarray],
    in_regions: Mapping[str, Any],
    reply: pb.RunResponse,
) -> RepeatedRun | None:
    """The run's repeat, or None when it cannot repeat this way: an input neither in a region nor
    attached, a result neither computed in place in a region nor attached (inline, or kept), or memory
    reserved for it."""
    if request.reservation or not computed_in(outputs, in_regions):
        return None
    regions, attached = [], []
    for name in prepared.plan.inputs:
        if name not in request.params:
            return None
        tensor = request.params[name].tensor
        kind = tensor.ref.WhichOneof("kind") if tensor.HasField("ref") else None
        if kind == "region":
            regions.append((name, _place(tensor.ref.region)))
        elif kind == "attached":
            attached.append((name, (tensor.ref.attached.offset, tensor.ref.attached.size)))
        else:
            return None
    results, attached_results = [], []
    for name, array in outputs.items():
        if name in in_regions:
            results.append((name, _place(request.placements[name].region), array.shape, array.dtype))
        elif reply.outputs[name].HasField("attached"):
            attached_results.append((name, reply.outputs[name].attached.offset))
        else:
            return None
    places = (tuple(regions), tuple(results), tuple(attached), tuple(attached_results))
    return RepeatedRun(prepared, call.placed, call.kept, *places, reply)


def computed_in(outputs: Mapping[str, np.ndarray], arrays: Mapping[str, Any]) -> bool:
    """Whether the engine computed into every array given for an output (the others it made itself)."""
    return all(name in outputs and outputs[name] is array for name, array in arrays.items())


def _place(region: pb.RegionSlice) -> RegionPlace:
    return region.region, region.offset, region.size
