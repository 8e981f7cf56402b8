"""Outside torch.compile the offloaded norms run as plain autograd Functions (ops/eager.py): the same
forward and backward as their custom ops, without the dispatcher around each call."""

from __future__ import annotations

import pytest
import torch

from aclnn_client.torch import layer_norm
from aclnn_client.torch.clients import client_id
from aclnn_client.torch.ops.layer_norm import _layer_norm_op
from aclnn_server import LocalClient


@pytest.fixture(scope="module")
def local():
    with LocalClient("numpy") as c:
        yield c


def test_eager_layer_norm_matches_its_custom_op_bit_for_bit(local):
    torch.manual_seed(0)
    x, w, b, g = torch.randn(6, 16), torch.randn(16), torch.randn(16), torch.randn(6, 16)
    grads = []
    for eager in (True, False):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        if eager:
            out = layer_norm(xi, [16], wi, bi, client=local)
            assert type(out.grad_fn).__name__ == "LayerNormFunctionBackward"
        else:
            out = _layer_norm_op(xi, [16], wi, bi, 1e-5, client_id(local))[0]
        out.backward(g)
        grads.append((out.detach(), xi.grad, wi.grad, bi.grad))
    for eager_result, op_result in zip(*grads):
        assert torch.equal(eager_result, op_result)


def test_eager_double_backward_differentiates_pytorchs_formula(local):
    """With create_graph the eager backward, like the custom op's, returns PyTorch's differentiable gradients."""
    torch.manual_seed(1)
    x, w = torch.randn(4, 8), torch.randn(8)
    second = []
    for offloaded in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = layer_norm(xi, [8], wi, None, client=local) if offloaded else torch.nn.functional.layer_norm(xi, [8], wi)
        (grad,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        grad.sum().backward()
        second.append(xi.grad)
    torch.testing.assert_close(second[0], second[1])
