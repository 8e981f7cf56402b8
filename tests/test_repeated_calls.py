"""Client(shared_memory=True) calls of a layout that ran before: sent as they were, straight between the
caller's arrays and the layout's regions (grpc_client._Repeat), and served from the first on the server
(transport/repeats.py). Every result is checked against the float64 oracle, call after call."""

from __future__ import annotations

import batch_norm_forward_cases as bn
import numpy as np
import pytest
import torch
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close
from test_transport import wait_for

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


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
def test_a_layout_called_again_is_bound_once(serve, rng, binds, as_torch):
    served = serve()
    with Client(served.address, shared_memory=True) as c:
        for _ in range(4):
            p = layer_norm_call(rng, (32, 512))
            if as_torch:  # the tensors' own memory: the results land in them
                p = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in p.items()}
            c.run(OP, **p)
            check(p)
        assert binds == [OP]
        p = layer_norm_call(rng, (16, 512))  # another layout: bound once too
        c.run(OP, **p)
        c.run(OP, **p)
        check(p)
        assert binds == [OP, OP]


def test_running_statistics_update_in_place_call_after_call(serve, rng, binds):
    """aclnnBatchNorm in training: runningMean/runningVar are read and written by each call (in/out),
    through the repeats as through the first."""
    served = serve()
    p = bn.forward_call(rng, shape=(8, 4, 6))
    with Client(served.address, shared_memory=True) as c:
        for _ in range(4):
            p["input"][...] = rng.uniform(-1.0, 3.0, p["input"].shape)
            bn.run_checked(c, p)
    assert binds == [bn.OP]


def test_a_repeat_whose_regions_the_server_lost_goes_the_full_way(serve, rng, binds):
    served = serve(session_ttl_s=0.3)
    with Client(served.address, shared_memory=True) as c:
        p = layer_norm_call(rng, (32, 512))
        c.run(OP, **p)
        wait_for(lambda: served.server.storage.counts()[1] == 0)  # the lease lapsed: regions gone
        p = layer_norm_call(rng, (32, 512))
        c.run(OP, **p)  # refused as a repeat (161002, region): bound and registered again
        check(p)
        assert binds == [OP, OP]
        c.run(OP, **p)
        check(p)
        assert binds == [OP, OP]
