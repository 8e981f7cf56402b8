"""LocalClient's repeated layouts: a `run` shaped like an earlier one that computed in place skips
binding and the error table, with the same results and errors as a full call."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

import aclnn_server.local
from aclnn_client import AclnnError
from aclnn_common.binding import bind
from aclnn_server import Engine, LocalClient
from aclnn_server.admission import CallAbandoned
from aclnn_server.backends import NumpyBackend
from aclnn_server.engine import CallContext, PlanCache

OP = "aclnnLayerNormBackward"
OUTPUTS = ("gradInputOut", "gradWeightOut", "gradBiasOut")
RMS_OUTPUTS = ("yOut", "rstdOut")


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


def test_a_prepared_layout_outlives_the_plan_cache_not_its_backend(counted, rng):
    """A layout keeps what the engine prepared for it (plan, workspace, kernel), whatever the plan
    cache evicts; once another backend is in place (auto's switch) it runs in full again."""
    with LocalClient("numpy") as c:
        c.engine._plans = PlanCache(capacity=1)
        c.run(OP, **layer_norm_call(rng, (4, 16)))
        c.run(OP, **layer_norm_call(rng, (4, 32)))  # evicts the first plan
        p = layer_norm_call(rng, (4, 16))
        c.run(OP, **p)
        check(p)
        assert counted == {"bind": 2, "validate": 2}
        c.engine._load_done(NumpyBackend())
        p = layer_norm_call(rng, (4, 16))
        c.run(OP, **p)
        check(p)
        assert counted == {"bind": 3, "validate": 3}


# --- the engine's prepared runs (a server's repeated `run`: its bytes come from a client) ----------


def received(p: dict, op: str = OP, outputs: tuple[str, ...] = OUTPUTS) -> dict:
    """A call's values as a server receives them: descriptors, the inputs' bytes, outputs without."""
    return bind(op, p, frozenset(outputs)).values


def refusal(engine: Engine, values: dict, call: CallContext | None = None) -> tuple[int, str, str]:
    with pytest.raises(AclnnError) as refused:
        engine.run(OP, values, call)
    return refused.value.code, refused.value.param, str(refused.value)


def test_a_repeated_server_call_checks_the_bytes_it_was_sent(counted, rng):
    """The layout's checks are done once; the bytes of each call are checked every time, with the
    errors a fresh engine gives."""
    engine = Engine("numpy")
    values = received(layer_norm_call(rng, (4, 16)))
    engine.run(OP, values)
    p = layer_norm_call(rng, (4, 16))
    results = engine.run(OP, received(p))[1]
    for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
        assert_close(results[name], ref.reshape(results[name].shape), name)
    short = dataclasses.replace(values["gradOut"], data=values["gradOut"].data.tobytes()[:-4])
    for bad, param in (
        (dict(values, gradOut=short), "gradOut"),
        (dict(values, mean=values["mean"].without_data()), "mean"),
    ):
        got = refusal(engine, bad)
        assert got[:2] == (161002, param)
        assert got == refusal(Engine("numpy"), bad)
    assert counted["validate"] == 3  # the first call, and each fresh engine's


def test_a_changed_layout_is_validated_again(counted, rng):
    """Another shape, strides or scalar is another layout: validated in full, refused as a fresh
    engine refuses it, naming the parameter."""
    engine = Engine("numpy")
    p = layer_norm_call(rng, (4, 16))
    engine.run(OP, received(p))
    rstd = dict(p, rstd=np.ones((4, 2), np.float32))
    shape = dict(p, normalizedShape=[8])
    for bad, param in ((rstd, "rstd"), (shape, "input")):
        got = refusal(engine, received(bad))
        assert got[:2] == (161002, param)
        assert got == refusal(Engine("numpy"), received(bad))
    transposed = dict(p, gradOut=np.asfortranarray(p["gradOut"]))  # the same values, other strides
    results = engine.run(OP, received(transposed))[1]
    for name, ref in zip(OUTPUTS, layer_norm_reference(p)):
        assert_close(results[name], ref.reshape(results[name].shape), name)
    assert counted["validate"] == 1 + 2 * 2 + 1


def test_a_prepared_run_is_kept_per_placement(rng):
    """What a call holds depends on which results it sends inline: a layout prepared with its results
    placed elsewhere does not let the same layout send them inline past the message limit."""
    engine = Engine("numpy", max_result_bytes=64)
    values = received(layer_norm_call(rng, (4, 16)))
    engine.run(OP, values, CallContext(placed=frozenset(OUTPUTS)))
    got = refusal(engine, values)
    assert got[:2] == (161002, "gradInputOut")
    assert got == refusal(Engine("numpy", max_result_bytes=64), values)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])  # those that prepare (torch and npu run every call in full)
def test_a_prepared_call_beyond_fp32s_range_is_computed_in_fp64(counted, rng, backend):
    """x² overflows fp32 (x ~ 5e19): the repeated call (in process, and as a server runs it) still
    takes the fp64 repeat, so y is about ±1, as a first call's."""
    gamma = rng.uniform(0.5, 1.5, 9).astype(np.float32)

    def rms_norm(scale: float) -> dict:
        x = (rng.uniform(-1, 1, (4, 9)) * scale).astype(np.float32)
        return dict(x=x, gamma=gamma, epsilon=0.0, yOut=np.empty_like(x), rstdOut=np.empty((4, 1), np.float32))

    def expected(p: dict) -> torch.Tensor:
        return torch.nn.functional.rms_norm(torch.from_numpy(p["x"]).double(), [9], torch.from_numpy(gamma).double())

    with LocalClient(backend) as c:
        c.run("aclnnRmsNorm", **rms_norm(1.0))
        for _ in range(2):
            p = rms_norm(5e19)
            c.run("aclnnRmsNorm", **p)
            assert_close(p["yOut"], expected(p), "yOut")
        engine = c.engine
        engine.run("aclnnRmsNorm", received(rms_norm(1.0), "aclnnRmsNorm", RMS_OUTPUTS))
        p = rms_norm(5e19)
        y = engine.run("aclnnRmsNorm", received(p, "aclnnRmsNorm", RMS_OUTPUTS))[1]["yOut"]
        assert_close(y, expected(p), "yOut")
    assert counted == {"bind": 1, "validate": 1}


def test_a_changed_layout_in_process_is_refused_as_a_fresh_client_refuses_it(rng):
    """LocalClient: after a prepared layout, the same arrays with another scalar or shape run in full."""
    with LocalClient("numpy") as c, LocalClient("numpy") as fresh:
        c.run(OP, **layer_norm_call(rng, (4, 16)))
        c.run(OP, **layer_norm_call(rng, (4, 16)))
        for change, param in (({"normalizedShape": [8]}, "input"), ({"rstd": np.ones((4, 2), np.float32)}, "rstd")):
            p = dict(layer_norm_call(rng, (4, 16)), **change)
            before = {name: p[name].copy() for name in OUTPUTS}
            refusals = []
            for client in (c, fresh):
                with pytest.raises(AclnnError) as refused:
                    client.run(OP, **p)
                refusals.append((refused.value.code, refused.value.param, str(refused.value)))
            assert refusals[0] == refusals[1] and refusals[0][:2] == (161002, param)
            for name in OUTPUTS:
                assert np.array_equal(p[name], before[name], equal_nan=True), name


def test_a_prepared_call_that_holds_no_memory_still_waits_for_its_slot_and_keeps_its_deadline(counted, rng):
    """The fast lane of a small prepared call (Admission.try_start) takes an execution slot like any
    call: with every slot busy or a call waiting before it, it queues; past its deadline it is not run."""
    with LocalClient("numpy", max_concurrency=1) as c:
        p = layer_norm_call(rng, (4, 16))
        c.run(OP, **p)  # prepared from here on
        assert counted["bind"] == 1
        busy = c.engine.admission.slot({"running": 0, "result": 0}, "someone else")
        busy.__enter__()  # the only slot
        done = threading.Event()
        worker = threading.Thread(target=lambda: (c.run(OP, **p), done.set()))
        worker.start()
        try:
            assert not done.wait(0.5), "a prepared call ran while every slot was busy"
            assert c.engine.admission.waiting == 1
        finally:
            busy.__exit__(None, None, None)
        worker.join(10)
        assert done.is_set() and counted["bind"] == 1
        check(p)
        prepared = next(iter(c._prepared.values())).run
        fresh = {k: np.zeros_like(v) for k, v in p.items() if k in OUTPUTS}
        storage = {name: p[name] for name in prepared.plan.inputs}
        late = CallContext(deadline=time.monotonic() - 1)
        with pytest.raises(CallAbandoned):
            c.engine.run_prepared(prepared, storage, fresh, late)
        assert not any(a.any() for a in fresh.values()), "a call past its deadline wrote its outputs"
        assert c.engine.admission.running == 0


def test_a_prepared_call_reading_inputs_in_place_holds_them_while_it_runs(rng, monkeypatch):
    """Inputs read where the client wrote them (a mailbox the ledger does not hold) are held with the
    call while it computes, on a prepared run too: the fast lane is only for calls that hold nothing."""
    engine = Engine("numpy")
    p = layer_norm_call(rng, (4, 16))
    values = bind(OP, p, frozenset(OUTPUTS)).values
    held_while_computing = []
    compute = NumpyBackend.compute

    def watching(self, operator, plan, args):
        held_while_computing.append(engine.ledger.held_by("tenant"))
        return compute(self, operator, plan, args)

    monkeypatch.setattr(NumpyBackend, "compute", watching)
    for _ in range(3):  # the first validates and prepares; the others run prepared
        call = CallContext(owner="tenant", holds=[], in_place_bytes=1 << 20)
        engine.run(OP, values, call)
        for hold in call.holds:
            hold.release()
    assert len(held_while_computing) == 3
    in_place = sum(values[n].data.nbytes for n in ("gradOut", "input", "mean", "rstd", "weightOptional"))
    assert all(held >= in_place for held in held_while_computing), held_while_computing
    assert engine.ledger.held_by("tenant") == 0
