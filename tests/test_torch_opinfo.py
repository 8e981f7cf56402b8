"""PyTorch's own OpInfo samples and error inputs for the norms, through aclnn_client.torch on every client.

`torch.testing._internal.common_methods_invocations` (a corpus this project did not write): the
reference inputs (sample inputs and more) of nn.functional.layer_norm, batch_norm (both variants),
group_norm, rms_norm and the native forms (native_layer_norm, native_batch_norm,
_native_batch_norm_legit, _batch_norm_with_update, native_group_norm), in fp32, fp16 and bf16, each
also in its non-contiguous form (OpInfo's `noncontiguous()`), run
through `layer_norm` / `batch_norm` / `group_norm` / `rms_norm` on LocalClient("numpy"),
LocalClient("cpu") and a real server (cpu backend). The output, every gradient a sample asks for
(input, weight, bias, with one seeded upstream gradient) and the running statistics are compared
with the op itself in float64 on the same values: each must be within SPEC 1.5's tolerance for its
dtype, or within twice PyTorch's own error in that dtype where that is larger (a tolerance no
tighter than PyTorch meets). Each error input must raise what PyTorch raises (type and message).

fp64 is not a dtype the service serves: those samples must give PyTorch's own results, computed
here, with a NotServedWarning.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from aclnn_client import Client
from aclnn_client.torch import batch_norm, group_norm, layer_norm, rms_norm
from aclnn_client.torch.local import NotServedWarning
from aclnn_server import LocalClient, ServerOptions, create_server

# fp64 is not a dtype the service serves: such a call runs PyTorch's own implementation, here,
# forward and backward, with a NotServedWarning (docs/torch.md; aclnn_client.torch.local).
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-3)}
CLIENTS = ("local-numpy", "local-cpu", "server")


def _legit(client, x, w, b, *rest):
    """_native_batch_norm_legit: (running_mean, running_var, training, momentum, eps), or the
    no_stats overload's (training, momentum, eps)."""
    rm, rv, (training, momentum, eps) = (*rest[:2], rest[2:]) if len(rest) == 5 else (None, None, rest)
    return batch_norm(x, rm, rv, w, b, training, momentum, eps, client=client)


# OpInfo name (variant) -> our functional form, called with the sample's arguments.
FORMS: dict[str, Callable] = {
    "nn.functional.layer_norm": lambda c, x, *a, **k: layer_norm(x, *a, **k, client=c),
    "native_layer_norm": lambda c, x, shape, w, b, eps: layer_norm(x, shape, w, b, eps, client=c),
    "nn.functional.batch_norm": lambda c, x, *a, **k: batch_norm(x, *a, **k, client=c),
    "nn.functional.batch_norm.without_cudnn": lambda c, x, *a, **k: batch_norm(x, *a, **k, client=c),
    "native_batch_norm": lambda c, x, w, b, rm, rv, training, momentum, eps: batch_norm(
        x, rm, rv, w, b, training, momentum, eps, client=c
    ),
    "_native_batch_norm_legit": _legit,
    "_batch_norm_with_update": lambda c, x, w, b, rm, rv, momentum, eps: batch_norm(
        x, rm, rv, w, b, True, momentum, eps, client=c
    ),
    "nn.functional.group_norm": lambda c, x, *a, **k: group_norm(x, *a, **k, client=c),
    "native_group_norm": lambda c, x, w, b, n, ch, hxw, group, eps: group_norm(x, group, w, b, eps, client=c),
    "nn.functional.rms_norm": lambda c, x, *a, **k: rms_norm(x, *a, **k, client=c),
}


def opinfo(name: str):
    from torch.testing._internal.common_methods_invocations import op_db  # imports expecttest

    for op in op_db:
        if (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name) == name:
            return op
    raise LookupError(name)


@pytest.fixture(scope="module")
def clients():
    server, port, engine = create_server(ServerOptions(host="127.0.0.1", port=0, backend="cpu"))
    engine.ready.wait()
    server.start()
    made = {
        "local-numpy": LocalClient("numpy"),
        "local-cpu": LocalClient("cpu"),
        "server": Client(f"127.0.0.1:{port}"),
    }
    yield made
    for client in made.values():
        client.close()
    server.stop(None)


def tensors_of(sample) -> list[torch.Tensor]:
    """The sample's tensors in argument order: input, then args, then kwargs."""
    values = [sample.input, *sample.args, *sample.kwargs.values()]
    return [v for v in values if isinstance(v, torch.Tensor)]


def clone(sample, dtype: torch.dtype | None):
    """Fresh leaves of the sample's tensors (cast to `dtype` when given), requires_grad kept."""

    def copy(v):
        if not isinstance(v, torch.Tensor):
            return v
        t = v.detach().to(dtype or v.dtype).clone()
        return t.requires_grad_(v.requires_grad)

    return copy(sample.input), [copy(a) for a in sample.args], {k: copy(v) for k, v in sample.kwargs.items()}


def outcome(call: Callable, sample, dtype: torch.dtype | None, seed: int) -> dict[str, torch.Tensor]:
    """Output, the gradients of the tensors that require them, and the tensors changed in place
    (running statistics), after calling `call(input, *args, **kwargs)` on fresh copies."""
    x, args, kwargs = clone(sample, dtype)
    inputs = [t for t in (x, *args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    out = call(x, *args, **kwargs)
    out = out[0] if isinstance(out, tuple | list) else out
    result = {"output": out.detach()}
    leaves = [(i, t) for i, t in enumerate(inputs) if t.requires_grad]
    if leaves and out.requires_grad:
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        grads = torch.autograd.grad(out, [t for _, t in leaves], upstream.to(out.dtype), allow_unused=True)
        result.update({f"grad{i}": g for (i, _), g in zip(leaves, grads) if g is not None})
    result.update({f"state{i}": t.detach() for i, t in enumerate(inputs) if not t.requires_grad and i > 0})
    return result


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN entries differ"
    assert torch.equal(a[~both & ~torch.isnan(a)], b[~both & ~torch.isnan(b)]), "±Inf entries differ"
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


def compare(ours: dict, own: dict, ref: dict, dtype: torch.dtype, where: str) -> None:
    """Every tensor of `ref` within SPEC 1.5, or within twice PyTorch's own error (`own`)."""
    assert ours.keys() == own.keys() == ref.keys(), (where, sorted(ours), sorted(own))
    rtol, atol = TOLERANCES[dtype]
    for name, r in ref.items():
        assert ours[name].shape == r.shape, (where, name, ours[name].shape, r.shape)
        if r.numel() == 0:
            continue
        finite = r[torch.isfinite(r)]
        spec = atol + rtol * (float(finite.abs().max()) if finite.numel() else 0.0)
        bound = max(spec, 2 * error(own[name], r))
        assert error(ours[name], r) <= bound, f"{where} {name}: error {error(ours[name], r):.3g} > {bound:.3g}"


def check_sample(op, name: str, clients: dict, sample, dtype: torch.dtype, where: str) -> None:
    """The sample on every client against PyTorch (its float64 result and its own in `dtype`)."""
    form = FORMS[name]
    try:
        own = outcome(op.op, sample, dtype, 0)
    except Exception as err:  # PyTorch rejects the sample: so must every client, alike
        for client in clients.values():
            with pytest.raises(type(err)):
                outcome(lambda *a, c=client, **k: form(c, *a, **k), sample, dtype, 0)
        return
    ref = {k: v.to(torch.float64) for k, v in outcome(op.op, sample, torch.float64, 0).items()}
    for client_name, client in clients.items():
        ours = outcome(lambda *a, c=client, **k: form(c, *a, **k), sample, dtype, 0)
        compare(ours, own, ref, dtype, f"{where} on {client_name}")


@pytest.mark.slow  # PyTorch's own fp16/bf16 CPU kernels take seconds on the larger samples (about 1-2 min in all)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FORMS))
def test_opinfo_samples_match_pytorch(clients, name, dtype):
    op = opinfo(name)
    samples = list(op.reference_inputs("cpu", dtype, requires_grad=True))
    assert samples
    for index, sample in enumerate(samples):
        where = f"{name} {dtype} sample {index} {sample.summary() if hasattr(sample, 'summary') else ''}"
        check_sample(op, name, clients, sample, dtype, where)
        check_sample(op, name, clients, sample.noncontiguous(), dtype, f"{where} (non-contiguous)")


@pytest.mark.parametrize("name", list(FORMS))
def test_opinfo_fp64_samples_run_in_pytorch(clients, name):
    """fp64 runs in PyTorch, locally: PyTorch's own results, and a warning saying so."""
    op = opinfo(name)
    for index, sample in enumerate(op.reference_inputs("cpu", torch.float64, requires_grad=True)):
        try:
            own = outcome(op.op, sample, torch.float64, index)
        except Exception:
            continue  # PyTorch rejects it itself (the other dtypes' test covers rejections)
        with pytest.warns(NotServedWarning):
            ours = outcome(lambda *a, **k: FORMS[name](clients["server"], *a, **k), sample, torch.float64, index)
        assert ours.keys() == own.keys()
        for key, value in own.items():
            torch.testing.assert_close(ours[key], value, msg=f"{name} fp64 sample {index} {key}")


ERROR_OPS = ("native_layer_norm", "nn.functional.group_norm", "nn.functional.rms_norm")  # those with error inputs


@pytest.mark.parametrize("client_name", CLIENTS)
@pytest.mark.parametrize("name", ERROR_OPS)
def test_opinfo_error_inputs_raise_as_pytorch(clients, name, client_name):
    op = opinfo(name)
    cases = list(op.error_inputs("cpu"))
    assert cases
    for case in cases:
        s = case.sample_input
        with pytest.raises(case.error_type, match=case.error_regex):
            FORMS[name](clients[client_name], s.input, *s.args, **s.kwargs)


def test_every_norm_opinfo_is_covered():
    """A new OpInfo for these norms (a new variant, a new native form) joins FORMS."""
    from torch.testing._internal.common_methods_invocations import op_db

    norms = ("layer_norm", "batch_norm", "group_norm", "rms_norm")
    names = {(f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name) for o in op_db}
    covered = {n for n in names if any(k in n for k in norms) and "instance" not in n}
    assert covered <= set(FORMS), sorted(covered - set(FORMS))
