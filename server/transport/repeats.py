"""Runs served again from the first like them in their session.

A training loop sends the same Run call after call: the same descriptors and scalars, its tensors and
results at the same offsets of the same shared-memory regions (Client(shared_memory=True) keeps a
layout's staging for that). A data-channel Run whose request is byte for byte one that ran in full
before in the same session, with every input read from a region and every result computed in place in
one, is served from what that run derived: its prepared run (the error table's verdict, the plan, the
kernel), where its tensors lie, and its reply (which names only those regions). Per call, only the
region slices are looked up again (one unregistered since: the call runs in full, which says so), the
bytes checked to hold each tensor, and the call admitted and computed like any other: decoding,
validation and placement, ~0.15 ms of Python, are skipped. Region ids are never reused, and a memfd is
mapped at most once at a time, so the same ids and offsets are the same memory: what the first run
checked of them (in bounds, aligned, results apart from each other and from the inputs) still holds.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aclnn_common._proto import aclnn_pb2 as pb

from ..engine import CallContext, PreparedRun

MAX_MESSAGE_BYTES = 2048  # a request's bytes are its key: larger ones are not kept (a LayerNorm backward's: ~700)
MAX_PER_SESSION = 16  # layouts kept per session, the oldest forgotten first

RegionPlace = tuple[str, int, int]  # region id, offset, size


@dataclass(frozen=True)
class RepeatedRun:
    """What a Run that ran in full leaves for its repeats."""

    prepared: PreparedRun
    placed: frozenset[str]
    kept: frozenset[str]
    inputs: tuple[tuple[str, RegionPlace], ...]
    results: tuple[tuple[str, RegionPlace, tuple[int, ...], np.dtype], ...]
    reply: pb.RunResponse


_lock = threading.Lock()  # around changes to a session's `repeats`, which its concurrent calls share


def keep(repeats: dict[bytes, RepeatedRun], key: bytes, run: RepeatedRun) -> None:
    with _lock:
        repeats.pop(key, None)
        repeats[key] = run
        while len(repeats) > MAX_PER_SESSION:
            del repeats[next(iter(repeats))]


def forget(repeats: dict[bytes, RepeatedRun], key: bytes) -> None:
    with _lock:
        repeats.pop(key, None)


def repeated_run(
    prepared: PreparedRun,
    request: pb.OpCall,
    call: CallContext,
    outputs: Mapping[str, np.ndarray],
    in_regions: Mapping[str, Any],
    reply: pb.RunResponse,
) -> RepeatedRun | None:
    """The run's repeat, or None when it cannot repeat this way: an input not in a region, a result
    not computed in place in one (inline, attached or kept), or memory reserved for it."""
    if request.reservation or call.attached_results or not computed_in(outputs, in_regions):
        return None
    inputs = []
    for name in prepared.plan.inputs:
        if name not in request.params:
            return None
        tensor = request.params[name].tensor
        if not tensor.HasField("ref") or tensor.ref.WhichOneof("kind") != "region":
            return None
        inputs.append((name, _place(tensor.ref.region)))
    results = tuple(
        (name, _place(request.placements[name].region), array.shape, array.dtype) for name, array in outputs.items()
    )
    return RepeatedRun(prepared, call.placed, call.kept, tuple(inputs), results, reply)


def computed_in(outputs: Mapping[str, np.ndarray], arrays: Mapping[str, Any]) -> bool:
    """Whether the engine computed every output into the array given for it, and only those."""
    return outputs.keys() == arrays.keys() and all(outputs[name] is arrays[name] for name in outputs)


def _place(region: pb.RegionSlice) -> RegionPlace:
    return region.region, region.offset, region.size
