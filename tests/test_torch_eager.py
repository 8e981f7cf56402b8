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


def test_eager_backward_is_not_differentiable_again(local):
    x = torch.randn(4, 8, requires_grad=True)
    y = layer_norm(x, [8], torch.ones(8, requires_grad=True), None, client=local).square().sum()
    (grad,) = torch.autograd.grad(y, x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()
