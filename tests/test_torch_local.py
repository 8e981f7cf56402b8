"""aclnn_client.torch: what stays in PyTorch. A float64 layer or call runs PyTorch's own (one warning per
layer, naming it); a gradient that is differentiated again (create_graph=True) comes from PyTorch's own
differentiable formula, as plain PyTorch's; a model saved and loaded says to offload it again.

Where nothing may reach the service, the offloading client is closed: any call that did would raise."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from aclnn_client import AclnnError
from aclnn_client.torch import batch_norm, group_norm, layer_norm, offload_norms, rms_norm
from aclnn_client.torch.clients import client_id
from aclnn_client.torch.local import NotServedWarning
from aclnn_client.torch.sync_batch_norm import SyncBatchNormFunction
from aclnn_server import LocalClient


@pytest.fixture
def closed_client() -> LocalClient:
    client = LocalClient("numpy")
    client.close()
    return client


def norms_model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Linear(12, 16),
        nn.LayerNorm(16),
        nn.Unflatten(1, (8, 2)),
        nn.BatchNorm1d(8),
        nn.GroupNorm(4, 8),
        nn.Flatten(),
        nn.RMSNorm(16),
        nn.Linear(16, 3),
    )


def step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One forward and backward; the gradients of the input and of every parameter."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    model(x).square().mean().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def test_a_float64_model_runs_in_pytorch_with_one_warning_per_layer(closed_client):
    plain = norms_model().double()
    offloaded = offload_norms(copy.deepcopy(plain), closed_client)
    x = torch.randn(6, 12, dtype=torch.float64)
    with pytest.warns(NotServedWarning) as caught:
        for _ in range(2):
            for got, want in zip(step(offloaded, x), step(plain, x)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"offloaded layer '{name}' ({kind}) runs in PyTorch here, forward and backward: float64 is not served "
        "(the service computes float32, float16 and bfloat16)"
        for name, kind in (("1", "LayerNorm"), ("3", "BatchNorm1d"), ("4", "GroupNorm"), ("6", "RMSNorm"))
    ]
    torch.testing.assert_close(offloaded[3].running_mean, plain[3].running_mean, rtol=0, atol=0)
    with warnings.catch_warnings():  # a float32 model is served again (and so meets the closed client)
        warnings.simplefilter("error")
        with pytest.raises(AclnnError, match="is closed"):
            step(offload_norms(norms_model(), closed_client), x.float())


@pytest.mark.parametrize(
    "offloaded,plain",
    [
        (lambda x, c: layer_norm(x, 8, client=c), lambda x: F.layer_norm(x, [8])),
        (lambda x, c: rms_norm(x, [8], client=c), lambda x: F.rms_norm(x, [8])),
        (lambda x, c: group_norm(x, 2, client=c), lambda x: F.group_norm(x, 2)),
        (
            lambda x, c: batch_norm(x, None, None, training=True, client=c),
            lambda x: F.batch_norm(x, None, None, training=True),
        ),
    ],
    ids=["layer_norm", "rms_norm", "group_norm", "batch_norm"],
)
def test_the_functions_follow_the_same_rule(closed_client, offloaded, plain):
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    name = offloaded.__code__.co_names[0]
    with pytest.warns(NotServedWarning, match=rf"^aclnn_client\.torch\.{name} runs in PyTorch here"):
        got = offloaded(x, closed_client)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    want = plain(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, torch.autograd.grad(want.square().sum(), x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("train", [True, False])
def test_double_backward_matches_pytorch(train):
    """A gradient penalty (create_graph=True through every kind of offloaded norm) trains as PyTorch's; the
    plain backward of the same step (the loss's own term) still runs on the service."""
    plain = norms_model().train(train)
    offloaded = offload_norms(copy.deepcopy(plain), LocalClient("numpy"))
    x = torch.randn(6, 12)

    def penalized(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad()
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        (grad,) = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
        (out.sum() + grad.square().sum()).backward()
        return [inputs.grad, *(p.grad for p in model.parameters())]

    for got, want in zip(penalized(offloaded), penalized(plain)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_reloaded_model_says_to_offload_it_again(closed_client):
    buffer = io.BytesIO()
    torch.save(offload_norms(norms_model(), closed_client), buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    with pytest.raises(AclnnError) as err:
        step(reloaded, torch.randn(6, 12))
    assert err.value.param == "client"
    assert "call offload_norms(model, client) again after loading" in err.value.message
    with LocalClient("numpy") as client:
        step(offload_norms(reloaded, client), torch.randn(6, 12))  # offloaded again, it trains


def test_sync_batch_norm_refuses_double_backward_at_once(tmp_path, monkeypatch):
    """Like PyTorch's own SyncBatchNorm, its synchronized path has no double backward, and says so at the
    first backward (a one-process gloo group drives that path here; two processes train it elsewhere)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with LocalClient("numpy") as client:
            x = torch.randn(8, 4, requires_grad=True)
            weight, bias = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
            out = SyncBatchNormFunction.apply(x, weight, bias, None, None, 1e-5, 0.1, None, 1, client_id(client))
            with pytest.raises(RuntimeError, match="offload_norms cannot be differentiated twice"):
                torch.autograd.grad(out.square().sum(), x, create_graph=True)
    finally:
        dist.destroy_process_group()
