"""A client's life: after close() every call says the client is closed (it never reconnects behind its
user's back), and a server restarting on its port under a running client costs that client no failed call."""

from __future__ import annotations

import time

import grpc
import pytest
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close
from test_processes import free_port, start_server

from aclnn_client import AclnnError, Client
from aclnn_server import LocalClient

OP = "aclnnLayerNormBackward"


def every_call(client, rng) -> dict:
    """Each public method of a client, as a thunk (an executor made before the close for those that take one)."""
    executor = client.get_workspace_size(OP, **layer_norm_call(rng, (2, 8)))[1]
    calls = {
        "run": lambda: client.run(OP, **layer_norm_call(rng, (2, 8))),
        "run_async": lambda: client.run_async(OP, **layer_norm_call(rng, (2, 8))).result(),
        "get_workspace_size": lambda: client.get_workspace_size(OP, **layer_norm_call(rng, (2, 8))),
        "execute": lambda: client.execute(executor),
        "set_executor_repeatable": lambda: client.set_executor_repeatable(executor),
        "destroy_executor": lambda: client.destroy_executor(executor),
    }
    if isinstance(client, Client):
        calls["list_operators"] = client.list_operators
    return calls


@pytest.mark.parametrize("how", ["close", "with"])
@pytest.mark.parametrize("kind", ["grpc", "local"])
def test_every_call_after_close_says_the_client_is_closed(serve, kind, how, rng):
    client = Client(serve().address) if kind == "grpc" else LocalClient("numpy")
    calls = every_call(client, rng)
    if how == "close":
        client.close()
    else:
        with client:
            pass
    assert client.closed
    for name, call in calls.items():
        with pytest.raises(AclnnError) as closed:
            call()
        assert closed.value.param == "client", name
        assert "is closed (by close() or the end of its with block)" in closed.value.message, name
    client.close()  # closing again does nothing


@pytest.mark.parametrize("data_channel", [True, False])
def test_a_server_restarted_on_its_port_is_reached_by_the_next_call(data_channel, rng):
    """A real server process killed and started again on the same port while a client runs: the client's
    next stateless call waits for its connection to come back within the one retry layer, and succeeds."""
    port = free_port()
    server, address = start_server("--port", str(port))
    try:
        with Client(address, data_channel=data_channel) as client:
            p = layer_norm_call(rng, (4, 16))
            client.run(OP, **p)
            server.kill()
            server.wait()
            time.sleep(1.5)  # long enough for gRPC's reconnect backoff to grow past the retries' own sleeps
            server, _ = start_server("--port", str(port))
            for attempt in range(2):  # a plan (stateless too), then a run
                p = layer_norm_call(rng, (4, 16))
                if attempt == 0:
                    client.execute(client.get_workspace_size(OP, **p)[1])
                else:
                    client.run(OP, **p)
                assert_close(p["gradInputOut"], layer_norm_reference(p)[0])
    finally:
        server.kill()
        server.wait()


def test_a_server_that_stays_down_fails_the_call_in_seconds(rng):
    """The wait for a connection is bounded: a server that is gone is UNAVAILABLE after a few seconds."""
    port = free_port()
    server, address = start_server("--port", str(port))
    with Client(address) as client:
        client.run(OP, **layer_norm_call(rng, (4, 16)))
        server.kill()
        server.wait()
        with pytest.raises(AclnnError) as gone:
            client.run(OP, **layer_norm_call(rng, (4, 16)))
        assert gone.value.grpc_code == grpc.StatusCode.UNAVAILABLE
