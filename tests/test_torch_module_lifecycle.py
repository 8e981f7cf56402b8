"""aclnn_client.torch as PyTorch users drive modules: torch.func transforms and forward-mode AD,
pickling user subclasses, lazy BatchNorm, TorchScript (issues found by a PyTorch user's session)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from aclnn_client import AclnnError
from aclnn_client.torch import offload_norms, restore_norms
from aclnn_server import LocalClient


class CountingClient(LocalClient):
    """A LocalClient that counts its calls by operator."""

    def __init__(self) -> None:
        super().__init__("numpy")
        self.calls: list[str] = []

    def run(self, op, /, *, stream=None, **params):
        self.calls.append(op)
        super().run(op, stream=stream, **params)


def norms_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.LayerNorm(16),
        nn.Unflatten(1, (4, 4)),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.RMSNorm(16),
        nn.BatchNorm1d(16).eval(),  # eval: functorch refuses a train-mode BatchNorm's in-place stats
    )


@pytest.mark.parametrize("transform", ["vmap", "grad", "per-sample-grad", "jvp", "forward-ad"])
def test_torch_func_transforms_and_forward_ad_run_pytorchs_own(transform):
    """Under a torch.func transform or forward-mode AD a layer runs PyTorch's own implementation
    (the offloaded Function has neither a batching rule nor a jvp, and failed with functorch's
    internal errors): the same numbers as the plain model's, and no call to the service."""
    client = CountingClient()
    plain = norms_model()
    offloaded = offload_norms(norms_model(), client)
    x = torch.randn(5, 8)
    params = {k: v.detach() for k, v in plain.named_parameters()}

    def loss(model, p, xs):
        return functional_call(model, p, (xs,)).square().sum()

    def run(model):
        if transform == "vmap":
            return vmap(model)(x.unsqueeze(1))
        if transform == "grad":
            return grad(lambda p: loss(model, p, x))(params)
        if transform == "per-sample-grad":
            return vmap(grad(lambda p, xi: loss(model, p, xi[None])), (None, 0))(params, x)
        if transform == "jvp":
            return jvp(model, (x,), (torch.ones_like(x),))
        with fwAD.dual_level():
            return fwAD.unpack_dual(model(fwAD.make_dual(x, torch.ones_like(x)))).tangent

    torch.testing.assert_close(run(offloaded), run(plain), rtol=0, atol=0)
    assert client.calls == []
    offloaded(x).sum().backward()  # and outside them, the service again
    assert "aclnnLayerNormBackward" in client.calls


class EpsLayerNorm(nn.LayerNorm):  # a subclass keeping the stock forward: offloaded, as documented
    def __init__(self, features: int) -> None:
        super().__init__(features, eps=1e-6)


class LayerNorm(nn.LayerNorm):  # a user class named like the stock one
    pass


@pytest.mark.parametrize("cls", [EpsLayerNorm, LayerNorm, nn.LayerNorm])
def test_offloaded_subclasses_pickle_and_come_back_unbound(cls):
    """An offloaded user subclass's class is made at run time; it pickles as the class it was made from
    (it failed: no importable name), comes back offloaded without a client, and trains once offloaded again."""
    client = CountingClient()
    model = offload_norms(nn.Sequential(nn.Linear(4, 8), cls(8)), client)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded[1]) is type(model[1]) and isinstance(loaded[1], cls)
    assert loaded[1].eps == model[1].eps and torch.equal(loaded[1].weight, model[1].weight)
    with pytest.raises(AclnnError, match=r"offload_norms\(model, client\) again"):
        loaded(torch.randn(3, 4)).sum().backward()
    offload_norms(loaded, client)(torch.randn(3, 4)).sum().backward()
    assert client.calls == ["aclnnLayerNormBackward"]
    assert type(restore_norms(pickle.loads(pickle.dumps(loaded)))[1]) is cls


@pytest.mark.parametrize("lazy,stock", [(nn.LazyBatchNorm1d, nn.BatchNorm1d), (nn.LazyBatchNorm2d, nn.BatchNorm2d)])
def test_lazy_batch_norm_is_offloaded(lazy, stock):
    """A lazy BatchNorm is offloaded too (it was left alone, then became a plain BatchNorm at its first
    forward): it becomes the offloaded BatchNorm, and trains as the plain model does."""
    client = CountingClient()
    shape = (6, 3) if stock is nn.BatchNorm1d else (6, 3, 4, 4)
    x = torch.randn(shape)
    plain, offloaded = lazy(), offload_norms(lazy(), client)
    for model in (plain, offloaded):
        model(x).square().sum().backward()
    assert isinstance(offloaded, stock) and type(offloaded).__name__ == f"Offloaded{stock.__name__}"
    assert client.calls == ["aclnnBatchNormBackward"]
    torch.testing.assert_close(offloaded.weight.grad, plain.weight.grad)
    torch.testing.assert_close(offloaded.running_var, plain.running_var, rtol=0, atol=0)
    assert type(restore_norms(offloaded)) is stock


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # deprecated, not gone
def test_torchscript_says_why_it_cannot_script_an_offloaded_layer_and_trace_works():
    client = CountingClient()
    model = offload_norms(nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4), nn.LayerNorm([4, 5, 5])), client)
    with pytest.raises(RuntimeError, match="cannot be scripted: its backward calls the aclnn client"):
        torch.jit.script(model)
    x = torch.randn(2, 3, 5, 5)
    with pytest.warns(torch.jit.TracerWarning):  # GroupNorm's own size check, read while tracing
        traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)
    torch.jit.script(restore_norms(model))


def test_symbolic_trace_keeps_each_offloaded_layer_whole():
    """torch.fx.symbolic_trace keeps PyTorch's norm layers as call_module leaves (their class lives in
    torch.nn); an offloaded one it traced into, whose forward branches on the input's dtype: TraceError
    (red-team finding; torchvision's feature extraction and FX quantization trace so). Each offloaded
    layer is now one call_module node, and the traced module computes as the model does, its norms'
    backwards on the service."""
    from torch import fx

    model = nn.Sequential(
        nn.Linear(6, 8), nn.LayerNorm(8), nn.Unflatten(1, (4, 2)), nn.BatchNorm1d(4), nn.GroupNorm(2, 4),
        nn.Flatten(), nn.RMSNorm(8),
    )  # fmt: skip
    plain = copy.deepcopy(model)
    client = CountingClient()
    offloaded = offload_norms(model, client)
    traced = fx.symbolic_trace(offloaded)
    leaves = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert leaves == ["0", "1", "2", "3", "4", "5", "6"], traced.graph
    x = torch.randn(5, 6)
    x_traced, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    (traced(x_traced) ** 2).sum().backward()
    (plain(x_plain) ** 2).sum().backward()
    torch.testing.assert_close(x_traced.grad, x_plain.grad, rtol=1e-4, atol=1e-5)
    assert sorted(client.calls) == sorted(
        ["aclnnLayerNormBackward", "aclnnBatchNormBackward", "aclnnGroupNormBackward", "aclnnRmsNormGrad"]
    )


def test_a_layer_parametrized_after_offloading_rebinds_and_restores():
    """torch's parametrize (weight_norm, orthogonal, register_parametrization) makes a class of the layer's
    own for it, here of the offloaded one: offloading again kept the first client, restore_norms left the
    layer offloaded (red-team finding). Both now see it; removing the parametrization after restoring
    gives back the plain layer."""
    import torch.nn.utils.parametrize as parametrize

    class Exp(nn.Module):
        def forward(self, w):
            return w.exp()

    first, second = CountingClient(), CountingClient()
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    offload_norms(model, first)
    parametrize.register_parametrization(model[1], "weight", Exp())
    offload_norms(model, second)
    model(torch.randn(2, 4)).square().sum().backward()
    assert (first.calls, second.calls) == ([], ["aclnnLayerNormBackward"])
    restore_norms(model)
    first.close()
    second.close()  # a restored model calls no client
    model(torch.randn(2, 4)).square().sum().backward()
    assert second.calls == ["aclnnLayerNormBackward"] and not hasattr(model[1], "_aclnn")
    assert type(model[1]).__mro__[1] is nn.LayerNorm and type(model[1]).__name__ == "ParametrizedLayerNorm"
    parametrize.remove_parametrizations(model[1], "weight")
    assert type(model[1]) is nn.LayerNorm
