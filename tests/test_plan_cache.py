"""The engine's plan cache: repeated calls of one shape skip the error table, bad calls never do."""

from __future__ import annotations

import numpy as np
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

from aclnn_client import AclnnError
from aclnn_common.binding import bind
from aclnn_common.tensor import BoolArray, IntArray
from aclnn_server import Engine, LocalClient
from aclnn_server.engine import PlanCache, plan_key

OP = "aclnnLayerNormBackward"


@pytest.fixture
def validations(monkeypatch) -> list[str]:
    """The ops the engine ran its error table for (the real validation still runs)."""
    seen: list[str] = []
    validate = Engine._validate
    monkeypatch.setattr(Engine, "_validate", staticmethod(lambda op, values: seen.append(op) or validate(op, values)))
    return seen


def test_repeated_shapes_are_validated_once(validations, rng):
    with LocalClient("numpy") as c:
        for _ in range(3):
            p = layer_norm_call(rng, (4, 16))  # new bytes, same descriptors
            c.run(OP, **p)
            for name, ref in zip(("gradInputOut", "gradWeightOut", "gradBiasOut"), layer_norm_reference(p)):
                assert_close(p[name], ref.reshape(p[name].shape), name)
        assert len(validations) == 1
        c.run(OP, **layer_norm_call(rng, (4, 32)))  # another shape
        c.run(OP, **dict(layer_norm_call(rng, (4, 16)), outputMask=[True, False, True]))  # another mask
        assert len(validations) == 3


def test_bad_calls_are_checked_every_time(validations, rng):
    p = layer_norm_call(rng, (4, 16))
    p["rstd"] = p["rstd"].astype(np.float64)
    with LocalClient("numpy") as c:
        for _ in range(2):
            with pytest.raises(AclnnError) as raised:
                c.run(OP, **p)
            assert raised.value.param == "rstd"
    assert len(validations) == 2


@pytest.mark.parametrize(
    "a,b",
    [(1, True), (1, 1.0), (0.0, -0.0), (IntArray([1]), BoolArray([True])), (None, "None")],
)
def test_values_that_compare_equal_but_validate_differently_get_their_own_plans(a, b):
    assert plan_key(OP, {"x": a}) != plan_key(OP, {"x": b})


def test_unhashable_values_are_not_cached():
    assert plan_key(OP, {"x": [1, 2]}) is None


def test_the_cache_is_bounded():
    cache = PlanCache(capacity=2)
    engine = Engine("numpy")
    outputs = frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"})
    calls = [bind(OP, layer_norm_call(np.random.default_rng(i), (2, 4 + i)), outputs) for i in range(3)]
    planned = [engine._validate(OP, call.descriptors()) for call in calls]
    for key, validated in enumerate(planned):
        cache.put(key, validated)
    assert cache.get(0) is None and cache.get(1) is not None and cache.get(2) is not None
