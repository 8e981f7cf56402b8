"""Every client path against the in-process one, on random calls, valid and broken: a differential fuzz.

Valid calls (test_backend_agreement's builders: random shapes, dtypes, masks, value distributions,
strided views at an offset) go through a real server on the cpu backend by each transport (the
default data channel, shared memory, the data channel over TCP, gRPC alone) and must write, bit for
bit, what LocalClient("cpu") writes, change no input and write no output's gaps.

Broken calls are valid ones with one thing wrong: a null tensor, another dtype, another shape, a
bad scalar or list, an integer past int64, a missing or unknown parameter, an output aliasing an
input or another output, a read-only output, an output written twice (stride 0), a hand-made
descriptor with any offset, strides and storage size. Every backend in process and every transport
must answer the same: success, or the same (code, parameter); never an inner error or a bare Python
exception; and a call that fails writes nothing. (This fuzz found an integer past int64 refused by
the wire's encoder with a ValueError and accepted in process, and an output's offset past NumPy's
reach raising OverflowError in process.)

Seeded and bounded like the backend fuzz: ACLNN_TRANSPORT_FUZZ_CASES per operator (default 6 valid
and 12 broken), ACLNN_FUZZ_SEED another seed.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from conftest import CROSS_BACKENDS, TORCH_DEVICE
from test_backend_agreement import BUILDERS, FLOAT_DTYPES, SEED, Case, distribute, layout, pick, run

from aclnn_client import AclnnError, Client, create_tensor
from aclnn_server import LocalClient, ServerOptions, create_server

CASES = int(os.environ.get("ACLNN_TRANSPORT_FUZZ_CASES", 6))
TRANSPORTS = {
    "default": {},
    "shared memory": {"shared_memory": True},
    "TCP": {"unix_socket": False},
    "gRPC": {"data_channel": False},
}


@pytest.fixture(scope="module")
def address():
    server, port, engine = create_server(ServerOptions(host="127.0.0.1", port=0, backend="cpu"))
    engine.ready.wait()
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture(scope="module")
def clients(address):
    made = {f"in process, {name}": LocalClient(name, torch_device=TORCH_DEVICE) for name in CROSS_BACKENDS}
    made.update({name: Client(address, **options) for name, options in TRANSPORTS.items()})
    yield made
    for client in made.values():
        client.close()


def random_case(kind: str, op: str, index: int) -> tuple[np.random.Generator, Case]:
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{op}/{SEED}/{index}".encode()))
    case = BUILDERS[op](rng, pick(rng, FLOAT_DTYPES))
    distribute(rng, case)
    return rng, case


@pytest.mark.parametrize("op", list(BUILDERS))
def test_every_transport_writes_what_local_writes(clients, op):
    for index in range(CASES):
        rng, case = random_case("valid", op, index)
        layouts = {n: layout(rng, v.ndim) for n, v in case.call.items() if isinstance(v, np.ndarray)}
        status, expected = run(clients["in process, cpu"], case, layouts)
        for name in TRANSPORTS:
            got_status, got = run(clients[name], case, layouts)  # inputs unchanged, gaps kept
            where = f"{op} case {index} (seed {SEED}) over {name}"
            assert got_status == status, f"{where}: {got_status} against {status} in process"
            for out, value in expected.items():
                assert got[out].tobytes() == value.tobytes(), f"{where}: {out} differs"


# --- broken calls ------------------------------------------------------------------------------


def _tensors(p: dict) -> list[str]:
    return [n for n, v in p.items() if isinstance(v, np.ndarray)]


def _outputs(case: Case, p: dict) -> list[str]:
    return [n for n in case.outputs if isinstance(p.get(n), np.ndarray)]


def choose(rng: np.random.Generator, names: list[str]) -> str | None:
    return pick(rng, names) if names else None


def null(rng, case, p):
    name = choose(rng, _tensors(p))
    if name is None:
        return None
    p[name] = None
    return f"{name} null"


def other_dtype(rng, case, p):
    name = choose(rng, _tensors(p))
    if name is None:
        return None
    dtype = pick(rng, [np.float64, np.int32, np.int64, np.float16, np.float32, np.bool_, np.uint8])
    with np.errstate(all="ignore"):  # NaN or Inf entries cast to an integer type
        p[name] = p[name].astype(dtype)
    return f"{name} as {p[name].dtype}"


def other_shape(rng, case, p):
    name = choose(rng, _tensors(p))
    if name is None:
        return None
    shape = list(p[name].shape)
    if shape and rng.random() < 0.5:
        axis = int(rng.integers(len(shape)))
        shape[axis] = max(0, shape[axis] + int(rng.choice([-1, 1, 2])))
    else:
        shape = shape[1:] if shape and rng.random() < 0.5 else [2, *shape]
    p[name] = np.full(shape, 0.5, p[name].dtype)
    return f"{name} of shape {shape}"


def bad_value(rng, case, p):
    name = choose(rng, [n for n, v in p.items() if isinstance(v, bool | int | float | list)])
    if name is None:
        return None
    value = p[name]
    if isinstance(value, list):
        options = [value[:-1], [*value, 1], [-1] * len(value), [], ["x"] * len(value), [2**64] * max(len(value), 1)]
    elif isinstance(value, bool):
        options = [2, "yes", None]
    else:
        options = [-1, -1e-5, float("nan"), float("inf"), 2**70, "s", None]
    p[name] = options[int(rng.integers(len(options)))]
    return f"{name}={p[name]!r}"


def missing(rng, case, p):
    name = pick(rng, list(p))
    del p[name]
    return f"{name} missing"


def unknown(rng, case, p):
    p["weightOptinal"] = np.zeros(3, np.float32)
    return "an unknown parameter"


def aliased(rng, case, p):
    target = choose(rng, _outputs(case, p))
    if target is None:
        return None
    like = [n for n in _tensors(p) if n != target and p[n].shape == p[target].shape and p[n].dtype == p[target].dtype]
    if not like:
        return None
    source = pick(rng, like)
    p[target] = p[source]
    return f"{target} is {source}"


def read_only(rng, case, p):
    name = choose(rng, _outputs(case, p))
    if name is None:
        return None
    p[name].flags.writeable = False
    return f"{name} read-only"


def written_twice(rng, case, p):
    name = choose(rng, [n for n in _outputs(case, p) if p[n].ndim and p[n].shape[0] > 1])
    if name is None:
        return None
    a = p[name]
    p[name] = np.lib.stride_tricks.as_strided(a, a.shape, (0, *a.strides[1:]))
    return f"{name} with stride 0"


def descriptor(rng, case, p):
    name = choose(rng, _tensors(p))
    if name is None:
        return None
    a = p[name]
    strides = [int(rng.choice([1, 2, 0, -1, 3, 2**40, -(2**40), 2**62, 2**63])) for _ in a.shape]
    offset = int(rng.choice([0, 1, 5, -1, 100, 2**62, 2**63]))
    size = int(rng.choice([a.size, a.size + 3, max(a.size - 1, 0), 1, 0, 2 * a.size]))
    data_type = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}.get(a.dtype, 27)
    storage = np.full(int(rng.integers(0, size + 4)) if rng.random() < 0.3 else size, 0.5, a.dtype)
    p[name] = create_tensor(a.shape, data_type, strides, offset, 2, [size], storage)
    return f"{name} as strides {strides}, offset {offset}, storage {size} ({storage.size} sent)"


MUTATIONS: tuple[Callable[..., str | None], ...] = (
    null, other_dtype, other_shape, bad_value, missing, unknown, aliased, read_only, written_twice, descriptor,
)  # fmt: skip


def attempt(client, op: str, p: dict) -> tuple | str:
    """'ok', (code, param), or the bare exception's name (which must never come), after checking that
    a failed call changed none of its arrays."""
    before = {n: v.tobytes() for n, v in p.items() if isinstance(v, np.ndarray)}
    try:
        client.run(op, **p)
        return "ok"
    except AclnnError as err:
        outcome = (err.code, err.param)
    except Exception as exc:  # reported: a bare exception is a finding
        outcome = f"{type(exc).__name__}: {exc}"
    changed = [n for n, v in p.items() if isinstance(v, np.ndarray) and v.tobytes() != before[n]]
    assert not changed, f"failed with {outcome} but wrote {changed}"
    return outcome


def fresh(p: dict) -> dict:
    """The call's arrays copied for one client (aliases kept; views over a storage kept as they are)."""
    copies: dict[int, np.ndarray] = {}
    out = {}
    for name, value in p.items():
        if isinstance(value, np.ndarray) and value.flags.writeable and value.base is None:
            out[name] = copies.setdefault(id(value), value.copy())
        else:
            out[name] = value
    return out


@pytest.mark.parametrize("op", list(BUILDERS))
def test_broken_calls_fail_alike_everywhere(clients, op):
    for index in range(2 * CASES):
        rng, case = random_case("broken", op, index)
        p = {n: (v.copy() if isinstance(v, np.ndarray) else v) for n, v in case.call.items()}
        what = MUTATIONS[index % len(MUTATIONS)](rng, case, p)
        if what is None:
            continue
        outcomes = {name: attempt(client, op, fresh(p)) for name, client in clients.items()}
        where = f"{op} case {index} (seed {SEED}), {what}"
        for name, outcome in outcomes.items():
            assert not isinstance(outcome, str) or outcome == "ok", f"{where}: {name} raised {outcome}"
            assert outcome == "ok" or outcome[0] != 561000, f"{where}: {name} failed inside the service"
        assert len(set(outcomes.values())) == 1, f"{where}: {outcomes}"


def test_outputs_sharing_memory_are_written_in_the_order_passed(clients):
    """gradWeightOut and gradBiasOut overlapping in one array: every path writes gradWeight, then
    gradBias over the shared part (README: Outputs), bit for bit as in process, whatever order the
    results come back in (a reply's map has none: this failed for about half of PYTHONHASHSEEDs);
    an output that is the input gradOut itself gets its result (computed apart from the inputs)."""
    rng = np.random.default_rng(11)
    x, g = rng.standard_normal((2, 6, 40), dtype=np.float32)
    mean = x.mean(1, keepdims=True)
    rstd = (1 / np.sqrt(x.var(1, keepdims=True) + 1e-5)).astype(np.float32)
    written = {}
    for name in ["in process, cpu", *TRANSPORTS]:
        shared, grad = np.full(60, -7.25, np.float32), g.copy()
        clients[name].run(
            "aclnnLayerNormBackward",
            gradOut=grad,
            input=x,
            normalizedShape=[40],
            mean=mean,
            rstd=rstd,
            weightOptional=np.ones(40, np.float32),
            outputMask=[True, True, True],
            gradInputOut=grad,
            gradWeightOut=shared[:40],
            gradBiasOut=shared[20:],
        )
        written[name] = (shared.tobytes(), grad.tobytes())
    assert len(set(written.values())) == 1, {name: hash(value) for name, value in written.items()}
    shared = np.frombuffer(written["default"][0], np.float32)
    np.testing.assert_allclose(shared[20:], g.sum(0), rtol=1e-5, atol=1e-5)  # gradBias, written last
    x_hat = (x - mean) * rstd
    np.testing.assert_allclose(shared[:20], (g * x_hat).sum(0)[:20], rtol=1e-4, atol=1e-4)  # gradWeight's head
