"""The torch backend (aten ops on CPU) against the operator conformance suites.

The suites run through LocalClient(backend=TorchBackend(TORCH_DEVICE)) and through a real gRPC
server whose engine holds another TorchBackend (cpu, or the device in $ACLNN_TORCH_DEVICE).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conformance import collect_into
from conftest import TORCH_DEVICE
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import assert_close
from rms_norm_cases import rms_norm_reference
from test_layer_norm_grad import lng_call, lng_reference

from aclnn_client import Client
from aclnn_server import Engine, LocalClient, ServerOptions, create_server
from aclnn_server.backends.torch_backend import TorchBackend

# The operator conformance suites, run here again with this module's `client` fixture.
collect_into(globals())


@pytest.fixture(scope="module")
def torch_backend():
    return TorchBackend(TORCH_DEVICE)


@pytest.fixture(scope="module")
def server_address():
    server, port, _ = create_server(ServerOptions(host="127.0.0.1", port=0), engine=Engine(TorchBackend(TORCH_DEVICE)))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture(params=["grpc", "local"])
def client(request: pytest.FixtureRequest, torch_backend):
    c = Client(request.getfixturevalue("server_address")) if request.param == "grpc" else LocalClient(torch_backend)
    yield c
    c.close()


def test_outputs_are_cast_to_their_dtype(torch_backend, rng):
    p = layer_norm_call(rng, (8, 16), 1, np.float16, "float32", out_dtype=np.float16)
    LocalClient(torch_backend).run("aclnnLayerNormBackward", **p)
    assert p["gradInputOut"].dtype == np.float16
    assert_close(p["gradInputOut"], layer_norm_reference(p)[0], "gradInputOut")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_one_element_results_come_back(torch_backend, rng, dtype):
    """A one-element gradient the formula leaves as an expanded view (stride 0) is still copied out
    (found by the long backend-agreement fuzz: an inner error, 561000)."""
    p = lng_call(rng, (1,), (1,), (1,), dtype, mask=(False, True, True))
    LocalClient(torch_backend).run("LayerNormGrad", **p)
    expected = lng_reference(p)
    for name in ("pd_gamma", "pd_beta"):
        assert_close(p[name], expected[name], name)


def test_rms_norm_of_a_long_row_keeps_its_accuracy(torch_backend):
    """The mean square of a 2**20-element row within SPEC 1.5 (torch's fp32 vector_norm on the CPU
    is 1.5e-3 off on this constant row, 2.3e-4 on the fuzz's 295,632 elements)."""
    n = 1 << 20
    p = dict(
        x=np.full((1, n), 0.183837890625, np.float32),
        gamma=np.ones(n, np.float32),
        epsilon=1e-6,
        yOut=np.empty((1, n), np.float32),
        rstdOut=np.empty((1, 1), np.float32),
    )
    LocalClient(torch_backend).run("aclnnRmsNorm", **p)
    y, rstd = rms_norm_reference(p)
    assert_close(p["rstdOut"], rstd, "rstdOut")
    assert_close(p["yOut"], y, "yOut")


def test_without_torch_the_error_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(RuntimeError, match="torch backend needs PyTorch"):
        TorchBackend(TORCH_DEVICE)


def test_unusable_devices_are_clear_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        TorchBackend("npu:0")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'cuda:0' is not usable"):
            TorchBackend("cuda:0")
