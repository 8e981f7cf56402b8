"""Client calls of a layout that ran before: sent as they were, with shared memory straight between the
caller's arrays and the layout's regions (grpc_client._Repeat), by default as the same message with the
caller's arrays attached (grpc_client._AttachedRepeat), and served from the first on the server
(transport/repeats.py). Every result is checked against the float64 oracle, call after call."""

from __future__ import annotations

import os

import batch_norm_forward_cases as bn
import numpy as np
import pytest
import torch
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

import aclnn_client.grpc_client
from aclnn_client import Client

OP = "aclnnLayerNormBackward"
OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")


@pytest.fixture
def binds(monkeypatch):
    """The calls the client bound (the full way): a repeat binds nothing."""
    bound: list[str] = []
    original = aclnn_client.grpc_client.bind
    monkeypatch.setattr(aclnn_client.grpc_client, "bind", lambda op, *a: bound.append(op) or original(op, *a))
    return bound


def check(p: dict) -> None:
    for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
        assert_close(np.asarray(p[name]), ref.reshape(p[name].shape), name)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "attached"])
@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
def test_a_layout_called_again_is_bound_once(serve, rng, binds, as_torch, shared_memory):
    """The client binds a layout once; the server runs it in full once per data-channel connection
    (each keeps its own repeats: transport/repeats.py), then serves it from that run."""
    served = serve()
    full_runs = []
    original = served.engine.run
    served.engine.run = lambda op, *a, **k: full_runs.append(op) or original(op, *a, **k)
    with Client(served.address, shared_memory=shared_memory) as c:

        def layout_runs(rows: int, calls: int) -> None:
            full_runs.clear()
            for _ in range(calls):
                p = layer_norm_call(rng, (rows, 512))
                if as_torch:  # the tensors' own memory: the results land in them
                    p = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in p.items()}
                c.run(OP, **p)
                check(p)
            assert 1 <= len(full_runs) <= served.server.data_channel.open_connections < calls

        layout_runs(32, 6)
        assert binds == [OP]
        layout_runs(16, 6)  # another layout: bound once too
        assert binds == [OP, OP]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "attached"])
def test_running_statistics_update_in_place_call_after_call(serve, rng, binds, shared_memory):
    """aclnnBatchNorm in training: runningMean/runningVar are read and written by each call (in/out),
    through the repeats as through the first."""
    served = serve()
    p = bn.forward_call(rng, shape=(8, 4, 6))
    with Client(served.address, shared_memory=shared_memory) as c:
        for _ in range(4):
            p["input"][...] = rng.uniform(-1.0, 3.0, p["input"].shape)
            bn.run_checked(c, p)
    assert binds == [bn.OP]


def test_an_attached_repeat_goes_the_full_way_on_a_data_channel_opened_again(serve, rng, binds):
    """A layout's attached repeat is its data channel's: once the client opened another (the server
    restarted, or moved), the next call goes the full way, and repeats on the new one after."""
    served = serve()
    with Client(served.address) as c:
        p = layer_norm_call(rng, (32, 512))
        c.run(OP, **p)
        c._forget_data_channel(0)
        for _ in range(2):
            p = layer_norm_call(rng, (32, 512))
            c.run(OP, **p)
            check(p)
        assert binds == [OP, OP]


def test_with_several_backends_calls_are_spread_not_repeated(serve, rng):
    """Stateless calls go to each backend in turn: a repeat would pin them to the first's."""
    first, second = serve(), serve()
    with Client([first.address, second.address]) as c:
        for _ in range(4):
            p = layer_norm_call(rng, (8, 64))
            c.run(OP, **p)
            check(p)
        served = [s.server.metrics.requests.labels("Run", OP, "ACLNN_SUCCESS")._value.get() for s in (first, second)]
        assert served == [2, 2]


def test_a_repeat_whose_regions_the_server_lost_goes_the_full_way(serve, rng, binds):
    served = serve()
    with Client(served.address, shared_memory=True) as c:
        p = layer_norm_call(rng, (32, 512))
        c.run(OP, **p)
        # The server loses the session's regions, as to a lease that lapsed while the client slept
        served.server.storage.end(c._base_metadata[0][1], f"uid:{os.getuid()}")
        assert served.server.storage.counts()[1] == 0
        p = layer_norm_call(rng, (32, 512))
        c.run(OP, **p)  # refused as a repeat (161002, region): bound and registered again
        check(p)
        assert binds == [OP, OP]
        c.run(OP, **p)
        check(p)
        assert binds == [OP, OP]
