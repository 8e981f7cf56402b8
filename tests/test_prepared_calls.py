"""LocalClient's repeated layouts: a `run` shaped like an earlier one that computed in place skips
binding and the error table, with the same results and errors as a full call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

import aclnn_server.local
from aclnn_client import AclnnError
from aclnn_server import Engine, LocalClient
from aclnn_server.engine import PlanCache

OP = "aclnnLayerNormBackward"
OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """How often calls were bound and validated in full (the real functions still run)."""
    counts = {"bind": 0, "validate": 0}
    bind, validate = aclnn_server.local.bind, Engine._validate

    def counting_bind(*args, **kwargs):
        counts["bind"] += 1
        return bind(*args, **kwargs)

    def counting_validate(op, values):
        counts["validate"] += 1
        return validate(op, values)

    monkeypatch.setattr(aclnn_server.local, "bind", counting_bind)
    monkeypatch.setattr(Engine, "_validate", staticmethod(counting_validate))
    return counts


def check(p: dict) -> None:
    for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
        assert_close(p[name], ref.reshape(p[name].shape), name)


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
def test_a_repeated_layout_is_bound_and_validated_once(counted, rng, as_torch):
    with LocalClient("numpy") as c:
        for _ in range(3):
            p = layer_norm_call(rng, (4, 16))  # new arrays and bytes, the same layout
            args = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in p.items()}
            c.run(OP, **(args if as_torch else p))
            check(p)
        assert counted == {"bind": 1, "validate": 1}
        c.run(OP, **layer_norm_call(rng, (4, 32)))  # another layout: bound and validated in full
        assert counted == {"bind": 2, "validate": 2}


def test_results_and_errors_are_those_of_a_full_call(counted, rng):
    p = layer_norm_call(rng, (6, 16))
    with LocalClient("numpy") as c, LocalClient("numpy") as fresh:
        c.run(OP, **p)
        # gradInputOut over gradOut's own memory: not in place, so run in full (a fresh array, then copied)
        q = layer_norm_call(rng, (6, 16))
        expected = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in q.items()}
        expected["gradInputOut"] = expected["gradOut"]
        q["gradInputOut"] = q["gradOut"]
        c.run(OP, **q)
        fresh.run(OP, **expected)
        for name in OUTPUTS:
            assert np.array_equal(q[name], expected[name], equal_nan=True), name
        # The same layout with a read-only output: refused as a full call refuses it, nothing written
        r = layer_norm_call(rng, (6, 16))
        r["gradWeightOut"].flags.writeable = False
        before = r["gradInputOut"].copy()
        with pytest.raises(AclnnError) as refused:
            c.run(OP, **r)
        assert (refused.value.code, refused.value.param) == (161002, "gradWeightOut")
        assert np.array_equal(r["gradInputOut"], before, equal_nan=True)


def test_a_layout_keeps_floats_by_their_bits(counted, rng):
    """epsilon 0.0 and -0.0 compare equal in Python: they are still two calls, validated apart."""
    x = rng.standard_normal((4, 16), dtype=np.float32)
    gamma = np.ones(16, np.float32)
    with LocalClient("numpy") as c:
        for eps in (0.0, -0.0, 0.0):
            y, rstd = np.empty_like(x), np.empty((4, 1), np.float32)
            c.run("aclnnRmsNorm", x=x, gamma=gamma, epsilon=eps, yOut=y, rstdOut=rstd)
        assert counted["validate"] == 2


def test_a_layout_whose_plan_left_the_cache_runs_in_full(counted, rng):
    with LocalClient("numpy") as c:
        c.engine._plans = PlanCache(capacity=1)
        c.run(OP, **layer_norm_call(rng, (4, 16)))
        c.run(OP, **layer_norm_call(rng, (4, 32)))  # evicts the first plan
        p = layer_norm_call(rng, (4, 16))
        c.run(OP, **p)
        check(p)
        assert counted == {"bind": 3, "validate": 3}
