"""Device memory on the torch backend: buffers as tensors on the torch device, every operator computed
on views of them, queued on client streams (cpu here; cuda:0 when bench/gpu.py sets ACLNN_TORCH_DEVICE)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import test_batch_norm_elemt_backward
import test_device_memory as suite
import test_layer_norm_grad
from batch_norm_cases import bn_call, bn_reference
from batch_norm_cases import elemt_call as elemt_backward_call
from conftest import TORCH_DEVICE
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import BF16, assert_close
from test_device_memory import on_device
from test_norm_backends import CASES

from aclnn_client import DataType, Format, create_tensor
from aclnn_common.tensor import Tensor
from aclnn_common.types import data_type_of
from aclnn_server import Engine, LocalClient, ServerOptions, create_server
from aclnn_server.backends.torch_backend import TorchBackend
from aclnn_server.ops import OPERATORS

# The device-memory suite, run here again with this module's `device_client` (torch memory).
suite.collect_into(globals())


@pytest.fixture(scope="module")
def torch_backend():
    return TorchBackend(TORCH_DEVICE)


@pytest.fixture(scope="module")
def torch_address(torch_backend):
    server, port, _ = create_server(ServerOptions(host="127.0.0.1", port=0), engine=Engine(torch_backend))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture(params=["grpc", "data-channel", "local"])
def device_client(request: pytest.FixtureRequest, torch_backend):
    yield from suite.clients_of(request, torch_backend, "torch_address")


def _compared(p: dict, names: tuple[str, ...], reference) -> Callable[[], None]:
    def check() -> None:
        for name, ref in zip(names, reference(p)):
            if p[name] is not None:
                assert_close(p[name], ref, name)

    return check


def _bn_backward(rng, dtype, **options):
    p = bn_call(rng, dtype=dtype, **options)
    return p, _compared(p, ("gradInput", "gradWeight", "gradBias"), bn_reference)


def _layer_norm_backward(rng, dtype):
    p = layer_norm_call(rng, (6, 4, 8), 2, dtype)
    return p, _compared(p, ("gradInputOut", "gradWeightOut", "gradBiasOut"), layer_norm_reference)


def _elemt_backward(rng, dtype):
    p = elemt_backward_call(rng, (4, 3, 5), dtype)
    return p, lambda: test_batch_norm_elemt_backward.check(p)


def _layer_norm_grad(rng, dtype):
    p = test_layer_norm_grad.lng_call(rng, (6, 4, 8), (6, 1, 1), (4, 8), dtype)
    return p, lambda: test_layer_norm_grad.check(p)


# operator -> (rng, dtype) -> (a valid call on host arrays, the check of its outputs)
RESIDENT_CASES = {
    **CASES,
    "aclnnLayerNormBackward": _layer_norm_backward,
    "aclnnBatchNormBackward": _bn_backward,
    "aclnnBatchNormElemtBackward": _elemt_backward,
    "LayerNormGrad": _layer_norm_grad,
}


def resident(c, op: str, p: dict) -> tuple[dict, list]:
    """The call with each host array copied into a device buffer of its own (a Tensor's format tag
    kept); and (name, host array, buffer) for each output, to copy back after the call."""
    outputs = {s.name for s in OPERATORS[op].signature.params if s.output or s.inout}
    call, back = {}, []
    for name, value in p.items():
        array, fmt = (value, Format.ND) if isinstance(value, np.ndarray) else (None, None)
        if isinstance(value, Tensor) and isinstance(value.data, np.ndarray):
            array, fmt = value.data.reshape(value.view_dims), value.format
        if array is None:
            call[name] = value
            continue
        buf = c.malloc(max(array.nbytes, 1))
        if array.nbytes:
            c.memcpy(buf, np.ascontiguousarray(array))
        strides = [s // array.itemsize for s in np.empty(array.shape, array.dtype).strides]
        call[name] = create_tensor(array.shape, data_type_of(array.dtype), strides, 0, fmt, array.shape, buf)
        if name in outputs:
            back.append((name, array, buf))
    return call, back


def copy_back(c, p: dict, back: list) -> None:
    for name, array, buf in back:
        if array.nbytes:
            host = np.empty(array.shape, array.dtype)
            c.memcpy(host, buf)
            p[name][...] = host


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("op", RESIDENT_CASES)
def test_every_operator_on_device_memory(torch_backend, rng, op, dtype):
    """Queued on a client stream, waited for by synchronize; the results are the host path's."""
    p, check = RESIDENT_CASES[op](rng, dtype)
    with LocalClient(torch_backend) as c:
        call, back = resident(c, op, p)
        c.run(op, **call, stream=7)
        c.synchronize(7)
        copy_back(c, p, back)
    check()


@pytest.mark.parametrize(
    "options",
    [dict(shape=(4, 6), training=False), dict(shape=(5, 3), training=False), dict(shape=(4, 3, 5), training=False),
     dict(training=False, mask=(False, True, False)), dict(training=False, mask=(True, False, False))],
    ids=["NC", "ND", "NCL", "mask-010", "mask-100"],
)  # fmt: skip
@pytest.mark.parametrize("where", ["host", "device"])
def test_eval_batch_norm_backward_reads_the_running_statistics(torch_backend, rng, options, where):
    """Issue 28's failing cases: rank-2 inputs in eval mode, masked-off outputs null. The saved
    statistics hold other values; eval mode must not read them (aten's CUDA kernel does)."""
    p, check = _bn_backward(rng, np.float32, **options)
    p["saveMean"], p["saveInvstd"] = p["saveMean"] + 0.5, p["saveInvstd"] * 3
    with LocalClient(torch_backend) as c:
        if where == "host":
            c.run("aclnnBatchNormBackward", **p)
        else:
            call, back = resident(c, "aclnnBatchNormBackward", p)
            c.run("aclnnBatchNormBackward", **call)
            copy_back(c, p, back)
    check()


def test_strided_and_broadcast_views_of_device_memory(torch_backend, rng):
    """A transposed input and a stride-0 weight in device buffers, a strided output: the views' own strides."""
    rows, cols = 6, 10
    x = rng.uniform(-2, 2, (cols, rows)).astype(np.float32)  # stored transposed
    with LocalClient(torch_backend) as c:
        xb, yb, gb, rb = c.malloc(x.nbytes), c.malloc(2 * x.nbytes), c.malloc(4), c.malloc(rows * 4)
        c.memcpy(xb, x)
        c.memcpy(gb, np.array([1.5], np.float32))
        f, nd = DataType.FLOAT, Format.ND
        xt = create_tensor((rows, cols), f, (1, rows), 0, nd, (cols, rows), xb)
        gamma = create_tensor((cols,), f, (0,), 0, nd, (1,), gb)
        y = create_tensor((rows, cols), f, (2 * cols, 2), 0, nd, (rows, 2 * cols), yb)  # every other element
        c.run("aclnnRmsNorm", x=xt, gamma=gamma, epsilon=1e-6, yOut=y, rstdOut=on_device(rb, (rows, 1)), stream=2)
        c.synchronize(2)
        out = np.empty((rows, 2 * cols), np.float32)
        c.memcpy(out, yb)
    xs = x.T.astype(np.float64)
    assert_close(out[:, ::2], 1.5 * xs / np.sqrt((xs**2).mean(1, keepdims=True) + 1e-6), "yOut")
    assert not out[:, 1::2].any(), "the gaps between the output's elements were written"


def test_in_place_gradient_over_its_input(torch_backend, rng):
    """gradInput written over gradOut's own storage: every result is computed before any is written."""
    p = layer_norm_call(rng, (8, 16), 1)
    ref = layer_norm_reference(p)
    with LocalClient(torch_backend) as c:
        call, back = resident(c, "aclnnLayerNormBackward", p)
        call["gradInputOut"] = call["gradOut"]
        c.run("aclnnLayerNormBackward", **call, stream=3)
        c.synchronize(3)
        copy_back(c, p, [(n, a, b) for n, a, b in back if n != "gradInputOut"])
        c.memcpy(p["gradInputOut"], call["gradOut"].data)
    for name, r in zip(("gradInputOut", "gradWeightOut", "gradBiasOut"), ref):
        assert_close(p[name], r, name)


def test_one_buffer_holds_tensors_of_several_dtypes(torch_backend, rng):
    """fp16 and fp32 tensors side by side in one buffer, at offsets that are multiples of their own
    element size only (the fp32 statistics at byte 4 mod 8): each is its own dtype's view, twice."""
    rows, cols = 5, 6
    x = rng.uniform(-2, 2, (rows, cols)).astype(np.float16)
    gamma = rng.uniform(0.5, 1.5, cols).astype(np.float16)
    x_at, gamma_at, y_at, rstd_at = 2, 2 + x.nbytes, 2 + x.nbytes + gamma.nbytes, 4 * 35  # 140: 4 mod 8
    with LocalClient(torch_backend) as c:
        buf = c.malloc(rstd_at + 4 * rows)
        c.memcpy(buf + x_at, x)
        c.memcpy(buf + gamma_at, gamma)
        for stream in (4, 5):
            c.run("aclnnRmsNorm", x=on_device(buf + x_at, x.shape, DataType.FLOAT16), epsilon=1e-6,
                  gamma=on_device(buf + gamma_at, gamma.shape, DataType.FLOAT16),
                  yOut=on_device(buf + y_at, x.shape, DataType.FLOAT16),
                  rstdOut=on_device(buf + rstd_at, (rows, 1)), stream=stream)  # fmt: skip
            c.synchronize(stream)
            y, rstd = np.empty_like(x), np.empty((rows, 1), np.float32)
            c.memcpy(y, buf + y_at)
            c.memcpy(rstd, buf + rstd_at)
            back = np.empty_like(x)
            c.memcpy(back, buf + x_at)
            assert back.tobytes() == x.tobytes(), "the input's bytes changed"
    xs = x.astype(np.float64)
    ref_rstd = 1 / np.sqrt((xs**2).mean(1, keepdims=True) + 1e-6)
    assert_close(rstd, ref_rstd, "rstdOut")
    assert_close(y, xs * ref_rstd * gamma.astype(np.float64), "yOut")
