"""Executor lifecycle: single use, repeatable, destroy, expiry, and the count bound."""

from __future__ import annotations

import time

import grpc
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close

from aclnn_client import AclnnError, Client
from aclnn_server import Engine, LocalClient, ServerOptions, create_server

OP = "aclnnLayerNormBackward"


def assert_executor_error(call, text: str) -> None:
    with pytest.raises(AclnnError) as info:
        call()
    assert (info.value.code, info.value.param) == (161002, "executor")
    assert text in str(info.value)


def test_single_use(client, rng):
    p = layer_norm_call(rng, (4, 8))
    _, executor = client.get_workspace_size(OP, **p)
    client.execute(executor)
    assert_executor_error(lambda: client.execute(executor), "already executed")
    assert_executor_error(lambda: client.set_executor_repeatable(executor), "already executed")


def test_repeatable_reads_current_inputs_until_destroyed(client, rng):
    """A training loop: validate once, update the arrays in place, execute many times."""
    p = layer_norm_call(rng, (4, 8))
    _, executor = client.get_workspace_size(OP, **p)
    client.set_executor_repeatable(executor)
    for step in range(3):
        p["gradOut"][...] = rng.uniform(-1, 1, p["gradOut"].shape)
        client.execute(executor)
        assert_close(p["gradInputOut"], layer_norm_reference(p)[0], f"step {step}")
    client.destroy_executor(executor)
    assert_executor_error(lambda: client.execute(executor), "destroyed")
    assert_executor_error(lambda: client.destroy_executor(executor), "destroyed")


def test_repeatable_only_before_first_execute(client, rng):
    _, executor = client.get_workspace_size(OP, **layer_norm_call(rng, (2, 4)))
    client.execute(executor)
    assert_executor_error(lambda: client.set_executor_repeatable(executor), "already executed")


def test_destroy_never_executed(client, rng):
    _, executor = client.get_workspace_size(OP, **layer_norm_call(rng, (2, 4)))
    client.destroy_executor(executor)
    assert_executor_error(lambda: client.execute(executor), "destroyed")


def test_not_an_executor(client):
    with pytest.raises(AclnnError) as info:
        client.execute("0123")
    assert (info.value.code, info.value.param) == (161002, "executor")


@pytest.fixture(params=["grpc", "local"])
def limited(request):
    """Makes clients whose server has the given executor limits, over gRPC or in process."""
    servers, clients = [], []

    def make(**limits):
        if request.param == "local":
            clients.append(LocalClient(**limits))
        else:
            server, port, _ = create_server(ServerOptions(port=0, backend="numpy", **limits))
            server.start()
            servers.append(server)
            clients.append(Client(f"127.0.0.1:{port}"))
        return clients[-1]

    yield make
    for c in clients:
        c.close()
    for server in servers:
        server.stop(None)


def test_unexecuted_executors_expire(limited, rng):
    short_lived = limited(executor_ttl_s=0.2)
    p = layer_norm_call(rng, (2, 4))
    _, stale = short_lived.get_workspace_size(OP, **p)
    _, kept = short_lived.get_workspace_size(OP, **p)
    short_lived.set_executor_repeatable(kept)
    short_lived.execute(kept)  # executed: not subject to expiry
    time.sleep(0.3)
    assert_executor_error(lambda: short_lived.execute(stale), "expired")
    short_lived.execute(kept)
    short_lived.destroy_executor(kept)


def test_executor_count_is_bounded(limited, rng):
    c = limited(max_executors=3)
    p = layer_norm_call(rng, (2, 4))
    executors = [c.get_workspace_size(OP, **p)[1] for _ in range(3)]
    with pytest.raises(AclnnError) as info:
        c.get_workspace_size(OP, **p)
    assert info.value.code == 561101 and "executor limit" in str(info.value)
    if isinstance(c, Client):
        assert info.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    c.run(OP, **p)  # Run needs no executor slot
    c.execute(executors[0])  # frees a slot
    c.get_workspace_size(OP, **p)


def test_input_bytes_with_the_plan_or_with_execute(rng):
    """The engine takes bytes at either phase; missing bytes fail without spending the executor."""
    engine = Engine("numpy")
    p = layer_norm_call(rng, (3, 4))
    client = LocalClient()
    from aclnn_common.binding import bind

    call = bind(OP, p, frozenset({"gradInputOut", "gradWeightOut", "gradBiasOut"}))
    _, executor = engine.get_workspace_size(OP, call.descriptors())
    with pytest.raises(AclnnError) as info:
        engine.execute(executor, {})
    assert (info.value.code, info.value.param) == (161002, "gradOut")
    with pytest.raises(AclnnError) as info:
        engine.execute(executor, {"bogus": b""})
    assert (info.value.code, info.value.param) == (161002, "bogus")
    data = {name: t.data for name, t in call.inputs().items()}
    results = engine.execute(executor, data)
    client.run(OP, **p)
    assert results["gradInputOut"].tobytes() == p["gradInputOut"].tobytes()
    _, executor = engine.get_workspace_size(OP, call.values)  # bytes shipped with the plan
    assert engine.execute(executor, {})["gradInputOut"].tobytes() == p["gradInputOut"].tobytes()
