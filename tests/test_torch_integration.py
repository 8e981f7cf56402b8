"""aclnn_client.torch: offloaded normalization backward against plain PyTorch training, and torch
tensors as Client / LocalClient arguments.

Models are trained side by side, offloaded and plain, on the same batches with SGD; after every
step parameters, their gradients and buffers must agree within SPEC 1.5's tolerances (the
offloaded gradient is the service's, which rounds differently from aten's kernels).
"""

from __future__ import annotations

import copy
import pathlib
import pickle
import re
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
import torch
from layer_norm_cases import layer_norm_call
from oracle import BF16, assert_close
from test_processes import start_server
from torch import nn

from aclnn_client import AclnnError, Client, Format, create_tensor
from aclnn_client.torch import batch_norm, layer_norm, offload_norms, restore_norms
from aclnn_common.types import data_type_of
from aclnn_server import LocalClient

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16)}
NUMPY_DTYPES[torch.bfloat16] = np.dtype(ml_dtypes.bfloat16)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 24),
        nn.LayerNorm(24, bias=False),
        nn.ReLU(),
        nn.Linear(24, 6),
        nn.LayerNorm([6], elementwise_affine=False),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        # No bias before a BatchNorm: its gradient would be Σ gradInput over the batch, zero but for rounding.
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, bias=False),
        nn.BatchNorm2d(8, affine=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 16, bias=False),
        nn.BatchNorm1d(16),
        nn.Linear(16, 4),
    )


def batches(model: str, dtype: torch.dtype, steps: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (16, 12) if model == "mlp" else (6, 3, 8, 8)
    return [(torch.randn(shape, generator=g) * 2 + 0.5).to(dtype) for _ in range(steps)]


def build(model: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(3)
    return (mlp() if model == "mlp" else cnn()).to(dtype)


def assert_same_state(
    offloaded: nn.Module, plain: nn.Module, what: str, grads: bool = True, at: torch.dtype | None = None
) -> None:
    """Parameters (and their gradients) and buffers within SPEC 1.5's tolerance of their dtype (or of
    `at`); counts equal."""
    for (name, a), (_, b) in zip(offloaded.named_parameters(), plain.named_parameters()):
        _close(a.detach(), b.detach(), f"{what}: {name}", at)
        if grads and b.grad is not None:
            _close(a.grad, b.grad, f"{what}: {name}.grad", at)
    for (name, a), (_, b) in zip(offloaded.named_buffers(), plain.named_buffers()):
        if a.is_floating_point():
            _close(a, b, f"{what}: {name}", at)
        else:
            assert torch.equal(a, b), (what, name, a, b)


def _close(got: torch.Tensor, ref: torch.Tensor, name: str, at: torch.dtype | None = None) -> None:
    assert got.dtype == ref.dtype, (name, got.dtype, ref.dtype)
    assert_close(_numpy(got.to(at or got.dtype)), ref.double().numpy(), name)


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def train_side_by_side(
    offloaded: nn.Module,
    plain: nn.Module,
    xs: list[torch.Tensor],
    backwards: int = 1,
    lr: float = 0.05,
    at: torch.dtype | None = None,
) -> None:
    """SGD on the same batches; compares the two models after every step.

    Gradients are compared while both models are still equal (the first step), and in fp32 throughout;
    in fp16/bf16 the two models' ulp-apart parameters make later gradients differ by more than one
    operator's tolerance, so there only parameters and buffers are compared.
    """
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (offloaded, plain)]
    for step, x in enumerate(xs):
        for model, optimizer in zip((offloaded, plain), optimizers):
            optimizer.zero_grad()
            for k in range(backwards):  # gradients accumulate over several backwards
                loss(model, x + k).backward()
        grads = step == 0 or xs[0].dtype == torch.float32
        assert_same_state(offloaded, plain, f"step {step} before the update", grads, at)
        for optimizer in optimizers:
            optimizer.step()
        assert_same_state(offloaded, plain, f"step {step}", grads, at)


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Squared error against a fixed target: gradients of order one, far above the tolerances' atol."""
    y = model(x).float()
    target = torch.randn(y.shape, generator=torch.Generator().manual_seed(11))
    return (y - target).square().sum()


@pytest.fixture(params=["local-numpy", "local-cpu", "grpc"])
def offload_client(request, serve):
    """LocalClient on both CPU backends, and Client through a real server."""
    if request.param == "grpc":
        client = Client(serve().address)
    else:
        client = LocalClient(request.param.removeprefix("local-"))
    yield client
    client.close()


def remote_calls(served, op: str) -> float:
    """aclnn_requests_total of `op`, whatever the method and status."""
    return sum(
        sample.value
        for metric in served.server.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "aclnn_requests_total" and sample.labels.get("op") == op
    )


# ---------------------------------------------------------------------- training


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_trains_like_pytorch(offload_client, model):
    plain = build(model, torch.float32)
    offloaded = offload_norms(copy.deepcopy(plain), offload_client)
    train_side_by_side(offloaded, plain, batches(model, torch.float32))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_low_precision_models_train_like_pytorch(model, dtype):
    plain = build(model, DTYPES[dtype])
    with LocalClient("cpu") as client:
        offloaded = offload_norms(copy.deepcopy(plain), client)
        train_side_by_side(offloaded, plain, batches(model, DTYPES[dtype], steps=3), lr=0.01)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_bf16_activations_with_fp32_norms(model):
    """Mixed precision: the norms' parameters and statistics stay fp32, the activations are bf16.

    Compared at bf16's tolerance: aten's mixed-dtype LayerNorm backward rounds its fp32 gradWeight
    through bf16 (6e-3 relative off the fp64 oracle), the service's is fp32-accurate.
    """
    plain = build(model, torch.bfloat16)
    for m in plain.modules():
        if isinstance(m, (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)):
            m.float()
    with LocalClient("cpu") as client:
        offloaded = offload_norms(copy.deepcopy(plain), client)
        train_side_by_side(offloaded, plain, batches(model, torch.bfloat16, steps=3), lr=0.01, at=torch.bfloat16)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_gradients_accumulate_over_two_backwards(offload_client, model):
    plain = build(model, torch.float32)
    offloaded = offload_norms(copy.deepcopy(plain), offload_client)
    train_side_by_side(offloaded, plain, batches(model, torch.float32, steps=2), backwards=2)


def test_momentum_none_is_a_cumulative_average(offload_client):
    plain = build("cnn", torch.float32)
    for m in plain.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
    offloaded = offload_norms(copy.deepcopy(plain), offload_client)
    train_side_by_side(offloaded, plain, batches("cnn", torch.float32))
    assert offloaded[1].num_batches_tracked.item() == 4


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_eval_mode(offload_client, model):
    """Inference normalization (running statistics) has its own backward; the buffers stay put."""
    plain = build(model, torch.float32)
    train_side_by_side(plain, copy.deepcopy(plain), batches(model, torch.float32, steps=1))  # stats move off 0/1
    offloaded = offload_norms(copy.deepcopy(plain), offload_client)
    before = copy.deepcopy(offloaded.state_dict())
    plain.eval(), offloaded.eval()
    train_side_by_side(offloaded, plain, batches(model, torch.float32, steps=2))
    for name, value in offloaded.state_dict().items():
        if "running" in name or "num_batches" in name:
            assert torch.equal(value, before[name]), name


def test_backward_runs_on_the_server(serve):
    served = serve()
    with Client(served.address) as client:
        offloaded = offload_norms(build("mlp", torch.float32), client)
        offloaded(batches("mlp", torch.float32)[0]).sum().backward()
        assert remote_calls(served, "aclnnLayerNormBackward") == 3  # one per LayerNorm
        cnn_model = offload_norms(build("cnn", torch.float32), client)
        cnn_model(batches("cnn", torch.float32)[0]).sum().backward()
        assert remote_calls(served, "aclnnBatchNormBackward") == 3
        restore_norms(offloaded)(batches("mlp", torch.float32)[0]).sum().backward()
        assert remote_calls(served, "aclnnLayerNormBackward") == 3  # restored: local again


class RecordingClient(LocalClient):
    """A LocalClient that remembers each call's outputMask."""

    def __init__(self) -> None:
        super().__init__("numpy")
        self.masks: list[tuple[str, list[bool]]] = []

    def run(self, op, *, stream=None, **params):
        self.masks.append((op, list(params["outputMask"])))
        super().run(op, stream=stream, **params)


def test_only_the_gradients_autograd_needs_are_computed():
    client = RecordingClient()
    x = torch.randn(8, 6)  # no grad: the first layer needs no gradInput
    ln, bn = nn.LayerNorm(6), nn.BatchNorm1d(6)
    ln.bias.requires_grad_(False)
    bn.weight.requires_grad_(False)
    model = offload_norms(nn.Sequential(ln, bn), client)
    model(x).square().sum().backward()
    assert client.masks == [
        ("aclnnBatchNormBackward", [True, False, True]),
        ("aclnnLayerNormBackward", [False, True, False]),
    ]
    assert ln.bias.grad is None and bn.weight.grad is None
    client.masks.clear()
    with torch.no_grad():
        model(x)
    model(x.requires_grad_()).detach()  # no backward: no call
    assert client.masks == []


# ---------------------------------------------------------------------- the functions and the module swap


def test_functions_match_torch_nn_functional():
    client = LocalClient("numpy")
    x = torch.randn(5, 4, 6, dtype=torch.float64).float().requires_grad_()
    w, b = torch.rand(6, requires_grad=True), torch.randn(6, requires_grad=True)
    for fn, ref in (
        (lambda: layer_norm(x, 6, w, b, 1e-3, client=client), lambda: nn.functional.layer_norm(x, [6], w, b, 1e-3)),
        (lambda: layer_norm(x, (4, 6), client=client), lambda: nn.functional.layer_norm(x, (4, 6))),
    ):
        got, want = fn(), ref()
        assert torch.equal(got, want)  # the forward is aten's own
        grads = torch.autograd.grad(got.square().sum(), [x, w, b], allow_unused=True)
        wants = torch.autograd.grad(want.square().sum(), [x, w, b], allow_unused=True)
        for g, r in zip(grads, wants):
            assert (g is None) == (r is None)
            if g is not None:
                _close(g, r, "grad")
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    rm2, rv2 = rm.clone(), rv.clone()
    wc = torch.rand(4, requires_grad=True)
    got = batch_norm(x, rm, rv, wc, None, True, 0.3, 1e-4, client=client)
    want = nn.functional.batch_norm(x, rm2, rv2, wc, None, True, 0.3, 1e-4)
    assert torch.equal(got, want) and torch.equal(rm, rm2) and torch.equal(rv, rv2)  # aten's update, bit for bit
    for g, r in zip(torch.autograd.grad(got.sum(), [x, wc]), torch.autograd.grad((want * 1).sum(), [x, wc])):
        _close(g, r, "grad")
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        batch_norm(torch.randn(1, 4), rm, rv, training=True, client=client)
    with pytest.raises(TypeError, match="client must be"):
        layer_norm(x, 6, client=object())


def test_restore_and_state_dict_round_trip(offload_client):
    plain = build("cnn", torch.float32)
    model = copy.deepcopy(plain)
    assert offload_norms(model, offload_client) is model
    assert type(model[1]).__name__ == "OffloadedBatchNorm2d" and isinstance(model[1], nn.BatchNorm2d)
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())  # checkpoints load either way
    model(batches("cnn", torch.float32)[0]).sum().backward()
    twin = copy.deepcopy(model)  # a copy shares the client
    assert twin[1]._aclnn.client is offload_client
    restored = pickle.loads(pickle.dumps(model))  # pickles without its client, and says so when used
    with pytest.raises(AclnnError, match=r"call offload_norms\(model, client\) again after loading") as err:
        restored(batches("cnn", torch.float32)[0]).sum().backward()
    assert err.value.param == "client"
    assert restore_norms(model) is model
    assert [type(m) for m in model.modules()] == [type(m) for m in plain.modules()]
    assert not any(hasattr(m, "_aclnn") for m in model.modules())
    plain.load_state_dict(model.state_dict())


def test_custom_forwards_are_left_alone():
    class Mine(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    model = offload_norms(nn.Sequential(Mine(4), nn.LayerNorm(4)), LocalClient("numpy"))
    assert type(model[0]) is Mine and type(model[1]).__name__ == "OffloadedLayerNorm"


# ---------------------------------------------------------------------- errors


def test_service_errors_raise_from_backward():
    """A call the service refuses (beyond its memory budget): 161002 naming gradOut, out of loss.backward()."""
    model = offload_norms(nn.LayerNorm(64), LocalClient("numpy", memory_budget_bytes=256))
    loss = model(torch.randn(4, 64)).square().sum()
    with pytest.raises(AclnnError) as err:
        loss.backward()
    assert (err.value.code, err.value.param) == (161002, "gradOut")
    assert "memory budget" in err.value.message


def test_a_server_that_dies_mid_training_fails_backward_promptly():
    proc, address = start_server()
    try:
        client = Client(address, timeout=10)
        plain = build("mlp", torch.float32)
        model = offload_norms(copy.deepcopy(plain), client)
        xs = batches("mlp", torch.float32, steps=2)
        train_side_by_side(model, plain, xs[:1])
        proc.kill()
        proc.wait()
        loss = model(xs[1]).square().mean()
        start = time.monotonic()
        with pytest.raises(AclnnError) as err:
            loss.backward()
        assert time.monotonic() - start < 10, "backward should fail promptly, not hang"
        assert err.value.code and err.value.message
        client.close()
    finally:
        proc.kill()
        proc.communicate()


# ---------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_torch_compile_trains_like_eager():
    """fullgraph=True: no graph break anywhere; the remote backward is one opaque op per layer."""
    client, eager_client = RecordingClient(), LocalClient("numpy")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 8, bias=False))
    model.append(nn.BatchNorm1d(8))
    eager = offload_norms(copy.deepcopy(model), eager_client)
    compiled_model = offload_norms(model, client)
    compiled = torch.compile(compiled_model, fullgraph=True)
    xs = [torch.randn(12, 10) for _ in range(3)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled_model, eager)]
    for x in xs:
        for fn, optimizer in zip((compiled, eager), optimizers):
            optimizer.zero_grad()
            loss(fn, x).backward()
            optimizer.step()
        assert_same_state(compiled_model, eager, "compiled")
    assert [op for op, _ in client.masks] == ["aclnnBatchNormBackward", "aclnnLayerNormBackward"] * len(xs)
    client.close(), eager_client.close()


# ---------------------------------------------------------------------- torch tensors as call arguments


@pytest.fixture(params=["grpc", "local"])
def any_client(request, serve):
    client = Client(serve().address) if request.param == "grpc" else LocalClient("numpy")
    yield client
    client.close()


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_torch_tensors_as_inputs_and_outputs(any_client, rng, dtype):
    """The same call with NumPy arrays and with torch tensors (strided, transposed) gives the same bytes."""
    p = layer_norm_call(rng, (6, 10), dtype=NUMPY_DTYPES[dtype])
    any_client.run("aclnnLayerNormBackward", **p)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return (
            torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
            if a.dtype == ml_dtypes.bfloat16
            else torch.from_numpy(a)
        )

    x = tensor(p["input"]).t().contiguous().t()  # a column-major input
    g = torch.empty(6, 20, dtype=dtype)[:, ::2]  # a strided input
    g.copy_(tensor(p["gradOut"]))
    dx = torch.full((10, 6), -7.25, dtype=dtype).t()  # a transposed output
    dw = torch.full((3, 10), -7.25, dtype=dtype)[1]  # an output inside a larger tensor
    storage = torch.full((12,), -7.25, dtype=dtype)
    db = create_tensor([10], data_type_of(NUMPY_DTYPES[dtype]), [1], 2, Format.ND, [12], storage)  # at offset 2
    any_client.run(
        "aclnnLayerNormBackward",
        gradOut=g,
        input=x,
        normalizedShape=[10],
        mean=tensor(p["mean"]),
        rstd=tensor(p["rstd"]),
        weightOptional=tensor(p["weightOptional"]).requires_grad_(dtype != torch.float16),
        biasOptional=None,
        outputMask=[True, True, True],
        gradInputOut=dx,
        gradWeightOut=dw,
        gradBiasOut=db,
    )
    assert _numpy(dx).tobytes() == p["gradInputOut"].tobytes()
    assert _numpy(dw).tobytes() == p["gradWeightOut"].tobytes()
    assert _numpy(storage[2:]).tobytes() == p["gradBiasOut"].tobytes()
    assert (storage[:2] == -7.25).all()


@pytest.mark.parametrize("transport", ["grpc-only", "data-channel", "shared-memory"])
def test_large_torch_tensors_travel_in_place(serve, rng, transport):
    """Above max_inline_bytes inputs are uploaded and results downloaded, straight from and into the
    tensors' storage, on each transport; bf16 and a transposed output included."""
    served = serve()
    options = {"grpc-only": {"data_channel": False}, "data-channel": {}, "shared-memory": {"shared_memory": True}}
    p = layer_norm_call(rng, (512, 384), dtype=BF16, mask=(True, True, False))
    p["gradWeightOut"] = np.zeros(384, np.float32)
    with LocalClient("numpy") as local:
        local.run("aclnnLayerNormBackward", **p)
    x = torch.from_numpy(p["input"].view(np.int16)).view(torch.bfloat16)
    g = torch.from_numpy(p["gradOut"].view(np.int16)).view(torch.bfloat16)
    dx = torch.zeros(384, 512, dtype=torch.bfloat16).t()
    dw = torch.zeros(384, dtype=torch.float32)  # FLOAT gradWeight for a BF16 model: the mixed-precision call
    with Client(served.address, max_inline_bytes=64 << 10, **options[transport]) as client:
        for _ in range(2):  # the second call reuses what the first one set up (regions, connections)
            client.run(
                "aclnnLayerNormBackward",
                gradOut=g,
                input=x,
                normalizedShape=[384],
                mean=torch.from_numpy(p["mean"].view(np.int16)).view(torch.bfloat16),
                rstd=torch.from_numpy(p["rstd"].view(np.int16)).view(torch.bfloat16),
                weightOptional=torch.from_numpy(p["weightOptional"].view(np.int16)).view(torch.bfloat16),
                outputMask=[True, True, False],
                gradInputOut=dx,
                gradWeightOut=dw,
            )
            assert _numpy(dx).tobytes() == p["gradInputOut"].tobytes()
            np.testing.assert_array_equal(dw.numpy(), p["gradWeightOut"])
            dx.zero_(), dw.zero_()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_tensors_numpy_cannot_see_are_refused(any_client, rng):
    p = layer_norm_call(rng, (4, 8))
    for bad, match in (
        (torch.empty(4, 8, device="meta"), "on the CPU"),
        (torch.zeros(4, 8, dtype=torch.complex32), "NumPy"),
    ):
        with pytest.raises(AclnnError, match=match) as err:
            any_client.run("aclnnLayerNormBackward", **{**p, "gradInputOut": bad})
        assert (err.value.code, err.value.param) == (161002, "gradInputOut")


def test_importing_the_client_does_not_import_torch():
    code = "import sys, aclnn_client, aclnn_common.binding; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------- the README's example

README_SECTION = "## Offloading a PyTorch model"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_block(after: str, language: str, within: str = "") -> str:
    """The first fenced block of `language` after the line `after` (inside the section `within`)."""
    text = (ROOT / "README.md").read_text()
    text = text[text.index(within) :] if within else text
    return re.search(rf"```{language}\n(.*?)```", text[text.index(after) :], re.S)[1]


def test_readme_example_trains_through_a_live_server(serve, tmp_path):
    assert README_SECTION in (ROOT / "README.md").read_text(), "README lacks the section (text in /tmp/notes_C.md)"
    served = serve()
    example = readme_block(README_SECTION, "python").replace("127.0.0.1:50051", served.address)
    (tmp_path / "example.py").write_text(example)
    out = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    promised = readme_block("It prints:", "", within=README_SECTION).strip().splitlines()
    lines = out.strip().splitlines()
    assert len(lines) == len(promised), out
    for line, expected in zip(lines, promised):
        assert re.fullmatch(re.escape(expected).replace(r"\.\.\.", r"[-+.\de]+"), line), (line, expected)
    assert remote_calls(served, "aclnnLayerNormBackward") == 3 and remote_calls(served, "aclnnBatchNormBackward") == 3
