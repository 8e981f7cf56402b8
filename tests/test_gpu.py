"""The torch backend on a CUDA device (marked `gpu`; skipped without one). bench/gpu.py runs these and
the whole torch suite on cuda:0 (ACLNN_TORCH_DEVICE=cuda:0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batch_norm_cases import bn_call, bn_reference
from layer_norm_cases import layer_norm_call, layer_norm_reference
from oracle import BF16, assert_close
from rms_norm_cases import rms_norm_call
from test_device_memory import on_device

from aclnn_client import DataType, Format, create_tensor
from aclnn_server import LocalClient
from aclnn_server.backends.torch_backend import TorchBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_backend():
    return TorchBackend("cuda:0")


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, False)], ids=str)
@pytest.mark.parametrize("shape", [(4, 6), (5, 3)], ids=str)
def test_eval_batch_norm_backward_of_rank_2_inputs(cuda_backend, rng, shape, mask):
    """Issue 28's four failing cases (eval mode, [N, C], masked-off outputs null): aten's CUDA kernel
    takes a contiguous [N, C] input for channels-last and in eval reads save_mean/save_invstd."""
    p = bn_call(rng, shape, training=False, mask=mask)
    p["saveMean"], p["saveInvstd"] = p["saveMean"] + 0.5, p["saveInvstd"] * 3  # eval must not read them
    with LocalClient(cuda_backend) as c:
        c.run("aclnnBatchNormBackward", **p)
    for name, ref in zip(("gradInput", "gradWeight", "gradBias"), bn_reference(p)):
        if p[name] is not None:
            assert_close(p[name], ref, name)


def test_device_buffers_are_cuda_tensors(cuda_backend):
    memory = cuda_backend.device_memory()
    block = memory.allocate(1 << 20)
    try:
        assert block.tensor.is_cuda and memory.host_array(block) is None
        assert not block.tensor.any()
    finally:
        memory.release(block)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
def test_half_inputs_travel_as_half(cuda_backend, rng, dtype):
    """fp16/bf16 inputs go up at 2 bytes an element and are widened on the device."""
    p = layer_norm_call(rng, (64, 96), 1, dtype)
    with LocalClient(cuda_backend) as c:
        c.run("aclnnLayerNormBackward", **p)
    for name, ref in zip(("gradInputOut", "gradWeightOut", "gradBiasOut"), layer_norm_reference(p)):
        assert_close(p[name], ref, name)


def test_out_of_range_call_is_repeated_in_fp64_on_the_gpu(cuda_backend, rng):
    """x² overflows fp32 at 5e19: the fp64 repeat runs on the device and y is about ±1."""
    p = rms_norm_call(rng, (4, 9), 1, np.float32)
    p.update(x=(rng.uniform(-1, 1, (4, 9)) * 5e19).astype(np.float32), epsilon=0.0)
    with LocalClient(cuda_backend) as c:
        c.run("aclnnRmsNorm", **p)
    x = p["x"].astype(np.float64)
    assert_close(p["yOut"], x / np.sqrt((x**2).mean(1, keepdims=True)) * p["gamma"], "yOut")


def test_streams_run_concurrently_and_synchronize_waits(cuda_backend, rng):
    """Calls queued on two client streams, one synchronize for the session: both results are there."""
    rows, cols = 256, 1024
    xs = [rng.uniform(-2, 2, (rows, cols)).astype(np.float32) for _ in range(2)]
    with LocalClient(cuda_backend) as c:
        bufs = []
        for stream, x in enumerate(xs, start=1):
            xb, yb, stats = c.malloc(x.nbytes), c.malloc(x.nbytes), c.malloc(8 * rows)
            c.memcpy(xb, x)
            for _ in range(3):
                c.run("aclnnLayerNorm", input=on_device(xb, x.shape), normalizedShape=[cols], eps=1e-5,
                      out=on_device(yb, x.shape), meanOutOptional=on_device(stats, (rows, 1)),
                      rstdOutOptional=on_device(stats + 4 * rows, (rows, 1)), stream=stream)  # fmt: skip
            bufs.append(yb)
        c.synchronize()
        for x, yb in zip(xs, bufs):
            y = np.empty_like(x)
            c.memcpy(y, yb)
            xf = x.astype(np.float64)
            assert_close(y, (xf - xf.mean(1, keepdims=True)) / np.sqrt(xf.var(1, keepdims=True) + 1e-5), "out")


@pytest.mark.parametrize("weight", ["same", None], ids=["weight", "no-weight"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (96, 300), (130, 4096), (3, 9000)], ids=str)
def test_fused_layer_norm_backward_matches_the_oracle_and_repeats_bit_for_bit(cuda_backend, rng, shape, dtype, weight):
    """On CUDA the fp32 pass runs the fused Triton kernels (fused.py): rows wider than one chunk
    (9000 > 4096), row counts that end mid-run (130 = 2·64 + 2), no weight; a second call gives
    the same bits."""
    from aclnn_server.backends.torch_backend import formulas

    ran = []
    original = formulas.fused_layer_norm_backward
    formulas.fused_layer_norm_backward = lambda c, m, n: ran.append((m, n)) or original(c, m, n)
    try:
        p = layer_norm_call(rng, shape, 1, dtype, weight)
        again = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in p.items()}
        with LocalClient(cuda_backend) as c:
            c.run("aclnnLayerNormBackward", **p)
            c.run("aclnnLayerNormBackward", **again)
    finally:
        formulas.fused_layer_norm_backward = original
    assert ran == [(shape[0], shape[1])] * 2
    for name, ref in zip(("gradInputOut", "gradWeightOut", "gradBiasOut"), layer_norm_reference(p)):
        assert_close(p[name], ref, name)
        assert p[name].tobytes() == again[name].tobytes(), name


def test_fused_layer_norm_backward_reads_strided_device_views(cuda_backend, rng):
    """gradOut as a transposed view of a device buffer (column stride ≠ 1) is read through a copy."""
    rows, cols = 48, 80
    p = layer_norm_call(rng, (rows, cols), 1, np.float32)
    with LocalClient(cuda_backend) as c:
        names = ("gradOut", "input", "mean", "rstd", "weightOptional", "biasOptional")
        bufs = {n: c.malloc(p[n].nbytes) for n in names}
        for n in names:
            c.memcpy(bufs[n], np.ascontiguousarray(p[n].T) if n == "gradOut" else p[n])
        outs = {n: c.malloc(p[n].nbytes) for n in ("gradInputOut", "gradWeightOut", "gradBiasOut")}
        args = {n: on_device(bufs[n], p[n].shape) for n in names if n != "gradOut"}
        transposed = create_tensor((rows, cols), DataType.FLOAT, [1, rows], 0, Format.ND, (cols, rows), bufs["gradOut"])
        args["gradOut"] = transposed
        args.update({n: on_device(outs[n], p[n].shape) for n in outs})
        c.run("aclnnLayerNormBackward", normalizedShape=[cols], outputMask=[True] * 3, **args)
        for name, ref in zip(outs, layer_norm_reference(p)):
            got = np.empty_like(p[name])
            c.memcpy(got, outs[name])
            assert_close(got, ref, name)


def test_client_streams_share_a_bounded_pool_of_cuda_streams(cuda_backend):
    """A session that names a new stream id for each call keeps no state per id (a map of them grew
    until its session ended): POOL_SIZE CUDA streams in all, one stream id always on the same one,
    and the session's record gone with it."""
    from aclnn_server.backends.torch_backend.streams import POOL_SIZE

    streams = cuda_backend.streams
    used = {streams.stream(("alice", "s", stream_id)).cuda_stream for stream_id in range(1000)}
    assert len(used) <= POOL_SIZE and len(streams._pool) == POOL_SIZE
    assert streams.stream(("alice", "s", 7)) is streams.stream(("alice", "s", 7))
    # A call without a client stream waits on its thread's stream: never one that client streams queue on.
    assert streams.stream(None).cuda_stream not in {s.cuda_stream for s in streams._pool}
    streams.synchronize(("alice", "s", None))
    streams.synchronize(("alice", "s", 7))
    streams.end_session("alice", "s")
    streams.stream(("alice", "s", 3))  # a call still running as its session ended records nothing
    assert ("alice", "s") not in streams._used
